"""serve_bench --peer vllm without vLLM: its flags refused in one line, the peer protocol against a
stand-in `vllm` package (LLM settings, thread binding, a round's tokens and times, a peer that
dies), the figures and tables from known token times, and jaxpipe's side on a checkpoint written
by the peer's own `write` (transformers), its greedy tokens equal transformers' own."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from absl import app

from experiments import serve_bench, serve_peer, vllm_peer
from experiments.shapes import SHAPES
from jaxpipe.runtime import cli, process
from tests import helpers

# A stand-in for vLLM 0.32's offline API as vllm_peer.py uses it: LLM(**kwargs).llm_engine with
# add_request / step / has_unfinished_requests; one token per request per step, token = prompt's
# last + step (mod 1024), request ids suffixed as vLLM does. It writes its LLM kwargs and the
# thread binding it was started with to $FAKE_VLLM_RECORD.
FAKE_VLLM = textwrap.dedent("""\
    import json, os, types
    __version__ = "0.0-stand-in"
    if os.environ.get("FAKE_VLLM_DIE"):
      raise SystemExit("stand-in vLLM: dying as asked")

    class SamplingParams:
      def __init__(self, **kw):
        self.__dict__.update(kw)

    def TokensPrompt(prompt_token_ids):
      return {"prompt_token_ids": prompt_token_ids}

    class _Engine:
      def __init__(self):
        self.live = {}
      def add_request(self, rid, prompt, params):
        assert params.temperature == 0.0 and params.ignore_eos
        self.live[rid] = (prompt["prompt_token_ids"][-1], params.max_tokens, [])
      def has_unfinished_requests(self):
        return bool(self.live)
      def step(self):
        out = []
        for rid, (last, n, toks) in list(self.live.items()):
          toks.append((last + len(toks) + 1) % 1024)
          done = types.SimpleNamespace(token_ids=list(toks))
          out.append(types.SimpleNamespace(request_id=rid + "-a1b2", outputs=[done]))
          if len(toks) == n:
            del self.live[rid]
        return out

    class LLM:
      def __init__(self, **kw):
        with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
          f.write(json.dumps({"kw": kw, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}))
          f.write("\\n")
        self.llm_engine = _Engine()
""")

SPEC = {
    "model": "/nonexistent/checkpoint",
    "seed": 0,
    "prompts": [[5, 6, 7], [9], [1, 2]],
    "max_tokens": [3, 1, 2],
    "max_model_len": 16,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 8,
    "kv_cache_bytes": 12345,
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
  """PYTHONPATH with the stand-in package; -> the file it records its LLM settings in."""
  (tmp_path / "vllm").mkdir()
  (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
  record = tmp_path / "record.jsonl"
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
  return record


def script(path, body: str) -> str:
  """An executable shell script at `path` (a stand-in --peer_python)."""
  path.write_text("#!/bin/sh\n" + body + "\n")
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


@pytest.mark.parametrize(
    "flags, says",
    [
        ("--peer sglang --peer_python P", "--peer='sglang' is not a known peer; use --peer vllm"),
        ("--peer vllm", "--peer vllm needs --peer_python PATH"),
        ("--peer vllm --peer_python /no/such/python", "/no/such/python: not an executable file"),
        ("--peer vllm --peer_python BROKEN", "`import vllm` fails (ModuleNotFoundError: No module"),
        ("--peer vllm --peer_python P --peer_threads auto,0", "--peer_threads entry '0'"),
        ("--peer vllm --peer_python P --peer_threads x", "--peer_threads entry 'x'"),
        ("--peer vllm --peer_python P --peer_threads ,", "--peer_threads=',' is empty"),
        ("--peer vllm --peer_python P --peer_rounds 0", "--peer_rounds=0 must be at least 1"),
        ("--peer vllm --peer_python P --max_batch 0", "--max_batch=0 must be at least 1"),
        ("--peer vllm --peer_python P --peer_timeout 0", "--peer_timeout=0.0 must be > 0"),
        ("--peer vllm --peer_python P --peer_settle -1", "--peer_settle=-1.0 must be at least 0"),
        ("--peer vllm --peer_python P --prompt 9:2", "--prompt: length spec '9:2' needs"),
        ("--peer vllm --peer_python P --mode colocated", "--peer runs alone; leave out --mode"),
    ],
)
def test_bad_flags_are_one_line(flags, says, tmp_path, capsys):
  """Each refused before any work, exit status 2, one `error:` line naming the value."""
  good = script(tmp_path / "good", "echo 0.32.0")  # a python whose `import vllm` works
  broken = script(
      tmp_path / "broken", "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1"
  )
  args = flags.replace("BROKEN", broken).replace(" P", " " + good).split()
  assert cli.call(serve_bench.main, serve_bench.FLAGS, args) == cli.USAGE
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_peer_defaults_are_the_issue_workload_unless_given():
  args = type("A", (), {"requests": 5, "prompt": "8:96", "output": "8:96", "max_batch": 32})()
  args.token_budget = 128
  serve_peer.peer_args(args, present=["requests"])
  assert (args.requests, args.prompt, args.output) == (5, "32:256", "64")
  assert (args.max_batch, args.token_budget) == (64, 1024)


def test_thread_env_binds_the_cores_vllm_reads():
  assert serve_peer.thread_env("auto") == {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
  assert serve_peer.thread_env("1") == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
  assert serve_peer.thread_env("2") == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
  assert serve_peer.parse_threads(" auto, 2 ", cpus=2) == ["auto", "2"]


def test_protocol_lines_parse_and_vllms_own_lines_pass_by():
  ours = vllm_peer.line("round", tokens=[[1, 2]], times=[[0.5, 0.75]], steps=2)
  assert vllm_peer.parse_line(ours) == {
      "event": "round",
      "tokens": [[1, 2]],
      "times": [[0.5, 0.75]],
      "steps": 2,
  }
  for other in (
      "(EngineCore pid=1) INFO 12-02 06:29:35 [core.py:133] Initializing a V1 LLM engine",
      "@peer not json",
      '@peer ["no", "event"]',
      '@peer {"no_event": 1}',
      "",
  ):
    assert vllm_peer.parse_line(other) is None


def test_a_round_through_the_stand_in(fake_vllm, tmp_path):
  """Warm-up, two rounds, quit: every request's tokens and one time per token, the settings and
  binding the peer was given."""
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps(SPEC))
  env = serve_peer.thread_env("2")
  peer = serve_peer.Peer(sys.executable, str(spec), env, str(tmp_path / "log"), timeout=60)
  try:
    assert peer.info["version"] == "0.0-stand-in"
    for _ in range(2):
      got = peer.run_round()
      assert got["tokens"] == [[8, 9, 10], [10], [3, 4]]
      assert [len(t) for t in got["times"]] == [3, 1, 2]
      assert all(a <= b for t in got["times"] for a, b in zip(t, t[1:]))
      assert got["steps"] == 3
  finally:
    peer.close()
  assert peer.proc.returncode == 0
  (record,) = [json.loads(s) for s in fake_vllm.read_text().splitlines()]
  assert record["bind"] == "0-1"
  kw = record["kw"]
  assert kw["max_num_seqs"] == 3 and kw["max_num_batched_tokens"] == 8
  assert kw["enable_prefix_caching"] is False and kw["kv_cache_memory_bytes"] == 12345
  assert kw["skip_tokenizer_init"] and kw["dtype"] == "float32" and kw["max_model_len"] == 16


def _state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


def test_a_paused_peer_is_stopped_then_runs_and_quits(fake_vllm, tmp_path):
  """pause(True) stops the peer's process (state T) while another engine's round runs;
  pause(False) continues it, and a peer closed while paused is continued to read its quit."""
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps(SPEC))
  peer = serve_peer.Peer(sys.executable, str(spec), {}, str(tmp_path / "log"), timeout=60)
  try:
    assert _state(peer.proc.pid) in "RS"
    peer.pause(True)
    deadline = time.monotonic() + 10
    while _state(peer.proc.pid) != "T" and time.monotonic() < deadline:
      time.sleep(0.01)
    assert _state(peer.proc.pid) == "T"
    peer.pause(False)
    assert peer.run_round()["tokens"] == [[8, 9, 10], [10], [3, 4]]
    peer.pause(True)
  finally:
    peer.close()
  assert peer.proc.returncode == 0


_HOLDS_A_PAUSED_PEER = """
import sys, time
from experiments import serve_peer
with serve_peer.peers_closed() as peers:
  peers["x"] = serve_peer.Peer(sys.executable, sys.argv[1], {}, sys.argv[2], timeout=60)
  peers["x"].pause(True)
  print(peers["x"].proc.pid, flush=True)
  time.sleep(120)
"""


def test_sigterm_to_the_bench_continues_and_closes_a_paused_peer(fake_vllm, tmp_path):
  """SIGTERM while a peer is stopped: the bench exits and the peer with it, not left stopped."""
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps(SPEC))
  bench = subprocess.Popen(
      [sys.executable, "-c", _HOLDS_A_PAUSED_PEER, str(spec), str(tmp_path / "log")],
      cwd=helpers.ROOT,
      stdout=subprocess.PIPE,
      text=True,
  )
  pid = None
  try:
    pid = int(bench.stdout.readline())
    deadline = time.monotonic() + 10
    while _state(pid) != "T" and time.monotonic() < deadline:
      time.sleep(0.01)
    assert _state(pid) == "T"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    assert not os.path.exists(f"/proc/{pid}")  # continued, quit and reaped
  finally:
    bench.kill()
    if pid is not None and os.path.exists(f"/proc/{pid}"):  # the failure's stopped leftover
      os.killpg(pid, signal.SIGKILL)


class _Turns:
  """A stand-in engine: its round records which peers were stopped while it ran."""

  def __init__(self, name, log, peers):
    self.name, self.log, self.peers, self.stopped = name, log, peers, False

  def pause(self, stop: bool):
    self.stopped = stop

  def run_round(self):
    assert not self.stopped, f"{self.name} ran while stopped"
    self.log.append((self.name, sorted(n for n, p in self.peers.items() if p.stopped)))
    return {"times": [[0.1, 0.2]]}


def test_each_round_stops_every_peer_but_the_one_whose_turn_it_is(capsys):
  log, peers = [], {}
  for name in ("vllm-auto", "vllm-2"):
    peers[name] = _Turns(name, log, peers)
  raw = serve_peer.alternate(_Turns(serve_peer.JAXPIPE, log, peers), peers, rounds=3, settle=0)
  assert {n: len(r) for n, r in raw.items()} == {serve_peer.JAXPIPE: 3, "vllm-auto": 3, "vllm-2": 3}
  everyone = ["vllm-2", "vllm-auto"]
  assert log == [  # turns rotate by one a round; jaxpipe runs with both peers stopped
      (serve_peer.JAXPIPE, everyone),
      ("vllm-auto", ["vllm-2"]),
      ("vllm-2", ["vllm-auto"]),
      ("vllm-auto", ["vllm-2"]),
      ("vllm-2", ["vllm-auto"]),
      (serve_peer.JAXPIPE, everyone),
      ("vllm-2", ["vllm-auto"]),
      (serve_peer.JAXPIPE, everyone),
      ("vllm-auto", ["vllm-2"]),
  ]
  assert capsys.readouterr().out.count("# round ") == 3


def test_a_peer_that_dies_says_why(fake_vllm, tmp_path, monkeypatch):
  monkeypatch.setenv("FAKE_VLLM_DIE", "1")
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps(SPEC))
  with pytest.raises(
      serve_peer.PeerError, match="exited .* before its 'ready' line.*dying as asked"
  ):
    serve_peer.Peer(sys.executable, str(spec), {}, str(tmp_path / "log"), timeout=60)


def test_figures_and_tables_from_known_times():
  # 2 requests: tokens at 1, 2, 3 s and at 2, 4 s; 5 tokens by 4 s
  fig = serve_peer.round_figures([[1.0, 2.0, 3.0], [2.0, 4.0]])
  assert fig["tokens_per_s"] == 5 / 4
  assert fig["ttft50"] == 1.5 and fig["tpot50"] == 1.5  # TPOTs 1 and 2
  assert fig["ttft90"] == pytest.approx(1.9) and fig["tpot90"] == pytest.approx(1.9)
  with pytest.raises(ValueError, match="at least one token time"):
    serve_peer.round_figures([[1.0], []])
  rounds = {
      "jaxpipe": [{**fig, "steps": 4}, {**fig, "tokens_per_s": 2.5, "steps": 4}],
      "vllm (auto binding)": [
          {**fig, "tokens_per_s": 5.0, "steps": 3},
          {**fig, "tokens_per_s": 7.5, "steps": 5},
      ],
  }
  rows = serve_peer.summarise(rounds)
  assert rows[1]["ratio"] == [4.0, 3.0] and rows[1]["tokens_per_s"] == 6.25
  lines = serve_peer.table(rows).splitlines()
  assert lines[0].startswith("| engine | tokens/s | TTFT p50 / p90 (ms)")
  assert lines[2] == "| jaxpipe | 2 | 1,500 / 1,900 | 1,500.0 / 1,900.0 | 4 | 1.00 (1.00–1.00) |"
  assert lines[3] == (
      "| vllm (auto binding) | 6 | 1,500 / 1,900 | 1,500.0 / 1,900.0 | 4 | 3.50 (3.00–4.00) |"
  )
  host = serve_peer.host_table({"schedule": 0.01, "wait": 0.5}, steps=10, real=300, padded=100)
  assert host.splitlines()[2] == (
      "| 1.00 | 0.00 | 0.00 | 0.00 | 0.00 | 50.00 | 0.00 | 300 / 400 (75.0%) |"
  )


def test_agreement_counts_tokens_before_the_first_difference():
  assert serve_peer.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (1, 4 / 5)
  assert serve_peer.agreement([[1, 2]], [[3, 2]]) == (0, 0.0)


def test_jaxpipe_serves_the_checkpoint_the_peer_writes(tmp_path, monkeypatch):
  """vllm_peer.write (transformers) -> hf.load -> the engine: greedy tokens equal transformers'
  generate on the same checkpoint; host time is counted in every phase but compile."""
  import torch
  import transformers

  model = dict(serve_peer.llama_fields(SHAPES["toy"]), vocab_size=128, hidden_size=64)
  model.update(intermediate_size=128)
  model.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  vllm_peer.write(str(tmp_path), model)
  args = type("A", (), {})()
  args.requests, args.prompt, args.output, args.seed = 3, "3:9", "4", 0
  args.max_batch, args.token_budget, args.page_size, args.attention = 4, 16, 4, "xla"
  args.peer_dtype = "float32"
  work = serve_peer.workload(args, 128)
  length = serve_peer.max_len(work, 4)
  assert length % 4 == 0 and length >= max(len(w.prompt) + 4 for w in work)
  buckets = dict(token_buckets=(16,), page_buckets=(length // 4,))  # one program to compile
  jaxpipe = serve_peer.Jaxpipe(str(tmp_path), args, work, length, **buckets)
  jaxpipe.run_round()  # compiles
  got = jaxpipe.run_round()
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  for w, tokens in zip(work, got["tokens"]):
    seq = list(w.prompt)
    with torch.no_grad():  # greedy, EOS ignored, as both engines serve it
      for _ in range(4):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert tokens == seq[len(w.prompt) :]
  assert [len(t) for t in got["times"]] == [4] * 3
  assert got["real"] == sum(len(w.prompt) + 3 for w in work) and got["padded"] >= 0
  from jaxpipe.serve.engine import HOST_PHASES

  assert set(got["host"]) == set(HOST_PHASES) - {"mask"}  # no grammar: no masks
  assert all(got["host"][p] > 0 for p in HOST_PHASES if p not in ("compile", "mask"))
  assert np.isclose(got["host"]["compile"], 0.0, atol=0.05)  # all compiled in the first round
  assert os.path.isfile(tmp_path / "model.safetensors")


def test_the_checkpoint_fields_are_the_shapes_own():
  """--peer_shape's LlamaConfig fields; the toy one is the checkpoint the toy rows measured."""
  assert serve_peer.llama_fields(SHAPES["toy"]) == {
      "vocab_size": 1024,
      "hidden_size": 256,
      "intermediate_size": 1024,
      "num_hidden_layers": 4,
      "num_attention_heads": 8,
      "num_key_value_heads": 4,
      "head_dim": 32,
      "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0,
      "tie_word_embeddings": False,
  }
  one_b = serve_peer.llama_fields(SHAPES["llama3.2-1b"])
  assert (one_b["hidden_size"], one_b["num_hidden_layers"], one_b["vocab_size"]) == (
      2048,
      16,
      128256,
  )
  assert (one_b["num_attention_heads"], one_b["num_key_value_heads"]) == (32, 8)
  assert one_b["intermediate_size"] == 8192 and one_b["tie_word_embeddings"]


def test_the_peer_casts_to_the_runs_dtype(fake_vllm, tmp_path):
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({**SPEC, "dtype": "bfloat16"}))
  peer = serve_peer.Peer(sys.executable, str(spec), {}, str(tmp_path / "log"), timeout=60)
  peer.close()
  (record,) = [json.loads(s) for s in fake_vllm.read_text().splitlines()]
  assert record["kw"]["dtype"] == "bfloat16"


def test_a_libc_that_refuses_pooling_is_one_line(tmp_path, capsys, monkeypatch):
  """--pool_host_memory (default on) where mallopt refuses: one line naming the way out, before
  the checkpoint is written; --nopool_host_memory never asks."""
  good = script(tmp_path / "good", "echo 0.32.0")
  asked = []
  monkeypatch.setattr(process, "pool_host_memory", lambda: asked.append(1) or False)
  args = ["--peer", "vllm", "--peer_python", good]
  assert cli.call(serve_bench.main, serve_bench.FLAGS, args) == cli.USAGE
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
      "error: --pool_host_memory: this C library refuses glibc's mallopt settings; pass "
      "--nopool_host_memory"
  ]
  assert asked == [1]

  def written(*a, **k):
    raise app.UsageError("stop at the checkpoint")

  monkeypatch.setattr(serve_peer, "write_checkpoint", written)
  assert cli.call(serve_bench.main, serve_bench.FLAGS, [*args, "--nopool_host_memory"]) == cli.USAGE
  assert asked == [1] and "stop at the checkpoint" in capsys.readouterr().err
