"""Continuous batching over paged KV against static batching over a contiguous max-length cache.

  python -m experiments.serve_bench [--requests 64 --rates 2,8,32 --prompt 8:96 --output 8:96
      --kv_tokens 3072 --page_size 16 --seed 0]
  python -m experiments.serve_bench --kernel     # the paged-attention kernel alone (GPU or CPU)
  python -m experiments.serve_bench --mode colocated|disaggregated|both --prefill_workers 2
      --decode_workers 6 --rates 2,6 --requests 64 --ttft_slo 0.25 --tpot_slo 0.1
      [--prompt lognormal:64:512 --trace_in trace.csv --trace_out trace.csv --stream_layers]
  python -m experiments.serve_bench --url http://127.0.0.1:8000 [--compare]   # a server, over HTTP
  python -m experiments.serve_bench --prefill [--prefill_tokens 1024 --prefill_context 4096]
  python -m experiments.serve_bench --peer vllm --peer_python PATH   # against vLLM, one checkpoint
  python -m experiments.serve_bench --scaling [--prefill_context 4096 --repeats 2]

--peer: experiments/serve_peer.py (jaxpipe's engine and vLLM's on one Hugging Face checkpoint
and workload, rounds alternating; vLLM runs in the interpreter PATH, never as a dependency).

--mode serves the same seeded requests through `serve.deploy`'s deployments on 8 host devices
(`--host_devices`; on a GPU machine, its GPUs): colocated (every worker prefills and decodes;
`--workers`, default prefill + decode workers) and disaggregated (prefill workers, decode
workers, a K/V copy between them). For each it prints TTFT / TPOT / end-to-end percentiles, the
share of requests meeting both SLOs and the K/V bytes moved at each rate, then searches its
goodput (the highest rate at which 90% meet both, DistServe's definition) with up to `--probes`
runs; each run has max(--requests, rate x --horizon) requests so that fast rates queue. It
writes a Perfetto trace of every run (a track per worker and P->D link: queue, prefill, handoff,
transfer and decode spans) and a TTFT / TPOT CDF plot into --out.

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
row of the batch, for as long as the batch runs; paged: the pages they hold), summed over steps.
Runs on the first device (on CPU, one host device: the host devices share the same cores).
Compilation happens before the clock starts.

--prefill times one engine step of a prompt chunk of --prefill_tokens tokens at each cached
prefix 0, chunk, 2·chunk, .. below --prefill_context, for the paged attention backends xla (a
gather per token) and xla_ragged (a gather per block of a sequence's tokens), against
`transformer.forward` on the same chunk, on a random float32 Llama-shaped model (hidden 256,
4 layers, 8 query / 4 KV heads, vocab 1024), one sequence, pages of 16; and the attention call
alone on one layer's shapes (`paged_attention_reference` over T tokens, and the ragged call).

--kernel times the decode kernel alone on a GPU (bf16, 32 query / 8 KV heads, head dim 128,
pages of 16, every row `context` keys): ours (`kernels_pallas.paged_attention`), JAX's own
Pallas GPU paged attention and the XLA gather reference, in TFLOP/s (4·B·H·L·K) and in GB/s of
K/V read (2·B·L·G·K·2 bytes; decode attention is bound by memory bandwidth).
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import quickstart
from experiments.serving import Done, Paged, parse_lengths, serve
from experiments.timing import median_time
from jaxpipe.models import transformer
from jaxpipe.runtime import cli
from jaxpipe.serve import model as serve_model
from jaxpipe.serve.deploy import Colocated, Disaggregated, device_groups
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.pages import SCRATCH_PAGE
from jaxpipe.serve.sampling import SamplingBatch
from jaxpipe.serve.slo import SLO, GoodputSearch, attainment, e2e, percentiles, summary
from jaxpipe.serve.workload import Work, at_rate, generate, read_csv, write_csv
from jaxpipe.training import config as config_lib

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("requests", 64, "Requests per rate (--mode: at least).", flag_values=FLAGS)
flags.DEFINE_string("rates", "2,8,32", "Arrival rates to run, requests/s.", flag_values=FLAGS)
flags.DEFINE_alias("rate", "rates", flag_values=FLAGS)
flags.DEFINE_string(
    "prompt",
    "8:96",
    "Prompt lengths: N, MIN:MAX or lognormal:MEDIAN:MAX[:SIGMA] tokens.",
    flag_values=FLAGS,
)
flags.DEFINE_string("output", "8:96", "Output lengths, as --prompt.", flag_values=FLAGS)
flags.DEFINE_integer(
    "kv_tokens",
    3072,
    "KV slots per layer for either system (--mode: per worker).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=FLAGS)
flags.DEFINE_integer("max_batch", 32, "Paged: most requests running at once.", flag_values=FLAGS)
flags.DEFINE_integer("token_budget", 128, "Paged: tokens per step.", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the workload.", flag_values=FLAGS)
flags.DEFINE_string(
    "attention",
    "auto",
    "Paged attention: xla, pallas, xla_ragged, pallas_ragged, cpu_ragged, auto.",
    flag_values=FLAGS,
)
flags.DEFINE_bool("prefill", False, "Time a prefill chunk's step (CPU).", flag_values=FLAGS)
flags.DEFINE_integer("prefill_tokens", 1024, "--prefill: tokens per chunk.", flag_values=FLAGS)
flags.DEFINE_integer(
    "prefill_context",
    4096,
    "--prefill: the sequence's length after its last chunk.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "kernel",
    False,
    "Time the paged-attention kernel alone (GPU; on CPU the C++ one).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "scaling",
    False,
    "Prefill of a --prefill_context prompt by chunk count; prefill and decode by batch and "
    "context (experiments/serve_scaling.py).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("repeats", 20, "--kernel: timed calls per cell.", flag_values=FLAGS)
flags.DEFINE_string(
    "url",
    None,
    "Drive this OpenAI-compatible server instead (experiments/serve_client.py).",
    flag_values=FLAGS,
)
flags.DEFINE_bool("compare", False, "--url: also run its engine in-process.", flag_values=FLAGS)
# jaxpipe's engine against another engine on one checkpoint (--peer, experiments/serve_peer.py)
flags.DEFINE_string(
    "peer",
    None,
    "vllm: serve the same checkpoint and workload with vLLM's offline engine too, rounds "
    "alternating (experiments/serve_peer.py).",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "peer_python", None, "--peer: the python of a venv with vLLM installed.", flag_values=FLAGS
)
flags.DEFINE_string(
    "peer_threads",
    "auto,2",
    "--peer: one vLLM process per entry: auto (vLLM's CPU binding) or N threads.",
    flag_values=FLAGS,
)
flags.DEFINE_integer("peer_rounds", 3, "--peer: timed rounds of every engine.", flag_values=FLAGS)
flags.DEFINE_enum(
    "peer_shape",
    "toy",
    ["toy", "smollm2-135m", "llama3.2-1b"],
    "--peer: the checkpoint's Llama shape (experiments/shapes.py), random weights.",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "peer_dtype",
    "float32",
    ["float32", "bfloat16"],
    "--peer: both engines cast the weights to this and compute in it (serve --dtype).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "peer_timeout", 900, "--peer: seconds for a vLLM start or round.", flag_values=FLAGS
)
flags.DEFINE_bool(
    "pool_host_memory",
    True,
    "--peer: jaxpipe's process keeps freed host memory in the heap, as `python -m jaxpipe.serve` "
    "does on CPU; --nopool_host_memory: glibc's defaults.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "peer_settle",
    2.0,
    "--peer: seconds of rest before each engine's round (vLLM's idle workers spin for 1 s).",
    flag_values=FLAGS,
)
# colocated vs disaggregated (--mode)
flags.DEFINE_string(
    "mode",
    "",
    "colocated, disaggregated or both (comma-separated): serve the "
    "same requests through each deployment.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "prefill_workers", 2, "--mode disaggregated: prefill workers.", flag_values=FLAGS
)
flags.DEFINE_integer(
    "decode_workers", 6, "--mode disaggregated: decode workers.", flag_values=FLAGS
)
flags.DEFINE_integer(
    "workers",
    0,
    "--mode colocated: workers (default: prefill + decode workers, the same devices).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "devices_per_worker",
    1,
    "--mode: devices of each worker (KV heads split over them).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "host_devices", 8, "--mode: CPU host devices to create (ignored on GPU).", flag_values=FLAGS
)
flags.DEFINE_float(
    "ttft_slo", 0.25, "--mode: time-to-first-token target, seconds.", flag_values=FLAGS
)
flags.DEFINE_float(
    "tpot_slo", 0.1, "--mode: time-per-output-token target, seconds.", flag_values=FLAGS
)
flags.DEFINE_float(
    "horizon",
    10.0,
    "--mode: seconds of arrivals at least: max(--requests, rate x "
    "horizon) requests, so that a fast rate runs long enough to queue.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "probes",
    6,
    "--mode: goodput search: most rates run per deployment (the --rates included).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "stream_layers", False, "--mode disaggregated: copy K/V one layer at a time.", flag_values=FLAGS
)
flags.DEFINE_string(
    "trace_in",
    "",
    "--mode: CSV trace of requests (arrival_s,prompt_len,"
    "output_len[,prompt]) to replay; each rate rescales its arrivals.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "trace_out", "", "--mode: write the first rate's requests as CSV.", flag_values=FLAGS
)
flags.DEFINE_string(
    "out", "out/serve_bench", "--mode: Perfetto traces and latency CDF plot.", flag_values=FLAGS
)

ANCHORS = (
    "vLLM (SOSP'23): 2-4x the throughput of FasterTransformer and Orca at the same latency; "
    "those systems used 20.4-38.2% of reserved KV memory for tokens; paged KV wastes at most "
    "the last page of each sequence (block size 16)."
)
PD_ANCHORS = (
    "DistServe (OSDI'24): 7.4x more requests or 12.6x tighter SLO with >90% of requests "
    "meeting both targets; Splitwise (ISCA'24): 1.4x throughput at 20% lower cost; vLLM's "
    "docs: disaggregation tunes TTFT and inter-token latency separately, it does not raise "
    "throughput."
)


class Static:
  """Static batches over a contiguous cache: row b owns pages 1 + b*n .. (b+1)*n of the pool."""

  def __init__(
      self, cfg, params, batch: int, max_len: int, max_prompt: int, page_size: int, backend: str
  ):
    self.cfg, self.params, self.b, self.max_len = cfg, params, batch, max_len
    self.n, self.s, self.max_prompt = max_len // page_size, page_size, max_prompt
    self.kv = serve_model.init_kv(cfg, 1 + batch * self.n, page_size)
    self.fn = jax.jit(
        functools.partial(serve_model.serve_step, cfg, backend=backend), donate_argnums=1
    )
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
      tokens[i, : len(x)], positions[i, : len(x)] = x, pos
      slots[i, : len(x)] = self.tables[i, pos // self.s] * self.s + pos % self.s
      last[i] = i * t + len(x) - 1
    batch = serve_model.TokenBatch(
        tokens.ravel(), positions.ravel(), slots.ravel(), np.repeat(self.tables, t, axis=0), last
    )
    zeros = np.zeros(b, np.int32)
    sampling = SamplingBatch(np.zeros(b, np.float32), zeros, np.ones(b, np.float32), zeros, zeros)
    out, _, self.kv = self.fn(self.params, self.kv, batch, sampling)
    return np.asarray(out)

  def warm_up(self) -> None:
    for t in (self.max_prompt, 1):
      self._run([[0] * t] * self.b, [0] * self.b, t)

  def step(self) -> None:
    if not self.rows:  # a new batch: prefill, padded to the workload's longest prompt
      batch, self.queue = self.queue[: self.b], self.queue[self.b :]
      out = self._run(
          [w.prompt for w, _ in batch] + [[0]] * (self.b - len(batch)),
          [0] * self.b,
          self.max_prompt,
      )
      now = time.perf_counter()
      self.rows = [
          {"w": w, "arrival": a, "tokens": list(w.prompt), "times": [now], "out": [int(o)]}
          for (w, a), o in zip(batch, out)
      ]
    else:
      live = [r for r in self.rows if len(r["out"]) < r["w"].max_tokens]
      inputs = [[r["out"][-1]] for r in self.rows] + [[0]] * (self.b - len(self.rows))
      starts = [len(r["tokens"]) + len(r["out"]) - 1 for r in self.rows] + [0] * (
          self.b - len(self.rows)
      )
      out = self._run(inputs, starts, 1)  # finished rows keep computing: the batch moves as one
      now = time.perf_counter()
      for r, o in zip(self.rows, out):
        if r in live:
          r["out"].append(int(o))
          r["times"].append(now)
    live = [r for r in self.rows if len(r["out"]) < r["w"].max_tokens]
    self.usage.append(
        (sum(len(r["tokens"]) + len(r["out"]) - 1 for r in live), len(self.rows) * self.max_len)
    )
    if not live:
      self.done += [Done(r["arrival"], r["times"]) for r in self.rows]
      self.rows = []


def row(name: str, rate: float, system, makespan: float, generated: int) -> str:
  pct = lambda xs, q: 1e3 * float(np.percentile(xs, q))
  ttft = [d.ttft for d in system.done]
  tpot = [d.tpot for d in system.done if d.tpot is not None]
  tokens, slots = np.asarray(system.usage, np.float64).sum(0)
  return (
      f"| {name} | {rate:g} | {generated / makespan:,.0f} | "
      f"{pct(ttft, 50):,.0f} / {pct(ttft, 90):,.0f} / {pct(ttft, 99):,.0f} | "
      f"{pct(tpot, 50):,.1f} / {pct(tpot, 90):,.1f} / {pct(tpot, 99):,.1f} | "
      f"{100 * tokens / slots:.1f}% | {len(system.usage)} |"
  )


def kernel_table(repeats: int) -> None:
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

  from kernels_pallas.paged_attention import paged_attention, paged_attention_reference

  if jax.default_backend() != "gpu":
    cpu_kernel_table(repeats)
    return
  heads, kv_heads, head_dim, page, dtype = 32, 8, 128, 16, jnp.bfloat16
  print(
      f"# paged attention decode on {jax.devices()[0].device_kind}: bf16, {heads}/{kv_heads} "
      f"heads, head dim {head_dim}, pages of {page}; ms / TFLOP/s / GB/s of K/V read"
  )
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
    for _name, fn in runs.items():
      try:
        t = median_time(fn, q, k, v, tables, lengths, repeats=repeats)
        cells.append(f"{1e3 * t:.3f} / {flops / t / 1e12:.1f} / {kv_bytes / t / 1e9:,.0f}")
      except Exception as e:  # noqa: BLE001 -- one backend failing must not hide the others
        cells.append(f"failed: {type(e).__name__}")
    print(f"| {batch} | {context} | " + " | ".join(cells) + " |", flush=True)


def _rows(seqs, page: int, kv_heads: int, head_dim: int, rng):
  """Pools holding sequences (cached, new tokens), each on its own shuffled pages, and the step's
  rows (`ops.attention.RaggedRows`) -> (k, v, rows, token count)."""
  from jaxpipe.ops.attention import RaggedRows

  need = [-(-(c + n) // page) for c, n in seqs]
  total = sum(need) + 1
  k = rng.standard_normal((kv_heads, total, page, head_dim), dtype=np.float32)
  v = rng.standard_normal((kv_heads, total, page, head_dim), dtype=np.float32)
  order = rng.permutation(total)
  tables = np.zeros((len(seqs), max(need)), np.int32)
  starts, counts, cached = (np.zeros(len(seqs), np.int32) for _ in range(3))
  at = used = 0
  for i, ((c, n), m) in enumerate(zip(seqs, need)):
    tables[i, :m] = order[used : used + m]
    starts[i], counts[i], cached[i] = at, n, c
    used, at = used + m, at + n
  rows = RaggedRows(*(jnp.asarray(x) for x in (tables, starts, counts, cached)))
  return jnp.asarray(k), jnp.asarray(v), rows, at  # on the device: no copy in the timed call


def cpu_kernel_table(repeats: int) -> None:
  """One layer's paged attention on this CPU, the serving model's heads (8 query / 4 KV, head dim
  32, pages of 16, float32 or an int8 cache): the C++ kernel (`cpu_ragged`) against XLA's block
  path (`xla_ragged`) on decode and prefill steps, alternated; each cell the median of the
  rounds."""
  from jaxpipe.ops.attention import cpu_kernel_unsupported, ragged_paged_attention

  heads, kv_heads, head_dim, page = 8, 4, 32, 16
  reason = cpu_kernel_unsupported(head_dim, jnp.float32)
  if reason is not None:
    print(f"# --kernel on CPU times the C++ kernel, which cannot run here: {reason}")
    return
  rng = np.random.default_rng(0)
  prompts = [150, 200, 100, 250, 180, 90, 54]
  short = [(int(c), 1) for c in rng.integers(32, 320, 64)]
  cases = {
      "decode, 64 rows at context 32-320": (short, False),
      "decode, 64 rows at context 32-320, int8 cache": (short, True),
      "decode, 64 rows at context 2,048": ([(2047, 1)] * 64, False),
      "prefill, 7 prompts (1,024 tokens)": ([(0, n) for n in prompts], False),
      "prefill, 7 prompts (1,024 tokens), int8 cache": ([(0, n) for n in prompts], True),
      "prefill, 1,024 tokens after 3,072 cached": ([(3072, 1024)], False),
  }
  print(
      f"# one layer's paged attention on {os.cpu_count()} cores ({platform.machine()}): {heads} / "
      f"{kv_heads} heads, head dim {head_dim}, pages of {page}; ms per call, median of {repeats} "
      "alternated rounds"
  )
  print(
      "| step | tokens | (query, key) pairs | xla_ragged ms | cpu_ragged ms "
      "| xla_ragged / cpu_ragged |"
  )
  print("|---|---|---|---|---|---|")
  for name, (seqs, int8) in cases.items():
    k, v, rows, tokens = _rows(seqs, page, kv_heads, head_dim, rng)
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim), dtype=np.float32))
    scales = {}
    if int8:  # the engine's 8-bit cache: int8 values, a float32 scale per (head, page, slot)
      (k, k_s), (v, v_s) = (serve_model.quantize(x, jnp.int8) for x in (k, v))
      scales = dict(k_scales_GxPxS=k_s, v_scales_GxPxS=v_s)
    block = 1 if all(n == 1 for _, n in seqs) else 32
    fns = {
        kernel: jax.jit(functools.partial(ragged_paged_attention, block=block, kernel=kernel))
        for kernel in ("xla", "cpu")
    }
    times = collections.defaultdict(list)
    for _ in range(repeats):
      for kernel, fn in fns.items():
        times[kernel].append(median_time(functools.partial(fn, **scales), q, k, v, rows, repeats=5))
    xla, cpu = (float(np.median(times[x])) for x in ("xla", "cpu"))
    keys = sum((c + n) * n - n * (n - 1) // 2 for c, n in seqs)  # per query: its position + 1
    print(
        f"| {name} | {tokens:,} | {keys:,} | {1e3 * xla:.3f} | {1e3 * cpu:.3f} | {xla / cpu:.2f} |",
        flush=True,
    )


PREFILL_MODEL = transformer.TransformerConfig(
    vocab=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=1024
)


def prefill_table(chunk: int, context: int, repeats: int) -> None:
  """Seconds per engine step of one `chunk`-token prompt chunk at each cached prefix, per paged
  backend, against the training forward on the chunk (see the module docstring)."""
  from jaxpipe.ops.attention import cpu_kernel_unsupported

  cfg, page = PREFILL_MODEL, 16
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (context,), 0, cfg.vocab))
  forward = jax.jit(lambda t: transformer.forward(cfg, params, t))
  t_fwd = median_time(forward, jnp.asarray(tokens[None, :chunk]), repeats=repeats)
  print(f"# forward on {chunk} tokens: {t_fwd:.3f} s; median of {repeats} steps per cell")
  print("| backend | chunk tokens | context after the step | s / step | step / forward |")
  print("|---|---|---|---|---|")
  backends = ["xla", "xla_ragged"]
  if cpu_kernel_unsupported(cfg.head_dim, jnp.float32) is None:
    backends.append("cpu_ragged")
  for backend in backends:
    engine = Engine(
        cfg,
        params,
        page_size=page,
        num_pages=context // page + 2,
        max_batch=16,
        max_tokens_per_step=chunk,
        max_seq_len=context + 1,
        attention=backend,
        token_buckets=(chunk,),
        prefix_caching=False,
    )
    times = collections.defaultdict(list)
    for rep in range(repeats + 1):  # the first run compiles
      engine.add_request(list(map(int, tokens)), max_tokens=1)
      i = 0
      while engine.has_work():
        start = time.perf_counter()
        engine.step()
        if rep:
          times[i].append(time.perf_counter() - start)
        i += 1
      engine.finished()
    for i in sorted(times):
      t = float(np.median(times[i]))
      print(
          f"| {backend} | {chunk} | {min(context, (i + 1) * chunk)} | {t:.3f} | {t / t_fwd:.1f} |",
          flush=True,
      )


QUICKSTART = config_lib.model_config(quickstart.get_config())  # the model both systems serve


def quickstart_params(cfg: transformer.TransformerConfig = QUICKSTART) -> dict:
  """Fresh parameters (seed 0)."""
  return jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))


def engine_args(args, max_len: int) -> dict:
  """The engine settings both benches share: pages, pool, batch, budget and step buckets."""
  s = args.page_size
  pages_per_seq = max_len // s
  return dict(
      page_size=s,
      num_pages=args.kv_tokens // s + 1,
      max_batch=args.max_batch,
      max_tokens_per_step=args.token_budget,
      max_seq_len=max_len,
      attention=args.attention,
      token_buckets=sorted({8, 32, args.token_budget}),
      page_buckets=sorted({max(1, pages_per_seq // 3), pages_per_seq // 2 or 1, pages_per_seq}),
  )


def paged_vs_static(args) -> None:
  prompt, output = parse_lengths(args)
  cfg, params = QUICKSTART, quickstart_params()
  s = args.page_size
  max_len = math.ceil((prompt.high + output.high) / s) * s
  static_batch = args.kv_tokens // max_len
  if static_batch < 1:
    raise SystemExit(f"--kv_tokens={args.kv_tokens} cannot hold one {max_len}-token sequence")
  print(
      f"# serve_bench on {jax.devices()[0].device_kind}: quickstart model (d_model {cfg.d_model}, "
      f"{cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab}), "
      f"{cfg.dtype}; {args.requests} requests per rate, Poisson arrivals, prompt {prompt}, "
      f"output {output} tokens, seed {args.seed}"
  )
  print(
      f"# KV memory: {args.kv_tokens} slots per layer "
      f"({serve_model.kv_bytes(cfg, args.kv_tokens, 1) / 2**20:.1f} MiB) for both; "
      f"paged: pages of {s}, <= {args.max_batch} running, {args.token_budget} tokens per step; "
      f"static: batches of {static_batch} x {max_len} contiguous slots"
  )
  print(
      "| system | rate (req/s) | generated tok/s | TTFT p50 / p90 / p99 (ms) | "
      "TPOT p50 / p90 / p99 (ms) | KV in use / reserved | steps |"
  )
  print("|---|---|---|---|---|---|---|")
  engine = Engine(cfg, params, **engine_args(args, max_len))
  engine.precompile()
  static = Static(cfg, params, static_batch, max_len, prompt.high, s, engine.backend)
  static.warm_up()
  for rate in (float(r) for r in args.rates.split(",")):
    work = generate(args.requests, rate, prompt, output, cfg.vocab, args.seed)
    generated = sum(w.max_tokens for w in work)
    paged = Paged(engine)
    print(row("paged, continuous", rate, paged, serve(paged, work), generated), flush=True)
    static.done, static.usage = [], []
    print(row("static, contiguous", rate, static, serve(static, work), generated), flush=True)
  print(
      f"# paged: {len(engine.programs)} compiled step programs (bound {engine.max_programs}), "
      f"{engine.counts['preemptions']} preemptions, {engine.counts['cached_tokens']} prompt "
      "tokens from the prefix cache over all rates"
  )
  print(f"# anchors: {ANCHORS}")


# -- colocated vs disaggregated ------------------------------------------------------------------


class Deployed(Paged):
  """A deployment (serve.deploy: the Engine's interface), keeping its finished requests whole."""

  def step(self) -> None:
    self.engine.step()
    self.done += self.engine.finished()


def check_deployment_args(args) -> tuple[list[str], SLO]:
  """Every bad flag, before any device work: one line naming the value and the fix."""
  modes = [m.strip() for m in args.mode.split(",")]
  modes = ["colocated", "disaggregated"] if modes == ["both"] else modes
  bad = [m for m in modes if m not in ("colocated", "disaggregated")]
  if bad:
    raise SystemExit(f"--mode {bad[0]!r}: use colocated, disaggregated or both")
  if "disaggregated" in modes:
    for flag, n in (
        ("--prefill_workers", args.prefill_workers),
        ("--decode_workers", args.decode_workers),
    ):
      if n < 1:
        raise SystemExit(f"{flag}={n} leaves no {flag[2:-8]} worker; give at least 1")
  try:
    slo = SLO(args.ttft_slo, args.tpot_slo)
  except ValueError as e:
    raise SystemExit(f"--{str(e).split()[0]}_slo: {e}") from None
  if args.requests < 1 or args.probes < 1:
    raise SystemExit(f"--requests={args.requests} and --probes={args.probes} must be >= 1")
  if any(not float(r) > 0 for r in args.rates.split(",")):
    raise SystemExit(f"--rates={args.rates}: every rate must be > 0 requests/s")
  return modes, slo


def perfetto(requests, t0: float) -> str:
  """Chrome trace JSON of the requests' spans: a process per worker (and per P->D link), a
  thread per request."""
  names = sorted({w for r in requests for w, *_ in r.spans})
  pid = {w: i for i, w in enumerate(names)}
  events = [
      {"ph": "M", "name": "process_name", "pid": i, "args": {"name": w}} for w, i in pid.items()
  ]
  colours = {
      "queue": "grey",
      "prefill": "thread_state_running",
      "handoff": "yellow",
      "transfer": "rail_load",
      "decode": "good",
  }
  for r in requests:
    for w, kind, start, end in r.spans:
      events.append(
          {
              "name": f"{kind} r{r.id}",
              "cat": kind,
              "ph": "X",
              "pid": pid[w],
              "tid": r.id,
              "ts": 1e6 * (start - t0),
              "dur": 1e6 * (end - start),
              "cname": colours[kind],
              "args": {
                  "request": r.id,
                  "prompt": len(r.prompt),
                  "output": len(r.output),
                  "kv_bytes": r.kv_bytes,
              },
          }
      )
  return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def cdf_plot(path: str, runs: dict[str, list], slo: SLO) -> None:
  """TTFT and TPOT CDFs, a line per (deployment, rate), the SLO targets dashed."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(11, 4))
  FigureCanvasAgg(fig)
  for i, (metric, target) in enumerate((("ttft", slo.ttft), ("tpot", slo.tpot))):
    ax = fig.add_subplot(1, 2, i + 1)
    for label, done in runs.items():
      xs = np.sort([1e3 * getattr(r, metric) for r in done if getattr(r, metric) is not None])
      ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    ax.axvline(1e3 * target, color="k", linestyle="--", linewidth=0.8)
    ax.axhline(slo.attainment, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("share of requests")
  fig.axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def deployment_row(mode: str, rate: float, done: list, makespan: float, slo: SLO) -> str:
  ms = lambda xs: " / ".join(f"{1e3 * x:,.0f}" for x in xs)
  ttft, tpot = percentiles(r.ttft for r in done), percentiles(r.tpot for r in done)
  moved = [r.kv_bytes for r in done]
  tokens = sum(len(r.output) for r in done)
  return (
      f"| {mode} | {rate:g} | {tokens / makespan:,.0f} | {ms(ttft)} | "
      f"{' / '.join(f'{1e3 * x:,.1f}' for x in tpot)} | "
      f"{ms(percentiles(map(e2e, done), (50, 90)))} | "
      f"{100 * attainment(done, slo):.0f}% | {sum(moved) / 2**20:,.2f} MiB "
      f"({np.mean(moved) / 2**10:,.1f} KiB/req) |"
  )


def build_deployment(mode: str, args, cfg, params, max_len: int, max_prompt: int):
  """The deployment and its engines, every step program compiled."""
  kw = engine_args(args, max_len)
  dpw = args.devices_per_worker
  if mode == "colocated":
    groups = device_groups(args.workers or args.prefill_workers + args.decode_workers, dpw)
    dep = Colocated(cfg, params, groups, **kw)
  else:
    p, d = args.prefill_workers, args.decode_workers
    groups = device_groups(p + d, dpw)
    dep = Disaggregated(cfg, params, groups[:p], groups[p:], stream_layers=args.stream_layers, **kw)
  dep.precompile(max_prompt)
  return dep


def measure(args, modes: list[str], slo: SLO, rates: list[float], show: bool = True) -> dict:
  """Serves the workload through each deployment at `rates`, then searches its goodput; returns
  {(mode, rate): TTFT/TPOT p50 and p90 and the share meeting the SLO, (mode, 'goodput'): rate}.
  Writes a Perfetto trace per run and the latency CDFs of the `rates` runs into args.out."""
  prompt, output = parse_lengths(args)
  cfg = QUICKSTART
  try:
    trace = read_csv(args.trace_in, cfg.vocab, args.seed) if args.trace_in else None
  except (OSError, ValueError) as e:
    raise SystemExit(f"--trace_in: {e}") from None
  workers = {
      "colocated": args.workers or args.prefill_workers + args.decode_workers,
      "disaggregated": args.prefill_workers + args.decode_workers,
  }
  for m in modes:
    try:
      device_groups(workers[m], args.devices_per_worker)
    except ValueError as e:
      raise SystemExit(f"--mode {m}: {e}") from None
  params = quickstart_params()
  s = args.page_size
  if trace:
    max_prompt = max(len(w.prompt) for w in trace)
    max_len = max(len(w.prompt) + w.max_tokens for w in trace)
  else:
    max_prompt, max_len = prompt.high, prompt.high + output.high
  max_len = math.ceil(max_len / s) * s
  work_at = lambda rate: (
      at_rate(trace, rate)
      if trace
      else generate(
          max(args.requests, math.ceil(rate * args.horizon)),
          rate,
          prompt,
          output,
          cfg.vocab,
          args.seed,
      )
  )
  if args.trace_out:
    write_csv(args.trace_out, work_at(rates[0]))
  os.makedirs(args.out, exist_ok=True)
  say = print if show else (lambda *a, **k: None)
  say(
      f"# serve_bench --mode on {len(jax.devices())} x {jax.devices()[0].device_kind}: quickstart "
      f"model (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} "
      f"heads), {cfg.dtype}; "
      + (
          f"trace {args.trace_in} ({len(trace)} requests)"
          if trace
          else f"max({args.requests}, rate x {args.horizon:g} s) requests, Poisson arrivals, "
          f"prompt {prompt}, output {output} tokens"
      )
      + f", seed {args.seed}; SLO: TTFT <= {1e3 * slo.ttft:g} ms and TPOT <= {1e3 * slo.tpot:g} ms "
      f"for {100 * slo.attainment:g}% of requests"
  )
  say(
      f"# each worker: {args.devices_per_worker} device(s), {args.kv_tokens} KV slots per layer, "
      f"pages of {s}, <= {args.max_batch} running, {args.token_budget} tokens per step; "
      f"colocated: {workers['colocated']} workers; disaggregated: {args.prefill_workers} prefill "
      f"+ {args.decode_workers} decode workers"
      + (", K/V streamed per layer" if args.stream_layers else "")
  )
  say(
      "| deployment | rate (req/s) | generated tok/s | TTFT p50 / p90 / p99 (ms) | "
      "TPOT p50 / p90 / p99 (ms) | e2e p50 / p90 (ms) | SLO met | KV moved |"
  )
  say("|---|---|---|---|---|---|---|---|")
  curves, out = {}, {}
  deps = {mode: build_deployment(mode, args, cfg, params, max_len, max_prompt) for mode in modes}

  def probe(mode: str, rate: float) -> float:
    system = Deployed(deps[mode])
    makespan = serve(system, work_at(rate))
    done = system.done
    say(deployment_row(mode, rate, done, makespan, slo), flush=True)
    out[(mode, rate)] = summary(done, slo)
    if rate in rates:
      curves[f"{mode} {rate:g}/s"] = done
    with open(os.path.join(args.out, f"{mode}_{rate:g}.perfetto.json"), "w") as f:
      f.write(perfetto(done, min(r.arrival for r in done)))
    return out[(mode, rate)]["met"]

  # the deployments take turns, rate by rate, so that the machine's load drifts over both alike
  searches = {mode: GoodputSearch(rates, slo.attainment, max_probes=args.probes) for mode in modes}
  while any(s.next_rate() is not None for s in searches.values()):
    for mode, search in searches.items():
      rate = search.next_rate()
      if rate is not None:
        search.record(rate, probe(mode, rate))
  for mode, search in searches.items():
    result, dep = search.result(), deps[mode]
    out[(mode, "goodput")] = result.goodput
    tried = ", ".join(f"{r:g}: {100 * a:.0f}%" for r, a in sorted(result.tried.items()))
    above = f"; {result.above:g} req/s missed it" if result.above else ""
    say(
        f"# {mode}: goodput {result.goodput:g} req/s (SLO met at each rate probed: {tried}"
        f"{above}); {dep.steps} iterations, {dep.counts['transfers']} K/V transfers, "
        f"{sum(e.counts['preemptions'] for e in dep.engines)} preemptions, "
        f"{dep.counts['recomputes']} recomputed",
        flush=True,
    )
  cdf_plot(os.path.join(args.out, "latency_cdf.png"), curves, slo)
  say(f"# Perfetto traces (ui.perfetto.dev) and latency_cdf.png in {args.out}/")
  return out


def deployments(args) -> None:
  modes, slo = check_deployment_args(args)
  measure(args, modes, slo, [float(r) for r in args.rates.split(",")])
  print(f"# anchors: {PD_ANCHORS}")


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  for name in ("out", "trace_in", "trace_out"):
    if FLAGS[name].present and not args.mode:
      raise app.UsageError(f"--{name} is read by --mode runs only; add --mode or leave it out")
  if args.peer is not None:
    from experiments import serve_peer

    present = [name for name in serve_peer.PEER_DEFAULTS if FLAGS[name].present]
    serve_peer.run(args, present)
  elif args.url:
    from experiments import serve_client  # httpx and prometheus_client: the serving extra

    serve_client.run(args)
  elif args.kernel:
    kernel_table(args.repeats)
  elif args.scaling:
    from experiments import serve_scaling

    serve_scaling.run(PREFILL_MODEL, args.prefill_context, min(args.repeats, 5))
  elif args.prefill:
    prefill_table(args.prefill_tokens, args.prefill_context, min(args.repeats, 5))
  elif args.mode:
    jax.config.update("jax_num_cpu_devices", args.host_devices)  # before JAX starts its backend
    deployments(args)
  else:
    paged_vs_static(args)


if __name__ == "__main__":
  cli.run(main)
