"""What moving a request's K/V between two processes costs (`serve.kv_wire`), over loopback.

  python -m experiments.kv_wire_bench [--shape toy|smollm2-135m] [--lengths 128,512,2048
      --kv_cache_dtype auto --repeats 3]

A sending process (this module with `--role send`) prefills one request per length and repeat
(and one more per length, untimed, which warms the receiver up) on an engine of the shape
(random float32 weights) and offers each (`KVWire.offer`); this process pulls each into its
own engine (`KVWire.receive`: reserve, pull, write, admit). Per
length: the request's KV bytes (what its pages hold), the bytes pulled, and the seconds of
`receive`, median over the repeats, with the bandwidth they make; then latency + bytes /
bandwidth fitted to every timed move, the cost the P:D planner prices a move at
(`pd_plan --cpu --transfer_bw --transfer_latency`). KV bytes are the prompt's
tokens'; the pull carries whole pages. Each process has one CPU
host device; both share the machine's cores.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
from absl import flags

from experiments.shapes import SHAPES
from jaxpipe.models import transformer
from jaxpipe.runtime import cli
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.kv_wire import KVWire, Ticket

FLAGS = cli.flag_values(__name__)
flags.DEFINE_enum("shape", "toy", list(SHAPES), "The Llama's shape.", flag_values=FLAGS)
flags.DEFINE_list(
    "lengths", ["128", "512", "2048"], "Prompt tokens per request.", flag_values=FLAGS
)
flags.DEFINE_integer("repeats", 3, "Requests per length.", flag_values=FLAGS)
flags.DEFINE_enum(
    "kv_cache_dtype", "auto", ["auto", "int8", "fp8"], "The pools' dtype.", flag_values=FLAGS
)
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
flags.DEFINE_enum("role", "receive", ["receive", "send"], "This process' end.", flag_values=FLAGS)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def engine(args, lengths: list[int], prefill_only: bool) -> Engine:
  """An engine of the shape whose pool holds every request of the run at once."""
  cfg = SHAPES[args.shape]
  params = transformer.init_params(cfg, jax.random.key(0))
  pages = sum(-(-(n + 1) // args.page_size) for n in lengths) * (args.repeats + 1) + 1
  longest = max(lengths) + 2
  return Engine(
      cfg,
      params,
      page_size=args.page_size,
      num_pages=pages,
      max_batch=len(lengths) * (args.repeats + 1),
      max_tokens_per_step=512,
      max_seq_len=-(-longest // args.page_size) * args.page_size,
      prefix_caching=False,
      prefill_only=prefill_only,
      async_scheduling=False,
      kv_cache_dtype=args.kv_cache_dtype,
  )


def send(args, lengths: list[int]) -> None:
  """The sending process: prefill, offer, print the tickets, wait for a line on stdin."""
  e = engine(args, lengths, prefill_only=True)
  rng = np.random.default_rng(0)
  for n in lengths:
    for _ in range(args.repeats + 1):  # the first of each length warms the receiver up
      e.add_request(rng.integers(0, e.cfg.vocab, n).tolist(), 2, eos_id=None)
  while e.has_work() and len(e.prefilled) < len(lengths) * (args.repeats + 1):
    e.step()
  wire = KVWire()
  for r in list(e.prefilled):
    print(len(r.prompt), wire.offer(e, r.id).to_json(), flush=True)
  print("ready", flush=True)
  sys.stdin.readline()


def main(argv) -> None:
  del argv
  args = FLAGS
  lengths = [int(n) for n in args.lengths]
  if args.role == "send":
    send(args, lengths)
    return
  cmd = [sys.executable, "-m", "experiments.kv_wire_bench", "--role", "send"]
  cmd += [f"--{f}={getattr(args, f)}" for f in ("shape", "repeats", "kv_cache_dtype")]
  cmd += [f"--lengths={','.join(map(str, lengths))}", f"--page_size={args.page_size}"]
  env = {**os.environ, "JAXPIPE_HOST_DEVICES": "1"}
  proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
  tickets = []
  for line in proc.stdout:
    if line.strip() == b"ready":
      break
    n, text = line.decode().split(" ", 1)
    tickets.append((int(n), Ticket.from_json(text)))
  if not tickets:
    sys.exit(f"the sending process ended without offering (exit {proc.wait()})")
  e = engine(args, lengths, prefill_only=False)
  wire = KVWire()
  load0 = os.getloadavg()[0]
  times: dict[int, list[float]] = {n: [] for n in lengths}
  pulled: dict[int, int] = {}
  seen = set()
  for n, t in tickets:
    start = time.perf_counter()
    rid = wire.receive(e, t)
    jax.block_until_ready(e.kv.k)
    if n in seen:  # the first of each length: the connection and the writes' compiles
      times[n].append(time.perf_counter() - start)
    seen.add(n)
    pulled[n] = sum(
        int(np.prod(s)) * np.dtype(d).itemsize for c in t.chunks for s, d in c["arrays"]
    )
    e.cancel(rid)
  proc.stdin.write(b"\n")
  proc.stdin.flush()
  proc.wait(timeout=60)
  cfg = SHAPES[args.shape]
  print(
      f"# {args.shape} Llama ({cfg.n_layers} layers, {e.cached[0]} KV heads x {e.cached[1]}), "
      f"pools {e.kv.k.dtype}, pages of {args.page_size}; two processes over loopback, one CPU "
      f"device each; {args.repeats} requests a length; {os.cpu_count()} cores, load "
      f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"
  )
  print("| prompt tokens | KV bytes | bytes pulled | receive s (median) | MB/s |")
  print("| --- | --- | --- | --- | --- |")
  heads, k_width, v_width = e.cached
  per_token = heads * cfg.n_layers * (k_width + v_width) * np.dtype(e.kv_dtype).itemsize
  if e.kv.k_scales is not None:  # a float32 scale per head, layer and K or V
    per_token += heads * cfg.n_layers * 2 * 4
  for n in lengths:
    s = statistics.median(times[n])
    kv_bytes = n * per_token  # the tokens' K/V; pulled: whole pages
    print(f"| {n:,} | {kv_bytes:,} | {pulled[n]:,} | {s:.4f} | {pulled[n] / s / 1e6:,.0f} |")
  if len(lengths) > 1:
    latency, bandwidth = fit(
        [pulled[n] for n in lengths for _ in times[n]], [t for n in lengths for t in times[n]]
    )
    print(
        f"\nfit: seconds = {1e3 * latency:.2f} ms + bytes / {bandwidth / 1e9:.2f} GB/s; price "
        f"it in the planner: python -m experiments.pd_plan --cpu --transfer_bw {bandwidth:.3g} "
        f"--transfer_latency {latency:.3g}"
    )


def fit(nbytes: list[int], seconds: list[float]) -> tuple[float, float]:
  """A move's cost as latency + bytes / bandwidth, least squares over the timed moves.

  Args:
    nbytes: each move's bytes.
    seconds: each move's seconds.

  Returns:
    (latency in seconds, at least 0; bandwidth in bytes per second).
  """
  slope, intercept = np.polyfit(np.asarray(nbytes, np.float64), np.asarray(seconds), 1)
  return max(0.0, float(intercept)), 1.0 / float(slope)


if __name__ == "__main__":
  cli.run(main)
