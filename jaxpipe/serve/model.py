"""The model over a paged KV cache: the training layers, with attention reading K/V through pages.

Nothing here re-implements a layer: each decoder layer is `transformer.Block` applied to the
training parameter dict, inside `attention.kv_cache(hook)`, so that its attention core hands the
new (rotated) keys and values to the hook, which writes them into their pages and attends over
every cached key of the token's sequence.

A step is one flat batch of T tokens from any number of sequences (prefill chunks and decode
tokens alike): token t has its position, the cache slot it writes (page * page_size + offset)
and its sequence's block table; it sees the keys at positions 0..position of that sequence,
which is causal attention. Padding tokens write the scratch page. The batch also says which
tokens belong to which sequence (`TokenBatch.seq_*`, one row per sequence, its tokens
contiguous), for the ragged backends (`RAGGED_BACKENDS`), which read a sequence's pages once per
block of its tokens rather than once per token (`ops.attention.ragged_paged_attention`):
`cpu_ragged`, the C++ kernel, is auto's choice on CPU, `xla_ragged` where it cannot run.

The pools of all layers share two arrays `[G, pages, page, K]`: layer l's pool is the P pages
from its offset (l*P when every layer keeps every page), itself in the `[kv_heads, num_pages,
page_size, head_dim]` layout of the kernel, so a layer's attention needs no copy of its pool
(its block tables are offset instead).

Sliding-window layers need only the keys of their window. Given `window_pages` (> 0), each of
them takes that many pages after the full-attention layers' (`KVPages.offsets`), and a sequence
holds a ring of pages there (`TokenBatch.ring_*`): position p lives in the ring's page
(p // page) mod R, so that writing a token overwrites one a window and a step's chunk before it,
which no query of the step sees. Layers' pools are thus sized by the window and the chunk, not
by the context (`ring_pages`).

An 8-bit cache (`kv_cache_dtype` "int8" or "fp8", float8_e4m3fn) halves the pools against
bfloat16 (a quarter against float32): each (KV head, slot) is stored scaled by its absolute
maximum over head_dim onto the 8-bit range, with that float32 scale beside it in `k_scales` /
`v_scales [G, n_layers * P, page]` (the kernel's layout: value = stored * scale). A token is
quantised once, as it is written; attention dequantises on the fly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.models import attention as attention_lib
from jaxpipe.models import rope as rope_lib
from jaxpipe.models import transformer
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.ops.attention import (
    RAGGED_KERNELS,
    RaggedRows,
    paged_attention,
    ragged_paged_attention,
    resolve_paged_backend,
    resolve_step_backend,
)
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.serve import speculative
from jaxpipe.serve.sampling import SamplingBatch, sample, top_logprobs

KV_AXIS = "kv"  # the engine's mesh axis; the pools' KV heads are split over it
# A bfloat16 pool is held as its bits, at rest and in a step: XLA:CPU widens a bfloat16 scatter
# (and a bfloat16 operand of a custom call in a loop) to float32 copies of the whole pool, every
# layer, where it updates uint16 ones in place; and a conversion at a step's edges copies the
# whole pool (four copies a step: 200 ms of a 350 ms decode step at SmolLM2-135M's shape).
BITS = jnp.uint16
NAN_BITS = 0x7FC0  # a bfloat16 NaN's bits
RAGGED_BLOCK = 32  # queries per block of a multi-token row (`ragged_paged_attention`'s default)
RAGGED_BACKENDS = tuple(RAGGED_KERNELS)  # the backends that read TokenBatch.seq_*


@flax.struct.dataclass
class KVPages:
  """K and V pools of every layer: a full-attention layer owns `num_pages` pages, a ring layer
  (sliding window, `ring_layers`) `window_pages`, each layer's from its `offsets` entry."""

  # [G, pages of every layer, page_size, head_dim]; a bfloat16 pool is held as its bits (BITS)
  k: jax.Array
  v: jax.Array
  num_pages: int = flax.struct.field(pytree_node=False)  # pages per layer, scratch page 0 included
  k_scales: jax.Array | None = None  # float32 [G, pages of every layer, page_size]; 8-bit pools
  v_scales: jax.Array | None = None
  window_pages: int = flax.struct.field(pytree_node=False, default=0)  # per ring layer
  ring_layers: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

  @property
  def pools(self) -> tuple:
    """(k, v, k_scales, v_scales): what a layer reads and writes."""
    return self.k, self.v, self.k_scales, self.v_scales

  @property
  def dtype(self):
    """The values' dtype: bfloat16 for pools held as their bits."""
    return jnp.dtype(jnp.bfloat16) if self.k.dtype == BITS else self.k.dtype

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @property
  def n_layers(self) -> int:
    rings = len(self.ring_layers)
    return (self.k.shape[1] - rings * self.window_pages) // self.num_pages + rings

  @property
  def layout(self) -> PoolLayout:
    return PoolLayout(self.n_layers, self.num_pages, self.window_pages, self.ring_layers)

  def with_pools(self, k, v, k_scales=None, v_scales=None) -> KVPages:
    """The same layout over other pools.

    Args:
      k: the K pool [G, pages of every layer, page_size, head_dim].
      v: the V pool, shaped as k.
      k_scales: float32 [G, pages of every layer, page_size] of an 8-bit cache, else None.
      v_scales: the same for V.

    Returns:
      The `KVPages`.
    """
    return self.replace(k=k, v=v, k_scales=k_scales, v_scales=v_scales)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Where each layer's pages lie in the pools: full-attention layers first, `num_pages` each,
  then the ring layers, `window_pages` each."""

  n_layers: int
  num_pages: int
  window_pages: int = 0
  ring_layers: tuple[int, ...] = ()

  @property
  def ring(self) -> np.ndarray:
    """bool [n_layers]: which layers keep rings."""
    return np.isin(np.arange(self.n_layers), self.ring_layers)

  @property
  def offsets(self) -> np.ndarray:
    """int32 [n_layers]: each layer's first page in the pools."""
    full = np.flatnonzero(~self.ring)
    out = np.zeros(self.n_layers, np.int32)
    out[full] = np.arange(len(full)) * self.num_pages
    rings = np.flatnonzero(self.ring)
    out[rings] = len(full) * self.num_pages + np.arange(len(rings)) * self.window_pages
    return out


def ring_layers(cfg: TransformerConfig) -> tuple[int, ...]:
  """The layers that keep a ring of their window's pages: the sliding-window ones.

  Args:
    cfg: the model.

  Returns:
    Their indices, ascending.
  """
  return tuple(l for l, w in enumerate(cfg.layer_windows) if w)


def ring_pages(cfg: TransformerConfig, page_size: int, max_tokens_per_step: int) -> int:
  """Pages in one sequence's ring.

  Its widest window plus the longest chunk a step writes (so that no token of a step overwrites
  a key another query of the step sees), and one page more for a window that starts mid-page.

  Args:
    cfg: the model, with sliding-window layers.
    page_size: tokens per page.
    max_tokens_per_step: the longest chunk a step writes.

  Returns:
    The page count.
  """
  window = max(cfg.layer_windows)
  return -(-(window + max_tokens_per_step - 1) // page_size) + 1


@flax.struct.dataclass
class TokenBatch:
  """T tokens of one step and the R rows whose next-token logits are wanted."""

  tokens_T: jax.Array  # int32
  positions_T: jax.Array  # int32; the token sees keys at positions 0..position of its sequence
  slots_T: jax.Array  # int32 page * page_size + offset (in layer 0's numbering); padding: 0
  tables_TxN: jax.Array  # int32 the token's sequence's block table (padding entries: 0)
  rows_R: jax.Array  # int32 token index of each wanted row (in order), then padding 0
  # The same tokens grouped by sequence (`ops.attention.RaggedRows`, what `xla_ragged` reads):
  # B rows (`serve.batch.row_count`: at most the engine's max_batch), each sequence's tokens
  # contiguous in the flat batch.
  seq_tables_BxN: jax.Array | None = None  # int32 the sequence's block table
  seq_starts_B: jax.Array | None = None  # int32 its first token index
  seq_counts_B: jax.Array | None = None  # int32 its tokens this step (0: padding row)
  seq_cached_B: jax.Array | None = None  # int32 its tokens cached before this step
  # Async scheduling: the token's row in the previous step's sampled tokens, which the host had
  # not read back when it built this step (-1: tokens_T holds the token); see `serve_step`.
  prev_T: jax.Array | None = None
  # Ring layers (KVPages.ring_layers): the slots and block tables of each sequence's ring, its
  # pages repeated along the table (entry i: ring[i mod R]), in ring numbering.
  ring_slots_T: jax.Array | None = None
  ring_tables_TxN: jax.Array | None = None
  ring_seq_tables_BxN: jax.Array | None = None


KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": jnp.bfloat16,
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,
}  # None: the compute dtype


def kv_dtype(cfg: TransformerConfig, kv_cache_dtype: str = "auto"):
  """The pools' element dtype for a `kv_cache_dtype` name.

  Args:
    cfg: the model (its compute dtype, for 'auto').
    kv_cache_dtype: one of KV_CACHE_DTYPES ('auto': the compute dtype; 'int8' / 'fp8': 8-bit
      with a scale per head and slot).

  Returns:
    The dtype.

  Raises:
    ValueError: another name.
  """
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)} "
        "('auto': the compute dtype; 'int8' / 'fp8': 8-bit with a scale per head and slot)"
    )
  return jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype] or cfg.compute_dtype)


def quantized(dtype) -> bool:
  """Whether pools of this dtype are an 8-bit cache (with scales).

  Args:
    dtype: the pools' element dtype.

  Returns:
    True for int8 and float8_e4m3fn.
  """
  return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def kv_bytes(
    cfg: TransformerConfig,
    num_pages: int,
    page_size: int,
    dtype=None,
    kv_cache_dtype="auto",
    window_pages: int = 0,
    mla_cache: str = "latent",
) -> int:
  """Bytes of both pools.

  heads · ((key width + value width) · bytes per element + 8 for the two float32 scales of an
  8-bit cache) · slots of every layer (num_pages each, window_pages each for the sliding-window
  layers given window_pages > 0); `cached_heads` gives the heads and widths.

  Args:
    cfg: the model.
    num_pages: pages per full-attention layer.
    page_size: tokens per page.
    dtype: the element dtype (default: kv_cache_dtype's).
    kv_cache_dtype: one of KV_CACHE_DTYPES.
    window_pages: pages per sliding-window layer; 0: num_pages, as every layer.
    mla_cache: what a latent-attention model's pages hold (`cached_heads`).

  Returns:
    The bytes.
  """
  dtype = jnp.dtype(dtype or kv_dtype(cfg, kv_cache_dtype))
  heads, k_width, v_width = cached_heads(cfg, mla_cache)
  per_head = (k_width + v_width) * dtype.itemsize + (8 if quantized(dtype) else 0)
  rings = len(ring_layers(cfg)) if window_pages else 0
  pages = (cfg.n_layers - rings) * num_pages + rings * window_pages
  return heads * per_head * pages * page_size


def init_kv(
    cfg: TransformerConfig,
    num_pages: int,
    page_size: int,
    fill: float = 0.0,
    sharding=None,
    kv_cache_dtype: str = "auto",
    window_pages: int = 0,
    mla_cache: str = "latent",
) -> KVPages:
  """Pools for `num_pages` pages per layer, every slot `fill`.

  With window_pages > 0, that many per sliding-window layer instead, which then keeps rings.
  `fill` is NaN in tests of page ownership; in an 8-bit cache the scales hold `fill` and the
  values 0.

  Args:
    cfg: the model.
    num_pages: pages per full-attention layer, scratch page 0 included.
    page_size: tokens per page.
    fill: the value of every slot.
    sharding: of each pool and scale pool (default: the default device).
    kv_cache_dtype: one of KV_CACHE_DTYPES.
    window_pages: pages per sliding-window layer; 0: no rings.
    mla_cache: what a latent-attention model's pages hold (`cached_heads`).

  Returns:
    The `KVPages`, pools [heads, pages of every layer, page_size, width] (`cached_heads`).
  """
  dtype = kv_dtype(cfg, kv_cache_dtype)
  rings = ring_layers(cfg) if window_pages else ()
  total = (cfg.n_layers - len(rings)) * num_pages + len(rings) * window_pages
  heads, k_width, v_width = cached_heads(cfg, mla_cache)
  k_shape, v_shape = ((heads, total, page_size, w) for w in (k_width, v_width))
  layout = dict(window_pages=window_pages if rings else 0, ring_layers=rings)
  # one program per shape (K and V alike but for a latent cache's empty V)
  full = jax.jit(jnp.full, static_argnums=(0, 2), out_shardings=sharding)
  if dtype == jnp.bfloat16:  # held as its bits (BITS)
    full = jax.jit(
        lambda shape, fill, dtype: jax.lax.bitcast_convert_type(jnp.full(shape, fill, dtype), BITS),
        static_argnums=(0, 2),
        out_shardings=sharding,
    )
  if not quantized(dtype):
    return KVPages(full(k_shape, fill, dtype), full(v_shape, fill, dtype), num_pages, **layout)
  pools = full(k_shape, 0, dtype), full(v_shape, 0, dtype)
  scales = [full(k_shape[:3], fill, jnp.float32) for _ in range(2)]
  return KVPages(*pools, num_pages, *scales, **layout)


def quantize(x_TxGxK: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Vectors scaled onto an 8-bit range, with their scales.

  Each vector is divided by scale = max |x| over head_dim / the dtype's largest value (127 for
  int8, 448 for float8_e4m3fn) and rounded to nearest; an all-zero vector keeps scale 0. fp8
  values are clamped after scaling: E4M3 has no infinity, and a value rounding past 448 would
  become NaN.

  Args:
    x_TxGxK: [T, G, head_dim] keys or values.
    dtype: int8 or float8_e4m3fn.

  Returns:
    (x / scale in `dtype` [T, G, head_dim], scale [T, G] float32).
  """
  x = x_TxGxK.astype(jnp.float32)
  top = 127.0 if jnp.dtype(dtype) == jnp.int8 else float(jnp.finfo(dtype).max)
  scale_TxG = jnp.max(jnp.abs(x), axis=-1) / top
  y = x / jnp.where(scale_TxG > 0, scale_TxG, 1.0)[..., None]
  y = jnp.round(y) if jnp.dtype(dtype) == jnp.int8 else y
  return jnp.clip(y, -top, top).astype(dtype), scale_TxG


MLA_CACHES = ("latent", "expanded")  # what a latent-attention model's pages hold


def check_mla_cache(mla_cache: str) -> None:
  """Raises ValueError (one line) unless `mla_cache` is one of `MLA_CACHES`.

  Args:
    mla_cache: the name to check.
  """
  if mla_cache not in MLA_CACHES:
    raise ValueError(f"mla_cache={mla_cache!r} is unknown; use one of {MLA_CACHES}")


def cached_heads(cfg: TransformerConfig, mla_cache: str = "latent") -> tuple[int, int, int]:
  """(heads, key width, value width) of what one layer's pages hold per token.

  Grouped-query attention caches its KV heads at head_dim. Latent attention caches, with
  `mla_cache='latent'`, one vector per token: its latent c_kv then its rotary key
  (`kv_lora_rank + qk_rope_head_dim` values, in the K pool; the V pool is empty), which decode
  attends with the up-projections absorbed (`mla.LatentAttention`); with 'expanded', every
  query head's key at qk_nope + qk_rope channels and its value zero-padded to that width.

  Args:
    cfg: the model.
    mla_cache: 'latent' or 'expanded' (`MLA_CACHES`); moot without `cfg.mla`.

  Returns:
    `(heads, key width, value width)`.

  Raises:
    ValueError: an unknown `mla_cache`.
  """
  check_mla_cache(mla_cache)
  if cfg.mla is not None and mla_cache == "latent":
    return 1, cfg.mla.cache_width, 0
  if cfg.mla is not None:
    return cfg.n_heads, cfg.mla.qk_head_dim, cfg.mla.qk_head_dim
  return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim


def serving_config(cfg: TransformerConfig) -> TransformerConfig:
  """The model as served: MoE layers dropless, so that no token's output depends on its batch.

  Args:
    cfg: the model.

  Returns:
    `cfg`, its MoE dispatch 'dropless'.
  """
  if cfg.moe is None or cfg.moe.dispatch == "dropless":
    return cfg
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="dropless"))


class _PagedHook:
  """What `attention` calls inside `kv_cache`: store this layer's new K/V, attend through pages.

  Runs on one device's pools: under tensor parallelism inside the step's `shard_map`, where the
  layer's K/V heads and its pools' are this rank's share."""

  def __init__(self, pools: tuple, layout: PoolLayout, batch: TokenBatch, backend: str):
    self.pools, self.layout = pools, layout
    self.batch, self.backend = batch, backend
    self.layer = None  # set before each layer (a traced index inside the layer scan)
    # the pools hold latent attention's latents (`cached_heads`: an empty V pool)
    self.latent = pools[1].shape[-1] == 0

  def __call__(self, q_1xTxHxK, k_1xTxGxK, v_1xTxGxK, sm_scale=None, window=0, softcap=0.0):
    return self._attend(q_1xTxHxK, k_1xTxGxK, v_1xTxGxK[0], sm_scale, window, softcap)

  def latent_attention(self, q_1xTxHxC, latent_1xTx1xC, values, sm_scale):
    """`attention.latent_attention` over the pages: the latents stored in the K pool, which the
    kernels then read as both keys and values."""
    return self._attend(q_1xTxHxC, latent_1xTx1xC, None, sm_scale)[..., :values]

  def _attend(self, q_1xTxHxK, k_1xTxGxK, v_TxGxK, sm_scale, window=0, softcap=0.0):
    """`_write_and_attend` on this layer's slots and rows."""
    slots, rows, offset = self._rows()
    o_TxHxK, self.pools = _write_and_attend(
        q_1xTxHxK[0],
        k_1xTxGxK[0],
        v_TxGxK,
        self.pools,
        slots,
        rows,
        offset,
        backend=self.backend,
        sm_scale=sm_scale,
        window=window,
        softcap=softcap,
    )
    return o_TxHxK[None]

  def _rows(self):
    """This layer's slots of the step's tokens, its rows (as `_write_and_attend` takes them)
    and its first page in the pools."""
    b, layout = self.batch, self.layout
    offset = jnp.asarray(layout.offsets)[self.layer]
    slots, tables, seq_tables = b.slots_T, b.tables_TxN, b.seq_tables_BxN
    if layout.ring_layers:  # a ring layer reads and writes its sequence's ring
      ring = layout.ring
      if ring.all():
        slots, tables, seq_tables = b.ring_slots_T, b.ring_tables_TxN, b.ring_seq_tables_BxN
      else:
        on = jnp.asarray(ring)[self.layer]
        pick = lambda x, y: None if x is None else jnp.where(on, x, y)
        slots = pick(b.ring_slots_T, slots)
        tables = pick(b.ring_tables_TxN, tables)
        seq_tables = pick(b.ring_seq_tables_BxN, seq_tables)
    if self.backend in RAGGED_BACKENDS:
      rows = RaggedRows(seq_tables + offset, b.seq_starts_B, b.seq_counts_B, b.seq_cached_B)
    else:
      rows = (tables + offset, b.positions_T + 1)
    return slots, rows, offset


def _to_bits(pool):
  if pool is None or pool.dtype != jnp.bfloat16:
    return pool
  return jax.lax.bitcast_convert_type(pool, BITS)


def _from_bits(pool, dtype):
  if pool is None or dtype != jnp.bfloat16:
    return pool
  return jax.lax.bitcast_convert_type(pool, dtype)


def _scatter(pool, at, x):
  """pool.at[at].set(x) in the pool's dtype (a bfloat16 pool's bits as uint16 BITS)."""
  if pool.dtype == BITS:
    return pool.at[at].set(jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BITS))
  return pool.at[at].set(x.astype(pool.dtype))


def _write_and_attend(
    q_TxHxK,
    k_TxGxK,
    v_TxGxK,
    pools,
    slots_T,
    rows,
    offset,
    *,
    backend,
    sm_scale=None,
    window=0,
    softcap=0.0,
):
  """Writes the T tokens' K/V at their slots (quantised into an 8-bit pool) and attends through
  the pages; pools = (k, v, k_scales, v_scales), the scales None for a float cache; rows: the
  tokens by sequence (`RaggedRows`) for xla_ragged, else (tables_TxN, lengths_T) per token.
  sm_scale, window, softcap: the layer's (`ops.attention.ragged_paged_attention`). v_TxGxK
  None: the K pool's vectors are the values too (latents), the V pool left as it is."""
  k_pool, v_pool, k_scales, v_scales = pools
  s = k_pool.shape[2]
  g_G = jnp.arange(k_pool.shape[0])[None, :]
  at = (g_G, (offset + slots_T // s)[:, None], (slots_T % s)[:, None])
  if k_scales is None:
    k_pool = _scatter(k_pool, at, k_TxGxK)
    if v_TxGxK is not None:
      v_pool = _scatter(v_pool, at, v_TxGxK)
  else:
    k_q, k_scale_TxG = quantize(k_TxGxK, k_pool.dtype)
    k_pool, k_scales = k_pool.at[at].set(k_q), k_scales.at[at].set(k_scale_TxG)
    if v_TxGxK is not None:
      v_q, v_scale_TxG = quantize(v_TxGxK, v_pool.dtype)
      v_pool, v_scales = v_pool.at[at].set(v_q), v_scales.at[at].set(v_scale_TxG)
  values_pool, values_scales = (v_pool, v_scales) if v_TxGxK is not None else (k_pool, k_scales)
  scales = dict(
      k_scales_GxPxS=k_scales,
      v_scales_GxPxS=values_scales,
      sm_scale=sm_scale,
      window=window,
      softcap=softcap,
  )
  # the CPU kernel reads a bfloat16 pool's bits as they are; the others a bfloat16 view
  k_read, v_read = k_pool, values_pool
  if k_pool.dtype == BITS and backend != "cpu_ragged":
    k_read, v_read = _from_bits(k_pool, jnp.bfloat16), _from_bits(values_pool, jnp.bfloat16)
  if backend in RAGGED_BACKENDS:
    o_TxHxK = ragged_paged_attention(
        q_TxHxK, k_read, v_read, rows, block=RAGGED_BLOCK, kernel=RAGGED_KERNELS[backend], **scales
    )
  else:
    o_TxHxK = paged_attention(q_TxHxK, k_read, v_read, *rows, backend=backend, **scales)
  return o_TxHxK.astype(q_TxHxK.dtype), (k_pool, v_pool, k_scales, v_scales)


def _layer(cfg, hook, layer_params, index, x_1xTxD, positions_T, moe: bool, seq_lens_T=None):
  hook.layer = index
  with attention_lib.kv_cache(hook):
    out = transformer.Block(cfg, moe=moe).apply(
        transformer.block_variables(layer_params), x_1xTxD, positions_T, None, index, seq_lens_T
    )
  return out[0] if moe else out


def prepack_params(cfg: TransformerConfig, params: dict) -> dict:
  """The parameters with every projection's kernel and the output head prepacked for oneDNN.

  Each dense layer's (and each MoE layer's attention and shared experts') `layers.Dense`
  kernels, cast to the compute dtype and in oneDNN's blocked layout (`ops.matmul.prepack`), under
  the layer's `ops.matmul.PREPACKED` key, and the head under the tree's; `forward_paged` and
  prompt scoring (`transformer.forward` over the unstacked layers) run those products on them.
  The weights are held once: each prepacked kernel's row-major one (and an untied head's) is
  dropped, but for latent attention's `kv_b`, which its serving path reads whole.

  Args:
    cfg: the model (served as `serving_config`).
    params: its params, layers unstacked (`unstack_layers`) or stacked: each layer (unit) is
      then sliced out of the stack as it is prepacked, so only one layer's row-major copy is
      held beside the stack at a time.

  Returns:
    The tree with the prepacked kernels in place of the row-major ones, layers unstacked.

  Raises:
    RuntimeError: the oneDNN kernel is unavailable here.
  """
  cfg = serving_config(cfg)
  out = dict(params)

  def with_prepacked(layer_params: dict, index: int, moe: bool) -> dict:
    kernels = _prepack_layer(cfg, moe, layer_params, index)
    return {**_without(layer_params, kernels), matmul_lib.PREPACKED: kernels}

  if params.get("first_layers") is not None:
    first = _each_layer(params["first_layers"])
    out["first_layers"] = [with_prepacked(p, i, False) for i, p in enumerate(first)]
  if cfg.moe is None:
    out["layers"] = [
        with_prepacked(p, i, False) for i, p in enumerate(_each_layer(params["layers"]))
    ]
  else:  # the MoE layer of each unit (its dense layers stay stacked, unprepacked)
    every = cfg.moe.every
    out["layers"] = [
        {**u, "moe": with_prepacked(u["moe"], cfg.first_dense + i * every + every - 1, True)}
        for i, u in enumerate(_each_layer(params["layers"]))
    ]
  head = params["embed"] if cfg.tied_embeddings else params["head"]
  out[matmul_lib.PREPACKED] = {
      "head": _prepack_head(head.astype(cfg.compute_dtype), cfg.tied_embeddings)
  }
  if not cfg.tied_embeddings:  # a tied one stays: the embedding's lookup reads it
    del out["head"]
  return out


# read whole besides its `Dense` (`mla.LatentAttention`'s serving path), so kept row-major too
_READ_WHOLE = ("kv_b",)


def _without(params: dict, kernels: dict) -> dict:
  """A module's params without the row-major kernels (and fused biases) held in `kernels`, its
  prepacked collection (a `Dense`'s "kernel", a `layers.dense_group`'s "q+k+v" entry)."""
  out = dict(params)
  for name, packed in kernels.items():
    if name == "kernel":
      del out["kernel"]
    elif "+" in name:  # a fused group: its members' kernels and biases are in the entry
      for member in name.split("+"):
        rest = {k: v for k, v in out[member].items() if k not in ("kernel", "bias")}
        out[member] = rest
        if not rest:
          del out[member]
    elif name not in _READ_WHOLE:
      out[name] = _without(out[name], packed)
  return out


@functools.partial(jax.jit, static_argnums=(1,))
def _prepack_head(w, tied: bool):
  return matmul_lib.prepack(w, transpose_w=tied)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prepack_layer(cfg: TransformerConfig, moe: bool, layer_params: dict, index) -> dict:
  """Layer `index`'s Dense kernels prepacked, collected from one token through it."""
  x_1x1xD = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
  with matmul_lib.prepacking():
    _, state = transformer.Block(cfg, moe=moe).apply(
        {"params": layer_params},
        x_1x1xD,
        jnp.zeros((1,), jnp.int32),
        None,
        index,
        None,
        mutable=[matmul_lib.PREPACKED],
    )
  return state[matmul_lib.PREPACKED]


def _seq_lens(batch: TokenBatch) -> jax.Array:
  """Each token's sequence length as this step leaves it (its last position here, plus one):
  what transformers' length-dependent rotary variants take, call by call of `generate`."""
  if batch.seq_counts_B is None:
    return batch.positions_T + 1
  t_T = jnp.arange(batch.tokens_T.shape[0])
  starts, counts = batch.seq_starts_B, batch.seq_counts_B
  mine_TxB = (t_T[:, None] >= starts[None]) & (t_T[:, None] < (starts + counts)[None])
  ends_B = batch.seq_cached_B + counts
  return jnp.max(jnp.where(mine_TxB, ends_B[None], batch.positions_T[:, None] + 1), axis=1)


def unstack_layers(params: dict) -> dict:
  """The parameters with each layer's weights (a MoE model's: each unit's) as arrays of their own.

  `forward_paged` then runs the layers in a Python loop, each reading its weights in place;
  a stacked tree runs them in a `lax.scan`, where XLA:CPU copies every layer's weights out of
  the stack each step (and converts a bfloat16 stack to float32 whole first).

  Args:
    params: `transformer.init_params`'s tree (`layers`, `first_layers` stacked on axis 0).

  Returns:
    The same tree but `layers` (and `first_layers`) lists of one tree per layer (unit).
  """
  out = dict(params)
  for name in ("first_layers", "layers"):
    if params.get(name) is not None:
      out[name] = list(_each_layer(params[name]))
  return out


def _each_layer(stack):
  """The layers (units) of a stacked tree, each sliced out (a copy) only when it is reached; an
  unstacked list as it is."""
  if isinstance(stack, (list, tuple)):
    return stack
  return (
      jax.tree.map(lambda x, i=i: x[i], stack) for i in range(jax.tree.leaves(stack)[0].shape[0])
  )


def param_specs(params: dict, tp: int) -> dict:
  """PartitionSpecs of the parameters on an engine's mesh.

  Megatron's tensor-parallel layout over `KV_AXIS` (`jaxpipe.parallel.tensor.split_dim`), which
  splits the KV heads as the pools are split.

  Args:
    params: the model's params.
    tp: the engine's devices.

  Returns:
    A tree of `PartitionSpec`s with the structure of `params`.
  """
  return tp_lib.param_specs(params, KV_AXIS, tp)


def forward_paged(
    cfg: TransformerConfig,
    params: dict,
    kv: KVPages,
    batch: TokenBatch,
    *,
    backend: str = "auto",
    mesh: Mesh | None = None,
    hidden: bool = False,
) -> tuple:
  """The model on one step's tokens over the paged pools.

  Args:
    cfg: the model (served as `serving_config`).
    params: its params.
    kv: the pools.
    batch: the step's T tokens and R wanted rows.
    backend: the paged attention backend ('auto' chooses; the ragged ones need
      `TokenBatch.seq_*`).
    mesh: the engine's devices (axis `KV_AXIS`). Over more than one, the model runs
      tensor-parallel (`jaxpipe.parallel.tensor`): parameters split as `param_specs`, each rank
      projecting its heads and its share of d_ff and of the vocabulary into its own share of the
      pools' KV heads; the rows' logits are gathered whole for sampling.
    hidden: also return every token's last hidden states (before the final norm).

  Returns:
    (logits [R, vocab] float32 of the wanted rows, pools with this step's K/V written); with
    hidden, (logits, states [T, D], pools).

  Raises:
    ValueError: a ragged backend for a batch without its rows.
  """
  cfg = serving_config(cfg)
  if batch.seq_counts_B is None:  # tokens not grouped by sequence: a per-token backend
    if backend in RAGGED_BACKENDS:
      raise ValueError(f"the {backend} backend needs the batch's rows (TokenBatch.seq_*)")
    backend = resolve_paged_backend(backend, kv.k.shape[-1], kv.page_size)
  else:
    backend = resolve_step_backend(backend, kv.k.shape[-1], kv.page_size, kv.dtype)
  run = functools.partial(_forward_local, cfg, layout=kv.layout, backend=backend, hidden=hidden)
  if mesh is not None and mesh.size > 1:
    tensor = functools.partial(_tensor_parallel, run, axis=KV_AXIS)
    heads = P(KV_AXIS)
    pool_specs = tuple(None if p is None else heads for p in kv.pools)
    run = jax.shard_map(
        tensor,
        mesh=mesh,
        # the paged kernels (Pallas, interpreted on CPU) do not track varying axes
        check_vma=False,
        in_specs=(param_specs(params, mesh.size), pool_specs, P()),
        out_specs=(P(), P(), pool_specs) if hidden else (P(), pool_specs),
    )
  *out, pools = run(params, kv.pools, batch)
  return *out, kv.with_pools(*pools)


def _tensor_parallel(run, params, pools, batch, *, axis):
  """`run` as one tensor rank: this rank's vocabulary slice of the logits, gathered whole (the
  states, when `run` returns them, are every rank's)."""
  with tp_lib.tensor_parallel(axis):
    logits_RxVp, *rest = run(params, pools, batch)
  return jax.lax.all_gather(logits_RxVp, axis, axis=1, tiled=True), *rest


def _forward_local(cfg, params, pools, batch, *, layout, backend, hidden=False):
  """The layer stack over one device's pools: (logits [R, vocab or its tp slice], pools); with
  hidden, (logits, the last layer's output of every token [T, D], pools)."""
  dtypes = [None if p is None else p.dtype for p in pools]
  hook = _PagedHook(tuple(_to_bits(p) for p in pools), layout, batch, backend)
  x_1xTxD = transformer.embed(cfg, params, batch.tokens_T[None])
  every = 1 if cfg.moe is None else cfg.moe.every
  positions_T = batch.positions_T
  seq_lens_T = None
  if rope_lib.scaling_of(cfg.rope_scaling).length_dependent:
    seq_lens_T = _seq_lens(batch)

  first = cfg.first_dense  # the first dense layers (pools 0..first-1), then the stack's

  def dense_body(carry, xs):
    x, hook.pools = carry
    layer, i = xs
    x = _layer(cfg, hook, layer, i, x, positions_T, False, seq_lens_T)
    return (x, hook.pools), None

  def unit_body(carry, xs):
    x, hook.pools = carry
    unit, u = xs
    if cfg.moe is None:
      x = _layer(cfg, hook, unit, u, x, positions_T, False, seq_lens_T)
    else:
      if "dense" in unit:
        (x, hook.pools), _ = jax.lax.scan(
            dense_body, (x, hook.pools), (unit["dense"], first + u * every + jnp.arange(every - 1))
        )
      moe_layer = first + u * every + every - 1
      x = _layer(cfg, hook, unit["moe"], moe_layer, x, positions_T, True, seq_lens_T)
    return (x, hook.pools), None

  carry = (x_1xTxD, hook.pools)
  if isinstance(params["layers"], (list, tuple)):  # unstacked (`unstack_layers`)
    # the step's real tokens come first: the prepacked projections skip the padding's rows
    real = contextlib.nullcontext()
    if batch.seq_counts_B is not None:
      real = matmul_lib.leading_rows(jnp.sum(batch.seq_counts_B), batch.tokens_T.shape[0])
    with real:
      for i, layer in enumerate(params.get("first_layers", ())):
        carry, _ = dense_body(carry, (layer, i))
      for u, unit in enumerate(params["layers"]):
        carry, _ = unit_body(carry, (unit, u))
    x_1xTxD, pools = carry
  else:
    if first:
      carry, _ = jax.lax.scan(dense_body, carry, (params["first_layers"], jnp.arange(first)))
    (x_1xTxD, pools), _ = jax.lax.scan(
        unit_body, carry, (params["layers"], jnp.arange(cfg.stack_units))
    )
  # the head's prepacked product computes the wanted rows alone (those up to the last nonzero
  # index: rows_R holds them first, in order, then padding 0), not a bucket's max_batch rows
  r = batch.rows_R.shape[0]
  wanted = jnp.max(jnp.where(batch.rows_R > 0, jnp.arange(1, r + 1), 1))
  with matmul_lib.leading_rows(wanted, r):
    logits_1xRxV = transformer.logits(cfg, params, x_1xTxD[:, batch.rows_R])
  pools = tuple(_from_bits(p, d) for p, d in zip(pools, dtypes))
  return (logits_1xRxV[0], x_1xTxD[0], pools) if hidden else (logits_1xRxV[0], pools)


def serve_forward(
    cfg: TransformerConfig,
    params: dict,
    kv: KVPages,
    batch: TokenBatch,
    prev_R: jax.Array | None = None,
    *,
    backend: str = "auto",
    mesh: Mesh | None = None,
    hidden: bool = False,
) -> tuple:
  """The model half of an engine iteration: the step's tokens in, its sampled rows' logits out.

  Args:
    cfg: the model.
    params: its params.
    kv: the pools.
    batch: the step's tokens.
    prev_R: the previous step's sampled tokens, still on the device: token t of this step is
      prev_R[batch.prev_T[t]] where prev_T[t] >= 0 (the engine's async scheduling builds step
      n+1 before step n's tokens reach the host).
    backend: the paged attention backend.
    mesh: the engine's devices (`forward_paged`).
    hidden: also return every token's last hidden states (`forward_paged`).

  Returns:
    (logits of the rows `batch.rows_R` names [R', V], pools); with hidden, (logits, states
    [T, D], pools).
  """
  if prev_R is not None and batch.prev_T is not None:
    from_prev_T = prev_R[jnp.maximum(batch.prev_T, 0)]
    batch = batch.replace(tokens_T=jnp.where(batch.prev_T >= 0, from_prev_T, batch.tokens_T))
  return forward_paged(cfg, params, kv, batch, backend=backend, mesh=mesh, hidden=hidden)


def serve_sample(
    logits_RxV: jax.Array,
    sampling: SamplingBatch,
    prev_R: jax.Array | None = None,
    *,
    logprobs: bool = False,
) -> tuple:
  """The sampling half of an engine iteration, on the devices.

  A row whose logits are not all finite samples -1, so that the tokens alone tell the host.

  Args:
    logits_RxV: `serve_forward`'s logits (in a verify step, k + 1 rows per sequence).
    sampling: each row's sampling values.
    prev_R: the previous step's sampled tokens (a penalized row's pending token).
    logprobs: also return the log-probabilities.

  Returns:
    (sampled tokens [R], whether each row's logits are finite [R]), or in a verify step
    (`sampling.drafts_RxK`, `serve.speculative`) [R, k + 2]: the tokens each row emits (-1 past
    them) and their count last; with logprobs, `sampling.top_logprobs` of the raw logits and the
    sampled tokens third: a few numbers per row, never the logits, for the host to read back.
  """
  drafts = sampling.drafts_RxK
  if drafts is not None:  # a verify step: k + 1 rows of logits per sequence
    r, k = drafts.shape
    logits_RxKxV = logits_RxV.reshape(r, k + 1, -1)
    logits_RxV = logits_RxKxV[:, 0]
  sampled_R = sample(logits_RxV, sampling, prev_R)
  finite_R = jnp.all(jnp.isfinite(logits_RxV), axis=-1)
  tokens_R = jnp.where(finite_R, sampled_R, -1)
  if drafts is not None:  # [R, k + 2]: the tokens emitted (-1 past them), then their count
    tokens_RxK1, count_R = speculative.verify(logits_RxKxV, sampling, sampled_R)
    finite_R = jnp.all(jnp.isfinite(logits_RxKxV), axis=(1, 2))
    emitted_RxK2 = jnp.concatenate([tokens_RxK1, count_R[:, None]], axis=1)
    tokens_R = jnp.where(finite_R[:, None], emitted_RxK2, -1)
  if logprobs:
    return tokens_R, finite_R, top_logprobs(logits_RxV, sampled_R)
  return tokens_R, finite_R


def serve_step(
    cfg: TransformerConfig,
    params: dict,
    kv: KVPages,
    batch: TokenBatch,
    sampling: SamplingBatch,
    prev_R: jax.Array | None = None,
    *,
    backend: str = "auto",
    mesh: Mesh | None = None,
    logprobs: bool = False,
    hidden: bool = False,
) -> tuple:
  """One engine iteration in one program: `serve_forward`, then `serve_sample`.

  Args:
    cfg: the model.
    params: its params.
    kv: the pools.
    batch: the step's tokens.
    sampling: each row's sampling values.
    prev_R: the previous step's sampled tokens, still on the device (`serve_forward`).
    backend: the paged attention backend.
    mesh: the engine's devices (`forward_paged`).
    logprobs: also return the log-probabilities.
    hidden: also return every token's last hidden states (`forward_paged`).

  Returns:
    `serve_sample`'s outputs, then with hidden the states [T, D], then the pools.
  """
  logits_RxV, *states, kv = serve_forward(
      cfg, params, kv, batch, prev_R, backend=backend, mesh=mesh, hidden=hidden
  )
  return (*serve_sample(logits_RxV, sampling, prev_R, logprobs=logprobs), *states, kv)


_forward_jit = jax.jit(forward_paged, static_argnums=0, static_argnames="backend", donate_argnums=2)


def _batch(tokens, positions, slots, tables, rows, *seqs) -> TokenBatch:
  as_i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
  return TokenBatch(*(as_i32(x) for x in (tokens, positions, slots, tables, rows, *seqs)))


def prefill(
    cfg: TransformerConfig,
    params: dict,
    kv: KVPages,
    tokens: list[int],
    start: int,
    block_table: list[int],
    *,
    backend: str = "auto",
) -> tuple[jax.Array, KVPages]:
  """A prompt chunk at positions start.. of one sequence.

  Args:
    cfg: the model.
    params: its params.
    kv: the pools.
    tokens: the chunk's token ids.
    start: the first token's position (tokens cached before it).
    block_table: the sequence's pages; it must already hold pages for positions
      0..start+len(tokens)-1.
    backend: the paged attention backend.

  Returns:
    (its last token's logits [V], pools).
  """
  s = kv.page_size
  positions = np.arange(start, start + len(tokens))
  table = np.asarray(block_table)
  batch = _batch(
      tokens,
      positions,
      table[positions // s] * s + positions % s,
      np.broadcast_to(table, (len(tokens), len(table))),
      [len(tokens) - 1],
      table[None],
      [0],
      [len(tokens)],
      [start],
  )
  logits, kv = _forward_jit(cfg, params, kv, batch, backend=backend)
  return logits[0], kv


def decode_step(
    cfg: TransformerConfig,
    params: dict,
    kv: KVPages,
    tokens_B: list[int],
    lengths_B: list[int],
    block_tables_BxN,
    *,
    backend: str = "auto",
) -> tuple[jax.Array, KVPages]:
  """One token per sequence, at position lengths[b] (the tokens cached before it).

  Args:
    cfg: the model.
    params: its params.
    kv: the pools.
    tokens_B: each sequence's token.
    lengths_B: each sequence's tokens cached before it.
    block_tables_BxN: [B, N] each sequence's pages.
    backend: the paged attention backend.

  Returns:
    (logits [B, V], pools).
  """
  s = kv.page_size
  positions = np.asarray(lengths_B)
  tables = np.asarray(block_tables_BxN)
  slots = tables[np.arange(len(positions)), positions // s] * s + positions % s
  b = len(positions)
  batch = _batch(
      tokens_B, positions, slots, tables, np.arange(b), tables, np.arange(b), np.ones(b), positions
  )
  return _forward_jit(cfg, params, kv, batch, backend=backend)
