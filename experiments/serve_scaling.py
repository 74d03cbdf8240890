"""How the engine's prefill and decode steps scale (`serve_bench --scaling`).

  python -m experiments.serve_bench --scaling [--prefill_context 4096 --repeats 2]

Two tables on serve_bench's random float32 Llama-shaped model (`PREFILL_MODEL`: hidden 256,
4 layers, 8 query / 4 KV heads, head dim 32, d_ff 1,024, vocab 1,024), pages of 16, the engine's
default attention (cpu_ragged on CPU), prefix caching off, every program compiled before the clock:

- by chunk count: one `--prefill_context`-token prompt prefilled in k = 1, 2, 4, .. chunks
  (`max_tokens_per_step` = context / k, power-of-two page buckets); the total prefill time (the
  k steps, until its first token) against k and against the training forward
  (`transformer.forward`) on the same tokens. Chunked prefill is sound when the total grows at
  most linearly in k: each chunk attends over the pages before it, so the attention's work is
  the same in all, and what grows with k is the per-step cost (the layers' weights read once per
  step, dispatch, the host).
- by batch and context: B prompts of L tokens prefilled in one step (budget B·L), beside the
  forward on the same [B, L] tokens; then the same B sequences decoding one token each at
  context L (ms per step, tokens/s).

Each figure is the median of `--repeats` runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.models import transformer
from jaxpipe.serve.engine import Engine

PAGE = 16


def _engine(cfg, params, *, batch: int, budget: int, context: int, **kw) -> Engine:
  return Engine(
      cfg,
      params,
      page_size=PAGE,
      num_pages=batch * (-(-context // PAGE)) + 2,
      max_batch=batch,
      max_tokens_per_step=budget,
      max_seq_len=context,
      prefix_caching=False,
      **kw,
  )


def _forward_s(cfg, params, tokens_BxL: np.ndarray, repeats: int) -> float:
  """Median seconds of the training forward on the tokens (compiled first)."""
  forward = jax.jit(lambda t: transformer.forward(cfg, params, t))
  x = jnp.asarray(tokens_BxL)
  jax.block_until_ready(forward(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(forward(x))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def prefill_s(engine: Engine, prompts: Sequence[Sequence[int]]) -> tuple[float, int]:
  """(seconds until every prompt has its first token, steps) of prompts added at once."""
  start = time.perf_counter()
  ids = [engine.add_request(list(p), max_tokens=1, eos_id=None) for p in prompts]
  steps = 0
  while engine.has_work():
    engine.step()
    steps += 1
  done = {r.id: r for r in engine.finished()}
  assert all(done[i].error is None for i in ids), [done[i].error for i in ids]
  return time.perf_counter() - start, steps


def chunk_rows(cfg, params, context: int, chunks: Sequence[int], repeats: int) -> list[dict]:
  """One row per chunk count k: the prefill of one `context`-token prompt in k chunks."""
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (context,), 0, cfg.vocab))
  rows = []
  for k in chunks:
    chunk = context // k  # every chunk is whole: one token bucket
    engine = _engine(
        cfg, params, batch=1, budget=chunk, context=context + 1, token_buckets=(chunk,)
    )
    prefill_s(engine, [tokens])  # compiles the page buckets it meets
    runs = [prefill_s(engine, [tokens]) for _ in range(repeats)]
    rows.append(
        {
            "chunks": k,
            "tokens": context // k,
            "steps": runs[0][1],
            "s": statistics.median(s for s, _ in runs),
            "programs": len(engine.programs),
        }
    )
  return rows


def chunk_table(rows: list[dict], forward_s: float) -> str:
  """The by-chunk-count table: total prefill, per chunk, and growth against k."""
  one = rows[0]["s"] / rows[0]["chunks"]
  lines = [
      "| chunks | tokens per chunk | prefill s | s per chunk | prefill / 1-chunk prefill | "
      "prefill / forward |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['chunks']} | {r['tokens']:,} | {r['s']:.3f} | {r['s'] / r['chunks']:.3f} | "
        f"{r['s'] / (one * rows[0]['chunks']):.2f} | {r['s'] / forward_s:.1f} |"
    )
  return "\n".join(lines)


def grid_rows(
    cfg, params, batches: Sequence[int], contexts: Sequence[int], repeats: int
) -> list[dict]:
  """Per (batch B, context L): a one-step prefill of B prompts of L tokens, the forward on the
  same tokens, and decode steps of the B sequences at context L."""
  rows = []
  rng = np.random.default_rng(0)
  for length in contexts:
    for b in batches:
      prompts = rng.integers(0, cfg.vocab, (b, length))
      decode = 4
      context = length + (repeats + 1) * decode + 1
      engine = _engine(
          cfg,
          params,
          batch=b,
          budget=b * length,
          context=context,
          token_buckets=(b, b * length),
          page_buckets=(-(-context // PAGE),),  # one table width: two programs per cell
      )
      engine.precompile()
      prefill = statistics.median(prefill_s(engine, prompts)[0] for _ in range(repeats))
      forward = _forward_s(cfg, params, prompts, repeats)
      for p in prompts:  # a long request each, decoding at about context L
        engine.add_request(list(map(int, p)), max_tokens=(repeats + 1) * decode, eos_id=None)
      engine.step()  # the prefill
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(decode):
          engine.step()
        times.append((time.perf_counter() - start) / decode)
      while engine.has_work():
        engine.step()
      engine.finished()
      rows.append(
          {
              "batch": b,
              "context": length,
              "prefill_s": prefill,
              "forward_s": forward,
              "decode_s": statistics.median(times),
          }
      )
  return rows


def grid_table(rows: list[dict]) -> str:
  lines = [
      "| batch | context | prefill s | prefill tokens/s | forward s | prefill / forward | "
      "decode ms / step | decode tokens/s |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    tokens = r["batch"] * r["context"]
    lines.append(
        f"| {r['batch']} | {r['context']:,} | {r['prefill_s']:.3f} | "
        f"{tokens / r['prefill_s']:,.0f} | {r['forward_s']:.3f} | "
        f"{r['prefill_s'] / r['forward_s']:.1f} | {1e3 * r['decode_s']:.1f} | "
        f"{r['batch'] / r['decode_s']:,.0f} |"
    )
  return "\n".join(lines)


def run(cfg, context: int, repeats: int) -> None:
  """Both tables (the module docstring)."""
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  chunks = [k for k in (1, 2, 4, 8, 16) if context % k == 0 and context // k >= 8]
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, context), 0, cfg.vocab))
  forward = _forward_s(cfg, params, tokens, repeats)
  print(
      f"# one {context:,}-token prompt prefilled in k chunks (median of {repeats}); the "
      f"forward on the same tokens: {forward:.3f} s",
      flush=True,
  )
  print(chunk_table(chunk_rows(cfg, params, context, chunks, repeats), forward), flush=True)
  print(
      f"\n# B prompts of L tokens: one prefill step, then decode at context L (median of {repeats})"
  )
  print(grid_table(grid_rows(cfg, params, (1, 4, 16), (256, 1024), repeats)), flush=True)
