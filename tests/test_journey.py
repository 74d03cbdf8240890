"""The journey a user takes with a Hugging Face model, each step the command they would run:

  python -m jaxpipe.convert hf-to-orbax SRC W                      # import the model
  python -m jaxpipe.data prepare --tokenizer W --input ... --out C  # my corpus, its tokenizer
  python -m jaxpipe.train --workdir W --config.data.source=tokens:C --config.mesh.pp=2 ...
  python -m jaxpipe.convert orbax-to-hf W OUT                       # export the fine-tuned model
  python -m jaxpipe.serve --workdir W --http                        # serve text and chat

and the oracles are transformers and lm-evaluation-harness on the exported checkpoint: the served
greedy completions (text and chat, stopping at EOS) equal transformers' `generate` decoded by the
same tokenizer, and lm-eval's `local-completions` model against the server scores a local task
exactly as its `hf` model does on the export.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tests import helpers

ROOT = helpers.ROOT
CORPUS = os.path.join(ROOT, "tests", "fixtures", "corpus")
LM_EVAL_TASK = os.path.join(ROOT, "tests", "fixtures", "lm_eval")
STEPS = 20
# Prompts from the corpus' documents. The first three were picked because, after this fine-tuning,
# their greedy continuations reached EOS within MAX_TOKENS, the last's did not; the test needs at
# least one to reach it (the EOS rule is then tested) and compares all four whichever way they end.
PROMPTS = [
    "東京は日本の",
    "Mount Everest is 8,84",
    "class Stack:\n    def __init__(self):\n        self.item",
    "def main():\n    return",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Print the squares."},
    ],
]
MAX_TOKENS = 32


def _run(args, env, timeout=600):
  proc = subprocess.run(
      [sys.executable, "-m", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, f"{args[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout + proc.stderr


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return json.loads(r.read())


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
  root = tmp_path_factory.mktemp("journey")
  env = helpers.env(root, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  src = helpers.write_tiny_llama(root / "src", **helpers.LLAMA_32)  # Llama 3.2's config fields
  workdir, corpus, export = str(root / "w"), str(root / "corpus"), str(root / "export")
  _run(["jaxpipe.convert", "hf-to-orbax", src, workdir], env)
  prepared = _run(
      [
          "jaxpipe.data",
          "prepare",
          "--tokenizer",
          workdir,
          "--input",
          os.path.join(CORPUS, "text.jsonl"),
          "--input",
          os.path.join(CORPUS, "chat.jsonl"),
          "--out",
          corpus,
      ],
      env,
  )
  _run(
      [
          "jaxpipe.train",
          "--workdir",
          workdir,
          f"--config.data.source=tokens:{corpus}",
          "--config.data.seq_len=64",
          "--config.data.batch=16",
          "--config.mesh.pp=2",
          "--config.pipeline.schedule=1f1b",
          "--config.pipeline.microbatches=4",
          f"--config.train.steps={STEPS}",
          f"--config.checkpoint.every={STEPS}",
          "--config.optimizer.lr=0.01",
          "--config.optimizer.warmup_steps=2",
      ],
      env,
  )
  _run(["jaxpipe.convert", "orbax-to-hf", workdir, export], env)
  port = _free_port()
  log = open(root / "server.log", "w")  # a file, not a pipe nobody reads while it serves
  server = subprocess.Popen(
      [
          sys.executable,
          "-m",
          "jaxpipe.serve",
          "--workdir",
          workdir,
          "--http",
          "--port",
          str(port),
          "--max_batch",
          "4",
          "--num_pages",
          "96",
          "--max_tokens_per_step",
          "64",
      ],
      cwd=ROOT,
      env=env,
      stdout=log,
      stderr=subprocess.STDOUT,
  )
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 300
  while True:
    try:
      if _get(url + "/health")["status"] == "ok":
        break
    except OSError:
      pass
    if server.poll() is not None or time.time() > deadline:
      server.kill()
      pytest.fail(f"the server did not come up:\n{(root / 'server.log').read_text()[-3000:]}")
    time.sleep(0.5)
  yield dict(root=root, workdir=workdir, corpus=corpus, export=export, url=url, prepared=prepared)
  server.send_signal(signal.SIGTERM)
  try:
    server.wait(60)
  except subprocess.TimeoutExpired:
    server.kill()
  log.close()


@pytest.fixture(scope="module")
def oracle(journey):
  """transformers' model and tokenizer of the exported checkpoint."""
  import torch
  import transformers

  torch.set_num_threads(1)
  model = transformers.AutoModelForCausalLM.from_pretrained(journey["export"]).eval()
  tok = transformers.AutoTokenizer.from_pretrained(journey["export"])
  return model, tok


def _generate(oracle, ids: list[int]) -> list[int]:
  import torch

  model, _ = oracle
  ids_1xL = torch.tensor([ids])
  with torch.no_grad():  # an explicit mask: without one, generate masks the BOS (id 0 = pad)
    out = model.generate(
        ids_1xL,
        attention_mask=torch.ones_like(ids_1xL),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
  return out[0, len(ids) :].tolist()


def _client(journey):
  import openai

  return openai.OpenAI(base_url=journey["url"] + "/v1", api_key="none", max_retries=0)


def test_the_model_is_llama_3_2s_as_transformers_wrote_it(journey):
  """The source config.json as transformers wrote it, llama3 rotary and its metadata included,
  converted as it is; the export writes the same fields back."""
  from jaxpipe.models import hf

  with open(os.path.join(journey["root"], "src", "config.json")) as f:
    src = json.load(f)
  assert src["rope_parameters"]["rope_type"] == "llama3" and src["tie_word_embeddings"]
  assert {"transformers_version", "dtype", "architectures", "head_dim"} <= set(src)
  cfg = hf.config_from_hf(src)
  assert cfg.rope_scaling.type == "llama3" and cfg.rope_scaling.factor == 32.0
  assert (cfg.rope_theta, cfg.head_dim, cfg.tied_embeddings) == (500_000.0, 8, True)
  with open(os.path.join(journey["export"], "config.json")) as f:
    out = json.load(f)
  assert out["rope_parameters"] == src["rope_parameters"] and out["head_dim"] == src["head_dim"]


def test_training_on_the_corpus_lowered_the_loss(journey):
  (first_step, first), *_, (last_step, last) = helpers.loss_rows(journey["workdir"])
  assert (first_step, last_step) == (1, STEPS)
  assert last < first - 1.0, (first, last)


def test_completions_equal_transformers_greedy_generate(journey, oracle):
  client = _client(journey)
  _, tok = oracle
  stopped = 0
  for prompt in PROMPTS:
    want = _generate(oracle, tok(prompt).input_ids)
    got = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    ).choices[0]
    assert got.model_extra["token_ids"] == want, prompt
    assert got.text == tok.decode(want, skip_special_tokens=True), prompt
    ends_at_eos = want[-1] in (tok.convert_tokens_to_ids(t) for t in ("</s>", "<|eot_id|>"))
    assert got.finish_reason == ("stop" if ends_at_eos else "length"), prompt
    stopped += ends_at_eos
  assert stopped, "no prompt's greedy continuation reached EOS: the EOS rule went untested"


def test_chat_completions_equal_transformers_chat_template_and_generate(journey, oracle):
  client = _client(journey)
  _, tok = oracle
  for messages in CHATS:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    want = _generate(oracle, list(ids["input_ids"]))
    got = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
    ).choices[0]
    assert got.message.content == tok.decode(want, skip_special_tokens=True), messages
    assert got.message.role == "assistant"


def test_lm_eval_through_the_server_equals_lm_eval_on_transformers(journey, monkeypatch):
  import lm_eval
  from lm_eval.tasks import TaskManager

  monkeypatch.chdir(LM_EVAL_TASK)  # the task's data_files are relative to it
  tasks = TaskManager(include_path=LM_EVAL_TASK, include_defaults=False)
  name = _get(journey["url"] + "/v1/models")["data"][0]["id"]

  def run(model: str, model_args: str) -> list[float]:
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["jaxpipe_tiny_choice"],
        task_manager=tasks,
        log_samples=True,
        batch_size=1,
    )
    samples = sorted(out["samples"]["jaxpipe_tiny_choice"], key=lambda s: s["doc_id"])
    lls = [ll for s in samples for ll, _ in s["filtered_resps"]]
    return lls, [s["acc"] for s in samples]

  # both prepend BOS, as the model was trained (lm-eval's API models leave it out by default)
  hf_ll, hf_acc = run(
      "hf", f"pretrained={journey['export']},dtype=float32,device=cpu,add_bos_token=True"
  )
  served_ll, served_acc = run(
      "local-completions",
      f"model={name},base_url={journey['url']}/v1/completions,tokenizer_backend=huggingface,"
      f"tokenizer={journey['export']},add_bos_token=True,num_concurrent=1,max_retries=1",
  )
  assert len(hf_ll) == len(served_ll) == 24
  np.testing.assert_allclose(served_ll, hf_ll, rtol=1e-4, atol=1e-4)
  assert served_acc == hf_acc
