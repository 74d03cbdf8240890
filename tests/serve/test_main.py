"""`python -m jaxpipe.serve` serves what `python -m jaxpipe.train` wrote."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.training import restore
from jaxpipe.training.trainer import Trainer
from tests import helpers

ROOT = helpers.ROOT


def _serve(*flags: str, devices: int = 1) -> subprocess.CompletedProcess:
  """`python -m jaxpipe.serve FLAGS` from the repository root on `devices` host devices."""
  return subprocess.run(
      [sys.executable, "-m", "jaxpipe.serve", *flags],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env={**os.environ, "PYTHONPATH": ROOT, "JAXPIPE_HOST_DEVICES": str(devices)},
  )


def test_a_training_checkpoint_is_served(tmp_path):
  """Trained tensor-parallel (tp 2 with sequence parallelism, zero1), served tensor-parallel on
  two devices; the tokens are the one-device forward pass's."""
  workdir = str(tmp_path / "run")
  config = tiny.get_config()
  config.mesh.tp = 2
  config.model.sequence_parallel = True
  config.optimizer.shard = "zero1"
  trainer = Trainer(config, workdir)
  trainer.train(steps=3, progress=False)
  trained = jax.device_get(trainer.model_params())
  step, params = restore.restore_params(workdir, restore.run_config(workdir))
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), trained)
  # --dtype bfloat16 reads the parameters cast (the optimizer's moments are never read)
  _, cast = restore.restore_params(workdir, restore.run_config(workdir), dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)), cast, trained)

  prompt = "0123"  # bytes 48..51, inside the tiny model's 64-token vocabulary
  forward = jax.jit(lambda tokens: transformer.forward(trainer.model_cfg, trained, tokens))
  want, tokens = [], list(prompt.encode())
  for _ in range(6):  # greedy, recomputing the whole sequence (right-padded to the context)
    logits = forward(np.asarray([tokens + [0] * (16 - len(tokens))], np.int32))
    want.append(int(np.argmax(logits[0, len(tokens) - 1])))
    tokens.append(want[-1])
  run = _serve(
      "--workdir",
      workdir,
      "--prompt",
      prompt,
      "--max_tokens",
      "6",
      "--page_size",
      "4",
      "--tensor_parallel",
      "2",
      devices=2,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert f"# step 3 of {workdir}; cpu x 2 tensor-parallel," in run.stdout
  assert f"# tokens: {want}" in run.stdout


def test_speculative_decoding_prints_the_plain_tokens_in_fewer_steps():
  """--speculative ngram on a prompt that repeats itself: the greedy tokens of the plain run,
  with its acceptance reported and fewer steps."""
  flags = ("--config", "configs/tiny.py", "--prompt", "0120120120", "--max_tokens", "24")
  flags += ("--max_seq_len", "64")
  plain, spec = _serve(*flags), _serve(*flags, "--speculative", "ngram")
  assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
  tokens = lambda run: [line for line in run.stdout.splitlines() if line.startswith("# tokens")]
  steps = lambda run: int(run.stdout.split(" steps")[0].rsplit(" ", 1)[1])
  assert tokens(spec) == tokens(plain)
  assert "# speculative: " in spec.stdout and steps(spec) < steps(plain), spec.stdout


def test_deepseek_v3s_mtp_module_drafts_for_its_own_model(tmp_path):
  """A DeepSeek-V3 checkpoint with its MTP layer (as transformers lays it out), converted and
  served with --speculative mtp: transformers' greedy tokens, the drafts' acceptance reported."""
  import torch
  import transformers

  from jaxpipe.training import hf_workdir

  src, _, _ = helpers.write_deepseek_v3_mtp(tmp_path, 1)
  workdir = str(tmp_path / "w")
  hf_workdir.hf_to_orbax(src, workdir)
  tok = transformers.AutoTokenizer.from_pretrained(src)
  model = transformers.AutoModelForCausalLM.from_pretrained(src)
  ids = tok("def main").input_ids
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
  want = out[0, len(ids) :].tolist()
  flags = ("--workdir", workdir, "--max_tokens", "8", "--prompt", "def main")
  run = _serve(*flags, "--speculative", "mtp", "--num_speculative_tokens", "2")
  assert run.returncode == 0, run.stderr[-2000:]
  assert f"# tokens: {want}" in run.stdout
  assert re.search(r"# speculative: \d+ of [1-9]\d* drafts accepted", run.stdout), run.stdout


def test_the_http_server_takes_its_api_key_from_the_environment():
  """$JAXPIPE_API_KEY (which keeps the key out of the process list) guards the server as
  --api_key does: 401 without it, 200 with it, /health open."""
  import socket

  import httpx

  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxpipe.serve", "--config", "configs/tiny.py", "--http"]
      + ["--port", str(port), "--max_seq_len", "32"],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={
          **os.environ,
          "PYTHONPATH": ROOT,
          "JAXPIPE_HOST_DEVICES": "1",
          "JAXPIPE_API_KEY": "from-env",
      },
  )
  url = f"http://127.0.0.1:{port}"
  try:
    helpers.wait_healthy(url, lambda: proc.poll() is None, output=proc.stdout.read)
    assert httpx.get(url + "/v1/models").status_code == 401
    auth = {"Authorization": "Bearer from-env"}
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
  finally:
    proc.terminate()
    proc.wait(60)


def test_runner_refuses_a_workdir_without_a_run(tmp_path):
  run = _serve("--workdir", str(tmp_path), "--prompt", "x")
  assert run.returncode != 0
  assert "config.json does not exist" in run.stderr


def test_a_converted_checkpoint_speaks_its_tokenizer_and_one_too_large_is_refused(tmp_path):
  import torch
  import transformers

  from jaxpipe.training import hf_workdir

  src = helpers.write_tiny_llama(tmp_path / "src")
  workdir = str(tmp_path / "w")
  hf_workdir.hf_to_orbax(src, workdir)
  tok = transformers.AutoTokenizer.from_pretrained(src)
  model = transformers.AutoModelForCausalLM.from_pretrained(src)
  prompt = "def main"
  ids = tok(prompt).input_ids
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
  want = out[0, len(ids) :].tolist()
  flags = ("--workdir", workdir, "--max_tokens", "5", "--prompt", prompt)
  # a pool of 8 pages of 16 holds 128 of the model's 256 positions
  run = _serve(*flags, "--num_pages", "9")
  assert run.returncode == 0, run.stderr[-2000:]
  assert "# the context is capped at 128 tokens" in run.stdout and "model's is 256" in run.stdout
  assert f"# tokens: {want}" in run.stdout  # the prompt went through the BPE tokenizer
  assert prompt + tok.decode(want, skip_special_tokens=True) in run.stdout
  # the model as its own drafter: every draft kept, the same tokens
  run = _serve(*flags, "--speculative", "draft", "--draft_workdir", workdir)
  assert run.returncode == 0, run.stderr[-2000:]
  assert f"# tokens: {want}" in run.stdout
  assert re.search(r"# speculative: (\d+) of \1 drafts accepted \(100%\)", run.stdout), run.stdout
  run = _serve(*flags, "--speculative", "draft")
  assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
      "error: --speculative draft needs --draft_workdir (the draft model's workdir)"
  )

  helpers.tiny_bpe(vocab_size=512).save(os.path.join(workdir, "hf", "tokenizer.json"))
  run = _serve(*flags)
  assert run.returncode != 0
  lines = [x for x in run.stderr.splitlines() if x.strip()]
  assert lines[-1].startswith("error: ") and "embedding has 384 rows" in lines[-1], lines
  assert "Traceback" not in run.stderr


def test_tensor_parallel_beyond_the_devices_is_one_error_line():
  from jaxpipe.serve import __main__ as serve_main

  n = len(jax.devices())
  with pytest.raises(
      SystemExit, match=rf"^error: --tensor_parallel={n + 1} needs 1 to {n} devices"
  ):
    serve_main._engine_devices(n + 1)
  assert serve_main._engine_devices(2) == jax.devices()[:2]


def test_tensor_parallel_with_a_deployment_mode_is_refused_before_any_work():
  run = _serve(
      "--config",
      "configs/tiny.py",
      "--http",
      "--mode",
      "colocated",
      "--tensor_parallel",
      "2",
      devices=2,
  )
  assert run.returncode != 0
  assert "--tensor_parallel is one engine's; with --mode=colocated give each worker" in run.stderr
  assert "Traceback" not in run.stderr


def test_the_cpu_kernel_asked_for_an_fp8_cache_is_one_error_line():
  """`--attention cpu_ragged` where the kernel does not take the cache: one `error:` line that
  names the cache and the backend to use instead."""
  run = _serve(
      "--config",
      "configs/tiny.py",
      "--prompt",
      "def ",
      "--attention",
      "cpu_ragged",
      "--kv_cache_dtype",
      "fp8",
  )
  assert run.returncode != 0
  lines = [x for x in run.stderr.splitlines() if x.strip()]
  assert lines[-1].startswith("error: ") and "not float8_e4m3fn" in lines[-1], lines
  assert "use 'xla_ragged'" in lines[-1]
  assert "Traceback" not in run.stderr


class _Stop(Exception):
  """Raised where the runner would first generate."""


@pytest.mark.parametrize("pooled", [True, False])
def test_the_runner_pools_host_memory_on_cpu_unless_told_not_to(monkeypatch, pooled):
  """--pool_host_memory (default on): `python -m jaxpipe.serve` keeps freed host memory in the
  heap on CPU devices (process.pool_host_memory) from the start, and gives back what loading
  freed once the engine holds its weights (process.trim_host_memory); --nopool_host_memory
  leaves glibc's defaults."""
  from jaxpipe.runtime import cli, process
  from jaxpipe.serve import __main__ as serve_main
  from jaxpipe.serve import engine as engine_lib

  events = []
  monkeypatch.setattr(process, "pool_host_memory", lambda: events.append("pool") or True)
  monkeypatch.setattr(process, "trim_host_memory", lambda: events.append("trim") or True)

  class Built:

    def __init__(self, *args, **kwargs):
      events.append("engine")

    def generate(self, *args, **kwargs):
      raise _Stop

  monkeypatch.setattr(engine_lib, "Engine", Built)
  flags = [f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}", "--prompt=x"]
  with pytest.raises(_Stop):
    cli.call(
        serve_main.main, serve_main.FLAGS, flags if pooled else [*flags, "--nopool_host_memory"]
    )
  assert events == (["pool", "engine", "trim"] if pooled else ["engine"])
