"""`python -m jaxpipe.serve --http` on a converted Hugging Face Llama speaks its language: text
through its tokenizer, its EOS ids, its context, chat, log-probabilities, /tokenize and vLLM's
metrics, checked against transformers (tokenizer, `generate` and forward) through the `openai`
client. One converted tiny Llama and one server for the module."""

import json
import os
import re
import socket
import subprocess
import sys
from typing import Literal

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch
import transformers

import jaxpipe
from jaxpipe.training import hf_workdir
from tests import helpers

ROOT = helpers.ROOT
NAME = "llama"
# A prompt whose greedy continuation ends with </s> after 19 tokens (found by a search over
# short prompts with transformers' generate on write_tiny_llama's seed 0).
EOS_PROMPT, EOS_AT = "What helpful", 19


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """(transformers' model directory, the converted workdir)."""
  root = tmp_path_factory.mktemp("llama")
  src = helpers.write_tiny_llama(root / "src")
  hf_workdir.hf_to_orbax(src, str(root / "w"))
  return src, str(root / "w")


@pytest.fixture(scope="module")
def hf(llama):
  """transformers' tokenizer (from the workdir's hf/) and model: the oracles."""
  src, workdir = llama
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(workdir, "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
  return tok, model.eval()


@pytest.fixture(scope="module")
def url(llama):
  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [
          sys.executable, "-m", "jaxpipe.serve", "--workdir", llama[1], "--http",
          "--port", str(port), "--model_name", NAME, "--max_batch", "4", "--num_pages", "80",
          "--max_tokens_per_step", "64", "--token_buckets", "8,64",
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "PYTHONPATH": ROOT, "JAXPIPE_HOST_DEVICES": "1"},
  )  # fmt: skip
  url = f"http://127.0.0.1:{port}"
  try:
    helpers.wait_healthy(url, lambda: proc.poll() is None, output=proc.stdout.read)
    yield url
  finally:
    proc.terminate()
    proc.wait(60)


@pytest.fixture(scope="module")
def client(url):
  return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _generate(hf, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
  """transformers' greedy continuation of `ids`, stopping at the generation config's EOS ids."""
  _, model = hf
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
  return out[0, len(ids) :].tolist()


def _chat_ids(hf, messages) -> list[int]:
  ids = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _by_index(response):
  return sorted(response.choices, key=lambda c: c.index)


def _text(hf, ids) -> str:
  return hf[0].decode(ids, skip_special_tokens=True)


def test_the_context_is_the_models_and_version_is_jaxpipes(url, client):
  (m,) = client.models.list().data
  assert m.max_model_len == 256  # max_position_embeddings, not the workdir's data.seq_len (128)
  assert httpx.get(url + "/version").json() == {"version": jaxpipe.__version__}


@pytest.mark.parametrize("prompt", ["def main", "naïve café 東京 🙂"])
def test_a_text_completion_is_transformers_greedy_generate(client, hf, prompt):
  ids = hf[0](prompt).input_ids
  want = _generate(hf, ids, 16)
  r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
  (c,) = r.choices
  assert c.token_ids == want
  assert c.text == _text(hf, want)
  assert r.usage.prompt_tokens == len(ids)  # BOS included, as transformers encodes it
  # streamed: the chunks' text is the whole text, no chunk with half a character
  chunks = list(
      client.completions.create(
          model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True
      )
  )
  texts = [ch.choices[0].text for ch in chunks if ch.choices]
  assert "".join(texts) == c.text
  assert not any("\ufffd" in t for t in texts) or "\ufffd" in c.text


def test_generation_stops_at_an_eos_id_and_its_text_is_not_sent(client, hf):
  ids = hf[0](EOS_PROMPT).input_ids
  want = _generate(hf, ids, 40)
  assert len(want) == EOS_AT and want[-1] == hf[0].eos_token_id  # the prompt does what it should
  r = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=40, temperature=0)
  (c,) = r.choices
  assert (c.token_ids, c.finish_reason) == (want, "stop")
  assert c.text == _text(hf, want) and "</s>" not in c.text
  # ignore_eos: generation goes on through the EOS to max_tokens
  r = client.completions.create(
      model=NAME, prompt=EOS_PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
  )
  (c,) = r.choices
  assert c.finish_reason == "length" and len(c.token_ids) == 24 and c.token_ids[:EOS_AT] == want
  # min_tokens: EOS cannot come before it (transformers' min_new_tokens)
  r = client.completions.create(
      model=NAME, prompt=EOS_PROMPT, max_tokens=30, temperature=0, extra_body={"min_tokens": 22}
  )
  assert r.choices[0].token_ids == _generate(hf, ids, 30, min_new_tokens=22)
  # stop_token_ids: the third token ends it, kept in token_ids, not in the text
  r = client.completions.create(
      model=NAME,
      prompt=EOS_PROMPT,
      max_tokens=30,
      temperature=0,
      extra_body={"stop_token_ids": [want[2]]},
  )
  (c,) = r.choices
  first = want.index(want[2])
  assert (c.token_ids, c.finish_reason) == (want[: first + 1], "stop")
  assert c.text == _text(hf, want[:first])


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital of Japan?"}]},
]


def test_a_chat_completion_is_transformers_chat_template_and_generate(client, hf):
  plain = [MESSAGES[0], {"role": "user", "content": "What is the capital of Japan?"}]
  ids = _chat_ids(hf, plain)
  want = _generate(hf, ids, 20)
  r = client.chat.completions.create(
      model=NAME, messages=MESSAGES, max_completion_tokens=20, temperature=0, seed=3
  )
  assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
  (c,) = r.choices
  assert c.message.role == "assistant" and c.message.content == _text(hf, want)
  assert c.finish_reason == ("stop" if want[-1] in (1, 4) else "length")
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))

  chunks = list(
      client.chat.completions.create(
          model=NAME,
          messages=MESSAGES,
          max_tokens=20,
          temperature=0,
          n=2,
          stream=True,
          stream_options={"include_usage": True},
      )
  )
  assert all(ch.object == "chat.completion.chunk" for ch in chunks)
  for i in range(2):
    deltas = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
    assert deltas[0].delta.role == "assistant"  # the first delta has the role
    assert "".join(d.delta.content or "" for d in deltas) == c.message.content
    assert [d.finish_reason for d in deltas].count(None) == len(deltas) - 1
    assert deltas[-1].finish_reason == c.finish_reason
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(want)
  assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize(
    "messages,words",
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role='wizard'"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], "messages[1]"),
        ([{"role": "user", "content": "\ud800"}], "lone UTF-16 surrogate"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
    ],
)
def test_bad_messages_are_a_400_naming_the_message(url, messages, words):
  body = json.dumps({"messages": messages}).encode()  # json writes "\ud800" as its escape
  r = httpx.post(
      url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
  )
  assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"max_completion_tokens": 300}, "max_tokens", "(max_completion_tokens)"),
        ({"max_tokens": 300}, "max_tokens", "exceeds the context of 256"),
        ({"top_logprobs": 3, "logprobs": True, "temperature": -1}, "temperature", "temperature="),
        ({"min_tokens": -2}, "min_tokens", "min_tokens=-2"),
    ],
)
def test_a_chat_refusal_names_the_chat_requests_field(url, fields, param, words):
  r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, **fields})
  error = r.json()["error"]
  assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text


def test_a_chat_prompt_past_the_context_is_refused_as_messages(url):
  long = [{"role": "user", "content": "word " * 1000}]  # past the context of 256 tokens
  r = httpx.post(url + "/v1/chat/completions", json={"messages": long, "max_tokens": 4})
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_tokenize_and_detokenize_equal_transformers(url, hf):
  tok = hf[0]
  text = "import os\nnaïve café 東京"
  r = httpx.post(url + "/tokenize", json={"prompt": text}).json()
  assert r == {
      "tokens": tok(text).input_ids,
      "count": len(tok(text).input_ids),
      "max_model_len": 256,
  }
  r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
  assert r["tokens"] == tok(text, add_special_tokens=False).input_ids
  plain = [MESSAGES[0], {"role": "user", "content": "What is the capital of Japan?"}]
  want = _chat_ids(hf, plain)
  assert httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"] == want
  ids = tok(text).input_ids
  assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}
  r = httpx.post(url + "/detokenize", json={"tokens": [1, 10**6]})
  assert r.status_code == 400 and "10000" in r.json()["error"]["message"]
  r = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": MESSAGES})
  assert r.status_code == 400


def test_tokenizer_info_is_what_lm_eval_reads_to_tokenize_through_the_server(url, hf):
  from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

  tok = hf[0]
  info = httpx.get(url + "/tokenizer_info").json()
  assert (info["bos_token"], info["eos_token"]) == (tok.bos_token, tok.eos_token)
  assert info["chat_template"] == tok.chat_template
  assert info["model_max_length"] == 256
  # lm-evaluation-harness's local-completions model picks the server's tokenizer by itself
  assert check_remote_tokenizer_support(url + "/v1/completions")
  remote = RemoteTokenizer(url + "/v1/completions")
  text = "def main():\n    return 東京"
  assert remote.encode(text) == tok(text, add_special_tokens=False).input_ids
  assert remote.eos_token_id == tok.eos_token_id
  assert remote.decode(tok(text).input_ids) == tok.decode(tok(text).input_ids)


def test_vllms_metrics_count_what_was_served(url, client, hf):
  labels = (("engine", "0"), ("model_name", NAME))
  prompt = helpers.TINY_TEXTS[1] * 3  # 2+ pages of 16 tokens: its second run hits the cache
  n_prompt = len(hf[0](prompt).input_ids)
  assert n_prompt >= 32
  before = helpers.metrics(url)
  for n in (5, 6, 7):
    client.completions.create(
        model=NAME, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
  after = helpers.metrics(url)

  def delta(name, *extra):
    key = (name, *sorted(labels + extra))
    assert key in after, f"{key} missing"
    return after[key] - before.get(key, 0)

  assert delta("vllm:prompt_tokens_total") == 3 * n_prompt
  assert delta("vllm:generation_tokens_total") == 18
  assert delta("vllm:request_success_total", ("finished_reason", "length")) == 3
  assert delta("vllm:request_success_total", ("finished_reason", "stop")) == 0
  for name in (
      "vllm:time_to_first_token_seconds",
      "vllm:e2e_request_latency_seconds",
      "vllm:request_prompt_tokens",
      "vllm:request_generation_tokens",
      "vllm:request_time_per_output_token_seconds",
  ):
    assert delta(name + "_count") == 3
    assert delta(name + "_bucket", ("le", "+Inf")) == 3
  assert delta("vllm:request_prompt_tokens_sum") == 3 * n_prompt
  assert delta("vllm:request_generation_tokens_sum") == 18
  assert delta("vllm:inter_token_latency_seconds_count") == 4 + 5 + 6  # gaps between tokens
  assert delta("vllm:time_per_output_token_seconds_count") == 4 + 5 + 6
  assert 0 < delta("vllm:e2e_request_latency_seconds_sum") < 300
  assert delta("vllm:prefix_cache_queries_total") == 3 * n_prompt
  assert delta("vllm:prefix_cache_hits_total") >= 2 * 16  # two later runs, a full page each
  assert delta("vllm:num_preemptions_total") == 0
  assert after[("vllm:num_requests_running", *labels)] == 0
  assert after[("vllm:num_requests_waiting", *labels)] == 0
  assert 0 <= after[("vllm:kv_cache_usage_perc", *labels)] <= 1
  # vLLM's buckets: TTFT's first is 1 ms, request_prompt_tokens' are 1, 2, 5, 10, ... <= 256
  assert ("vllm:time_to_first_token_seconds_bucket", *sorted(labels + (("le", "0.001"),))) in after
  assert ("vllm:request_prompt_tokens_bucket", *sorted(labels + (("le", "200.0"),))) in after
  assert ("vllm:request_prompt_tokens_bucket", *sorted(labels + (("le", "500.0"),))) not in after


def _logprobs(hf, ids) -> np.ndarray:
  """transformers' log_softmax of the next-token logits after each of `ids`."""
  with torch.no_grad():
    logits = hf[1](torch.tensor([ids])).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


def test_echo_and_logprobs_are_lm_evaluation_harness_loglikelihoods(client, hf):
  tok = hf[0]
  prompts = [tok(t).input_ids for t in ("def main():\n    return 0\n", "The quick brown fox")]
  # What lm-evaluation-harness' local-completions sends for loglikelihood requests.
  r = client.completions.create(
      model=NAME, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
  )
  for ids, c in zip(prompts, _by_index(r)):
    (new,) = c.token_ids
    want = _logprobs(hf, ids + [new])
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids + [new]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
    np.testing.assert_allclose(
        lp.token_logprobs[1:], [want[i - 1, t] for i, t in enumerate(ids + [new]) if i], atol=2e-4
    )
    assert new == int(np.argmax(want[len(ids) - 1]))  # greedy
    for i, top in enumerate(lp.top_logprobs[1:], 1):  # the chosen token, then the top 1
      best = int(np.argmax(want[i - 1]))
      assert top[tok.decode([best])] == pytest.approx(want[i - 1, best], abs=2e-4)
    assert c.text.startswith(tok.decode(ids))  # the prompt echoed before the generated text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

  # max_tokens 0: the prompt scored, nothing generated
  r = client.completions.create(
      model=NAME, prompt=prompts[0], max_tokens=0, temperature=0, logprobs=3, echo=True
  )
  (c,) = r.choices
  assert c.token_ids == [] and r.usage.completion_tokens == 0
  want = _logprobs(hf, prompts[0])
  np.testing.assert_allclose(
      c.logprobs.token_logprobs[1:], [want[i, t] for i, t in enumerate(prompts[0][1:])], atol=2e-4
  )
  assert all(len(top) >= 3 for top in c.logprobs.top_logprobs[1:])


def test_chat_logprobs_are_transformers_log_softmax(client, hf):
  r = client.chat.completions.create(
      model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
  )
  (c,) = r.choices
  plain = [MESSAGES[0], {"role": "user", "content": "What is the capital of Japan?"}]
  ids = _chat_ids(hf, plain)
  new = _generate(hf, ids, 6)
  want = _logprobs(hf, ids + new)
  content = c.logprobs.content
  assert [e.token for e in content] == [hf[0].decode([t]) for t in new]
  for j, (e, t) in enumerate(zip(content, new)):
    row = want[len(ids) + j - 1]
    assert e.logprob == pytest.approx(row[t], abs=2e-4)
    assert e.bytes == list(e.token.encode())
    assert len(e.top_logprobs) == 2
    assert [x.logprob for x in e.top_logprobs] == pytest.approx(np.sort(row)[::-1][:2], abs=2e-4)


# -- structured output ----------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def _valid(text: str, schema: dict) -> bool:
  try:
    jsonschema.validate(json.loads(text), schema)
  except (json.JSONDecodeError, jsonschema.ValidationError):
    return False
  return True


def test_a_json_schema_response_validates_where_free_text_does_not(client):
  """OpenAI's response_format json_schema, greedy and sampled (n=3): every content parses and
  validates; the same model unconstrained writes no JSON at all."""
  fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
  greedy = client.chat.completions.create(
      model=NAME, messages=ASK, response_format=fmt, temperature=0, max_tokens=120
  )
  sampled = client.chat.completions.create(
      model=NAME, messages=ASK, response_format=fmt, temperature=1, seed=4, n=3, max_tokens=120
  )
  for c in greedy.choices + sampled.choices:
    assert c.finish_reason == "stop", c.message.content
    assert _valid(c.message.content, PERSON), c.message.content
  assert len({c.message.content for c in sampled.choices}) > 1  # the draws differ
  free = client.chat.completions.create(model=NAME, messages=ASK, temperature=0, max_tokens=60)
  assert not _valid(free.choices[0].message.content, {"type": "object"})


def test_the_openai_clients_parse_fills_a_pydantic_model(client):
  """`client.chat.completions.parse(response_format=Model)`: the client sends the model's strict
  schema and parses the content into the model."""

  class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)

  r = client.chat.completions.parse(
      model=NAME, messages=ASK, response_format=Pet, temperature=0, max_tokens=60
  )
  pet = r.choices[0].message.parsed
  assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish")


def test_a_streamed_json_schema_response_concatenates_to_its_json(client):
  fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
  chunks = client.chat.completions.create(
      model=NAME, messages=ASK, response_format=fmt, temperature=0, max_tokens=120, stream=True
  )
  chunks = list(chunks)
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
  assert _valid(text, PERSON), text
  assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_json_object_response_parses_with_a_logit_bias_beside_it(client, hf):
  """json_object allows any object; the quote's bias closes the random model's strings soon
  enough to finish (the grammar's mask and the bias apply to the same logits)."""
  (quote,) = hf[0].encode('"', add_special_tokens=False)
  r = client.chat.completions.create(
      model=NAME,
      messages=ASK,
      response_format={"type": "json_object"},
      logit_bias={str(quote): 6},
      temperature=0,
      max_tokens=120,
  )
  (c,) = r.choices
  assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}"),
        ({"guided_choice": ["yes", "no", "maybe so"]}, r"yes|no|maybe so"),
        ({"structured_outputs": {"regex": r"(ab|cd)+!"}}, r"(ab|cd)+!"),
        ({"structured_outputs": {"grammar": 'start: "x=" /[1-9]/ (";" "x=" /[1-9]/)*'}}, None),
    ],
)
def test_vllms_guided_fields_constrain_completions(client, extra, pattern):
  r = client.completions.create(
      model=NAME,
      prompt="The answer:",
      max_tokens=40,
      temperature=1,
      seed=1,
      n=4,
      extra_body=extra,
  )
  for c in r.choices:
    assert c.finish_reason == "stop", c.text
    assert re.fullmatch(pattern or r"x=[1-9](;x=[1-9])*", c.text), c.text


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"guided_regex": "[0-9]+("}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "must be a non-empty list"),
        (
            {"guided_regex": "[0-9]", "guided_choice": ["a"]},
            "guided_choice",
            "guided_regex and guided_choice both constrain the output",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(url, fields, param, words):
  body = {"model": NAME, "messages": ASK, "max_tokens": 4, **fields}
  r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["param"] == param and words in err["message"], err


# -- tool calling ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls):
  assert calls
  for call in calls:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tools_reach_the_chat_template_as_transformers_renders_them(client, hf):
  """The prompt with tools, and a conversation holding a call and its result, has the token
  count of transformers' apply_chat_template with the same tools and messages."""
  call = {"name": "get_time", "arguments": {"zone": "utc"}}
  history = ASK + [
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
      {"role": "tool", "content": "12:00", "tool_call_id": "chatcmpl-tool-1"},
  ]
  sent = history[:1] + [
      {
          "role": "assistant",
          "content": None,
          "tool_calls": [
              {
                  "id": "chatcmpl-tool-1",
                  "type": "function",
                  "function": {"name": "get_time", "arguments": json.dumps(call["arguments"])},
              }
          ],
      },
      history[2],
  ]
  for messages, oracle in ((ASK, ASK), (sent, history)):
    r = client.chat.completions.create(
        model=NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2, temperature=0
    )
    want = hf[0].apply_chat_template(oracle, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason == "length"
  plain = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=1)
  assert plain.usage.prompt_tokens < len(_chat_ids(hf, ASK)) + 20 < r.usage.prompt_tokens


def test_tool_choice_required_calls_the_tools(client):
  """Sampled (n=3) with parallel_tool_calls=false: one valid call each."""
  r = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1, seed=2, n=3,
      max_tokens=100, parallel_tool_calls=False,
  )  # fmt: skip
  for c in r.choices:
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert len(c.message.tool_calls) == 1
    _check_calls(c.message.tool_calls)


def test_a_named_tool_choice_calls_that_function(client):
  named = {"type": "function", "function": {"name": "get_weather"}}
  r = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
  )
  (c,) = r.choices
  assert c.finish_reason == "stop" and [t.function.name for t in c.message.tool_calls] == [
      "get_weather"
  ]
  _check_calls(c.message.tool_calls)


def test_streamed_tool_calls_assemble_as_the_openai_client_reads_them(client):
  """The stream's tool_calls deltas, gathered by index as clients gather them, are the calls
  of the same request unstreamed."""
  kw = dict(
      model=NAME,
      messages=ASK,
      tools=TOOLS,
      tool_choice="required",
      parallel_tool_calls=False,
      temperature=0,
      max_tokens=100,
  )
  whole = client.chat.completions.create(**kw).choices[0]
  calls, finish = {}, None
  for chunk in client.chat.completions.create(stream=True, **kw):
    for c in chunk.choices:
      finish = c.finish_reason or finish
      for d in c.delta.tool_calls or []:
        got = calls.setdefault(d.index, {"name": "", "arguments": ""})
        got["name"] += d.function.name or ""
        got["arguments"] += d.function.arguments or ""
  assert finish == "tool_calls"
  assert [calls[i] for i in sorted(calls)] == [
      {"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls
  ]


def test_auto_tool_choice_returns_text_the_model_did_not_write_as_a_call(client):
  """The random model writes no <tool_call>: "auto" (the default with tools) gives its text as
  content and no calls, where the hermes parser (found in the template) finds none."""
  r = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=12
  )
  (c,) = r.choices
  assert c.message.content and c.message.tool_calls == [] and c.finish_reason == "length"


def test_a_named_functions_arguments_stream_delta_by_delta(client):
  """The first delta names the function (with its id); the arguments follow as they are
  generated and join to the unstreamed request's."""
  named = {"type": "function", "function": {"name": "get_weather"}}
  kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60)
  whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
  deltas = [
      d
      for chunk in client.chat.completions.create(stream=True, **kw)
      for c in chunk.choices
      for d in c.delta.tool_calls or []
  ]
  assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("chatcmpl-tool-")
  assert len(deltas) > 3  # the arguments came in pieces
  assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
