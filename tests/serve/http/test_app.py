"""The OpenAI-compatible server (serve/http/app.py over its engine loop), driven with the real
`openai` client, against `Engine.generate`."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import jax
import numpy as np
import openai
import pytest

from configs import tiny
from experiments import serve_client
from jaxpipe.models import transformer
from jaxpipe.serve import deploy, workload
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.http import CompletionServer, checks, protocol
from jaxpipe.serve.http.loop import load_of
from jaxpipe.serve.request import ENGINE_EOS, RequestLimits
from jaxpipe.training import config as config_lib
from tests import helpers

ROOT = helpers.ROOT
# The tiny model (vocab 64: digits and punctuation are tokens, letters are not); two programs.
ENGINE = dict(
    page_size=16,
    num_pages=80,
    max_batch=4,
    max_tokens_per_step=32,
    max_seq_len=512,
    token_buckets=(8, 32),
    page_buckets=(32,),
)
MAX_QUEUE = 12  # with max_batch: 16 sequences in flight at most


@pytest.fixture(scope="module")
def model():
  cfg = config_lib.model_config(tiny.get_config())
  return cfg, jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def reference(model):
  """A second engine on the same parameters: `generate` is the oracle."""
  return Engine(*model, **ENGINE)


@contextlib.contextmanager
def _serving(backend, **kw):
  """The app over `backend`, served by uvicorn on a thread on a free port: yields its URL."""
  app = CompletionServer(
      backend, model_name="tiny", max_batch=ENGINE["max_batch"], max_queue=MAX_QUEUE, **kw
  )
  sock = socket.create_server(("127.0.0.1", 0))
  server = app.uvicorn_server()
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  helpers.wait_healthy(url, thread.is_alive)
  yield url
  server.should_exit = True
  thread.join(30)
  assert not thread.is_alive()


@pytest.fixture(scope="module")
def url(model):
  engine = Engine(*model, **ENGINE)
  engine.precompile()
  with _serving(engine, drain_s=5) as url:
    yield url


@pytest.fixture(scope="module")
def disagg_url(model):
  """The server over a disaggregated deployment: one prefill and one decode worker."""
  devices = jax.devices()
  deployment = deploy.Disaggregated(*model, [devices[1:2]], [devices[2:3]], **ENGINE)
  with _serving(deployment) as url:
    yield url


@pytest.fixture
def client(url):
  return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _stream(client, **kw):
  """(chunks, text and token ids per choice, finish reasons, the last chunk's usage)."""
  chunks = list(client.completions.create(stream=True, **kw))
  n = kw.get("n", 1)
  texts, ids, finish = [""] * n, [[] for _ in range(n)], [None] * n
  for ch in chunks:
    for c in ch.choices:
      texts[c.index] += c.text
      ids[c.index] += c.token_ids
      finish[c.index] = c.finish_reason
  return chunks, texts, ids, finish, chunks[-1].usage


def _by_index(response):
  return sorted(response.choices, key=lambda c: c.index)


def test_models_and_health(url, client):
  assert httpx.get(url + "/health").json() == {"status": "ok"}
  (m,) = client.models.list().data
  assert m.id == "tiny" and m.max_model_len == 512


def test_greedy_completion_equals_engine_generate(client, reference):
  ids = [5, 9, 1, 33, 2, 7, 60, 4, 8, 1, 0, 63]
  want = reference.generate([list(b"0123"), ids], max_tokens=20)
  for prompt, w in zip(["0123", ids], want):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    (c,) = r.choices
    assert c.token_ids == w
    assert c.text == bytes(w).decode("ascii")  # the vocabulary is ASCII: one token, one character
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 20)
  r = client.completions.create(
      model="tiny", prompt=[list(b"0123"), ids], max_tokens=20, temperature=0
  )  # two prompts in one request
  assert [c.token_ids for c in _by_index(r)] == want


def test_penalties_bias_and_min_p_reach_the_sampler(client, reference):
  """The openai client's presence, frequency and logit_bias, and vLLM's repetition_penalty and
  min_p (extra_body), give the engine's tokens for the same sampling values; a bias of 100 on
  one token makes every greedy token that one."""
  from jaxpipe.serve.sampling import SamplingParams

  kw = dict(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={"7": 2.0, "1": -100.0})
  extra = dict(repetition_penalty=1.3, min_p=0.1)
  sp = SamplingParams(
      temperature=0.9,
      seed=5,
      min_p=0.1,
      presence_penalty=0.8,
      frequency_penalty=0.5,
      repetition_penalty=1.3,
      logit_bias=((7, 2.0), (1, -100.0)),
  )
  rid = reference.add_request(list(b"0123"), 16, sp, eos_id=None)
  while reference.has_work():
    reference.step()
  want = {r.id: r.output for r in reference.finished()}[rid]
  r = client.completions.create(
      model="tiny", prompt="0123", max_tokens=16, temperature=0.9, seed=5, extra_body=extra, **kw
  )
  assert r.choices[0].token_ids == want
  forced = client.completions.create(
      model="tiny", prompt="0123", max_tokens=6, temperature=0, logit_bias={"42": 100}
  )
  assert forced.choices[0].token_ids == [42] * 6


def test_stream_concatenates_to_the_completion_and_both_equal_the_engine_sample(client, reference):
  kw = dict(model="tiny", prompt="0123", max_tokens=24, temperature=0.9, top_p=0.9, seed=11, n=2)
  # choice k samples with seed + k, as generate's prompt k does
  want = reference.generate([list(b"0123")] * 2, max_tokens=24, temperature=0.9, top_p=0.9, seed=11)
  full = client.completions.create(**kw)
  assert [c.token_ids for c in _by_index(full)] == want
  chunks, texts, ids, finish, usage = _stream(client, **kw)
  assert ids == want and texts == [c.text for c in _by_index(full)]
  assert finish == ["length", "length"]
  assert all(len(c.token_ids) == 1 for ch in chunks for c in ch.choices)  # one chunk per token
  assert len(chunks) == 48 and usage.completion_tokens == 48 and usage.prompt_tokens == 4
  assert all(ch.usage is None for ch in chunks[:-1])

  # A stop sequence taken from the text: both end before its first occurrence.
  stop = texts[0][9:11]
  cut = [t[: t.find(stop)] if stop in t else t for t in texts]
  stopped = client.completions.create(**kw, stop=[stop, "never"])
  assert [c.text for c in _by_index(stopped)] == cut
  assert [c.finish_reason for c in _by_index(stopped)] == [
      "stop" if stop in t else "length" for t in texts
  ]
  _, s_texts, _, s_finish, _ = _stream(client, **kw, stop=[stop, "never"])
  assert s_texts == cut and s_finish == [c.finish_reason for c in _by_index(stopped)]


def test_16_concurrent_streams_are_all_answered(url, reference):
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(0, 64, rng.integers(1, 40))] for _ in range(16)]
  want = reference.generate(prompts, max_tokens=24)

  async def one(client, prompt):
    ids = []
    async for chunk in await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
    ):
      ids += [t for c in chunk.choices for t in c.token_ids]
    return ids

  async def main():
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return await asyncio.gather(*(one(client, p) for p in prompts))

  assert asyncio.run(main()) == want


def _wait(url, done, timeout=60):
  start = time.monotonic()
  while not done(m := helpers.metrics(url)):
    assert time.monotonic() - start < timeout, m
    time.sleep(0.05)
  return m


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_pages(url, client, stream):
  abort = ("jaxpipe_request_finished_total", ("finish_reason", "abort"))
  before = helpers.metrics(url).get(abort, 0)
  kw = dict(model="tiny", prompt="0123456789" * 3, max_tokens=450, temperature=0)
  if stream:
    response = client.completions.create(**kw, stream=True)
    chunks = iter(response)
    next(chunks), next(chunks)
    assert helpers.metrics(url)[("jaxpipe_kv_pages_running",)] >= 2  # 32 tokens: two pages of 16
    response.close()
  else:
    with pytest.raises(httpx.ReadTimeout):  # gives up waiting for the whole completion
      httpx.post(url + "/v1/completions", json=kw, timeout=httpx.Timeout(10, read=0.1))
  m = _wait(url, lambda m: m.get(abort, 0) == before + 1)  # cancelled, not run to its length
  assert m[("jaxpipe_num_requests_running",)] == m[("jaxpipe_num_requests_waiting",)] == 0
  assert m[("jaxpipe_kv_pages_running",)] == 0
  assert m[("jaxpipe_kv_pages_used",)] == m[("jaxpipe_kv_pages_cached",)]  # only the prefix cache


def test_a_disaggregated_deployment_serves_the_same_tokens_and_frees_both_sides(
    disagg_url, reference
):
  client = openai.OpenAI(base_url=disagg_url + "/v1", api_key="unused", max_retries=0)
  prompts = [
      [int(t) for t in np.random.default_rng(i).integers(0, 64, 5 + 9 * i)] for i in range(3)
  ]
  want = reference.generate(prompts, max_tokens=20)

  async def main():
    aclient = openai.AsyncOpenAI(base_url=disagg_url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt):
      return [
          t
          async for ch in await aclient.completions.create(
              model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True
          )
          for c in ch.choices
          for t in c.token_ids
      ]

    return await asyncio.gather(*(one(p) for p in prompts))

  assert asyncio.run(main()) == want  # prefilled on one worker, decoded on the other
  abort = ("jaxpipe_request_finished_total", ("finish_reason", "abort"))
  stream = client.completions.create(
      model="tiny", prompt="0123456789" * 3, max_tokens=450, temperature=0, stream=True
  )
  chunks = iter(stream)
  next(chunks), next(chunks)
  stream.close()
  m = _wait(disagg_url, lambda m: m.get(abort, 0) == 1)
  assert m[("jaxpipe_kv_pages_running",)] == 0  # summed over both workers
  assert m[("jaxpipe_kv_pages_used",)] == m[("jaxpipe_kv_pages_cached",)]


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(client, reference):
  """best_of=4, n=2: the engine's four candidates (seeds seed..seed+3, as the server seeds
  choices) ranked by the sum of their tokens' log-probabilities; the top two come back, most
  likely first, without logprobs unless asked for."""
  from jaxpipe.serve.sampling import SamplingParams

  seed, k = 21, 4
  rids = [
      reference.add_request(
          list(b"0123"), 10, SamplingParams(temperature=1.2, seed=seed + i, logprobs=0), eos_id=None
      )
      for i in range(k)
  ]
  while reference.has_work():
    reference.step()
  done = {r.id: r for r in reference.finished()}
  score = {i: sum(lp for lp, _ in done[rid].logprobs) for i, rid in enumerate(rids)}
  order = sorted(range(k), key=lambda i: -score[i])
  r = client.completions.create(
      model="tiny", prompt="0123", max_tokens=10, temperature=1.2, seed=seed, n=2, best_of=k
  )
  assert [c.index for c in r.choices] == [0, 1]
  assert [c.token_ids for c in r.choices] == [done[rids[i]].output for i in order[:2]]
  assert order[:2] != [0, 1]  # the ranking, not the first two candidates
  assert all(c.logprobs is None for c in r.choices)
  assert r.usage.completion_tokens == 20


def test_guided_choices_end_where_their_grammar_does_on_one_engine_and_on_two(client, disagg_url):
  """A model without EOS ids: a constrained choice ends where its grammar must (finish "stop",
  its last token's text kept). The disaggregated deployment moves each request, and its place
  in the grammar, from the prefill worker to the decode worker: the same tokens."""
  split = openai.OpenAI(base_url=disagg_url + "/v1", api_key="unused", max_retries=0)
  pattern = r"[1-9][0-9]{2}(,[0-9]{3}){2}\."
  kw = dict(model="tiny", prompt="0123", max_tokens=40, temperature=1.0, seed=9, n=3)
  extra = {"guided_regex": pattern}
  one = client.completions.create(**kw, extra_body=extra)
  two = split.completions.create(**kw, extra_body=extra)
  for r in (one, two):
    for c in r.choices:
      assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c
  assert [c.token_ids for c in _by_index(one)] == [c.token_ids for c in _by_index(two)]
  free = client.completions.create(**kw)
  assert not any(re.fullmatch(pattern, c.text) for c in free.choices)
  pick = client.chat.completions.create  # no chat template: 400 before any grammar
  with pytest.raises(openai.BadRequestError):
    pick(model="tiny", messages=[{"role": "user", "content": "1"}], extra_body=extra)
  r = client.completions.create(
      model="tiny",
      prompt="7",
      max_tokens=8,
      temperature=0,
      extra_body={"guided_choice": ["12", "3"]},
  )
  assert r.choices[0].text in ("12", "3") and r.choices[0].finish_reason == "stop"


def test_a_speculating_server_serves_the_plain_greedy_tokens_and_counts_its_drafts(
    model, reference
):
  from jaxpipe.serve.speculative import SpecConfig

  engine = Engine(*model, speculative=SpecConfig(num_tokens=3), **ENGINE)
  prompts = ["0120120120", "4545454"]
  want = reference.generate([list(p.encode()) for p in prompts], max_tokens=20)
  with _serving(engine) as url:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for prompt, tokens in zip(prompts, want):
      r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
      assert r.choices[0].token_ids == tokens
    m = helpers.metrics(url)
  drafts, kept = engine.counts["spec_drafts"], engine.counts["spec_accepted"]
  assert 0 < kept <= drafts
  assert m[
      ("vllm:spec_decode_num_draft_tokens_total", ("engine", "0"), ("model_name", "tiny"))
  ] == (drafts)
  key = ("vllm:spec_decode_num_accepted_tokens_total", ("engine", "0"), ("model_name", "tiny"))
  assert m[key] == kept


class _Failing:
  """A backend that generates token 48 twice, then its device work fails."""

  limits = RequestLimits(vocab=256, max_seq_len=64, page_size=16, num_pages=9)
  running, waiting = [], []

  def __init__(self):
    self.steps = None

  def check_request(self, prompt, max_tokens, sampling, eos_id=None):
    return None

  def add_request(self, prompt, max_tokens, sampling, *, eos_id):
    self.steps = 0
    return 0

  def step(self):
    self.steps += 1
    if self.steps > 2:
      raise RuntimeError("device lost")
    return {0: [48]}

  def finished(self):
    return []

  def has_work(self):
    return self.steps is not None

  def kv_usage(self):
    return dict(pages_total=8, pages_in_use=0, pages_running=0, cached_pages=0, tokens=0, slots=0)


@pytest.mark.parametrize("stream", [True, False])
def test_an_engine_fault_fails_its_requests_and_health_says_so(stream):
  with _serving(_Failing()) as url:
    body = {"prompt": "01", "max_tokens": 8, "stream": stream}
    r = httpx.post(url + "/v1/completions", json=body)
    if stream:  # the tokens so far, then the error, then the end
      events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
      assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["0", "0"]
      assert (
          json.loads(events[2])["error"]["message"]
          == "the engine failed: RuntimeError: device lost"
      )
      assert events[3:] == ["[DONE]"]
    else:
      assert r.status_code == 500
      assert r.json()["error"]["message"] == "the engine failed: RuntimeError: device lost"
    assert httpx.get(url + "/health").json() == {
        "status": "failed",
        "error": "RuntimeError: device lost",
    }
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 503 and "the engine failed" in r.json()["error"]["message"]


class _UnscorableLong(_Failing):
  """Generates like _Failing's first steps, and fails to score prompts longer than 3 tokens."""

  def step(self):
    self.steps += 1
    return {0: [48]}

  def finished(self):
    if self.steps is not None and self.steps >= 2:
      self.steps = None
      return [types.SimpleNamespace(id=0, finish_reason="length", error=None)]
    return []

  def score(self, prompt, top_logprobs=0):
    if len(prompt) > 3:
      raise MemoryError("the prompt's logits do not fit")
    return [None] + [(-1.0, [])] * (len(prompt) - 1)


def test_a_prompt_that_cannot_be_scored_fails_its_request_not_the_server():
  with _serving(_UnscorableLong()) as url:
    body = {"prompt": "0123", "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["message"] == (
        "scoring the prompt failed: MemoryError: the prompt's logits do not fit"
    )
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": "01"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]


def test_a_preempted_request_finding_its_own_pages_is_no_prefix_cache_hit():
  """vLLM counts a preempted request's lookup on readmission apart from its prefix-cache
  queries and hits. Prompts that share nothing, in a pool small enough to preempt: the engine
  takes tokens from the cache when the preempted come back, yet vllm:prefix_cache_hits_total
  reads 0, and vllm:num_preemptions_total the engine's preemptions."""
  from prometheus_client import generate_latest
  from prometheus_client.parser import text_string_to_metric_families

  from jaxpipe.serve.http.metrics import Metrics

  engine = Engine(
      helpers.DENSE, helpers.engine_params("dense"), num_pages=12, **helpers.ENGINE_ARGS
  )
  helpers.serve_arrivals(engine, helpers.prompts(seed=8, n=8), 14, first=4, eos_id=None)
  metrics = Metrics("tiny")
  metrics.engines(load_of(engine))
  text = generate_latest(metrics.registry).decode()
  got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
  assert engine.counts["preemptions"] > 0 and engine.counts["cached_tokens"] > 0
  assert engine.counts["prefix_hits"] == 0
  assert got["vllm:prefix_cache_hits_total"] == 0
  assert got["vllm:num_preemptions_total"] == engine.counts["preemptions"]


def test_metrics_parse_and_count_what_was_served(url, client):
  before = helpers.metrics(url)
  for n in (3, 5, 7):
    client.completions.create(model="tiny", prompt="012", max_tokens=n, temperature=0)
  after = helpers.metrics(url)
  delta = lambda *key: after.get(key, 0) - before.get(key, 0)
  assert delta("jaxpipe_generation_tokens_total") == 15
  assert delta("jaxpipe_prompt_tokens_total") == 9
  assert delta("jaxpipe_request_finished_total", ("finish_reason", "length")) == 3
  assert delta("jaxpipe_time_to_first_token_seconds_count") == 3
  assert delta("jaxpipe_time_per_output_token_seconds_count") == 3
  assert delta("jaxpipe_e2e_request_latency_seconds_count") == 3
  assert after[("jaxpipe_kv_pages_total",)] == ENGINE["num_pages"] - 1
  assert (
      after[("jaxpipe_time_to_first_token_seconds_bucket", ("le", "+Inf"))]
      == after[("jaxpipe_time_to_first_token_seconds_count",)]
  )
  for name in (
      "jaxpipe_num_requests_running",
      "jaxpipe_num_requests_waiting",
      "jaxpipe_kv_pages_used",
      "jaxpipe_generation_tokens_per_second",
  ):
    assert (name,) in after
  # idle, a finished request's full pages kept by the prefix cache: vLLM counts those as free
  client.completions.create(model="tiny", prompt="0123456789" * 4, max_tokens=4, temperature=0)
  idle = helpers.metrics(url)
  labels = ("engine", "0"), ("model_name", "tiny")
  assert idle[("jaxpipe_kv_pages_cached",)] >= 2
  assert idle[("jaxpipe_kv_pages_used",)] == idle[("jaxpipe_kv_pages_cached",)]
  assert idle[("vllm:kv_cache_usage_perc", *labels)] == 0


def test_an_api_key_guards_every_route_but_monitoring(model, reference):
  """With --api_key, a request without the Bearer token, or with another, gets 401 (the openai
  package's AuthenticationError); with it, the completion is the engine's; /health, /metrics
  and /version stay open. An empty key is refused."""
  engine = Engine(*model, **ENGINE)
  with _serving(engine, api_key="s3cret") as url:
    for key in ("wrong", "s3cre", "s3cret2"):  # another key, a prefix of it, one longer
      bad = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
      with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="012", max_tokens=3)
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
      r = httpx.request(method, url + path, json={"prompt": "012", "max_tokens": 3})
      assert r.status_code == 401, path
      assert r.json()["error"]["type"] == "authentication_error"
    for path in ("/health", "/ready", "/metrics", "/version"):
      assert httpx.get(url + path).status_code == 200, path
    good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    out = good.completions.create(model="tiny", prompt="012", max_tokens=3, temperature=0)
    assert out.choices[0].token_ids == reference.generate([list(b"012")], 3)[0]
  with pytest.raises(ValueError, match="the API key is empty"):
    CompletionServer(engine, model_name="tiny", max_batch=4, api_key="")


def test_a_request_whose_kv_is_on_its_way_is_waiting_as_vllm_counts_it():
  """vLLM's decode instance keeps a request whose K/V it awaits in its waiting queue, and a
  prefill instance's finished prefill in neither gauge: a prefilled request parked on a prefill
  engine counts nowhere, then waiting once a decode engine reserved it."""
  from jaxpipe.serve.http.metrics import Metrics

  fields = dict(helpers.ENGINE_ARGS, async_scheduling=False)
  params = helpers.engine_params("dense")
  p = Engine(helpers.DENSE, params, prefill_only=True, **fields)
  d = Engine(helpers.DENSE, params, **fields)
  p.add_request([1, 2, 3, 4, 5], 4, eos_id=None)
  while not p.prefilled:
    p.step()
  m = Metrics("tiny")
  gauge = lambda name: m.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"})
  m.engines(load_of(types.SimpleNamespace(engines=[p, d])))
  assert gauge("vllm:num_requests_running") == gauge("vllm:num_requests_waiting") == 0
  d.transfer.reserve_request(p.transfer.export_request(p.prefilled[0].id))
  m.engines(load_of(types.SimpleNamespace(engines=[p, d])))
  assert len(d.incoming) == 1 and not d.waiting and not d.running
  assert gauge("vllm:num_requests_waiting") == 1 and gauge("vllm:num_requests_running") == 0


BAD = [  # body, status, words of the message, the error's param
    (b'{"prompt": "01", ', 400, "not valid JSON", None),
    (b'["01"]', 400, "send a JSON object", None),
    ({"prompt": "01", "max_tokens": "five"}, 400, "max_tokens='five'", "max_tokens"),
    ({"prompt": "01", "temperature": "hot"}, 400, "temperature='hot'", "temperature"),
    ({"prompt": "01", "n": 1.5}, 400, "n=1.5", "n"),
    ({"prompt": "01", "stream": "yes"}, 400, "stream='yes'", "stream"),
    ({"prompt": "01", "colour": "red"}, 400, "unrecognized request argument 'colour'", "colour"),
    ({"prompt": 7}, 400, "prompt=7 must be a string", "prompt"),
    ({"max_tokens": 3}, 400, "'prompt' is required", "prompt"),
    (
        {"prompt": "01", "max_tokens": 0},
        400,
        "max_tokens=0 must be a positive integer",
        "max_tokens",
    ),
    (
        {"prompt": "01", "max_tokens": -3},
        400,
        "max_tokens=-3 must be a positive integer",
        "max_tokens",
    ),
    ({"prompt": "01", "max_tokens": 511}, 400, "exceeds the context of 512 tokens", "max_tokens"),
    (
        {"prompt": "01", "temperature": -0.5},
        400,
        "temperature=-0.5 must lie in [0, 100]",
        "temperature",
    ),
    (
        {"prompt": "01", "temperature": 1e308},
        400,
        "temperature=1e+308 must lie in [0, 100]",
        "temperature",
    ),
    (
        b'{"prompt": "01", "temperature": Infinity}',
        400,
        "temperature=inf must lie in [0, 100]",
        "temperature",
    ),
    (
        b'{"prompt": "01", "temperature": NaN}',
        400,
        "temperature=nan must lie in [0, 100]",
        "temperature",
    ),
    (
        b'{"prompt": "0\\ud8001"}',
        400,
        "the prompt holds a lone UTF-16 surrogate ('\\ud800' at",
        "prompt",
    ),
    (b'{"prompt": ["0", "\\udfff"]}', 400, "prompt 1 holds a lone UTF-16 surrogate", "prompt"),
    (
        {"prompt": "01", "min_tokens": -1},
        400,
        "min_tokens=-1 must be an integer >= 0",
        "min_tokens",
    ),
    (
        {"prompt": "01", "stop_token_ids": [64]},
        400,
        "stop_token_ids [64] are outside",
        "stop_token_ids",
    ),
    ({"prompt": "01", "top_p": 0}, 400, "top_p=0", "top_p"),
    ({"prompt": "01", "seed": -1}, 400, "seed=-1", "seed"),
    ({"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ({"prompt": []}, 400, "the prompt is empty", "prompt"),
    ({"prompt": "0\u00e91"}, 400, "prompt token 195 is outside the vocabulary [0, 64)", "prompt"),
    ({"prompt": [1, 64]}, 400, "prompt token 64 is outside the vocabulary [0, 64)", "prompt"),
    ({"prompt": [[1, 2], [3, 99]]}, 400, "prompt 1: prompt token 99", "prompt"),
    (
        {"prompt": ["01", [3]]},
        400,
        "must be a string, a list of token ids, or a list of either",
        "prompt",
    ),
    ({"prompt": [1] * 512}, 400, "leaves no room in the context of 512", "prompt"),
    ({"prompt": "01", "n": 0}, 400, "n=0 must be >= 1", "n"),
    ({"prompt": "01", "n": 17}, 400, "17 sequences exceed the server's 16", "n"),
    ({"prompt": "01", "stop": ["1", "2", "3", "4", "5"]}, 400, "at most 4", "stop"),
    ({"prompt": "01", "suffix": "x"}, 400, "suffix='x' is not supported", "suffix"),
    (
        {"prompt": "01", "logit_bias": {"a": 1}},
        400,
        "logit_bias key 'a' is not a token id",
        "logit_bias",
    ),
    ({"prompt": "01", "logit_bias": {"64": 1}}, 400, "token ids [64] outside", "logit_bias"),
    ({"prompt": "01", "logit_bias": {"5": 101}}, 400, "logit_bias {5: 101.0}", "logit_bias"),
    (
        {"prompt": "01", "presence_penalty": 3},
        400,
        "presence_penalty=3.0 must lie",
        "presence_penalty",
    ),
    (
        {"prompt": "01", "repetition_penalty": 0},
        400,
        "repetition_penalty=0.0",
        "repetition_penalty",
    ),
    ({"prompt": "01", "min_p": 2}, 400, "min_p=2.0 must lie in [0, 1]", "min_p"),
    (
        {"prompt": "01", "max_tokens": 0, "echo": False},
        400,
        "max_tokens=0 must be a positive",
        "max_tokens",
    ),
    ({"prompt": "01", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist", "model"),
]


@pytest.mark.parametrize("body,status,words,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(
    url, client, body, status, words, param
):
  kw = {"content": body} if isinstance(body, bytes) else {"json": body}
  r = httpx.post(url + "/v1/completions", headers={"content-type": "application/json"}, **kw)
  assert r.status_code == status
  error = r.json()["error"]
  assert words in error["message"]
  assert error["param"] == param, error
  assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
  assert (
      client.completions.create(model="tiny", prompt="01", max_tokens=2, temperature=0)
      .choices[0]
      .finish_reason
      == "length"
  )


def test_checks_name_the_field_as_a_chat_or_a_completions_request_spells_it(reference):
  limits = checks.Limits(ENGINE["max_seq_len"], ENGINE_EOS)

  def job(chat, fields, prompts):
    body = json.dumps({("messages" if chat else "prompt"): [], **fields}).encode()
    req = protocol.parse_chat(body) if chat else protocol.parse_request(body)
    return protocol.job_of(req, prompts, chat=chat)

  for chat, param in ((False, "prompt"), (True, "messages")):  # the backend's refusal
    with pytest.raises(protocol.BadRequest, match="prompt token 64 is outside") as e:
      checks.check(job(chat, {}, [([1, 64], None)]), reference, limits)
    assert e.value.status == 400 and e.value.param == param
  for chat, fields, param in (  # a check of the server's own
      (False, {"logprobs": 21}, "logprobs"),
      (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
  ):
    with pytest.raises(protocol.BadRequest, match=f"{param}=21 must lie in") as e:
      checks.check(job(chat, fields, [([1, 2], None)]), reference, limits)
    assert e.value.param == param
  # Each prompt's max_tokens: the request's (16 by default for completions), else the rest of
  # the context.
  assert checks.check(job(False, {}, [([1, 2], None), ([3], None)]), reference, limits) == [16, 16]
  assert checks.check(job(True, {}, [([1, 2], None)]), reference, limits) == [510]


def test_chat_without_a_chat_template_is_a_400_saying_so(client):
  with pytest.raises(openai.BadRequestError, match="tokenizer has no chat template"):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "01"}])


def test_the_openai_client_raises_the_servers_message(client):
  with pytest.raises(openai.BadRequestError, match=r"temperature=-1\.0 must lie in \[0, 100\]"):
    client.completions.create(model="tiny", prompt="01", max_tokens=2, temperature=-1)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="other", prompt="01", max_tokens=2)


def test_a_full_server_answers_429_with_retry_after(url, client):
  total = ENGINE["max_batch"] + MAX_QUEUE
  stream = client.completions.create(
      model="tiny", prompt="01", n=total, max_tokens=400, temperature=0, stream=True
  )  # takes every place
  next(iter(stream))
  r = httpx.post(url + "/v1/completions", json={"prompt": "01", "max_tokens": 2})
  assert r.status_code == 429 and r.headers["retry-after"] == "1"
  assert r.json()["error"]["type"] == "rate_limit_error"
  assert f"{total} of {total} sequences in flight" in r.json()["error"]["message"]
  with pytest.raises(openai.RateLimitError):
    client.completions.create(model="tiny", prompt="01", max_tokens=2)
  abort = ("jaxpipe_request_finished_total", ("finish_reason", "abort"))
  before = helpers.metrics(url).get(abort, 0)
  stream.close()  # its sequences are cancelled and their places free again
  _wait(url, lambda m: m.get(abort, 0) == before + total)
  retrying = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=5)
  assert (
      retrying.completions.create(model="tiny", prompt="01", max_tokens=2).usage.completion_tokens
      == 2
  )


def test_the_bench_client_reads_every_token_from_the_stream(url):
  work = workload.generate(
      6, 50.0, workload.Lengths.parse("1:20"), workload.Lengths.parse("2:12"), 64, seed=0
  )
  done, makespan, (tokens, slots, steps, cpu_s) = serve_client.http_run(url, "tiny", work)
  assert [len(d.token_times) for d in done] == [w.max_tokens for w in work]
  assert all(d.ttft > 0 for d in done) and makespan > 0
  assert 0 < tokens <= slots and steps >= max(w.max_tokens for w in work) and cpu_s > 0


def test_the_bench_refuses_a_workload_longer_than_the_served_context(url):
  (model,) = httpx.get(url + "/v1/models").json()["data"]
  fits = workload.Lengths.parse("8:256"), workload.Lengths.parse("256")
  serve_client.check_context(*fits, model["max_model_len"])  # 512: just fits
  longer = workload.Lengths.parse("lognormal:64:300"), workload.Lengths.parse("8:256")
  with pytest.raises(SystemExit, match="reach 556 tokens, past the server's context of 512"):
    serve_client.check_context(*longer, model["max_model_len"])
  run = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", "--out", "elsewhere"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert run.returncode == 2 and "--out is read by --mode runs only" in run.stderr


def _until(get, ok, timeout=10):
  start = time.monotonic()
  while not ok(r := get()):
    assert time.monotonic() - start < timeout, r
    time.sleep(0.02)
  return r


def test_sigterm_drains_finishes_or_cancels_and_exits_0():
  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
      [
          sys.executable,
          "-m",
          "jaxpipe.serve",
          "--config",
          "configs/tiny.py",
          "--http",
          "--port",
          str(port),
          "--max_seq_len",
          "8192",
          "--num_pages",
          "1100",
          "--max_batch",
          "2",
          "--max_tokens_per_step",
          "8",
          "--token_buckets",
          "8",
          "--drain_s",
          "5",
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "PYTHONPATH": ROOT, "JAXPIPE_HOST_DEVICES": "1"},
  )
  try:
    helpers.wait_healthy(url, lambda: proc.poll() is None, output=proc.stdout.read)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    results, started = {}, {"short": threading.Event(), "long": threading.Event()}

    def run(name, max_tokens):
      ids, finish = [], None
      for chunk in client.completions.create(
          model="tiny", prompt="01", max_tokens=max_tokens, temperature=0, stream=True
      ):
        started[name].set()
        for c in chunk.choices:
          ids += c.token_ids
          finish = c.finish_reason or finish
      results[name] = (len(ids), finish)

    threads = [threading.Thread(target=run, args=a) for a in (("short", 30), ("long", 8000))]
    for t in threads:
      t.start()
    for e in started.values():
      assert e.wait(60)
    proc.send_signal(signal.SIGTERM)
    # From now on nothing new is taken, but the socket stays open to say so.
    r = _until(lambda: httpx.get(url + "/health"), lambda r: r.status_code == 503)
    assert r.json() == {"status": "draining"}
    r = httpx.get(url + "/ready")
    assert r.status_code == 503 and r.json() == {"ready": False, "why": "the server is draining"}
    r = httpx.post(url + "/v1/completions", json={"prompt": "01", "max_tokens": 2})
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert proc.poll() is None  # still draining: the long request runs on
    for t in threads:
      t.join(60)
    assert proc.wait(60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
  out = proc.stdout.read()
  assert results["short"] == (30, "length"), out  # finished within the drain time
  n, finish = results["long"]
  assert finish == "abort" and 0 < n < 8000, out  # cancelled when it ran out
  assert "# drained; exiting" in out
