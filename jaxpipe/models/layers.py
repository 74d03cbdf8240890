"""The layers every model block is built of: RMSNorm and the projections (`Dense`, whose matmul
runs in the model's FP8 recipe), with DenseGeneral's parameter names, shapes and init."""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.ops import matmul as matmul_lib


def rms_norm(
    x_BxLxD: jax.Array, scale_D: jax.Array, eps: float, plus_one: bool = False
) -> jax.Array:
  """`x / rms(x) * scale`, computed in float32.

  Args:
    x_BxLxD: the activations, [..., D].
    scale_D: the norm's scale, [D].
    eps: added to the mean square.
    plus_one: scale by `1 + scale` instead (Gemma's).

  Returns:
    The normalised activations, shaped as `x_BxLxD`, in its dtype.
  """
  x = x_BxLxD.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return (y * (1.0 + scale_D if plus_one else scale_D)).astype(x_BxLxD.dtype)


# Normal, not Flax's default truncated normal: same scale, and XLA compiles it several times faster.
KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


class RMSNorm(nn.Module):
  eps: float
  plus_one: bool = False  # scale by 1 + w, w starting at 0 (Gemma)

  @nn.compact
  def __call__(self, x_BxLxD):
    """Normalises `x_BxLxD` with the module's `scale` parameter [D].

    Args:
      x_BxLxD: the activations, [..., D].

    Returns:
      `rms_norm(x_BxLxD, scale, eps, plus_one)`, shaped as `x_BxLxD`.
    """
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale_D = self.param("scale", init, (x_BxLxD.shape[-1],), jnp.float32)
    return rms_norm(x_BxLxD, scale_D, self.eps, self.plus_one)


def kernel_init(in_dims: int):
  """DenseGeneral's kernel initialiser: fan-in over all `in_dims` contracted axes together.

  Args:
    in_dims: the kernel's leading axes that a projection contracts.

  Returns:
    `init(rng, shape, dtype)`.
  """

  def init(rng, shape, dtype):  # DenseGeneral's: fan-in over all contracted axes together
    flat = (int(np.prod(shape[:in_dims])), int(np.prod(shape[in_dims:])))
    return KERNEL_INIT(rng, flat, dtype).reshape(shape)

  return init


class Kernel(nn.Module):
  """A bias-free DenseGeneral's kernel alone (same name, shape and init), for fused callers."""

  shape: tuple[int, ...]
  in_dims: int  # leading axes of `shape` that the projection contracts

  @nn.compact
  def __call__(self) -> jax.Array:
    return self.param("kernel", kernel_init(self.in_dims), self.shape, jnp.float32)


class Dense(nn.Module):
  """x's last `in_dims` axes projected to `features`: a bias-free DenseGeneral (same kernel name,
  shape and init) whose matmul runs in `cfg.fp8` (`fp8.dot`); every projection of the model.

  Traced inside `ops.matmul.prepacking()` (and without FP8), it also puts its kernel prepacked
  in the compute dtype into the `ops.matmul.PREPACKED` collection; an apply given that
  collection runs the product on the prepacked kernel."""

  features: tuple[int, ...]
  cfg: Any  # the model's config: its `fp8` recipe and `compute_dtype`
  in_dims: int = 1
  use_bias: bool = False  # a bias [features], added after `reduce`
  # applied to the product before the bias (a row-parallel projection's sum over tp ranks)
  reduce: Any = None
  # inside `prepacking()`, store the kernel prepacked (False: a `dense_group` stores it fused)
  prepack: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Projects `x`'s last `in_dims` axes to `features`.

    Args:
      x: the input, [..., *in].

    Returns:
      [..., *features] in the compute dtype: the product, passed through `reduce` when set, plus
      the bias when `use_bias`.
    """
    shape = x.shape[x.ndim - self.in_dims :] + tuple(self.features)
    if self.has_variable(matmul_lib.PREPACKED, "kernel"):
      w = self.get_variable(matmul_lib.PREPACKED, "kernel")
      if w.shape != shape:
        raise ValueError(f"{self.path}: a kernel prepacked as {w.shape} projects {shape}")
    else:
      w = self.param("kernel", kernel_init(self.in_dims), shape, jnp.float32)
      if self.prepack and matmul_lib.is_prepacking() and self.cfg.fp8 == "none":
        w = matmul_lib.prepack(w.astype(self.cfg.compute_dtype), self.in_dims)
        self.put_variable(matmul_lib.PREPACKED, "kernel", w)
    scale_3 = None
    if self.cfg.fp8 == "delayed":  # dequantisation scales of (x, w, g); see fp8.py
      scale_3 = self.param("fp8_scale", nn.initializers.ones, (3,), jnp.float32)
    y = fp8_lib.dot(x, w, self.in_dims, self.cfg.fp8, scale_3, self.cfg.compute_dtype)
    if self.reduce is not None:
      y = self.reduce(y)
    if self.use_bias:
      b = self.param("bias", nn.initializers.zeros, tuple(self.features), jnp.float32)
      y = y + b.astype(y.dtype)
    return y


def dense_group(
    parent: nn.Module,
    x: jax.Array,
    outs: Sequence[tuple[str, tuple[int, ...]]],
    cfg: Any,
    use_bias: bool = False,
) -> list[jax.Array]:
  """`x` projected by `parent`'s sibling `Dense`s of one input (q, k and v; gate and up).

  Traced inside `ops.matmul.prepacking()` (and without FP8), it puts their kernels side by side
  along the output axis, prepacked in the compute dtype, with their biases, into the
  `ops.matmul.PREPACKED` collection under their names joined by '+'; an apply given that
  collection runs one product on it and splits the result (decode's few rows then read one
  weight where they read several). Otherwise each is its own `Dense`.

  Args:
    parent: the module whose children the projections are (called in its compact `__call__`).
    x: the input, [..., D].
    outs: each projection's name and features.
    cfg: the model's config: its `fp8` recipe and `compute_dtype`.
    use_bias: each projection adds a bias [features].

  Returns:
    Each projection's output, [..., *features], in the compute dtype.
  """
  fused = "+".join(name for name, _ in outs)
  widths = [int(np.prod(features)) for _, features in outs]
  if parent.has_variable(matmul_lib.PREPACKED, fused):
    entry = parent.get_variable(matmul_lib.PREPACKED, fused)
    y = matmul_lib.dot(x.astype(cfg.compute_dtype), entry["kernel"])
    if "bias" in entry:
      y = y + entry["bias"].astype(y.dtype)
    parts = jnp.split(y, np.cumsum(widths)[:-1], axis=-1)
    return [p.reshape(x.shape[:-1] + tuple(f)) for p, (_, f) in zip(parts, outs, strict=True)]
  fuse = matmul_lib.is_prepacking() and cfg.fp8 == "none"
  denses = [Dense(f, cfg, use_bias=use_bias, prepack=not fuse, name=name) for name, f in outs]
  ys = [dense(x) for dense in denses]
  if fuse:
    params = [dense.variables["params"] for dense in denses]
    w = jnp.concatenate([p["kernel"].reshape(x.shape[-1], -1) for p in params], axis=1)
    entry = {"kernel": matmul_lib.prepack(w.astype(cfg.compute_dtype))}
    if use_bias:
      entry["bias"] = jnp.concatenate([p["bias"].reshape(-1) for p in params])
    parent.put_variable(matmul_lib.PREPACKED, fused, entry)
  return ys
