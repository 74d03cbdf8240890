"""One engine over two processes (`jaxpipe.serve.lockstep`), started as a user would:
`python -m jaxpipe.launch --processes 2 --devices_per_process 1 -- python -m jaxpipe.serve
--tensor_parallel 2 --http`. Process 0 serves; process 1 replays its engine's calls. Greedy
tokens equal one process's engine, prompt scores (echo) match it, a stream cancelled mid-way
leaves both processes in step (the next requests still serve), and SIGTERM to the launcher
drains and ends both with status 0. Settings that cannot span processes are refused in one
line."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.multiprocess

SERVE = ["-m", "jaxpipe.serve", "--config", "configs/tiny.py", "--max_seq_len", "512"]
PROMPTS = ["0123", "3210321", "1", "0000111122223333"]


def _launch(*flags: str) -> subprocess.Popen:
  launch = [sys.executable, "-m", "jaxpipe.launch", "--processes", "2", "--devices_per_process"]
  return subprocess.Popen(
      [*launch, "1", "--grace", "10", "--", sys.executable, *SERVE, *flags],
      cwd=helpers.ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "PYTHONPATH": helpers.ROOT},
  )


def _single():
  from configs import tiny
  from jaxpipe.serve.engine import Engine
  from jaxpipe.training import config as config_lib
  from jaxpipe.training import restore

  config = tiny.get_config()
  return Engine(
      config_lib.model_config(config),
      restore.fresh_params(config),
      max_seq_len=512,
      page_buckets=(32,),
  )


def test_an_engine_over_two_processes_serves_one_engines_tokens_and_drains():
  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  proc = _launch("--tensor_parallel", "2", "--http", "--port", str(port))
  url = f"http://127.0.0.1:{port}"
  try:
    helpers.wait_healthy(url, lambda: proc.poll() is None, output=proc.stdout.read)
    single = _single()
    want = single.generate([[ord(c) for c in p] for p in PROMPTS], 12)

    def complete(prompt):
      body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
      return httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
      got = [r["choices"][0]["token_ids"] for r in pool.map(complete, PROMPTS)]
    assert got == want
    # a stream the client leaves after its first tokens: both processes cancel it
    body = {"prompt": "0", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
      next(r.iter_lines())
    aborted = ("jaxpipe_request_finished_total", ("finish_reason", "abort"))
    deadline = time.monotonic() + 30
    while helpers.metrics(url).get(aborted) != 1:
      assert time.monotonic() < deadline, helpers.metrics(url)
      time.sleep(0.1)
    echo = {"prompt": "0123", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0}
    scored = httpx.post(url + "/v1/completions", json=echo, timeout=60).json()
    lps = scored["choices"][0]["logprobs"]["token_logprobs"][1:4]
    np.testing.assert_allclose(
        lps, [x[0] for x in single.score([ord(c) for c in "0123"])[1:]], rtol=1e-5, atol=1e-5
    )
    assert complete("0123")["choices"][0]["token_ids"] == want[0]  # still in step
  finally:
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "[0] # drained; exiting" in out


def test_settings_that_cannot_span_processes_are_refused_in_one_line():
  proc = _launch("--tensor_parallel", "1", "--prompt", "0")
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode != 0
  assert "over 2 processes the engine spans every device of every process" in out
  assert "give --tensor_parallel=2" in out


def test_the_leader_replays_what_changes_the_engine_and_refuses_what_it_cannot_replay():
  """Without processes: a `Leader` over a stand-in engine sends each replayed call (name and
  arguments) to its followers before running it, runs reads alone, and refuses other methods."""
  import pickle
  import struct

  from jaxpipe.serve import lockstep

  class Engine:
    limits = "limits"

    def __init__(self):
      self.calls = []

    def step(self, *args):
      self.calls.append(("step", args))
      return {}

    def has_work(self):
      return False

    def fork(self, rid):
      raise AssertionError("not to be called")

  here, there = socket.socketpair()
  engine = Engine()
  leader = lockstep.Leader(engine, [here])
  assert leader.step(7) == {} and engine.calls == [("step", (7,))]
  head = there.recv(8)
  assert pickle.loads(there.recv(struct.unpack("!Q", head)[0])) == ("step", (7,), {})
  assert leader.has_work() is False and leader.limits == "limits"
  with pytest.raises(AttributeError, match="Engine.fork is not replayed"):
    leader.fork(0)
  leader.close()
  head = there.recv(8)
  assert pickle.loads(there.recv(struct.unpack("!Q", head)[0]))[0] == "close"
