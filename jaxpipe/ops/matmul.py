"""The GEMM behind the model's projections and output head: XLA's dot, or oneDNN's.

Backends: `xla` (`lax.dot_general`, everywhere), `onednn` (`kernels_cpu.matmul`: CPU only,
float32 or bfloat16, its gradients oneDNN products too) and `auto`, which resolves to onednn on a
CPU where the kernel builds and to xla elsewhere. A kernel that cannot be built is said once per
process (a `RuntimeWarning`), and auto then takes xla.

The choice is made while tracing: code traced inside `backend('onednn')` runs its projections
(`dot`) through oneDNN; everything else runs XLA's dot. A serving engine traces its steps
inside its `EngineConfig.matmul` (default auto), the trainer its step inside `train.matmul`
(default xla). A product oneDNN does not take (another dtype, mixed dtypes) runs XLA's dot there
too.

Padding rows: traced inside `leading_rows(n, T)`, a prepacked product of T rows computes only the
first n (rounded up to 16) and zeros the rest (a serving step's padding to its token bucket).

Prepacked weights: a serving engine on oneDNN holds each projection's kernel (and the output
head) also in oneDNN's blocked layout (`Prepacked`), made once by `prepack`, so that a step's
products read the blocks their kernels load instead of reordering row-major weights every call
(decode's few rows paid that copy at every weight read). `layers.Dense`, traced inside
`prepacking()`, stores its kernel so in the `PREPACKED` collection, and an apply given that
collection reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_cpu import matmul as onednn_lib

BACKENDS = ("xla", "onednn", "auto")
PREPACKED = "prepacked"  # the flax collection of prepacked kernels (`layers.Dense`)
_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("matmul_backend", default="xla")
_PREPACKING: contextvars.ContextVar[bool] = contextvars.ContextVar("prepacking", default=False)
# (rows wanted, the rows they are of): `leading_rows`
_ROWS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("matmul_rows", default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepacked:
  """A weight [*contracted, *out] in oneDNN's blocked layout, as `dot` takes it (`prepack`)."""

  data: jax.Array  # uint8 [bytes]: the [K, N] product's weights, oneDNN's layout
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # the weight's own
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))  # float32 or bfloat16
  in_dims: int = dataclasses.field(metadata=dict(static=True))  # leading axes contracted

  def astype(self, dtype) -> Prepacked:
    """Itself, for its own dtype (a projection's cast to the compute dtype).

    Args:
      dtype: the dtype a product runs in.

    Returns:
      This weight.

    Raises:
      ValueError: another dtype (prepack the weight in the dtype it is used in).
    """
    if jnp.dtype(dtype) != self.dtype:
      raise ValueError(
          f"a weight prepacked in {self.dtype} is used in {jnp.dtype(dtype)}; prepack it in the "
          "compute dtype"
      )
    return self


def prepack(w: jax.Array, in_dims: int = 1, *, transpose_w: bool = False) -> Prepacked:
  """`w` in oneDNN's blocked layout, for `dot` on the CPU.

  Args:
    w: [*contracted, *out], float32 or bfloat16 (the dtype the products run in); with
      transpose_w, [N, K] (a tied embedding as the output head).
    in_dims: how many of w's leading axes are contracted (1 with transpose_w).
    transpose_w: w is given transposed.

  Returns:
    The prepacked weight: the logical shape [*contracted, *out] ([K, N] with transpose_w).

  Raises:
    RuntimeError: the oneDNN kernel is unavailable here (the reason).
    ValueError: another dtype, or transpose_w with in_dims other than 1 or w not 2-D.
  """
  if transpose_w and (w.ndim != 2 or in_dims != 1):
    raise ValueError(f"transpose_w takes a 2-D w and in_dims 1, not {w.shape}, {in_dims}")
  shape = tuple(w.shape[::-1]) if transpose_w else tuple(w.shape)
  k = int(np.prod(shape[:in_dims]))
  w_2d = w if transpose_w else w.reshape(k, -1)
  data = onednn_lib.prepack(w_2d, transpose_w=transpose_w)
  return Prepacked(data, shape, jnp.dtype(w.dtype), in_dims)


@contextlib.contextmanager
def prepacking():
  """While tracing inside, a `layers.Dense` puts its kernel prepacked in `PREPACKED`."""
  token = _PREPACKING.set(True)
  try:
    yield
  finally:
    _PREPACKING.reset(token)


def is_prepacking() -> bool:
  """Whether the code being traced runs inside `prepacking()`."""
  return _PREPACKING.get()


@contextlib.contextmanager
def leading_rows(rows: jax.Array, total: int):
  """While tracing inside, a product on prepacked weights whose input has `total` rows (its
  leading axes flattened) computes only the first `rows` of them, the others zeros.

  A serving step's tokens are its real ones, then padding to a bucket: the padding's rows then
  cost no multiply-adds. Products of another row count (the head over the sampled rows) are
  computed whole.

  Args:
    rows: an int32 scalar traced in the same program, at most `total`.
    total: the rows of the products it limits.
  """
  token = _ROWS.set((rows, int(total)))
  try:
    yield
  finally:
    _ROWS.reset(token)


@functools.cache
def _fall_back(reason: str) -> None:
  """Says once per process why auto runs XLA's dot."""
  warnings.warn(
      f"matmul: the oneDNN kernel is unavailable ({reason}); running XLA's dot",
      RuntimeWarning,
      stacklevel=3,
  )


def resolve(name: str) -> str:
  """The backend a serving engine or the trainer runs for `name`.

  Args:
    name: one of `BACKENDS`.

  Returns:
    'xla' or 'onednn'.

  Raises:
    ValueError: an unknown name, or 'onednn' where the kernel cannot run (the reason, and the
      fix).
  """
  if name not in BACKENDS:
    raise ValueError(f"unknown matmul backend {name!r}; choose one of {BACKENDS}")
  if name == "xla":
    return name
  reason = onednn_lib.unavailable()
  if name == "onednn" and reason is not None:
    raise ValueError(f"matmul backend 'onednn' is unavailable: {reason}; use 'xla'")
  if reason is not None:
    if jax.default_backend() == "cpu":  # not worth a word on an accelerator
      _fall_back(reason)
    return "xla"
  return "onednn"


def bfloat16_note(name: str, dtype) -> str | None:
  """A line for the user where products on `name` in `dtype` run as float32 ones on this CPU.

  Args:
    name: the resolved backend ('xla' or 'onednn').
    dtype: the dtype the model computes in.

  Returns:
    The line for oneDNN's bfloat16 products on a CPU without bfloat16 dot products
    (`kernels_cpu.matmul.bf16_in_float32`); None otherwise.
  """
  if name != "onednn" or jnp.dtype(dtype) != jnp.bfloat16 or not onednn_lib.bf16_in_float32():
    return None
  held = (
      "prepacked weights held as bfloat16 and widened as they load (the kernel's own AVX-512 "
      "tiles)"
      if onednn_lib.panels(1024, 1024)
      else "prepacked weights held as float32 (twice bfloat16's bytes)"
  )
  return (
      "# this CPU has no bfloat16 dot products (AVX512_BF16 or AMX): bfloat16 GEMMs run as "
      f"float32 ones, {held}, row-major ones (a tensor-parallel engine's) widened at each call"
  )


@contextlib.contextmanager
def backend(name: str):
  """While tracing inside, `dot` runs on this backend.

  Args:
    name: 'xla' or 'onednn' (`resolve`'s result).

  Raises:
    ValueError: another name.
  """
  if name not in ("xla", "onednn"):
    raise ValueError(f"matmul backend {name!r}: resolve it first ('xla' or 'onednn')")
  token = _BACKEND.set(name)
  try:
    yield
  finally:
    _BACKEND.reset(token)


def dot(
    x: jax.Array,
    w: jax.Array | Prepacked,
    in_dims: int = 1,
    out_dtype=None,
    *,
    transpose_w: bool = False,
) -> jax.Array:
  """`x`'s last `in_dims` axes contracted with `w`'s first `in_dims` (DenseGeneral's product).

  Args:
    x: the input, [..., *contracted].
    w: the weight, [*contracted, *out]; with transpose_w, [N, K] (2-D, contracted last); or
      the weight prepacked (`prepack`, in x's dtype), which oneDNN runs whatever the backend.
    in_dims: how many axes are contracted.
    out_dtype: the result's dtype; None: the inputs' (XLA's default for a dot).
    transpose_w: w is given transposed, [N, K] (a tied embedding as the output head).

  Returns:
    The product, [..., *out].

  Raises:
    ValueError: transpose_w with a w not 2-D or in_dims not 1; a prepacked w for another
      in_dims, or of another dtype than x's.
  """
  if isinstance(w, Prepacked):
    return _prepacked(x, w, in_dims, out_dtype)
  if transpose_w and (w.ndim != 2 or in_dims != 1):
    raise ValueError(f"transpose_w takes a 2-D w and in_dims 1, not {w.shape}, {in_dims}")
  out_dtype = None if out_dtype is None else jnp.dtype(out_dtype)
  k = int(np.prod(x.shape[x.ndim - in_dims :]))
  out = w.shape[:1] if transpose_w else w.shape[in_dims:]
  onednn = (
      _BACKEND.get() == "onednn"
      and x.dtype in onednn_lib.DTYPES
      and w.dtype == x.dtype
      and out_dtype in (None, x.dtype, jnp.float32)
  )
  if onednn:
    w_2d = w if transpose_w else w.reshape(k, -1)
    y = onednn_lib.matmul(x.reshape(-1, k), w_2d, out_dtype, transpose_w=transpose_w)
    return y.reshape(x.shape[: x.ndim - in_dims] + tuple(out))
  if transpose_w:
    w = w.T
  x_axes = tuple(range(x.ndim - in_dims, x.ndim))
  return lax.dot_general(
      x, w, ((x_axes, tuple(range(in_dims))), ((), ())), preferred_element_type=out_dtype
  )


def _prepacked(x: jax.Array, w: Prepacked, in_dims: int, out_dtype) -> jax.Array:
  """`dot` of a prepacked weight."""
  if in_dims != w.in_dims or x.dtype != w.dtype:
    raise ValueError(
        f"a weight prepacked for {w.in_dims} contracted axes in {w.dtype} is used for {in_dims} "
        f"in {x.dtype}; prepack it for the product it runs in"
    )
  k, out = int(np.prod(w.shape[:in_dims])), w.shape[in_dims:]
  x_MxK = x.reshape(-1, k)
  limit = _ROWS.get()
  rows = limit[0] if limit is not None and limit[1] == x_MxK.shape[0] else None
  y = onednn_lib.matmul_prepacked(x_MxK, w.data, int(np.prod(out)), out_dtype, rows)
  return y.reshape(x.shape[: x.ndim - in_dims] + tuple(out))
