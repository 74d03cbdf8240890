"""Attention cores on one device behind one call; the backend is chosen by config.

Backends: `xla` (`jax.nn.dot_product_attention`'s XLA path, runs everywhere), `cudnn` (cuDNN
flash attention through `jax.nn.dot_product_attention`, CUDA GPUs only), `pallas` (our Pallas
flash attention, compiled on GPU, interpreted elsewhere), and `auto`, which picks the fastest
backend that can serve the call on the current platform: cudnn, then pallas, then xla on GPU;
xla elsewhere (interpreted Pallas is a correctness tool, not a fast path).

Paged attention has its own backends behind `paged_attention`: `xla` (the pure-JAX gather
reference: every query token gathers its whole sequence's pages), `pallas`
(`kernels_pallas.paged_attention`, compiled on GPU, interpreted elsewhere), `xla_ragged`
(`ragged_paged_attention`: one gather per block of a sequence's tokens, not per token),
`pallas_ragged` (the same blocks through `kernels_pallas.paged_attention_rows`, the paged kernel
with a length per query row: compiled on GPU, interpreted elsewhere), `cpu_ragged` (the same rows
through `kernels_cpu.paged_attention`, a C++ kernel called through XLA's FFI that reads the pages
in place: CPU only, float32, bfloat16 or int8 pools) and `auto` (pallas on GPU, xla elsewhere;
for a serving step whose tokens come grouped by sequence, `resolve_step_backend` takes
cpu_ragged on a CPU where the kernel builds and the pools are float32, bfloat16 or int8, else
xla_ragged, where auto gives xla). The per-token backends take a query per row and its block
table; the ragged ones take the tokens by sequence (`RaggedRows`).

Why blocks (measured on CPU, docs/serving.md "Prefill attention"): the per-token gather moves
T x N·S keys per layer, 5-10x the cost of the training forward on the same tokens for a
1,024-token chunk. `ragged_paged_attention` splits the tokens of each sequence into blocks of
up to `block` consecutive queries (sequences of one token, decode, get blocks of one) and
attends with a causal mask by position; the chunk's own keys are read back from the pages they
were just written to, so one softmax serves the cached prefix and the chunk alike (no separate
pass over the chunk's keys, and an 8-bit cache sees its own rounding exactly as the gather
reference does). The block count is static: ceil(T / block) + the rows that can hold two or
more tokens, plus one block per row for one-token rows, so shapes depend on (T, rows, pages)
only and the engine compiles no more programs than before.

Work follows the step's real tokens, not those static counts: each block reads only the
chunks of `key_chunk` keys (whole pages) that hold a key it sees, the pages up to its last
query's position, and an empty block reads none. These (block, key chunk) pairs, block-major,
run `pairs` at a time in a loop whose trip count is the step's (zero for a pass with no live
block), each round gathering its pairs' pages and folding each pair's partial softmax into its
block's running max, sum and output (FlashAttention's online softmax). A prompt's attention
is then about the causal triangle of its blocks and keys, where attending every block to the
whole page bucket cost up to 10x the step's real work.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_cpu import paged_attention as cpu_pa
from kernels_pallas import flash_attention as fa
from kernels_pallas import paged_attention as pa

BACKENDS = ("xla", "cudnn", "pallas", "auto")
PAGED_BACKENDS = ("xla", "pallas", "xla_ragged", "pallas_ragged", "cpu_ragged", "auto")
RAGGED_KERNELS = {"xla_ragged": "xla", "pallas_ragged": "pallas", "cpu_ragged": "cpu"}
_AUTO_ORDER_GPU = ("cudnn", "pallas", "xla")
KEY_CHUNK = 64  # keys per (block, key chunk) pair of ragged_paged_attention (whole pages)
ROUND_PAIRS = 32  # (block, key chunk) pairs per round of its loop


@functools.cache
def _gpu_major() -> int | None:
  """CUDA compute capability major version of device 0, or None off GPU."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", "0")
  return int(str(cc).split(".")[0])


def unsupported_reason(
    backend: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids=None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> str | None:
  """Why `backend` cannot serve these shapes and dtypes on this platform, or None if it can.

  Args:
    backend: one of `BACKENDS` but `'auto'`.
    q: queries, [B, L, H, K].
    k: keys, [B, L, G, K] (H a multiple of G).
    v: values, [B, L, G, K].
    segment_ids: [B, L] document ids of packed rows, or None.
    window: a sliding window (keys of the last `window` positions; 0: none), a Python int or a
      traced one (per layer).
    softcap: scores capped as c·tanh(s / c) (0: none).

  Returns:
    A sentence saying why, and what to use instead; None when `backend` can serve the call.

  Raises:
    ValueError: an unknown backend.
  """
  if q.shape[2] % k.shape[2]:
    return (
        f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}); "
        f"pick a KV head count that divides {q.shape[2]}"
    )
  head_dim, dtype = q.shape[-1], q.dtype
  if backend == "xla":
    return None
  if softcap:
    return f"takes no score soft-capping (softcap={softcap}); use 'xla'"
  if backend == "pallas" and not _static_zero(window):
    return "takes no sliding window; use 'xla'"
  if backend == "cudnn" and not isinstance(window, int):
    return "takes a sliding window fixed at trace time only, not one per layer; use 'xla'"
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


def _static_zero(window) -> bool:
  return isinstance(window, int) and window == 0


def resolve_backend(
    backend: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids=None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> str:
  """The concrete backend that will run: validates an explicit choice, resolves `'auto'`.

  `'auto'` takes the first of cudnn, pallas, xla that can serve the call on a GPU; xla
  elsewhere.

  Args:
    backend: one of `BACKENDS`.
    q: queries, [B, L, H, K].
    k: keys, [B, L, G, K].
    v: values, [B, L, G, K].
    segment_ids: [B, L] document ids of packed rows, or None.
    window: a sliding window, as `unsupported_reason` takes it.
    softcap: a score soft-cap, as `unsupported_reason` takes it.

  Returns:
    The backend's name: `'xla'`, `'cudnn'` or `'pallas'`.

  Raises:
    ValueError: an unknown backend, or one that cannot serve the call (the message says why).
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  why = lambda name: unsupported_reason(name, q, k, v, segment_ids, window, softcap)
  if backend == "auto":
    order = _AUTO_ORDER_GPU if _gpu_major() is not None else ("xla",)
    for name in order:
      if why(name) is None:
        return name
    raise ValueError(why("xla"))
  reason = why(backend)
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
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Scaled dot-product attention, `jax.nn.dot_product_attention` layout.

  K/V may have fewer heads than Q. The arrays are this device's whole sequence;
  `jaxpipe.models.attention.attention` is the layers' entry point, which adds Ulysses context
  parallelism and the serving KV-cache hook.

  Args:
    q_BxLxHxK: queries, [B, L, H, K] (H a multiple of G).
    k_BxLxGxK: keys, [B, L, G, K].
    v_BxLxGxK: values, [B, L, G, K].
    causal: a query sees keys at its own position and before only.
    backend: one of BACKENDS.
    segment_ids: [B, L] document ids of packed rows; attention stays inside each document.
    sm_scale: the scores' scale (default head_dim^-1/2).
    window: with causal, a query at i sees keys at i - window < j <= i only (transformers'
      sliding window); 0 sees every earlier key. A Python int, or a traced int32 scalar (a
      layer's own window inside a scan over layers).
    softcap: scores become softcap·tanh(s / softcap) before the mask and softmax (Gemma 2); 0
      leaves them.

  Returns:
    [B, L, H, K] in q's dtype.

  Raises:
    ValueError: an unknown backend, or one that cannot serve the call.
  """
  q, k, v = q_BxLxHxK, k_BxLxGxK, v_BxLxGxK
  name = resolve_backend(backend, q, k, v, segment_ids, window, softcap)
  if name == "pallas":
    return fa.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, segment_ids=segment_ids)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  if name == "xla" and (softcap or not isinstance(window, int)):
    return _masked_attention(q, k, v, causal, mask, sm_scale, window, softcap)
  local = None if _static_zero(window) else (window - 1, 0)
  return jax.nn.dot_product_attention(
      q,
      k,
      v,
      mask=mask,
      scale=sm_scale,
      is_causal=causal,
      local_window_size=local,
      implementation=name,
  )


def _masked_attention(q, k, v, causal, mask, sm_scale, window, softcap):
  """Attention written out for what `jax.nn.dot_product_attention` does not take: scores
  soft-capped, or a window known only when the program runs (one per layer)."""
  b, l, h, d = q.shape
  s, g = k.shape[1], k.shape[2]
  scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  q_BxLxGxRxK = q.reshape(b, l, g, h // g, d)
  scores = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  i_L, j_S = jnp.arange(l)[:, None], jnp.arange(s)[None, :]
  keep_LxS = jnp.ones((l, s), bool)
  if causal:
    keep_LxS = j_S <= i_L
    keep_LxS = keep_LxS & ((window <= 0) | (j_S > i_L - window))
  keep = keep_LxS[None, None, None]
  if mask is not None:  # [B, 1, L, S]
    keep = keep & mask[:, :, None]
  scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(scores, axis=-1)
  o_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", p.astype(v.dtype), v)
  return o_BxLxGxRxK.reshape(b, l, h, d).astype(q.dtype)


def resolve_paged_backend(backend: str, head_dim: int, page_size: int) -> str:
  """The concrete paged-attention backend for these pages.

  Validates the choice and resolves `'auto'`: the compiled kernel (`'pallas'`) on GPU when it
  serves the shapes, else `'xla'`.

  Args:
    backend: one of `PAGED_BACKENDS`.
    head_dim: K, the head dimension.
    page_size: S, tokens per page.

  Returns:
    The backend's name.

  Raises:
    ValueError: an unknown backend, or `'pallas'`/`'pallas_ragged'` on a GPU whose compiled
      kernel cannot serve these shapes.
  """
  if backend not in PAGED_BACKENDS:
    raise ValueError(f"unknown paged attention backend {backend!r}; choose one of {PAGED_BACKENDS}")
  reason = pa.compiled_unsupported(head_dim, page_size) if _gpu_major() is not None else None
  if backend == "auto":
    return "pallas" if _gpu_major() is not None and reason is None else "xla"
  if backend in ("pallas", "pallas_ragged") and reason is not None:
    raise ValueError(f"paged attention backend {backend!r} {reason}; use 'xla'")
  return backend


def _cpu_kernel_refuses(head_dim: int, kv_dtype) -> str | None:
  """Why the cpu_ragged backend does not take these pools on this platform, built or not."""
  if jax.default_backend() != "cpu":
    return f"runs on CPU only, and this process runs on {jax.default_backend()}"
  if jnp.dtype(kv_dtype) not in cpu_pa.POOL_DTYPES:
    return (
        f"reads float32, bfloat16 or int8 pools, not {jnp.dtype(kv_dtype).name} "
        "(--kv_cache_dtype auto or int8)"
    )
  if head_dim % cpu_pa.HEAD_DIM_MULTIPLE:
    return f"needs a head dim that is a multiple of {cpu_pa.HEAD_DIM_MULTIPLE}, not {head_dim}"
  return None


def cpu_kernel_unsupported(head_dim: int, kv_dtype) -> str | None:
  """Why the `cpu_ragged` backend cannot serve these pools here, or None when it can.

  Includes a kernel that cannot be built.

  Args:
    head_dim: K, the head dimension.
    kv_dtype: the K/V pools' dtype.

  Returns:
    A sentence saying why; None when the CPU kernel serves these pools on this platform.
  """
  return _cpu_kernel_refuses(head_dim, kv_dtype) or cpu_pa.unavailable()


@functools.cache
def _fall_back(reason: str) -> None:
  """Says once per process why a CPU serving step runs the XLA attention."""
  warnings.warn(
      f"paged attention: the CPU kernel is unavailable ({reason}); running xla_ragged",
      RuntimeWarning,
      stacklevel=3,
  )


def resolve_step_backend(backend: str, head_dim: int, page_size: int, kv_dtype=jnp.float32) -> str:
  """`resolve_paged_backend` for a serving step, whose tokens come grouped by sequence.

  `'auto'` takes a ragged backend where the per-token choice would be the xla gather:
  `cpu_ragged` when the CPU kernel serves these pools (`cpu_kernel_unsupported`: float32,
  bfloat16 or int8) and `xla_ragged` otherwise. A CPU kernel that fails to build is reported
  once per process (a `RuntimeWarning`).

  Args:
    backend: one of `PAGED_BACKENDS`.
    head_dim: K, the head dimension.
    page_size: S, tokens per page.
    kv_dtype: the K/V pools' dtype.

  Returns:
    The backend's name.

  Raises:
    ValueError: an unknown backend, one that cannot serve these pages, or `'cpu_ragged'` where
      the CPU kernel cannot serve these pools.
  """
  name = resolve_paged_backend(backend, head_dim, page_size)
  if name == "cpu_ragged" and (reason := cpu_kernel_unsupported(head_dim, kv_dtype)):
    raise ValueError(f"paged attention backend 'cpu_ragged' {reason}; use 'xla_ragged'")
  if backend != "auto" or name != "xla":
    return name
  if _cpu_kernel_refuses(head_dim, kv_dtype):  # not a CPU, an fp8 cache, another head dim
    return "xla_ragged"
  if (reason := cpu_pa.unavailable()) is not None:
    _fall_back(reason)  # no compiler or a failed build: worth saying
    return "xla_ragged"
  return "cpu_ragged"


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
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """One query token per row attending over its first `lengths[b]` paged keys.

  With a window, only the last `window` of them (`kernels_pallas.paged_attention`).

  Args:
    q_BxHxK: one query per row, [B, H, K].
    k_pages_GxPxSxK: the key pool, [G, P, S, K]: KV heads, pages, tokens per page, head dim.
    v_pages_GxPxSxK: the value pool, [G, P, S, K].
    block_tables_BxN: each row's pages, int32 [B, N].
    lengths_B: each row's number of keys, int32 [B].
    backend: one of `PAGED_BACKENDS` but the ragged ones.
    k_scales_GxPxS: per-slot scales of an 8-bit key pool, [G, P, S]; None: none.
    v_scales_GxPxS: per-slot scales of an 8-bit value pool, [G, P, S]; None: none.
    sm_scale: the scores' scale (default head_dim^-1/2).
    window: > 0: a row sees its last `window` keys only; 0: all of them.
    softcap: > 0: scores become softcap·tanh(s / softcap).

  Returns:
    [B, H, K], each row's attention output.

  Raises:
    ValueError: an unknown backend, one that cannot serve these pages, or a ragged backend
      (those take rows of tokens: `ragged_paged_attention`).
  """
  scales = dict(
      k_scales_GxPxS=k_scales_GxPxS,
      v_scales_GxPxS=v_scales_GxPxS,
      sm_scale=sm_scale,
      window=window,
      softcap=softcap,
  )
  args = (q_BxHxK, k_pages_GxPxSxK, v_pages_GxPxSxK, block_tables_BxN, lengths_B)
  _, _, page_size, head_dim = k_pages_GxPxSxK.shape
  name = resolve_paged_backend(backend, head_dim, page_size)
  if name in RAGGED_KERNELS:
    raise ValueError(f"backend {name!r} takes rows of tokens: call ragged_paged_attention")
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
  """Block counts that always cover T tokens in at most `num_rows` rows.

  Args:
    num_tokens: T, the step's tokens.
    num_rows: the step's rows (sequences).
    block: queries per multi-token block (capped at T).

  Returns:
    `(one-query blocks, block-query blocks)`: `min(rows, T)`, and `ceil(T / block)` plus the
    rows that can hold two or more tokens.
  """
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
    q_TxHxK,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    tables_NBxN,
    index_NBxQ,
    pos_NBxQ,
    sm_scale,
    *,
    key_chunk: int = KEY_CHUNK,
    pairs: int = ROUND_PAIRS,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
):
  """Each block's queries over its sequence's pages, key position <= query position (and >
  query position - window with a window) -> [NB, Q, H, K] float32 (a query at position -1 sees
  no key; its output is finite and dropped). Scores soft-capped with softcap > 0.

  Work is spent on (block, key chunk) pairs that hold a visible key only: a block whose queries
  are at positions p0 .. p reads the chunks of `key_chunk` keys (whole pages) from the one of
  p0 - window + 1 (0 without a window) up to p, and an empty block (count 0) reads none. The
  pairs, block-major, run `pairs` at a time (default `ROUND_PAIRS`) in a loop whose trip count
  is the step's: each round gathers its chunks' pages, attends, and folds the partial softmax of
  each pair into its block's running max, sum and output (an online softmax, FlashAttention's
  merge)."""
  nb, q = index_NBxQ.shape
  _, h, d = q_TxHxK.shape
  g, _, s, _ = k_pages.shape
  n = tables_NBxN.shape[1]
  c = max(1, min(n, key_chunk // s))  # pages per chunk
  lc = c * s
  pairs = max(1, min(pairs, nb * -(-n // c)))
  last_NB = jnp.max(pos_NBxQ, axis=1)  # -1: an empty block
  w = jnp.asarray(window, jnp.int32)
  lowest_NB = jnp.min(jnp.where(pos_NBxQ >= 0, pos_NBxQ, last_NB[:, None]), axis=1)
  from_NB = jnp.where(w > 0, jnp.maximum(lowest_NB - w + 1, 0), 0) // lc  # each block's 1st chunk
  chunks_NB = jnp.where(last_NB >= 0, last_NB // lc + 1 - from_NB, 0)
  end_NB = jnp.cumsum(chunks_NB)
  total = end_NB[-1]
  q_f32 = q_TxHxK.astype(jnp.float32)
  hp = jax.lax.Precision.HIGHEST

  def gather(pool, scales, pages_PxC, keys_minor=False):
    """-> [P, G, C*S, K] float32, or [P, G, K, C*S] with keys_minor."""
    x = pool[:, pages_PxC].astype(jnp.float32)  # [G, P, C, S, K]
    if scales is not None:
      x = x * scales[:, pages_PxC][..., None]
    if keys_minor:
      return jnp.transpose(x, (1, 0, 4, 2, 3)).reshape(pairs, g, d, lc)
    return jnp.swapaxes(x, 0, 1).reshape(pairs, g, lc, d)

  def round_(i, state):
    m_NBxGxRxQ, l_NBxGxRxQ, o_NBxGxRxQxK = state
    j_P = i * pairs + jnp.arange(pairs)
    live_P = j_P < total
    blk_P = jnp.minimum(jnp.searchsorted(end_NB, j_P, side="right"), nb - 1)
    chunk_P = from_NB[blk_P] + j_P - (end_NB - chunks_NB)[blk_P]
    col_PxC = chunk_P[:, None] * c + jnp.arange(c)
    pages_PxC = jnp.take_along_axis(tables_NBxN[blk_P], jnp.minimum(col_PxC, n - 1), axis=1)
    key_PxL = (col_PxC[:, :, None] * s + jnp.arange(s)).reshape(pairs, lc)
    pos_PxQ = pos_NBxQ[blk_P]
    visible_PxQxL = (key_PxL[:, None, :] <= pos_PxQ[:, :, None]) & live_P[:, None, None]
    in_window = (w <= 0) | (key_PxL[:, None, :] > pos_PxQ[:, :, None] - w)
    visible_PxQxL = visible_PxQxL & in_window  # the keys before a window may be another's
    keyed_PxL = jnp.any(visible_PxQxL, axis=1)  # stale slots past every query may hold NaN
    v_PxGxLxK = jnp.where(keyed_PxL[:, None, :, None], gather(v_pages, v_scales, pages_PxC), 0.0)
    q_PxQxHxK = q_f32[jnp.maximum(index_NBxQ[blk_P], 0)]
    q_PxGxRxQxK = q_PxQxHxK.reshape(pairs, q, g, h // g, d).transpose(0, 2, 3, 1, 4)
    if q == 1:  # a matrix-vector product per pair: multiply and sum over K, keys minor
      k_PxGxKxL = gather(k_pages, k_scales, pages_PxC, keys_minor=True)
      s_PxGxRxL = jnp.sum(q_PxGxRxQxK[:, :, :, 0, :, None] * k_PxGxKxL[:, :, None], axis=-2)
      s_PxGxRxQxL = s_PxGxRxL[:, :, :, None]
    else:
      k_PxGxLxK = gather(k_pages, k_scales, pages_PxC)
      s_PxGxRxQxL = jnp.einsum("pgrqk,pglk->pgrql", q_PxGxRxQxK, k_PxGxLxK, precision=hp)
    s_PxGxRxQxL = s_PxGxRxQxL * sm_scale
    if softcap:
      s_PxGxRxQxL = softcap * jnp.tanh(s_PxGxRxQxL / softcap)
    s_PxGxRxQxL = jnp.where(visible_PxQxL[:, None, None], s_PxGxRxQxL, pa.MASK_VALUE)
    m_PxGxRxQ = jnp.max(s_PxGxRxQxL, axis=-1)
    e_PxGxRxQxL = jnp.exp(s_PxGxRxQxL - m_PxGxRxQ[..., None])
    l_PxGxRxQ = jnp.sum(e_PxGxRxQxL, axis=-1)
    if q == 1:
      o_PxGxRxK = jnp.einsum("pgrl,pglk->pgrk", e_PxGxRxQxL[:, :, :, 0], v_PxGxLxK, precision=hp)
      o_PxGxRxQxK = o_PxGxRxK[:, :, :, None]
    else:
      o_PxGxRxQxK = jnp.einsum("pgrql,pglk->pgrqk", e_PxGxRxQxL, v_PxGxLxK, precision=hp)
    # The round's pairs are consecutive, so their blocks lie in the window b0 .. b0 + pairs - 1:
    # only the window's running state is read and written.
    b0 = blk_P[0]
    at_P = jnp.where(live_P, blk_P - b0, pairs)  # pairs: dropped
    window = lambda x: jax.lax.dynamic_slice_in_dim(x, b0, pairs)
    m_W, l_W, o_W = window(m_NBxGxRxQ), window(l_NBxGxRxQ), window(o_NBxGxRxQxK)
    new_m_W = m_W.at[at_P].max(m_PxGxRxQ, mode="drop")
    alpha_W = jnp.exp(m_W - new_m_W)
    beta_P = jnp.exp(m_PxGxRxQ - new_m_W[jnp.minimum(at_P, pairs - 1)])
    l_W = (l_W * alpha_W).at[at_P].add(l_PxGxRxQ * beta_P, mode="drop")
    o_W = (o_W * alpha_W[..., None]).at[at_P].add(o_PxGxRxQxK * beta_P[..., None], mode="drop")
    put = lambda x, w: jax.lax.dynamic_update_slice_in_dim(x, w, b0, 0)
    return put(m_NBxGxRxQ, new_m_W), put(l_NBxGxRxQ, l_W), put(o_NBxGxRxQxK, o_W)

  shape = (nb + pairs, g, h // g, q)  # padded: every window lies inside
  state = (
      jnp.full(shape, pa.MASK_VALUE, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros((*shape, d), jnp.float32),
  )
  _, l_NBxGxRxQ, o_NBxGxRxQxK = jax.lax.fori_loop(0, -(-total // pairs), round_, state)
  l_NBxGxRxQ, o_NBxGxRxQxK = l_NBxGxRxQ[:nb], o_NBxGxRxQxK[:nb]
  o_NBxGxRxQxK = o_NBxGxRxQxK / jnp.where(l_NBxGxRxQ > 0, l_NBxGxRxQ, 1.0)[..., None]
  return o_NBxGxRxQxK.transpose(0, 3, 1, 2, 4).reshape(nb, q, h, d)


def ragged_paged_attention(
    q_TxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    rows: RaggedRows,
    *,
    block: int = 32,
    key_chunk: int = KEY_CHUNK,
    pairs: int = ROUND_PAIRS,
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
    sm_scale: float | None = None,
    kernel: str = "xla",
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Each token of `rows` over its sequence's keys at positions 0..its own.

  The pages must already hold this step's K/V (the caller writes them first). Equals
  `paged_attention_reference` per token with its sequence's table and length position + 1.

  Args:
    q_TxHxK: the step's queries, [T, H, K] (H a multiple of G).
    k_pages_GxPxSxK: the key pool, [G, P, S, K].
    v_pages_GxPxSxK: the value pool, [G, P, S, K].
    rows: the tokens grouped by sequence (`RaggedRows`).
    block: queries per block of a sequence's consecutive tokens.
    key_chunk: keys per (block, key chunk) pair (whole pages).
    pairs: (block, key chunk) pairs per round of the loop.
    k_scales_GxPxS: per-slot scales of an 8-bit key pool, [G, P, S]; None: none.
    v_scales_GxPxS: per-slot scales of an 8-bit value pool, [G, P, S]; None: none.
    sm_scale: the scores' scale (default head_dim^-1/2).
    kernel: `'xla'` (`_block_attention`'s (block, key chunk) pairs), `'pallas'` (each block
      through `kernels_pallas.paged_attention_rows`; interpreted off GPU) or `'cpu'` (the rows
      through `kernels_cpu.paged_attention`: CPU, float32, bfloat16 or int8 pools; `block`,
      `key_chunk` and `pairs` unused).
    window: > 0, a token at position p sees the keys at p - window + 1 .. p only (a traced int32
      may vary by layer), and no kernel reads the pages before them.
    softcap: > 0, scores become softcap·tanh(s / softcap).

  Returns:
    [T, H, K] in q's dtype; 0 for padding tokens that no row covers.

  Raises:
    ValueError: an unknown `kernel`, or H not a multiple of G.
  """
  if kernel not in ("xla", "pallas", "cpu"):
    raise ValueError(f"kernel={kernel!r} is not 'xla', 'pallas' or 'cpu'")
  q_TxHxK, k_pages_GxPxSxK, v_pages_GxPxSxK = map(
      jnp.asarray, (q_TxHxK, k_pages_GxPxSxK, v_pages_GxPxSxK)
  )
  rows = RaggedRows(*(jnp.asarray(x, jnp.int32) for x in rows))
  t, h, d = q_TxHxK.shape
  g, _, s, _ = k_pages_GxPxSxK.shape
  if h % g:
    raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({g})")
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  if kernel == "cpu":
    o_TxHxK = cpu_pa.ragged_paged_attention(
        q_TxHxK,
        k_pages_GxPxSxK,
        v_pages_GxPxSxK,
        *rows,
        sm_scale=sm_scale,
        k_scales_GxPxS=k_scales_GxPxS,
        v_scales_GxPxS=v_scales_GxPxS,
        window=window,
        softcap=softcap,
    )
    return o_TxHxK.astype(q_TxHxK.dtype)
  b = rows.counts_B.shape[0]
  block = max(1, min(block, t))
  ones, blocks = ragged_blocks(t, b, block)
  if block == 1:  # one layout serves every row
    passes = ((1, t, rows.counts_B > 0),)
  else:
    passes = ((1, ones, rows.counts_B == 1), (block, blocks, rows.counts_B > 1))

  def attend(o_TxHxK, size, count, take_B):
    row_NB, index_NBxQ, pos_NBxQ = _layout(rows, take_B, size, count)
    if kernel == "pallas":
      o_NBxQxHxK = pa.paged_attention_rows(
          q_TxHxK[jnp.maximum(index_NBxQ, 0)],
          k_pages_GxPxSxK,
          v_pages_GxPxSxK,
          rows.tables_BxN[row_NB],
          pos_NBxQ,
          k_scales_GxPxS=k_scales_GxPxS,
          v_scales_GxPxS=v_scales_GxPxS,
          sm_scale=sm_scale,
          window=window,
          softcap=softcap,
          interpret=_gpu_major() is None,
      )
    else:
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
          key_chunk=key_chunk,
          pairs=pairs,
          window=window,
          softcap=softcap,
      )
    at_NBxQ = jnp.where(index_NBxQ >= 0, index_NBxQ, t)  # t: dropped
    return o_TxHxK.at[at_NBxQ].set(o_NBxQxHxK, mode="drop")

  o_TxHxK = jnp.zeros((t, h, d), jnp.float32)
  for size, count, take_B in passes:
    # A pass none of whose rows has a token (the multi-token pass of a decode step) is skipped
    # whole: its blocks' state alone is [blocks, heads, block, K] floats to initialise.
    o_TxHxK = jax.lax.cond(
        jnp.any(take_B),
        functools.partial(attend, size=size, count=count, take_B=take_B),
        lambda o: o,
        o_TxHxK,
    )
  return o_TxHxK.astype(q_TxHxK.dtype)
