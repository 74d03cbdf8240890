"""Attention cores side by side: `python -m experiments.attention_bench [--seqs 1024,4096]`.

On a GPU: TFLOP/s of pallas, cudnn and xla, forward and forward+backward, causal and not,
over sequence lengths 1k-16k at head dim 128 (bf16, a fixed number of tokens per call).
FLOPs follow the FlashAttention papers: forward 4·B·H·L²·K (half when causal), backward 2.5×
forward. Elsewhere: the interpret-mode correctness pass of the Pallas kernel against XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.timing import median_time
from jaxpipe.ops.attention import attention, unsupported_reason
from jaxpipe.runtime import cli

FLAGS = cli.flag_values(__name__)
flags.DEFINE_list(
    "seqs", ["1024", "2048", "4096", "8192", "16384"], "Sequence lengths.", flag_values=FLAGS
)
flags.DEFINE_integer("heads", 16, "Query (= KV) heads.", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 128, "Head dimension.", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 16384, "batch * seq per call.", flag_values=FLAGS)
flags.DEFINE_list("backends", ["pallas", "cudnn", "xla"], "Backends to time.", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 10, "Timed calls per cell (median).", flag_values=FLAGS)
flags.DEFINE_string("dtype", "bfloat16", "bfloat16 or float16.", flag_values=FLAGS)

# Published H100 anchors (shared/anchors.md) printed beside our table.
ANCHORS = (
    "FlashAttention-3: up to 740 TFLOP/s bf16 forward; "
    "cuDNN: 497-617 TFLOP/s forward at head dim 128 (H100)."
)


def attention_flops(
    batch: int, seq: int, heads: int, head_dim: int, causal: bool, backward: bool
) -> float:
  fwd = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
  return fwd * 3.5 if backward else fwd


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)
  return q, k, v


def gpu_table(seqs, heads, head_dim, tokens, backends, repeats, dtype) -> None:
  print(
      f"# attention TFLOP/s on {jax.devices()[0].device_kind}, {jnp.dtype(dtype).name}, "
      f"head_dim {head_dim}, {heads} heads, {tokens} tokens per call (batch = tokens / seq)"
  )
  print("| seq | causal | pass | " + " | ".join(backends) + " |")
  print("|---|---|---|" + "---|" * len(backends))
  for causal in (False, True):
    for seq in seqs:
      batch = max(1, tokens // seq)
      q, k, v = _inputs(batch, seq, heads, heads, head_dim, dtype)
      for backward in (False, True):
        cells = []
        for backend in backends:
          reason = unsupported_reason(backend, q, k, v)
          if reason is not None:
            cells.append("n/a")
            continue
          fwd = functools.partial(attention, causal=causal, backend=backend)
          if backward:
            loss = lambda q, k, v, fwd=fwd: jnp.sum(fwd(q, k, v).astype(jnp.float32))
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
          else:
            fn = jax.jit(fwd)
          try:
            seconds = median_time(fn, q, k, v, repeats=repeats)
          except Exception as e:  # an OOM or a kernel limit is a table cell, not a crash
            cells.append(f"failed ({type(e).__name__})")
            continue
          flops = attention_flops(batch, seq, heads, head_dim, causal, backward)
          cells.append(f"{flops / seconds / 1e12:.0f}")
        kind = "fwd+bwd" if backward else "fwd"
        print(f"| {seq} | {causal} | {kind} | " + " | ".join(cells) + " |", flush=True)
  print(f"\nReference figures: {ANCHORS}")


def interpret_check() -> None:
  """Pallas (interpret mode) against jax.nn's XLA attention on small shapes, fwd and grads."""
  from kernels_pallas.flash_attention import flash_attention

  print(
      f"# Pallas flash attention, interpret mode on {jax.default_backend()}: max relative "
      f"error against XLA (float32)"
  )
  print("| seq | heads/kv | head_dim | causal | out | dq | dk | dv |")
  print("|---|---|---|---|---|---|---|---|")
  worst = 0.0
  for seq, heads, kv_heads, head_dim, causal in [
      (40, 4, 2, 32, True),
      (64, 4, 1, 64, False),
      (37, 2, 2, 16, True),
      (96, 8, 2, 128, True),
  ]:
    q, k, v = _inputs(1, seq, heads, kv_heads, head_dim, jnp.float32)
    do = jax.random.normal(jax.random.key(1), q.shape)
    blocks = dict(
        block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32
    )

    def run(fn):
      out, vjp = jax.vjp(fn, q, k, v)
      return (out, *vjp(do))

    got = jax.jit(
        lambda: run(functools.partial(flash_attention, causal=causal, interpret=True, **blocks))
    )()
    want = run(
        functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
    )
    errs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)]
    worst = max(worst, *errs)
    print(
        f"| {seq} | {heads}/{kv_heads} | {head_dim} | {causal} | "
        + " | ".join(f"{e:.1e}" for e in errs)
        + " |",
        flush=True,
    )
  print(f"\nworst relative error {worst:.1e} ({'PASS' if worst < 1e-5 else 'FAIL'} at 1e-5)")


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  try:
    seqs = [int(s) for s in FLAGS.seqs]
  except ValueError:
    raise app.UsageError(
        f"--seqs={','.join(FLAGS.seqs)}: give comma-separated integers, e.g. 1024,4096"
    ) from None
  if jax.default_backend() != "gpu":
    interpret_check()
    print(
        f"\nGPU timings need a GPU: this process runs on {jax.default_backend()}. Run "
        f"`python -m experiments.attention_bench` on a CUDA machine for the TFLOP/s table."
    )
    return
  gpu_table(
      seqs,
      FLAGS.heads,
      FLAGS.head_dim,
      FLAGS.tokens,
      FLAGS.backends,
      FLAGS.repeats,
      jnp.dtype(FLAGS.dtype),
  )


if __name__ == "__main__":
  cli.run(main)
