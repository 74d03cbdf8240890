"""Continuous batching over paged KV against static batching over a contiguous max-length cache.

  python -m experiments.serve_bench [--requests 64 --rates 2,8,32 --prompt 8:96 --output 8:96
      --kv_tokens 3072 --page_size 16 --seed 0]
  python -m experiments.serve_bench --kernel     # on a GPU: the PagedAttention kernel alone

A seeded workload: Poisson arrivals at each rate (requests/s), prompt and output lengths
uniform in the given ranges (inclusive), prompt tokens uniform over the vocabulary, greedy
decoding to exactly the output length (no EOS). Both systems get the same KV memory
(`--kv_tokens` slots per layer) and the same model, step program and sampling code:

- paged: `jaxpipe.serve.Engine`, continuous (iteration-level) batching, chunked prefill under a
  token budget, pages of `--page_size`, preemption by recompute, prefix cache;
- static: FasterTransformer-style. When idle, it takes up to B = kv_tokens // max_len queued
  requests (max_len = longest prompt + longest output), reserves max_len contiguous slots for
  each, prefills them padded to the longest prompt, and decodes every row until the batch's
  longest output is done; the batch then leaves together and the next one starts.

Reported per system and rate: generated tokens/s over the run, TTFT and TPOT percentiles (ms,
from each request's arrival and its own token times), and KV memory in use: tokens stored for
requests still generating / slots reserved for the requests being served (static: max_len per
row of the batch, for as long as the batch runs; paged: the pages they hold), summed over steps. Runs on the first device (on
CPU, one host device: the host devices share the same cores). Compilation happens before the
clock starts.

--kernel times the decode kernel alone on a GPU (bf16, 32 query / 8 KV heads, head dim 128,
pages of 16, every row `context` keys): ours (`kernels_pallas.paged_attention`), JAX's own
Pallas GPU paged attention and the XLA gather reference, in TFLOP/s (4·B·H·L·K) and in GB/s of
K/V read (2·B·L·G·K·2 bytes; decode attention is bound by memory bandwidth).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time

import jax
import numpy as np

from experiments.timing import median_time
from jaxpipe.models import transformer
from jaxpipe.serve import model as serve_model
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.pages import SCRATCH_PAGE
from jaxpipe.serve.sampling import SamplingBatch

ANCHORS = ("vLLM (SOSP'23): 2-4x the throughput of FasterTransformer and Orca at the same latency; "
           "those systems used 20.4-38.2% of reserved KV memory for tokens; paged KV wastes at most "
           "the last page of each sequence (block size 16).")


@dataclasses.dataclass
class Work:
  arrival: float  # seconds after the start
  prompt: list[int]
  max_tokens: int


@dataclasses.dataclass
class Done:
  arrival: float
  token_times: list[float]

  @property
  def ttft(self) -> float:
    return self.token_times[0] - self.arrival

  @property
  def tpot(self) -> float | None:
    n = len(self.token_times)
    return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def workload(n: int, rate: float, prompt: tuple[int, int], output: tuple[int, int], vocab: int,
             seed: int) -> list[Work]:
  """Poisson arrivals (exponential gaps, mean 1/rate) with uniform prompt and output lengths."""
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
  return [Work(float(a), list(map(int, rng.integers(0, vocab, rng.integers(prompt[0], prompt[1] + 1)))),
               int(rng.integers(output[0], output[1] + 1))) for a in arrivals]


class Paged:
  """The engine, driven request by request."""

  def __init__(self, engine: Engine):
    self.engine, self.done, self.usage = engine, [], []

  def add(self, w: Work, t0: float) -> None:
    rid = self.engine.add_request(w.prompt, w.max_tokens, eos_id=None)
    self.engine.requests[rid].arrival = t0 + w.arrival

  def busy(self) -> bool:
    return self.engine.has_work()

  def step(self) -> None:
    self.engine.step()
    u = self.engine.kv_usage()
    self.usage.append((u["tokens"], u["slots"]))
    for r in self.engine.finished():
      self.done.append(Done(r.arrival, r.token_times))


class Static:
  """Static batches over a contiguous cache: row b owns pages 1 + b*n .. (b+1)*n of the pool."""

  def __init__(self, cfg, params, batch: int, max_len: int, max_prompt: int, page_size: int,
               backend: str):
    self.cfg, self.params, self.b, self.max_len = cfg, params, batch, max_len
    self.n, self.s, self.max_prompt = max_len // page_size, page_size, max_prompt
    self.kv = serve_model.init_kv(cfg, 1 + batch * self.n, page_size)
    self.fn = jax.jit(functools.partial(serve_model.serve_step, cfg, backend=backend),
                      donate_argnums=1)
    self.tables = 1 + np.arange(batch * self.n, dtype=np.int32).reshape(batch, self.n)
    self.queue, self.rows, self.done, self.usage = [], [], [], []

  def add(self, w: Work, t0: float) -> None:
    self.queue.append((w, t0 + w.arrival))

  def busy(self) -> bool:
    return bool(self.queue or self.rows)

  def _run(self, rows_tokens: list[list[int]], starts: list[int], width: int) -> np.ndarray:
    """Row i's tokens at positions starts[i].., each row padded to `width` tokens (padding writes
    the scratch page) -> the token sampled after each row's last one."""
    b, t = self.b, width
    tokens, positions = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    slots = np.full((b, t), SCRATCH_PAGE * self.s, np.int32)
    last = np.zeros(b, np.int32)
    for i, (x, start) in enumerate(zip(rows_tokens, starts)):
      pos = np.arange(start, start + len(x))
      tokens[i, :len(x)], positions[i, :len(x)] = x, pos
      slots[i, :len(x)] = self.tables[i, pos // self.s] * self.s + pos % self.s
      last[i] = i * t + len(x) - 1
    batch = serve_model.TokenBatch(tokens.ravel(), positions.ravel(), slots.ravel(),
                                   np.repeat(self.tables, t, axis=0), last)
    zeros = np.zeros(b, np.int32)
    sampling = SamplingBatch(np.zeros(b, np.float32), zeros, np.ones(b, np.float32), zeros, zeros)
    out, _, self.kv = self.fn(self.params, self.kv, batch, sampling)
    return np.asarray(out)

  def warm_up(self) -> None:
    for t in (self.max_prompt, 1):
      self._run([[0] * t] * self.b, [0] * self.b, t)

  def step(self) -> None:
    if not self.rows:  # a new batch: prefill, padded to the workload's longest prompt
      batch, self.queue = self.queue[:self.b], self.queue[self.b:]
      out = self._run([w.prompt for w, _ in batch] + [[0]] * (self.b - len(batch)), [0] * self.b,
                      self.max_prompt)
      now = time.perf_counter()
      self.rows = [{"w": w, "arrival": a, "tokens": list(w.prompt), "times": [now], "out": [int(o)]}
                   for (w, a), o in zip(batch, out)]
    else:
      live = [r for r in self.rows if len(r["out"]) < r["w"].max_tokens]
      inputs = [[r["out"][-1]] for r in self.rows] + [[0]] * (self.b - len(self.rows))
      starts = [len(r["tokens"]) + len(r["out"]) - 1 for r in self.rows] + [0] * (self.b - len(self.rows))
      out = self._run(inputs, starts, 1)  # finished rows keep computing: the batch moves as one
      now = time.perf_counter()
      for r, o in zip(self.rows, out):
        if r in live:
          r["out"].append(int(o))
          r["times"].append(now)
    live = [r for r in self.rows if len(r["out"]) < r["w"].max_tokens]
    self.usage.append((sum(len(r["tokens"]) + len(r["out"]) - 1 for r in live),
                       len(self.rows) * self.max_len))
    if not live:
      self.done += [Done(r["arrival"], r["times"]) for r in self.rows]
      self.rows = []


def serve(system, work: list[Work]) -> float:
  """Runs the workload in real time; returns the makespan (first arrival to last token)."""
  pending, t0 = list(work), time.perf_counter()
  while pending or system.busy():
    now = time.perf_counter() - t0
    while pending and pending[0].arrival <= now:
      system.add(pending.pop(0), t0)
    if system.busy():
      system.step()
    elif pending:
      time.sleep(max(0.0, pending[0].arrival - now))
  return time.perf_counter() - t0 - work[0].arrival


def row(name: str, rate: float, system, makespan: float, generated: int) -> str:
  pct = lambda xs, q: 1e3 * float(np.percentile(xs, q))
  ttft = [d.ttft for d in system.done]
  tpot = [d.tpot for d in system.done if d.tpot is not None]
  tokens, slots = np.asarray(system.usage, np.float64).sum(0)
  return (f"| {name} | {rate:g} | {generated / makespan:,.0f} | "
          f"{pct(ttft, 50):,.0f} / {pct(ttft, 90):,.0f} / {pct(ttft, 99):,.0f} | "
          f"{pct(tpot, 50):,.1f} / {pct(tpot, 90):,.1f} / {pct(tpot, 99):,.1f} | "
          f"{100 * tokens / slots:.1f}% | {len(system.usage)} |")


def kernel_table(repeats: int) -> None:
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

  from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
  if jax.default_backend() != "gpu":
    print("# --kernel times the compiled kernel: it needs a GPU (tests/test_paged_attention.py "
          "checks it in interpret mode here)")
    return
  heads, kv_heads, head_dim, page, dtype = 32, 8, 128, 16, jnp.bfloat16
  print(f"# paged attention decode on {jax.devices()[0].device_kind}: bf16, {heads}/{kv_heads} "
        f"heads, head dim {head_dim}, pages of {page}; ms / TFLOP/s / GB/s of K/V read")
  print("| batch | context | ours, k_splits 1 | ours, k_splits 8 | JAX's Pallas | XLA gather |")
  print("|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for batch, context in ((8, 2048), (32, 2048), (128, 2048), (8, 16384), (32, 8192)):
    n = context // page
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (kv_heads, batch * n, page, head_dim), dtype)
    v = jax.random.normal(keys[2], (kv_heads, batch * n, page, head_dim), dtype)
    tables = jnp.asarray(rng.permutation(batch * n).reshape(batch, n), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    flops = 4.0 * batch * heads * context * head_dim
    kv_bytes = 2.0 * batch * context * kv_heads * head_dim * 2
    runs = {
        "ours1": jax.jit(functools.partial(paged_attention, k_splits=1)),
        "ours8": jax.jit(functools.partial(paged_attention, k_splits=8)),
        "jax": jax.jit(lambda q, *a: jax_paged.paged_attention(q / np.sqrt(head_dim), *a)),
        "xla": jax.jit(paged_attention_reference),
    }
    cells = []
    for name, fn in runs.items():
      try:
        t = median_time(fn, q, k, v, tables, lengths, repeats=repeats)
        cells.append(f"{1e3 * t:.3f} / {flops / t / 1e12:.1f} / {kv_bytes / t / 1e9:,.0f}")
      except Exception as e:  # noqa: BLE001 -- one backend failing must not hide the others
        cells.append(f"failed: {type(e).__name__}")
    print(f"| {batch} | {context} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--rates", default="2,8,32", help="arrival rates to run, requests/s")
  p.add_argument("--prompt", default="8:96", help="prompt length range, min:max tokens")
  p.add_argument("--output", default="8:96", help="output length range, min:max tokens")
  p.add_argument("--kv_tokens", type=int, default=3072, help="KV slots per layer for either system")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--max_batch", type=int, default=32, help="paged: most requests running at once")
  p.add_argument("--token_budget", type=int, default=128, help="paged: tokens per step")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--attention", default="auto")
  p.add_argument("--kernel", action="store_true", help="time the decode kernel alone (GPU)")
  p.add_argument("--repeats", type=int, default=20, help="--kernel: timed calls per cell")
  args = p.parse_args()
  if args.kernel:
    kernel_table(args.repeats)
    return
  prompt, output = (tuple(int(x) for x in v.split(":")) for v in (args.prompt, args.output))
  cfg = transformer.TransformerConfig(vocab=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                      head_dim=32, d_ff=384)  # configs/quickstart.py's model
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  s = args.page_size
  max_len = math.ceil((prompt[1] + output[1]) / s) * s
  static_batch = args.kv_tokens // max_len
  if static_batch < 1:
    raise SystemExit(f"--kv_tokens={args.kv_tokens} cannot hold one {max_len}-token sequence")
  pages_per_seq = max_len // s
  engine_args = dict(page_size=s, num_pages=args.kv_tokens // s + 1, max_batch=args.max_batch,
                     max_tokens_per_step=args.token_budget, max_seq_len=max_len,
                     attention=args.attention,
                     token_buckets=sorted({8, 32, args.token_budget}),
                     page_buckets=sorted({max(1, pages_per_seq // 3), pages_per_seq // 2 or 1, pages_per_seq}))
  print(f"# serve_bench on {jax.devices()[0].device_kind}: quickstart model (d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab}), "
        f"{cfg.dtype}; {args.requests} requests per rate, Poisson arrivals, prompt U{prompt}, "
        f"output U{output} tokens, seed {args.seed}")
  print(f"# KV memory: {args.kv_tokens} slots per layer "
        f"({serve_model.kv_bytes(cfg, args.kv_tokens, 1) / 2**20:.1f} MiB) for both; "
        f"paged: pages of {s}, <= {args.max_batch} running, {args.token_budget} tokens per step; "
        f"static: batches of {static_batch} x {max_len} contiguous slots")
  print("| system | rate (req/s) | generated tok/s | TTFT p50 / p90 / p99 (ms) | "
        "TPOT p50 / p90 / p99 (ms) | KV in use / reserved | steps |")
  print("|---|---|---|---|---|---|---|")
  engine = Engine(cfg, params, **engine_args)
  engine.precompile()
  static = Static(cfg, params, static_batch, max_len, prompt[1], s, engine.backend)
  static.warm_up()
  for rate in (float(r) for r in args.rates.split(",")):
    work = workload(args.requests, rate, prompt, output, cfg.vocab, args.seed)
    generated = sum(w.max_tokens for w in work)
    paged = Paged(engine)
    print(row("paged, continuous", rate, paged, serve(paged, work), generated), flush=True)
    static.done, static.usage = [], []
    print(row("static, contiguous", rate, static, serve(static, work), generated), flush=True)
  print(f"# paged: {len(engine.programs)} compiled step programs (bound {engine.max_programs}), "
        f"{engine.counts['preemptions']} preemptions, {engine.counts['cached_tokens']} prompt "
        "tokens from the prefix cache over all rates")
  print(f"# anchors: {ANCHORS}")


if __name__ == "__main__":
  main()
