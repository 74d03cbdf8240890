"""Flash attention as Pallas (Triton-lowering) GPU kernels, forward and backward, and a reference.

Layout is that of `jax.nn.dot_product_attention`: q `[B, L, H, K]`, k/v `[B, S, G, K]` with
H a multiple of G (grouped-query heads: query head h reads KV head h // (H // G); repeated
K/V are never materialised, the kernels index the shared KV head instead).

Forward: one program per (q block, batch, head) streams KV blocks with an online softmax and
keeps the log-sum-exp (base 2) as the residual. Backward: a dK/dV kernel per (KV block, batch,
KV head) that walks every query head of its group, and a dQ kernel per (q block, batch, head).
Sequences that are not a multiple of the block are padded outside the kernels and masked
inside; head dims are padded to a power of two (zeros do not change q.k and are cut off).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite so that a fully masked row never computes -inf - (-inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # Triton's smallest dot tile.


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one kernel launch (hashable: it is a custom_vjp nondiff arg)."""

  causal: bool
  sm_scale: float
  q_len: int  # unpadded query length
  kv_len: int  # unpadded key/value length
  head_dim: int  # unpadded head dim
  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  block_q_dq: int
  block_k_dq: int
  has_segments: bool
  interpret: bool
  num_warps: int | None
  num_stages: int


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _effective_block(block: int, length: int, name: str) -> int:
  if block < MIN_BLOCK or block & (block - 1):
    raise ValueError(f"{name}={block} must be a power of two >= {MIN_BLOCK}; e.g. {name}=64")
  # A block longer than the (power-of-two rounded) sequence only adds padding.
  return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def _dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
  """2-D matmul accumulating in float32; full precision for float32 operands (no TF32)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(
    cfg: _Config, q_start, k_start, block_q: int, block_k: int, q_seg, kv_seg, kv_padded: bool
):
  """Boolean [block_q, block_k] of allowed (query, key) pairs, or None when all are allowed."""
  mask = None
  span_q = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  span_k = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  if cfg.causal:
    mask = span_q >= span_k
  if kv_padded:
    valid = span_k < cfg.kv_len
    mask = valid if mask is None else mask & valid
  if q_seg is not None:
    same = q_seg[:, None] == kv_seg[None, :]
    mask = same if mask is None else mask & same
  return mask


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Config, kv_padded: bool):
  if cfg.has_segments:
    qseg_ref, kvseg_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  block_q, block_k = cfg.block_q, cfg.block_k
  padded_kv_len, head_dim_p = k_ref.shape
  num_k = padded_kv_len // block_k
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  q_seg = qseg_ref[...] if cfg.has_segments else None
  scale = cfg.sm_scale * LOG2E

  def body(j, carry):
    acc, m_prev, l_prev = carry
    k_start = j * block_k
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    s = _dot(q, k, trans_b=True) * scale
    kv_seg = kvseg_ref[pl.ds(k_start, block_k)] if cfg.has_segments else None
    mask = _mask(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, kv_padded)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    if mask is not None:
      p = jnp.where(mask, p, 0.0)  # a row masked so far keeps l = 0, not a count of masked keys
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  if cfg.causal:
    hi = jnp.minimum(lax.div(q_start + block_q + block_k - 1, block_k), num_k)
  else:
    hi = num_k
  acc = jnp.zeros((block_q, head_dim_p), jnp.float32)
  m = jnp.full((block_q,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  acc, m, l = lax.fori_loop(0, hi, body, (acc, m, l))
  l_safe = jnp.where(l == 0.0, 1.0, l)  # fully masked rows give 0, not NaN
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l_safe)


def _fwd(q, k, v, q_seg, kv_seg, cfg: _Config):
  """Padded inputs -> (out [B, Lp, H, Kp], lse2 [B, H, Lp] float32, base-2 log-sum-exp)."""
  batch, q_len_p, heads, head_dim_p = q.shape
  kv_len_p, kv_heads = k.shape[1], k.shape[2]
  rep = heads // kv_heads
  grid = (q_len_p // cfg.block_q, batch, heads)
  in_specs = [
      pl.BlockSpec((None, cfg.block_q, None, head_dim_p), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, kv_len_p, None, head_dim_p), lambda i, b, h: (b, 0, h // rep, 0)),
      pl.BlockSpec((None, kv_len_p, None, head_dim_p), lambda i, b, h: (b, 0, h // rep, 0)),
  ]
  args = [q, k, v]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, cfg.block_q), lambda i, b, h: (b, i)),
        pl.BlockSpec((None, kv_len_p), lambda i, b, h: (b, 0)),
    ]
    args += [q_seg, kv_seg]
  num_warps = cfg.num_warps or (4 if head_dim_p <= 64 else 8)
  out, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, kv_padded=kv_len_p != cfg.kv_len),
      grid=grid,
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, cfg.block_q, None, head_dim_p), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, cfg.block_q), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct((batch, heads, q_len_p), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(*args)
  return out, lse


# ----------------------------------------------------------------------------- backward


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config, rep: int, kv_padded: bool
):
  if cfg.has_segments:
    qseg_ref, kvseg_ref, dk_ref, dv_ref = refs
  else:
    dk_ref, dv_ref = refs
  block_q, block_k = cfg.block_q_dkv, cfg.block_k_dkv
  head_dim_p = k_ref.shape[-1]
  q_len_p = q_ref.shape[0]
  num_q = q_len_p // block_q
  k_start = pl.program_id(0) * block_k
  k = k_ref[...]
  v = v_ref[...]
  kv_seg = kvseg_ref[...] if cfg.has_segments else None
  scale = cfg.sm_scale * LOG2E
  lo = lax.div(k_start, block_q) if cfg.causal else 0
  dk = jnp.zeros((block_k, head_dim_p), jnp.float32)
  dv = jnp.zeros((block_k, head_dim_p), jnp.float32)
  # The query heads sharing this KV head sit side by side in the last axis of q/do
  # (a free reshape of [.., H, K] to [.., G, H/G * K]); a static loop keeps every slice static.
  for r in range(rep):
    cols = pl.ds(r * head_dim_p, head_dim_p)

    def body(i, carry, r=r, cols=cols):
      dk, dv = carry
      q_start = i * block_q
      rows = pl.ds(q_start, block_q)
      q = q_ref[rows, cols]
      do = do_ref[rows, cols]
      lse = lse_ref[pl.ds(r * q_len_p + q_start, block_q)]
      delta = delta_ref[pl.ds(r * q_len_p + q_start, block_q)]
      s = _dot(q, k, trans_b=True) * scale
      q_seg = qseg_ref[rows] if cfg.has_segments else None
      mask = _mask(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, kv_padded)
      p = jnp.exp2(s - lse[:, None])
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
      dp = _dot(do, v, trans_b=True)
      ds = p * (dp - delta[:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
      return dk, dv

    dk, dv = lax.fori_loop(lo, num_q, body, (dk, dv))
  dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config, kv_padded: bool
):
  if cfg.has_segments:
    qseg_ref, kvseg_ref, dq_ref = refs
  else:
    (dq_ref,) = refs
  block_q, block_k = cfg.block_q_dq, cfg.block_k_dq
  padded_kv_len, head_dim_p = k_ref.shape
  num_k = padded_kv_len // block_k
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_seg = qseg_ref[...] if cfg.has_segments else None
  scale = cfg.sm_scale * LOG2E

  def body(j, dq):
    k_start = j * block_k
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    s = _dot(q, k, trans_b=True) * scale
    kv_seg = kvseg_ref[pl.ds(k_start, block_k)] if cfg.has_segments else None
    mask = _mask(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, kv_padded)
    p = jnp.exp2(s - lse[:, None])
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  if cfg.causal:
    hi = jnp.minimum(lax.div(q_start + block_q + block_k - 1, block_k), num_k)
  else:
    hi = num_k
  dq = lax.fori_loop(0, hi, body, jnp.zeros((block_q, head_dim_p), jnp.float32))
  dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _bwd(q, k, v, q_seg, kv_seg, out, lse, do, cfg: _Config):
  batch, q_len_p, heads, head_dim_p = q.shape
  kv_len_p, kv_heads = k.shape[1], k.shape[2]
  rep = heads // kv_heads
  kv_padded = kv_len_p != cfg.kv_len
  # delta_i = sum_k dO_ik O_ik, the row term of softmax's Jacobian; XLA fuses it.
  delta = jnp.einsum("blhk,blhk->bhl", out.astype(jnp.float32), do.astype(jnp.float32))
  compiler_params = plgpu.CompilerParams(num_warps=cfg.num_warps or 4, num_stages=cfg.num_stages)

  # dK, dV: one program per (KV block, batch, KV head); q/do viewed as [B, Lp, G, rep*Kp].
  q_g = q.reshape(batch, q_len_p, kv_heads, rep * head_dim_p)
  do_g = do.reshape(batch, q_len_p, kv_heads, rep * head_dim_p)
  lse_g = lse.reshape(batch, kv_heads, rep * q_len_p)
  delta_g = delta.reshape(batch, kv_heads, rep * q_len_p)
  bk = cfg.block_k_dkv
  qg_spec = pl.BlockSpec((None, q_len_p, None, rep * head_dim_p), lambda j, b, g: (b, 0, g, 0))
  kv_spec = pl.BlockSpec((None, bk, None, head_dim_p), lambda j, b, g: (b, j, g, 0))
  row_spec = pl.BlockSpec((None, None, rep * q_len_p), lambda j, b, g: (b, g, 0))
  in_specs = [qg_spec, kv_spec, kv_spec, qg_spec, row_spec, row_spec]
  args = [q_g, k, v, do_g, lse_g, delta_g]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, q_len_p), lambda j, b, g: (b, 0)),
        pl.BlockSpec((None, bk), lambda j, b, g: (b, j)),
    ]
    args += [q_seg, kv_seg]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, rep=rep, kv_padded=kv_padded),
      grid=(kv_len_p // bk, batch, kv_heads),
      in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=cfg.interpret,
      name="flash_attention_dkv",
  )(*args)

  # dQ: one program per (q block, batch, head), streaming the KV blocks it can see.
  bq = cfg.block_q_dq
  q_spec = pl.BlockSpec((None, bq, None, head_dim_p), lambda i, b, h: (b, i, h, 0))
  kv_full = pl.BlockSpec((None, kv_len_p, None, head_dim_p), lambda i, b, h: (b, 0, h // rep, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  in_specs = [q_spec, kv_full, kv_full, q_spec, row, row]
  args = [q, k, v, do, lse, delta]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        pl.BlockSpec((None, kv_len_p), lambda i, b, h: (b, 0)),
    ]
    args += [q_seg, kv_seg]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, kv_padded=kv_padded),
      grid=(q_len_p // bq, batch, heads),
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params,
      interpret=cfg.interpret,
      name="flash_attention_dq",
  )(*args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg: _Config):
  return _fwd(q, k, v, q_seg, kv_seg, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg: _Config):
  out, lse = _fwd(q, k, v, q_seg, kv_seg, cfg)
  return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(cfg: _Config, res, do):
  q, k, v, q_seg, kv_seg, out, lse = res
  dq, dk, dv = _bwd(q, k, v, q_seg, kv_seg, out, lse, do, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public entry


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """Raises ValueError naming the first shape or dtype the Pallas kernels cannot serve."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"q, k, v must be [batch, seq, heads, head_dim]; got shapes "
        f"{q.shape}, {k.shape}, {v.shape}"
    )
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} must agree in batch and head_dim")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
        f"({k.shape[2]}); pick a KV head count that divides {q.shape[2]}"
    )
  if q.shape[3] > MAX_HEAD_DIM:
    raise ValueError(
        f"head_dim {q.shape[3]} exceeds the Pallas kernel's limit {MAX_HEAD_DIM}; "
        f"use backend='xla' or a smaller head dim"
    )
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if not any(q.dtype == d for d in SUPPORTED_DTYPES):
    raise ValueError(
        f"dtype {q.dtype} is not supported by the Pallas kernel; "
        f"cast to float32, bfloat16 or float16"
    )


def flash_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    interpret: bool | None = None,
    block_q: int = 128,
    block_k: int = 64,
    block_q_dkv: int = 64,
    block_k_dkv: int = 64,
    block_q_dq: int = 64,
    block_k_dq: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
  """Softmax(q k^T * sm_scale [masked]) v, fused; differentiable in q, k, v.

  segment_ids: int [B, L] for self-attention (query i sees key j only when their ids are
  equal; give padding its own id), or a pair (q_ids [B, L], kv_ids [B, S]). A query row that
  sees no key returns zeros. interpret=None runs the kernels compiled on GPU and in the Pallas
  interpreter elsewhere.
  """
  q, k, v = q_BxLxHxK, k_BxSxGxK, v_BxSxGxK
  check_inputs(q, k, v)
  batch, q_len, _, head_dim = q.shape
  kv_len = k.shape[1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  blocks = dict(
      block_q=_effective_block(block_q, q_len, "block_q"),
      block_k=_effective_block(block_k, kv_len, "block_k"),
      block_q_dkv=_effective_block(block_q_dkv, q_len, "block_q_dkv"),
      block_k_dkv=_effective_block(block_k_dkv, kv_len, "block_k_dkv"),
      block_q_dq=_effective_block(block_q_dq, q_len, "block_q_dq"),
      block_k_dq=_effective_block(block_k_dq, kv_len, "block_k_dq"),
  )
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    if q_seg.shape != (batch, q_len) or kv_seg.shape != (batch, kv_len):
      raise ValueError(
          f"segment_ids must be [batch, seq] = {(batch, q_len)} for queries and "
          f"{(batch, kv_len)} for keys; got {q_seg.shape} and {kv_seg.shape}"
      )
  cfg = _Config(
      causal=causal,
      sm_scale=float(sm_scale),
      q_len=q_len,
      kv_len=kv_len,
      head_dim=head_dim,
      has_segments=segment_ids is not None,
      interpret=bool(interpret),
      num_warps=num_warps,
      num_stages=num_stages,
      **blocks,
  )

  # Pad sequences to a multiple of every block on that axis (all powers of two: the largest),
  # and the head dim to a power of two; the kernels mask padded keys, padded queries are cut.
  q_len_p = _round_up(q_len, max(cfg.block_q, cfg.block_q_dkv, cfg.block_q_dq))
  kv_len_p = _round_up(kv_len, max(cfg.block_k, cfg.block_k_dkv, cfg.block_k_dq))
  head_dim_p = max(MIN_BLOCK, pl.next_power_of_2(head_dim))
  pad_q = ((0, 0), (0, q_len_p - q_len), (0, 0), (0, head_dim_p - head_dim))
  pad_kv = ((0, 0), (0, kv_len_p - kv_len), (0, 0), (0, head_dim_p - head_dim))
  if any(p != (0, 0) for p in pad_q):
    q = jnp.pad(q, pad_q)
  if any(p != (0, 0) for p in pad_kv):
    k, v = jnp.pad(k, pad_kv), jnp.pad(v, pad_kv)
  if q_seg is not None:
    q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, q_len_p - q_len)), constant_values=-1)
    kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, kv_len_p - kv_len)), constant_values=-2)
  out = _flash(q, k, v, q_seg, kv_seg, cfg)
  return out[:, :q_len, :, :head_dim]


# ----------------------------------------------------------------------------- reference


def attention_reference(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Dense pure-JAX attention with the same semantics (float32 softmax, empty rows give 0)."""
  q, k, v = q_BxLxHxK, k_BxSxGxK, v_BxSxGxK
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  q_BxLxGxRxK = q.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
  s_BxGxRxLxS = (
      jnp.einsum(
          "blgrk,bsgk->bgrls",
          q_BxLxGxRxK,
          k,
          preferred_element_type=jnp.float32,
          precision=lax.Precision.HIGHEST,
      )
      * sm_scale
  )
  mask_BxLxS = jnp.ones((batch, q_len, kv_len), bool)
  if causal:
    mask_BxLxS &= jnp.tril(jnp.ones((q_len, kv_len), bool))[None]
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    mask_BxLxS &= q_seg[:, :, None] == kv_seg[:, None, :]
  mask = mask_BxLxS[:, None, None]
  s_BxGxRxLxS = jnp.where(mask, s_BxGxRxLxS, -jnp.inf)
  m = jnp.max(s_BxGxRxLxS, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s_BxGxRxLxS - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum(
      "bgrls,bsgk->blgrk",
      p.astype(v.dtype),
      v,
      preferred_element_type=jnp.float32,
      precision=lax.Precision.HIGHEST,
  )
  return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)
