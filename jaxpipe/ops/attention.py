"""Attention cores on one device behind one call; the backend is chosen by config.

Backends: `xla` (`jax.nn.dot_product_attention`'s XLA path, runs everywhere), `cudnn` (cuDNN
flash attention through `jax.nn.dot_product_attention`, CUDA GPUs only), `pallas` (our Pallas
flash attention, compiled on GPU, interpreted elsewhere), and `auto`, which picks the fastest
backend that can serve the call on the current platform: cudnn, then pallas, then xla on GPU;
xla elsewhere (interpreted Pallas is a correctness tool, not a fast path).

Paged attention has its own backends behind `paged_attention`: `xla` (the pure-JAX gather
reference: every query token gathers its whole sequence's pages), `pallas`
(`kernels_pallas.paged_attention`, compiled on GPU, interpreted elsewhere), `xla_ragged`
(`ragged_paged_attention`: one gather per block of a sequence's tokens, not per token) and
`auto` (pallas on GPU, xla elsewhere; for a serving step whose tokens come grouped by
sequence, `resolve_step_backend` takes xla_ragged where auto gives xla). The per-token backends
take a query per row and its block table; `xla_ragged` takes the tokens by sequence
(`RaggedRows`).

Why blocks (measured on CPU, docs/serving.md "Prefill attention"): the per-token gather moves
T x N·S keys per layer, 5-10x the cost of the training forward on the same tokens for a
1,024-token chunk. `ragged_paged_attention` splits the tokens of each sequence into blocks of
up to `block` consecutive queries (sequences of one token, decode, get blocks of one), gathers
each block's sequence pages once and attends with a causal mask by position; the chunk's own
keys are read back from the pages they were just written to, so one masked softmax serves the
cached prefix and the chunk alike (no second pass over the chunk's keys and no merge of two
softmaxes, and an 8-bit cache sees its own rounding exactly as the gather reference does). The
block count is static: ceil(T / block) + the rows that can hold two or more tokens, plus one
block per row for one-token rows, so shapes depend on (T, rows, pages) only and the engine
compiles no more programs than before. The gather is blocks x N·S instead of T x N·S (48
instead of 1,024 per layer for a 1,024-token step of 16 rows), at the price of up to one
partly empty block per sequence.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import flash_attention as fa
from kernels_pallas import paged_attention as pa

BACKENDS = ("xla", "cudnn", "pallas", "auto")
PAGED_BACKENDS = ("xla", "pallas", "xla_ragged", "auto")
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


def resolve_step_backend(backend: str, head_dim: int, page_size: int) -> str:
  """`resolve_paged_backend` for a serving step, whose tokens come grouped by sequence: 'auto'
  takes xla_ragged where the per-token choice would be the xla gather."""
  name = resolve_paged_backend(backend, head_dim, page_size)
  return "xla_ragged" if backend == "auto" and name == "xla" else name


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
  name = resolve_paged_backend(backend, head_dim, page_size)
  if name == "xla_ragged":
    raise ValueError("backend 'xla_ragged' takes rows of tokens: call ragged_paged_attention")
  if name == "pallas":
    return pa.paged_attention(*args, **scales, interpret=_gpu_major() is None)
  return pa.paged_attention_reference(*args, **scales)


class RaggedRows(NamedTuple):
  """A step's T tokens grouped by sequence: row b's tokens are the flat indices
  starts[b] .. starts[b] + counts[b] - 1, at positions cached[b] .. cached[b] + counts[b] - 1 of
  the sequence whose pages are tables[b]. Padding rows have count 0; tokens no row covers are
  padding (their output is 0)."""

  tables_BxN: jax.Array  # int32 block table of each row (padding entries: any page)
  starts_B: jax.Array  # int32 the row's first token in the flat batch
  counts_B: jax.Array  # int32 the row's tokens in this step (0: padding row)
  cached_B: jax.Array  # int32 tokens of the sequence cached before this step


def ragged_blocks(num_tokens: int, num_rows: int, block: int) -> tuple[int, int]:
  """(one-query blocks, `block`-query blocks) that always cover T tokens in <= num_rows rows."""
  block = max(1, min(block, num_tokens))
  ones = min(num_rows, num_tokens)
  return ones, -(-num_tokens // block) + min(num_rows, num_tokens // 2)


def _layout(rows: RaggedRows, take_B, block: int, num_blocks: int):
  """Blocks of up to `block` consecutive tokens of the rows in take_B, in row order: for each,
  its row [NB], flat index of each query [NB, Q] and its position (both -1: no query)."""
  n_B = jnp.where(take_B, -(-rows.counts_B // block), 0)
  end_B = jnp.cumsum(n_B)
  j_NB = jnp.arange(num_blocks)
  row_NB = jnp.minimum(jnp.searchsorted(end_B, j_NB, side="right"), n_B.shape[0] - 1)
  first_NB = (j_NB - (end_B - n_B)[row_NB]) * block  # offset of the block within its row
  count_NB = jnp.where(j_NB < end_B[-1], jnp.clip(rows.counts_B[row_NB] - first_NB, 0, block), 0)
  i_Q = jnp.arange(block)
  live_NBxQ = i_Q[None, :] < count_NB[:, None]
  index_NBxQ = jnp.where(live_NBxQ, rows.starts_B[row_NB][:, None] + first_NB[:, None] + i_Q, -1)
  pos_NBxQ = jnp.where(live_NBxQ, rows.cached_B[row_NB][:, None] + first_NB[:, None] + i_Q, -1)
  return row_NB, index_NBxQ, pos_NBxQ


def _block_attention(
    q_TxHxK, k_pages, v_pages, k_scales, v_scales, tables_NBxN, index_NBxQ, pos_NBxQ, sm_scale
):
  """Each block's queries over its sequence's pages, key position <= query position -> [NB, Q,
  H, K] float32 (a query at position -1 sees no key; its output is finite and dropped)."""
  nb, q = index_NBxQ.shape
  _, h, d = q_TxHxK.shape
  g, _, s, _ = k_pages.shape
  n = tables_NBxN.shape[1]

  def gather(pages, scales):  # -> [NB, G, N*S, K] float32
    x = pages[:, tables_NBxN].astype(jnp.float32)  # [G, NB, N, S, K]
    if scales is not None:
      x = x * scales[:, tables_NBxN][..., None]
    return jnp.swapaxes(x, 0, 1).reshape(nb, g, n * s, d)

  k_NBxGxLxK, v_NBxGxLxK = gather(k_pages, k_scales), gather(v_pages, v_scales)
  visible_NBxQxL = jnp.arange(n * s)[None, None, :] <= pos_NBxQ[:, :, None]
  keyed_NBxL = jnp.any(visible_NBxQxL, axis=1)  # stale slots past every query may hold NaN
  v_NBxGxLxK = jnp.where(keyed_NBxL[:, None, :, None], v_NBxGxLxK, 0.0)
  q_NBxQxHxK = q_TxHxK.astype(jnp.float32)[jnp.maximum(index_NBxQ, 0)]
  q_NBxGxRxQxK = q_NBxQxHxK.reshape(nb, q, g, h // g, d).transpose(0, 2, 3, 1, 4)
  hp = jax.lax.Precision.HIGHEST
  s_NBxGxRxQxL = jnp.einsum("bgrqk,bglk->bgrql", q_NBxGxRxQxK, k_NBxGxLxK, precision=hp)
  s_NBxGxRxQxL = jnp.where(visible_NBxQxL[:, None, None], s_NBxGxRxQxL * sm_scale, pa.MASK_VALUE)
  p_NBxGxRxQxL = jax.nn.softmax(s_NBxGxRxQxL, axis=-1)
  o_NBxGxRxQxK = jnp.einsum("bgrql,bglk->bgrqk", p_NBxGxRxQxL, v_NBxGxLxK, precision=hp)
  return o_NBxGxRxQxK.transpose(0, 3, 1, 2, 4).reshape(nb, q, h, d)


def ragged_paged_attention(
    q_TxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    rows: RaggedRows,
    *,
    block: int = 32,
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
  """Each token of `rows` over its sequence's keys at positions 0..its own -> [T, H, K].

  The pages must already hold this step's K/V (the caller writes them first). Equals
  `paged_attention_reference` per token with its sequence's table and length position + 1.
  """
  t, h, d = q_TxHxK.shape
  g, _, s, _ = k_pages_GxPxSxK.shape
  if h % g:
    raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({g})")
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  b = rows.counts_B.shape[0]
  block = max(1, min(block, t))
  ones, blocks = ragged_blocks(t, b, block)
  if block == 1:  # one layout serves every row
    passes = ((1, t, rows.counts_B > 0),)
  else:
    passes = ((1, ones, rows.counts_B == 1), (block, blocks, rows.counts_B > 1))
  o_TxHxK = jnp.zeros((t, h, d), jnp.float32)
  for size, count, take_B in passes:
    row_NB, index_NBxQ, pos_NBxQ = _layout(rows, take_B, size, count)
    o_NBxQxHxK = _block_attention(
        q_TxHxK,
        k_pages_GxPxSxK,
        v_pages_GxPxSxK,
        k_scales_GxPxS,
        v_scales_GxPxS,
        rows.tables_BxN[row_NB],
        index_NBxQ,
        pos_NBxQ,
        sm_scale,
    )
    at_NBxQ = jnp.where(index_NBxQ >= 0, index_NBxQ, t)  # t: dropped
    o_TxHxK = o_TxHxK.at[at_NBxQ].set(o_NBxQxHxK, mode="drop")
  return o_TxHxK.astype(q_TxHxK.dtype)
