"""PagedAttention decode as a Pallas (Triton-lowering) GPU kernel,
and its pure-JAX gather reference.

Layout is that of JAX's own Pallas GPU paged attention: q `[B, H, K]` (one query token per row),
k/v pages `[G, P, page, K]` (G key/value heads, P physical pages), `block_tables[B, pages_per_seq]`
mapping row b's logical page i to a physical page, `lengths[B]` the keys row b sees (its first
`lengths[b]` logical token slots). Query head h reads KV head h // (H // G); repeated K/V are
never materialised. Optional int8/fp8 pages carry one float32 scale per (head, page, slot):
`k_scales[G, P, page]`, value = stored * scale.

One program per (row, KV head, split) walks its share of the row's pages, `pages_per_block` at a
time, with an online softmax; splits (flash-decoding) are merged outside from each one's
(output, max, sum). `paged_attention_rows` runs the same kernel over blocks of several query
tokens of one sequence (a prefill chunk, `ops.attention.ragged_paged_attention`): each of a
program's rows is one (query token, query head) with its own length, the keys at positions
0..its own, so causal attention within the chunk is a mask by position.

Slots past `lengths` are masked in the logits *and* zeroed in V, so stale contents of a page's
unused tail (NaN included) never reach the output: a page's tail belongs to the sequence but was
written by the page's previous owner.

A sliding window (`window` > 0, a traced int32 allowed: a layer's own) limits a row of length n
to the slots n - window .. n - 1, and the pages before them are not read (a sequence's freed
pages may hold another's keys); `softcap` > 0 caps the scores as softcap·tanh(s / softcap)
(Gemma 2), both as transformers computes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.flash_attention import MASK_VALUE, _dot

QUANT_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
MIN_ROWS = 16  # Triton's smallest dot tile: query heads per KV head and keys per block reach it


def compiled_unsupported(head_dim: int, page_size: int) -> str | None:
  """Why the compiled (Triton) kernel cannot serve these pages, or None;
  interpret mode serves all."""
  pow2 = lambda x: x > 0 and not x & (x - 1)
  if not pow2(head_dim) or head_dim < MIN_ROWS:
    return f"needs head_dim a power of two >= {MIN_ROWS}, got {head_dim}"
  if not pow2(page_size):
    return f"needs page_size a power of two, got {page_size}"
  return None


def check_inputs(q, k_pages, v_pages, block_tables, lengths, k_scales=None, v_scales=None):
  """Raises ValueError naming the first argument whose shape or dtype does not fit."""
  if q.ndim != 3 or k_pages.ndim != 4:
    raise ValueError(
        f"q must be [B, H, K] and k_pages [G, P, page, K]; got q{tuple(q.shape)}, "
        f"k_pages{tuple(k_pages.shape)}"
    )
  b, h, d = q.shape
  g, p, s, dk = k_pages.shape
  if v_pages.shape != k_pages.shape:
    raise ValueError(
        f"v_pages{tuple(v_pages.shape)} must have k_pages' shape {tuple(k_pages.shape)}"
    )
  if dk != d:
    raise ValueError(f"head_dim of q ({d}) differs from the pages' ({dk})")
  if h % g:
    raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({g})")
  if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != jnp.int32:
    raise ValueError(
        f"block_tables must be int32 [B={b}, pages_per_seq]; got "
        f"{block_tables.dtype}{tuple(block_tables.shape)}"
    )
  if lengths.shape != (b,) or lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32 [B={b}]; got {lengths.dtype}{tuple(lengths.shape)}")
  quantized = k_pages.dtype in QUANT_DTYPES
  if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
    raise ValueError(
        f"{k_pages.dtype} pages need k_scales and v_scales exactly when they are one "
        f"of {[jnp.dtype(t).name for t in QUANT_DTYPES]}"
    )
  for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
    if sc is not None and sc.shape != (g, p, s):
      raise ValueError(f"{name} must be [G, P, page] = {(g, p, s)}; got {tuple(sc.shape)}")


def first_slots(lengths, window):
  """The first slot a row of `lengths` sees: lengths - window with a window (> 0), else 0."""
  window = jnp.asarray(window, jnp.int32)
  return jnp.where(window > 0, jnp.maximum(lengths - window, 0), 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "softcap"))
def paged_attention_reference(
    q_BxHxK,
    k_pages_GxPxSxK,
    v_pages_GxPxSxK,
    block_tables_BxN,
    lengths_B,
    *,
    k_scales_GxPxS=None,
    v_scales_GxPxS=None,
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Gathers each row's pages into a contiguous [T = N * page] sequence and attends over it
  (its slots first_slots(length, window) .. length - 1)."""
  check_inputs(
      q_BxHxK,
      k_pages_GxPxSxK,
      v_pages_GxPxSxK,
      block_tables_BxN,
      lengths_B,
      k_scales_GxPxS,
      v_scales_GxPxS,
  )
  b, h, d = q_BxHxK.shape
  g, _, s, _ = k_pages_GxPxSxK.shape
  n = block_tables_BxN.shape[1]
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

  def gather(pages_GxPxSx_, scales_GxPxS):  # -> [B, G, T, ...] float32
    x = pages_GxPxSx_[:, block_tables_BxN].astype(jnp.float32)  # [G, B, N, S, ...]
    if scales_GxPxS is not None:
      x = x * scales_GxPxS[:, block_tables_BxN][..., None]
    return jnp.swapaxes(x, 0, 1).reshape(b, g, n * s, *x.shape[4:])

  k_BxGxTxK, v_BxGxTxK = gather(k_pages_GxPxSxK, k_scales_GxPxS), gather(
      v_pages_GxPxSxK, v_scales_GxPxS
  )
  t_T = jnp.arange(n * s)[None, :]
  valid_BxT = (t_T < lengths_B[:, None]) & (t_T >= first_slots(lengths_B, window)[:, None])
  v_BxGxTxK = jnp.where(valid_BxT[:, None, :, None], v_BxGxTxK, 0.0)
  q_BxGxRxK = q_BxHxK.astype(jnp.float32).reshape(b, g, h // g, d)
  hp = lax.Precision.HIGHEST
  s_BxGxRxT = jnp.einsum("bgrk,bgtk->bgrt", q_BxGxRxK, k_BxGxTxK, precision=hp) * sm_scale
  if softcap:
    s_BxGxRxT = softcap * jnp.tanh(s_BxGxRxT / softcap)
  s_BxGxRxT = jnp.where(valid_BxT[:, None, None, :], s_BxGxRxT, MASK_VALUE)
  p_BxGxRxT = jax.nn.softmax(s_BxGxRxT, axis=-1)
  o_BxGxRxK = jnp.einsum("bgrt,bgtk->bgrk", p_BxGxRxT, v_BxGxTxK, precision=hp)
  return o_BxGxRxK.reshape(b, h, d).astype(q_BxHxK.dtype)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
    sm_scale: float,
    softcap: float,
    pages_per_block: int,
    pages_per_split: int,
    quantized: bool,
):
  """One (row, KV head, split): q_ref [R, K]; k_ref, v_ref [P, page, K]; tables [N]; lengths
  and firsts [R] (each query row sees the slots first .. length - 1)."""
  if quantized:
    ks_ref, vs_ref, table_ref, length_ref, first_ref, o_ref, m_ref, l_ref = refs
  else:
    table_ref, length_ref, first_ref, o_ref, m_ref, l_ref = refs
  rows, head_dim = q_ref.shape
  page = k_ref.shape[1]
  block = pages_per_block * page
  lengths, firsts = length_ref[...], first_ref[...]
  length = jnp.max(lengths)
  lowest = jnp.min(jnp.where(lengths > 0, firsts, length))  # no row sees a slot before it
  first = pl.program_id(2) * pages_per_split  # this split's first logical page
  # the window's first block of pages: none before it is read
  first = jnp.maximum(first, lowest // page // pages_per_block * pages_per_block)
  end = jnp.minimum(pl.cdiv(length, page), pl.program_id(2) * pages_per_split + pages_per_split)
  q = q_ref[...]

  def body(j, carry):
    acc, m_prev, l_prev = carry
    start = first + j * pages_per_block
    pages = table_ref[pl.ds(start, pages_per_block)]
    k = k_ref[pages].reshape(block, head_dim)
    v = v_ref[pages].reshape(block, head_dim)
    if quantized:
      k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = _dot(q, k, trans_b=True) * sm_scale
    if quantized:
      s = s * ks_ref[pages].reshape(1, block)
    if softcap:
      s = softcap * jnp.tanh(s / softcap)
    slot = start * page + lax.broadcasted_iota(jnp.int32, (1, block), 1)
    valid = (slot < lengths[:, None]) & (slot >= firsts[:, None])  # [R, block]
    s = jnp.where(valid, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    if quantized:  # a stale slot's scale may be NaN too: 0 * NaN would reach the output
      p = p * jnp.where(valid, vs_ref[pages].reshape(1, block), 0.0)
    # by any row: the slots past it (a page's stale tail) and before the window may hold NaN
    seen = ((slot < length) & (slot >= lowest)).reshape(block, 1)
    v = jnp.where(seen, v, jnp.zeros_like(v))
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  init = (
      jnp.zeros((rows, head_dim), jnp.float32),
      jnp.full((rows,), MASK_VALUE, jnp.float32),
      jnp.zeros((rows,), jnp.float32),
  )
  acc, m, l = lax.fori_loop(0, jnp.maximum(pl.cdiv(end - first, pages_per_block), 0), body, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "softcap",
        "pages_per_block",
        "k_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_attention(
    q_BxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    block_tables_BxN: jax.Array,
    lengths_B: jax.Array,
    *,
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
    pages_per_block: int = 8,
    k_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
  """Attention of each row's query over the first `lengths[b]` slots of its pages (the last
  `window` of them with a window) -> [B, H, K].

  pages_per_block: pages per inner step (a power of two; block = pages_per_block * page keys);
  k_splits: programs per (row, KV head) that split its pages (flash-decoding), merged here.
  """
  check_inputs(
      q_BxHxK,
      k_pages_GxPxSxK,
      v_pages_GxPxSxK,
      block_tables_BxN,
      lengths_B,
      k_scales_GxPxS,
      v_scales_GxPxS,
  )
  b, h, d = q_BxHxK.shape
  g = k_pages_GxPxSxK.shape[0]
  r = h // g
  rows = max(MIN_ROWS, pl.next_power_of_2(r))
  q_BxGxRxK = jnp.pad(q_BxHxK.reshape(b, g, r, d), ((0, 0), (0, 0), (0, rows - r), (0, 0)))
  o = _paged_call(
      q_BxGxRxK,
      k_pages_GxPxSxK,
      v_pages_GxPxSxK,
      block_tables_BxN,
      jnp.broadcast_to(lengths_B[:, None], (b, rows)),
      jnp.broadcast_to(first_slots(lengths_B, window)[:, None], (b, rows)),
      k_scales_GxPxS,
      v_scales_GxPxS,
      sm_scale=sm_scale,
      softcap=softcap,
      pages_per_block=pages_per_block,
      k_splits=k_splits,
      num_warps=num_warps,
      num_stages=num_stages,
      interpret=interpret,
  )
  return o[:, :, :r].reshape(b, h, d).astype(q_BxHxK.dtype)


def _paged_call(
    q_BxGxRxK,
    k_pages_GxPxSxK,
    v_pages_GxPxSxK,
    block_tables_BxN,
    lengths_BxR,
    firsts_BxR,
    k_scales_GxPxS,
    v_scales_GxPxS,
    *,
    sm_scale,
    softcap,
    pages_per_block,
    k_splits,
    num_warps,
    num_stages,
    interpret,
):
  """The kernel over q [B, G, rows, K] (rows a power of two >= MIN_ROWS), each query row with its
  own first slot and length [B, rows] -> [B, G, rows, K] float32 (a row with length 0: zeros)."""
  if pages_per_block < 1 or pages_per_block & (pages_per_block - 1) or k_splits < 1:
    raise ValueError(
        f"pages_per_block={pages_per_block} must be a power of two and k_splits={k_splits} >= 1"
    )
  b, g, rows, d = q_BxGxRxK.shape
  _, p, s, _ = k_pages_GxPxSxK.shape
  n = block_tables_BxN.shape[1]
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  quantized = k_scales_GxPxS is not None
  # Each split gets a whole number of blocks; table entries past a row's pages are never read
  # unmasked (0 is a valid page index for the padding). Compiled, a block holds >= MIN_ROWS keys.
  pages_per_block = min(pages_per_block, pl.next_power_of_2(-(-n // k_splits)))
  if not interpret:
    pages_per_block = max(pages_per_block, -(-MIN_ROWS // s))
  pages_per_split = -(-n // (k_splits * pages_per_block)) * pages_per_block
  tables_BxN = jnp.pad(block_tables_BxN, ((0, 0), (0, pages_per_split * k_splits - n)))
  page_spec = pl.BlockSpec((None, p, s, d), lambda i, j, k: (j, 0, 0, 0))
  scale_spec = pl.BlockSpec((None, p, s), lambda i, j, k: (j, 0, 0))
  in_specs = [
      pl.BlockSpec((None, None, rows, d), lambda i, j, k: (i, j, 0, 0)),
      page_spec,
      page_spec,
  ]
  operands = [q_BxGxRxK, k_pages_GxPxSxK, v_pages_GxPxSxK]
  if quantized:
    in_specs += [scale_spec, scale_spec]
    operands += [k_scales_GxPxS.astype(jnp.float32), v_scales_GxPxS.astype(jnp.float32)]
  in_specs += [
      pl.BlockSpec((None, tables_BxN.shape[1]), lambda i, j, k: (i, 0)),
      pl.BlockSpec((None, rows), lambda i, j, k: (i, 0)),
      pl.BlockSpec((None, rows), lambda i, j, k: (i, 0)),
  ]
  operands += [tables_BxN, lengths_BxR.astype(jnp.int32), firsts_BxR.astype(jnp.int32)]
  kernel = functools.partial(
      _kernel,
      sm_scale=sm_scale,
      softcap=softcap,
      pages_per_block=pages_per_block,
      pages_per_split=pages_per_split,
      quantized=quantized,
  )
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, g, k_splits),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, d), lambda i, j, k: (k, i, j, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, j, k: (k, i, j, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, j, k: (k, i, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((k_splits, b, g, rows, d), jnp.float32),
          jax.ShapeDtypeStruct((k_splits, b, g, rows), jnp.float32),
          jax.ShapeDtypeStruct((k_splits, b, g, rows), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_attention",
  )(*operands)
  # Merge the splits' partial softmaxes; a row with no keys (length 0) gets zeros.
  m_max = jnp.max(m, axis=0)
  w = jnp.exp(m - m_max[None])
  l_sum = jnp.sum(w * l, axis=0)
  return jnp.sum(w[..., None] * o, axis=0) / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "softcap",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_attention_rows(
    q_NxMxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    block_tables_NxT: jax.Array,
    positions_NxM: jax.Array,
    *,
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
    pages_per_block: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
  """Blocks of M query tokens of one sequence each -> [N, M, H, K] float32: token m of block n,
  at position positions[n, m] of the sequence whose pages are block_tables[n], attends over its
  keys at positions 0..its own (the cached prefix and the chunk up to itself: causal); position
  -1 is no token (output 0). The pages must already hold the block's own K/V.

  One program per (block, KV head): its rows are the block's (token, query head) pairs of that
  KV head, each with its own length, so the kernel is `paged_attention`'s with a length per row.
  """
  n, m, h, d = q_NxMxHxK.shape
  check_inputs(
      q_NxMxHxK[:, 0],
      k_pages_GxPxSxK,
      v_pages_GxPxSxK,
      block_tables_NxT,
      positions_NxM[:, 0],
      k_scales_GxPxS,
      v_scales_GxPxS,
  )
  if positions_NxM.shape != (n, m):
    raise ValueError(f"positions must be int32 [N={n}, M={m}]; got {tuple(positions_NxM.shape)}")
  g = k_pages_GxPxSxK.shape[0]
  r = h // g
  rows = max(MIN_ROWS, pl.next_power_of_2(m * r))
  q_NxGxMRxK = q_NxMxHxK.reshape(n, m, g, r, d).transpose(0, 2, 1, 3, 4).reshape(n, g, m * r, d)
  q_NxGxRowsxK = jnp.pad(q_NxGxMRxK, ((0, 0), (0, 0), (0, rows - m * r), (0, 0)))
  lengths_NxMR = jnp.repeat(positions_NxM + 1, r, axis=1)  # row (m, r): token m's keys
  pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - m * r)))
  o = _paged_call(
      q_NxGxRowsxK,
      k_pages_GxPxSxK,
      v_pages_GxPxSxK,
      block_tables_NxT,
      pad(lengths_NxMR),
      pad(first_slots(lengths_NxMR, window)),
      k_scales_GxPxS,
      v_scales_GxPxS,
      sm_scale=sm_scale,
      softcap=softcap,
      pages_per_block=pages_per_block,
      k_splits=1,
      num_warps=num_warps,
      num_stages=num_stages,
      interpret=interpret,
  )
  return o[:, :, : m * r].reshape(n, g, m, r, d).transpose(0, 2, 1, 3, 4).reshape(n, m, h, d)
