"""Attention cores on one device behind one call; the backend is chosen by config.

Backends: `xla` (`jax.nn.dot_product_attention`'s XLA path, runs everywhere), `cudnn` (cuDNN
flash attention through `jax.nn.dot_product_attention`, CUDA GPUs only), `pallas` (our Pallas
flash attention, compiled on GPU, interpreted elsewhere), and `auto`, which picks the fastest
backend that can serve the call on the current platform: cudnn, then pallas, then xla on GPU;
xla elsewhere (interpreted Pallas is a correctness tool, not a fast path).

Paged (decode) attention has its own backends behind `paged_attention`: `xla` (the pure-JAX
gather reference), `pallas` (`kernels_pallas.paged_attention`, compiled on GPU, interpreted
elsewhere) and `auto` (pallas on GPU, xla elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import flash_attention as fa
from kernels_pallas import paged_attention as pa

BACKENDS = ("xla", "cudnn", "pallas", "auto")
PAGED_BACKENDS = ("xla", "pallas", "auto")
_AUTO_ORDER_GPU = ("cudnn", "pallas", "xla")


@functools.cache
def _gpu_major() -> int | None:
  """CUDA compute capability major version of device 0, or None off GPU."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", "0")
  return int(str(cc).split(".")[0])


def unsupported_reason(
    backend: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids=None
) -> str | None:
  """Why `backend` cannot serve these shapes/dtypes on this platform, or None if it can."""
  if q.shape[2] % k.shape[2]:
    return (
        f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}); "
        f"pick a KV head count that divides {q.shape[2]}"
    )
  head_dim, dtype = q.shape[-1], q.dtype
  if backend == "xla":
    return None
  if backend == "cudnn":
    if _gpu_major() is None:
      return f"needs a CUDA GPU, but this process runs on {jax.default_backend()}"
    if dtype not in (jnp.bfloat16, jnp.float16):
      return f"serves bfloat16/float16 only, got {dtype}; cast q, k, v or use 'pallas'/'xla'"
    max_dim = 256 if _gpu_major() >= 9 else 128
    if head_dim % 8 or head_dim > max_dim:
      return f"needs head_dim a multiple of 8 and <= {max_dim}, got {head_dim}"
    if segment_ids is not None:
      return "takes no segment_ids here; use 'pallas' or 'xla' for packed sequences"
    return None
  if backend == "pallas":
    try:
      fa.check_inputs(q, k, v)
    except ValueError as e:
      return str(e)
    return None
  raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def resolve_backend(
    backend: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids=None
) -> str:
  """The concrete backend that will run: validates an explicit choice, resolves 'auto'."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  if backend == "auto":
    order = _AUTO_ORDER_GPU if _gpu_major() is not None else ("xla",)
    for name in order:
      if unsupported_reason(name, q, k, v, segment_ids) is None:
        return name
    raise ValueError(unsupported_reason("xla", q, k, v, segment_ids))
  reason = unsupported_reason(backend, q, k, v, segment_ids)
  if reason is not None:
    raise ValueError(
        f"attention backend {backend!r} cannot serve q{tuple(q.shape)} "
        f"{q.dtype}, k{tuple(k.shape)}: {reason}"
    )
  return backend


def attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    causal: bool = True,
    backend: str = "xla",
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
  """Scaled dot-product attention, `jax.nn.dot_product_attention` layout (K/V may have fewer heads).

  The arrays are this device's whole sequence; `jaxpipe.models.attention.attention` is the
  layers' entry point, which adds Ulysses context parallelism and the serving KV-cache hook.
  """
  q, k, v = q_BxLxHxK, k_BxLxGxK, v_BxLxGxK
  name = resolve_backend(backend, q, k, v, segment_ids)
  if name == "pallas":
    return fa.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, segment_ids=segment_ids)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, scale=sm_scale, is_causal=causal, implementation=name
  )


def resolve_paged_backend(backend: str, head_dim: int, page_size: int) -> str:
  """The concrete paged-attention backend for these pages: validates the choice, resolves 'auto'
  (the compiled kernel on GPU when it serves the shapes, else xla)."""
  if backend not in PAGED_BACKENDS:
    raise ValueError(f"unknown paged attention backend {backend!r}; choose one of {PAGED_BACKENDS}")
  reason = pa.compiled_unsupported(head_dim, page_size) if _gpu_major() is not None else None
  if backend == "auto":
    return "pallas" if _gpu_major() is not None and reason is None else "xla"
  if backend == "pallas" and reason is not None:
    raise ValueError(f"paged attention backend 'pallas' {reason}; use 'xla'")
  return backend


def paged_attention(
    q_BxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    block_tables_BxN: jax.Array,
    lengths_B: jax.Array,
    *,
    backend: str = "auto",
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
) -> jax.Array:
  """One query token per row attending over its first `lengths[b]` paged keys
  (`kernels_pallas.paged_attention`)."""
  scales = dict(k_scales_GxPxS=k_scales_GxPxS, v_scales_GxPxS=v_scales_GxPxS)
  args = (q_BxHxK, k_pages_GxPxSxK, v_pages_GxPxSxK, block_tables_BxN, lengths_B)
  _, _, page_size, head_dim = k_pages_GxPxSxK.shape
  if resolve_paged_backend(backend, head_dim, page_size) == "pallas":
    return pa.paged_attention(*args, **scales, interpret=_gpu_major() is None)
  return pa.paged_attention_reference(*args, **scales)
