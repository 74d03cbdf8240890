"""FP8 GEMMs with Transformer Engine's scaling recipes, and the delayed recipe's training state.

Recipes (`model.fp8`), as TE names them:

  delayed  per-tensor scales from an amax history: E4M3 activations and weights in the forward,
           E5M2 gradients in the backward (TE's HYBRID format);
  current  per-tensor scales from each tensor's own amax at each use, same formats;
  block    DeepSeek-V3's fine-grained scaling: 1x128 tiles for activations and gradients (along
           the contracted axis), 128x128 blocks for weights, E4M3 everywhere.

Scales here are dequantisation scales (TE's `scale_inv`, flax's `scale`): x ~ q * s, q =
clamp(x / s) cast to FP8. E4M3 overflows to NaN rather than saturating, so values are clamped to
the format's largest finite value (448, 57344 for E5M2) after scaling; flax's
`fp8_ops.quantize` does exactly that and is used for every cast here.

Each GEMM is a custom VJP whose residuals are the FP8 tensors and their scales. For `delayed` and
`current` the three GEMMs (y = x w, dx = g w^T, dw = x^T g) take FP8 operands, so XLA on a Hopper
GPU can run them as FP8 GEMMs. XLA has no block-scaled GEMM for Hopper (DeepSeek's DeepGEMM is a
CUDA kernel), so `block` multiplies the dequantised tiles in the compute dtype: the recipe's
numerics, bf16's speed. Its weight gradient re-quantises the cached FP8 activations and the
gradient as 128x1 tiles (along tokens, the axis that product contracts), as DeepSeek-V3 does.

Delayed scaling's state. Each GEMM owns one `fp8_scale` parameter leaf [3]: the dequantisation
scales of (x, w, g) used throughout a step. Its "gradient" is what that step observed, the amax
of (x, w, g), combined by max rather than summed over micro-batches, data shards, sequence shards
and pipeline copies (`accumulate`, the executor's `Model.max_grads`, a pmax in the VJP inside
`shard_map`s that track varying axes). After the step `advance` rolls each amax into its history
(length `fp8_history`, default 1024; TrainState.fp8) and sets the next step's scale as TE does:
scale = (fp8_max / amax) / 2^margin, amax the history's maximum (`fp8_amax='max'`, TE's
default) or its newest entry ('most_recent'); a zero or non-finite amax keeps the old scale. So
the scale a step uses comes from the amaxes of the `fp8_history` steps before it, one history
entry per optimizer step (max over its micro-batches), whatever the gradient accumulation.

flax's `Fp8DirectDotGeneralOp` is not used as a whole: it keeps the high-precision inputs as
residuals beside their FP8 copies, and carries its state as a Flax collection updated through
the gradient with an extended dtype whose sum is a max, which neither the pipeline executor's
explicit accumulation nor a psum can carry. Its building blocks (`quantize`, `compute_scale`,
`compute_amax_history`, `get_fp8_max`) are used as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops
from jax import lax

from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.ops.vma import vary_like, varying_axes

RECIPES = ("none", "delayed", "current", "block")
AMAX_ALGOS = ("max", "most_recent")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCK = 128  # DeepSeek-V3's tile: 1 x BLOCK for activations, BLOCK x BLOCK for weights
STATE_PREFIX = "fp8_"  # parameter leaves named so hold a GEMM's delayed-scaling state
SCALE_FORMATS = (E4M3, E4M3, E5M2)  # formats of the (x, w, g) entries of a state leaf
_F32 = jnp.float32


def check_recipe(recipe: str) -> None:
  """Checks that `recipe` is one of `RECIPES`.

  Args:
    recipe: the `model.fp8` value.

  Raises:
    ValueError: an unknown recipe.
  """
  if recipe not in RECIPES:
    raise ValueError(f"fp8={recipe!r} is unknown; use one of {RECIPES}")


# -- scaling ------------------------------------------------------------------------------------


def fp8_max(dtype) -> float:
  """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2).

  Args:
    dtype: the FP8 dtype.

  Returns:
    Its largest finite value, as a Python float.
  """
  return float(fp8_ops.get_fp8_max(dtype, _F32))


def amax(x: jax.Array) -> jax.Array:
  """The largest absolute value of `x`.

  Args:
    x: any array.

  Returns:
    `max(|x|)`, a float32 scalar.
  """
  return jnp.max(jnp.abs(x)).astype(_F32)


def current_scale(amax_: jax.Array, dtype) -> jax.Array:
  """TE's current scaling: amax / fp8_max.

  1 where amax is zero or not finite. Also 1 where amax is so small (under fp8_max / float32's
  largest, about 1e-36) that fp8_max / amax overflows: flax's formula would give 0 there, and
  x / 0 NaN; such a tensor quantises to zeros, as an all-zero one does.

  Args:
    amax_: the tensor's amax (any shape: one scale per entry).
    dtype: the FP8 format the tensor is cast to.

  Returns:
    The dequantisation scale(s), float32, shaped as `amax_`.
  """
  scale = fp8_ops.compute_scale(amax_, jnp.ones_like(amax_), fp8_max(dtype))
  return jnp.where(scale > 0, scale, jnp.ones_like(scale))


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
  """`clamp(x / scale)` in `dtype`, computed in float32.

  Args:
    x: the tensor.
    dtype: the FP8 format.
    scale: the dequantisation scale; broadcasts against `x`.

  Returns:
    The quantised tensor, shaped as `x`, in `dtype`.
  """
  return fp8_ops.quantize(x.astype(_F32), dtype, jnp.broadcast_to(scale, x.shape), _F32)


def quantize_tiles(
    x_RxC: jax.Array, tile: tuple[int, int], dtype=E4M3
) -> tuple[jax.Array, jax.Array]:
  """Quantises `x_RxC` with one current scale per `tr x tc` tile.

  Edge tiles are partial (zero padding changes no amax).

  Args:
    x_RxC: the tensor, [R, C].
    tile: `(tr, tc)`, the tile's rows and columns.
    dtype: the FP8 format.

  Returns:
    `(q, scales)`: q [R, C] in `dtype`, and the float32 scales [ceil(R/tr), ceil(C/tc)].
  """
  (r, c), (tr, tc) = x_RxC.shape, tile
  padded = jnp.pad(x_RxC, ((0, -r % tr), (0, -c % tc)))
  t = padded.reshape(padded.shape[0] // tr, tr, padded.shape[1] // tc, tc)
  s = current_scale(jnp.max(jnp.abs(t), axis=(1, 3)).astype(_F32), dtype)
  q = quantize(t, dtype, s[:, None, :, None]).reshape(padded.shape)[:r, :c]
  return q, s


def dequantize_tiles(q_RxC: jax.Array, s: jax.Array, tile: tuple[int, int], dtype) -> jax.Array:
  """`q * (its tile's scale)`, in `dtype`.

  Args:
    q_RxC: the quantised tensor, [R, C].
    s: its tiles' scales, [ceil(R/tr), ceil(C/tc)].
    tile: `(tr, tc)`, the tile's rows and columns.
    dtype: the result's dtype.

  Returns:
    The dequantised tensor, [R, C], in `dtype`.
  """
  (r, c), (tr, tc) = q_RxC.shape, tile
  s_RxC = jnp.repeat(jnp.repeat(s, tr, axis=0), tc, axis=1)[:r, :c]
  return (q_RxC.astype(_F32) * s_RxC).astype(dtype)


# -- the GEMMs ----------------------------------------------------------------------------------
# x [M, K] times w [K, N] (dense) or w [G, K, N] with rows grouped by `sizes` (grouped GEMM,
# jax.lax.ragged_dot); float32 accumulation.


def _mm(a, b, sizes):
  if sizes is None:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
  return lax.ragged_dot(a, b, sizes, preferred_element_type=_F32)


def _mm_da(g, b, sizes):
  """g [M, N] against b: the input-side product, [M, K]."""
  if sizes is None:
    return lax.dot_general(g, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
  dims = lax.RaggedDotDimensionNumbers(
      (((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
  )
  return lax.ragged_dot_general(g, b, sizes, dims, preferred_element_type=_F32)


def _mm_db(a, g, sizes):
  """a [M, K] against g [M, N]: the weight-side product, [K, N] or per group [G, K, N]."""
  if sizes is None:
    return lax.dot_general(a, g, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
  dims = lax.RaggedDotDimensionNumbers(
      (((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
  )
  return lax.ragged_dot_general(a, g, sizes, dims, preferred_element_type=_F32)


_AMAX_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "fp8_amax_axes", default=()
)


@contextlib.contextmanager
def amax_over(axes: tuple[str, ...]):
  """While tracing inside, `dot`'s per-tensor amaxes are maxima over the mesh `axes` too.

  A weight or activation split over them (tensor parallelism) is scaled as one tensor, as
  Transformer Engine reduces amaxes over the tensor-parallel group.

  Args:
    axes: the mesh axes to reduce amaxes over; empty: none.
  """
  token = _AMAX_AXES.set(tuple(axes))
  try:
    yield
  finally:
    _AMAX_AXES.reset(token)


def _over(amax_: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return lax.pmax(amax_, axes) if axes else amax_


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tensor_scaled(dtype, out_dtype, axes, x, w, sizes, scale_3):
  """Per-tensor scaled GEMM; `scale_3` the delayed scales of (x, w, g), None for current; every
  amax a maximum over the mesh `axes` too (`amax_over`)."""
  return _tensor_fwd(dtype, out_dtype, axes, x, w, sizes, scale_3)[0]


def _tensor_fwd(dtype, out_dtype, axes, x, w, sizes, scale_3):
  amax_x, amax_w = _over(amax(x), axes), _over(amax(w), axes)
  if scale_3 is None:
    sx, sw = current_scale(amax_x, E4M3), current_scale(amax_w, E4M3)
  else:
    sx, sw = scale_3[0], scale_3[1]
  xq, wq = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
  y = (_mm(xq, wq, sizes) * (sx * sw)).astype(out_dtype)
  return y, (xq, wq, sx, sw, sizes, scale_3, amax_x, amax_w)


def _tensor_bwd(dtype, out_dtype, axes, res, g):
  xq, wq, sx, sw, sizes, scale_3, amax_x, amax_w = res
  amax_g = _over(amax(g), axes)
  sg = current_scale(amax_g, E5M2) if scale_3 is None else scale_3[2]
  gq = quantize(g, E5M2, sg)
  dx = (_mm_da(gq, wq, sizes) * (sg * sw)).astype(dtype)
  dw = (_mm_db(xq, gq, sizes) * (sx * sg)).astype(dtype)
  seen = None
  if scale_3 is not None:
    seen = _invariant_max(jnp.stack([amax_x, amax_w, amax_g]), scale_3)
  return dx, dw, None, seen


_tensor_scaled.defvjp(_tensor_fwd, _tensor_bwd)


def _invariant_max(seen_3: jax.Array, scale_3: jax.Array) -> jax.Array:
  """The amaxes as the scale's cotangent: inside a `shard_map` that tracks varying axes, a max
  over the axes the data varies over and the scale does not (so no sum is implied); elsewhere
  the caller combines local values by max."""
  missing = tuple(sorted(varying_axes(seen_3) - varying_axes(scale_3)))
  return lax.pmax(seen_3, missing) if missing else seen_3


def _tiles_w(w, tile):
  """quantize_tiles over a weight [K, N] or per group of [G, K, N]."""
  if w.ndim == 2:
    return quantize_tiles(w, tile)
  return jax.vmap(lambda v: quantize_tiles(v, tile))(w)


def _untiles_w(q, s, tile, dtype):
  if q.ndim == 2:
    return dequantize_tiles(q, s, tile, dtype)
  return jax.vmap(lambda a, b: dequantize_tiles(a, b, tile, dtype))(q, s)


_ROW, _COL, _SQUARE = (1, BLOCK), (BLOCK, 1), (BLOCK, BLOCK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _block_scaled(dtype, out_dtype, x, w, sizes):
  """DeepSeek-V3 fine-grained scaling: the products of dequantised tiles in `dtype`."""
  return _block_fwd(dtype, out_dtype, x, w, sizes)[0]


def _block_fwd(dtype, out_dtype, x, w, sizes):
  xq, sx = quantize_tiles(x, _ROW)
  wq, sw = _tiles_w(w, _SQUARE)
  y = _mm(dequantize_tiles(xq, sx, _ROW, dtype), _untiles_w(wq, sw, _SQUARE, dtype), sizes)
  return y.astype(out_dtype), (xq, sx, wq, sw, sizes)


def _block_bwd(dtype, out_dtype, res, g):
  xq, sx, wq, sw, sizes = res
  g_rows = dequantize_tiles(*quantize_tiles(g, _ROW), _ROW, dtype)
  dx = _mm_da(g_rows, _untiles_w(wq, sw, _SQUARE, dtype), sizes).astype(dtype)
  x_cols = quantize_tiles(dequantize_tiles(xq, sx, _ROW, _F32), _COL)
  g_cols = dequantize_tiles(*quantize_tiles(g, _COL), _COL, dtype)
  dw = _mm_db(dequantize_tiles(*x_cols, _COL, dtype), g_cols, sizes).astype(dtype)
  return dx, dw, None


_block_scaled.defvjp(_block_fwd, _block_bwd)


def _matmul(x_MxK, w, sizes, recipe, scale_3, out_dtype, amax_axes=()):
  check_recipe(recipe)
  if recipe == "none":
    return _mm(x_MxK, w, sizes).astype(out_dtype)
  x_MxK, w = _vary_alike(x_MxK, w)
  if recipe == "block":
    return _block_scaled(x_MxK.dtype, out_dtype, x_MxK, w, sizes)
  if (recipe == "delayed") != (scale_3 is not None):
    raise ValueError(
        f"fp8={recipe!r} "
        + ("needs its fp8_scale state" if scale_3 is None else "takes no fp8_scale state")
    )
  return _tensor_scaled(x_MxK.dtype, out_dtype, amax_axes, x_MxK, w, sizes, scale_3)


def _vary_alike(x, w):
  """x and w cast to vary over the same manual axes (a custom VJP's cotangents match its inputs':
  w's gradient is then summed over the axes only x varies over by the cast's transpose)."""
  return vary_like(x, w), vary_like(w, x)


def dot(
    x: jax.Array, w: jax.Array, in_dims: int, recipe: str, scale_3: jax.Array | None, dtype
) -> jax.Array:
  """`x`'s last `in_dims` axes contracted with `w`'s first `in_dims` (nn.DenseGeneral's product).

  With recipe `'none'` this is DenseGeneral's own product in `dtype` (`ops.matmul.dot`);
  otherwise the recipe's FP8 GEMM on the flattened [M, K] x [K, N] product. Per-tensor amaxes
  are maxima over the axes of an enclosing `amax_over` too.

  Args:
    x: the input, [..., *contracted].
    w: the weight, [*contracted, *out].
    in_dims: how many axes are contracted.
    recipe: one of `RECIPES`.
    scale_3: the delayed recipe's state, the scales of (x, w, g) [3]; None for other recipes.
    dtype: the compute and result dtype; `x` and `w` are cast to it.

  Returns:
    The product, [..., *out], in `dtype`.

  Raises:
    ValueError: an unknown recipe, or `scale_3` given for a recipe other than `'delayed'` (or
      missing for it).
  """
  x, w = x.astype(dtype), w.astype(dtype)
  if recipe == "none":  # XLA's dot, or oneDNN's inside a serving step (`ops.matmul`)
    return matmul_lib.dot(x, w, in_dims)
  lead, out = x.shape[: x.ndim - in_dims], w.shape[in_dims:]
  k = int(np.prod(w.shape[:in_dims]))
  y = _matmul(x.reshape(-1, k), w.reshape(k, -1), None, recipe, scale_3, dtype, _AMAX_AXES.get())
  return y.reshape(lead + out)


def grouped(
    x_MxK: jax.Array, w_GxKxN: jax.Array, sizes_G: jax.Array, recipe: str, scale_3: jax.Array | None
) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, sizes)` in the recipe.

  Per-tensor scales cover all of this device's experts together.

  Args:
    x_MxK: the rows, grouped by expert, [M, K].
    w_GxKxN: one weight per group, [G, K, N].
    sizes_G: rows per group, int [G].
    recipe: one of `RECIPES`.
    scale_3: the delayed recipe's state [3]; None for other recipes.

  Returns:
    The grouped product, [M, N], float32.

  Raises:
    ValueError: an unknown recipe, or `scale_3` given for a recipe other than `'delayed'` (or
      missing for it).
  """
  return _matmul(x_MxK, w_GxKxN, sizes_G, recipe, scale_3, _F32)


# -- delayed scaling's state --------------------------------------------------------------------


def is_state(path) -> bool:
  """Whether a key path names a delayed-scaling state leaf (its gradient combines by max).

  Args:
    path: a pytree key path.

  Returns:
    True when its last key is a string starting with `STATE_PREFIX`.
  """
  key = getattr(path[-1], "key", None) if path else None
  return isinstance(key, str) and key.startswith(STATE_PREFIX)


def accumulate(a: Any, b: Any) -> Any:
  """`a + b` over two gradient trees, except state leaves (observed amaxes): `max(a, b)`.

  Args:
    a: a gradient tree.
    b: a gradient tree of the same structure.

  Returns:
    The combined tree.
  """
  return jax.tree_util.tree_map_with_path(
      lambda p, u, v: jnp.maximum(u, v) if is_state(p) else u + v, a, b
  )


def map_grads(fn: Callable, grads: Any) -> Any:
  """`fn` on every gradient leaf but the state leaves (e.g. the loss normalisation).

  Args:
    fn: the function of a leaf.
    grads: a gradient tree.

  Returns:
    The tree with `fn` applied to every leaf that is not a state leaf; state leaves as they are.
  """
  return jax.tree_util.tree_map_with_path(lambda p, g: g if is_state(p) else fn(g), grads)


def state_of(tree: dict) -> dict:
  """The state leaves of a parameter-shaped dict tree (nested dicts), nothing else.

  Args:
    tree: nested dicts of parameters.

  Returns:
    The nested dicts that lead to state leaves, holding only those leaves.
  """
  out = {}
  for k, v in tree.items():
    if isinstance(k, str) and k.startswith(STATE_PREFIX):
      out[k] = v
    elif isinstance(v, dict):
      sub = state_of(v)
      if sub:
        out[k] = sub
  return out


def with_state(tree: dict, state: dict) -> dict:
  """`tree` with the leaves `state` names set to its values (added where `tree` lacks them).

  Args:
    tree: nested dicts of parameters.
    state: nested dicts of state leaves (the `state_of` structure).

  Returns:
    A new tree; `tree` itself is not changed.
  """
  out = dict(tree)
  for k, v in state.items():
    out[k] = with_state(tree.get(k, {}), v) if isinstance(v, dict) else v
  return out


def init_history(params: dict, length: int) -> dict:
  """Zero amax histories for every state leaf of `params`.

  Args:
    params: nested dicts of parameters whose state leaves are [..., 3].
    length: entries per history (`fp8_history`).

  Returns:
    The `state_of` structure with float32 zeros [..., 3, length] for each state leaf.
  """
  return jax.tree.map(lambda s: jnp.zeros(s.shape + (length,), _F32), state_of(params))


_roll_in = jnp.vectorize(fp8_ops.compute_amax_history, signature="(),(h)->(h)")
_FORMAT_MAX = np.array([fp8_max(f) for f in SCALE_FORMATS], np.float32)


def advance(
    scales: dict, history: dict, seen: dict, margin: int = 0, algo: str = "max"
) -> tuple[dict, dict]:
  """One step of delayed scaling.

  Each observed amax enters its history, then the scales follow TE's rule,
  `(fp8_max / amax) / 2^margin`, from the history's maximum or its newest entry; a zero or
  non-finite amax keeps the old scale. All three trees have the `state_of` structure.

  Args:
    scales: the scales the step used, leaves [..., 3].
    history: the amax histories, leaves [..., 3, length].
    seen: the amaxes the step observed, leaves [..., 3].
    margin: TE's margin, powers of two of headroom below the format's largest value.
    algo: `'max'` (the history's maximum) or `'most_recent'` (its newest entry).

  Returns:
    `(scales, history)`: the next step's scales and the updated histories.

  Raises:
    ValueError: an unknown `algo`.
  """
  if algo not in AMAX_ALGOS:
    raise ValueError(f"fp8_amax={algo!r} is unknown; use one of {AMAX_ALGOS}")

  def one(s, h, a):
    h = _roll_in(a, h)
    use = jnp.max(h, axis=-1) if algo == "max" else h[..., 0]
    return fp8_ops.compute_scale(use, s, _FORMAT_MAX, margin), h

  pairs = jax.tree.map(one, scales, history, seen)
  is_pair = lambda v: isinstance(v, tuple)
  return (
      jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
      jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
  )
