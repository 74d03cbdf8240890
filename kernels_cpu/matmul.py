"""A GEMM on the CPU through oneDNN: `matmul.cc` through XLA's FFI.

oneDNN comes from the `onednn-cpu-gomp` and `onednn-devel-cpu-gomp` packages (its library and
its headers; installed with jaxpipe on x86-64 Linux). The C++ source is compiled on first use
(`kernels_cpu.build`) and linked against that library. `unavailable()` says why the kernel
cannot run here (not a CPU, no oneDNN, no compiler, a failed build); callers then take XLA's dot.

Why: on an AVX512_BF16 CPU oneDNN's matmul runs bfloat16 GEMMs at about twice float32's rate,
while XLA:CPU's dots run them no faster than float32 (docs/benchmarks.md, "Where a serving step's
time goes"); oneDNN's float32 GEMMs are also ahead of XLA's at a decode step's few rows. On a CPU
without bfloat16 dot products, bfloat16 products run as float32 ones (`bf16_in_float32`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_cpu import build as build_lib

SOURCE = Path(__file__).with_name("matmul.cc")
TARGET = "jaxpipe_matmul"
PREPACKED_TARGET, PREPACK_TARGET = "jaxpipe_matmul_prepacked", "jaxpipe_prepack"
ROWS_TARGET = "jaxpipe_matmul_prepacked_rows"  # the prepacked product of its first rows only
ROW_GRAIN = 16  # a row-limited product computes its rows rounded up to this (matmul.cc)
PANELS_ROWS = 256  # float32 products of more rows run oneDNN, not the own tiles (matmul.cc)
DTYPES = (jnp.float32, jnp.bfloat16)  # x and w alike; a bfloat16 product may come out float32
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
_LIBRARY, _HEADERS = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"
_INSTALL = f"pip install {_LIBRARY} {_HEADERS}"


def _found(package: str, name: str) -> Path:
  """The installed file of `package` whose path ends in `name`; FileNotFoundError naming the
  package and how to install it otherwise."""
  try:
    files = importlib.metadata.files(package) or []
  except importlib.metadata.PackageNotFoundError:
    files = []
  for f in files:
    if str(f).endswith(name):  # the wheels' paths are relative to site-packages
      return Path(f.locate()).resolve()
  raise FileNotFoundError(f"oneDNN's {name} is not installed ({_INSTALL})")


def onednn() -> tuple[Path, Path]:
  """(oneDNN's library directory, its include directory), from the installed packages.

  Returns:
    The two directories.

  Raises:
    FileNotFoundError: a package is missing (the message says what to install).
  """
  lib = _found(_LIBRARY, "/libdnnl.so").parent
  header = _found(_HEADERS, "/oneapi/dnnl/dnnl.hpp")
  return lib, header.parents[2]


def build() -> Path:
  """The compiled library, built now unless the cache holds it; an error says why not."""
  lib, include = onednn()
  link = (f"-L{lib}", "-ldnnl", f"-Wl,-rpath,{lib}")
  return build_lib.library(SOURCE, (*FLAGS, f"-I{include}"), link)


@functools.cache
def unavailable() -> str | None:
  """None once the kernel is built and registered with XLA for the CPU; else the reason."""
  if jax.default_backend() != "cpu":
    return f"runs on CPU only, and this process runs on {jax.default_backend()}"
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in (
        (TARGET, library.JaxpipeMatmul),
        (PREPACKED_TARGET, library.JaxpipeMatmulPrepacked),
        (ROWS_TARGET, library.JaxpipeMatmulPrepackedRows),
        (PREPACK_TARGET, library.JaxpipePrepack),
    ):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    library.JaxpipeSetBf16InFloat32.argtypes = (ctypes.c_int,)
    library.JaxpipeSetPanels.argtypes = (ctypes.c_int,)
    library.JaxpipePanels.argtypes = (ctypes.c_int64, ctypes.c_int64)
    library.JaxpipePanelsCalls.restype = ctypes.c_int64
    library.JaxpipePrepackedBytes.restype = ctypes.c_int64
    library.JaxpipePrepackedBytes.argtypes = (ctypes.c_int64, ctypes.c_int64, ctypes.c_int)
    _LOADED.append(library)
  except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
    return str(e)
  return None


_LOADED: list[ctypes.CDLL] = []  # the library, once `unavailable()` has loaded it


def _check_available() -> None:
  reason = unavailable()
  if reason is not None:
    raise RuntimeError(f"the oneDNN matmul kernel is unavailable: {reason}")


def bf16_in_float32() -> bool:
  """Whether bfloat16 products run as float32 ones on this CPU.

  Where oneDNN has no bfloat16 dot products (its ISA lacks AVX512_BF16 and AMX: Ice Lake,
  Cascade Lake, Zen 3, AVX2 machines; or ONEDNN_MAX_CPU_ISA caps it below them) its bfloat16
  GEMM is emulated at about a fifth of its float32 rate. There x is widened (exactly), prepacked
  bfloat16 weights are held as bfloat16 and widened as they load where the kernel's own tiles
  run (`panels`: Intel CPUs with AVX-512), else as float32 (twice the bytes), and the float32
  sums are rounded to bfloat16 once: the same product at float32's rate.

  Returns:
    True where bfloat16 products run as float32 ones.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  _check_available()
  return bool(_LOADED[0].JaxpipeBf16InFloat32())


@contextlib.contextmanager
def _overridden(setter: str, value: bool):
  """One of the library's process-wide choices set to `value` inside, and back to the CPU's
  rule after (`setter`: its C function, which takes 1, 0 or -1)."""
  _check_available()
  set_choice = getattr(_LOADED[0], setter)
  set_choice(int(bool(value)))
  try:
    yield
  finally:
    set_choice(-1)


@contextlib.contextmanager
def bf16_as_float32(value: bool):
  """Runs bfloat16 products as float32 ones (True) or on oneDNN's bfloat16 kernels (False)
  inside, whatever the CPU (tests of either path). Weights prepacked inside are refused outside
  where the two differ, and the other way round.

  Args:
    value: the path to take.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  with _overridden("JaxpipeSetBf16InFloat32", value):
    yield


def panels(k: int, n: int) -> bool:
  """Whether float32 products on prepacked [K, N] weights run the kernel's own AVX-512 GEMM.

  Prepacked float32 weights are oneDNN's blocked layout (BA16a64b); on Intel CPUs with AVX-512
  the kernel's own tiles (`Panels` in matmul.cc) multiply by the same bytes instead of oneDNN's
  brgemm, for products of at most PANELS_ROWS rows (1.16-1.17x its rate at a decode step's 16
  and 64 rows on an Ice Lake Xeon, 0.94-0.99x at 1,024, where oneDNN runs them).
  bfloat16 products on a CPU without bfloat16 dot products take them too, on bfloat16 weights
  held in that layout and widened as they load. Elsewhere oneDNN runs them.

  Args:
    k: the weights' rows.
    n: their columns.

  Returns:
    True where `Panels` runs them.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  _check_available()
  return bool(_LOADED[0].JaxpipePanels(k, n))


def panels_calls() -> int:
  """Products the kernel's own AVX-512 GEMM (`panels`) ran in this process so far.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  _check_available()
  return int(_LOADED[0].JaxpipePanelsCalls())


@contextlib.contextmanager
def panels_forced(value: bool):
  """Runs float32 products on prepacked weights on `Panels` (True; where it is built, with
  AVX-512) or on oneDNN (False) inside, whatever the CPU (tests and benchmarks of either).

  Args:
    value: the kernel to take.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  with _overridden("JaxpipeSetPanels", value):
    yield


def prepacked_bytes(k: int, n: int, dtype) -> int:
  """The size of [K, N] weights of `dtype` in oneDNN's packed layout (`prepack`).

  Args:
    k: the contracted size.
    n: the output size.
    dtype: float32 or bfloat16.

  Returns:
    The packed array's length in bytes.

  Raises:
    RuntimeError: the kernel is unavailable here, or oneDNN has no product of these weights.
    ValueError: another dtype.
  """
  _check_available()
  dtype = jnp.dtype(dtype)
  if dtype not in DTYPES:
    raise ValueError(f"oneDNN packs float32 or bfloat16 weights, not {dtype}")
  size = _LOADED[0].JaxpipePrepackedBytes(int(k), int(n), int(dtype == jnp.bfloat16))
  if size < 0:
    raise RuntimeError(f"oneDNN has no packed layout for [{k}, {n}] {dtype} weights")
  return size


def prepack(w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
  """w [K, N] (or with transpose_w its [N, K] transpose) in oneDNN's packed layout.

  oneDNN's matmul reads packed weights in the blocks its kernels load, where row-major weights
  are reordered into them at every call: decode's few rows pay that copy once per weight read.
  The layout is this process's (this CPU's kernels): packed bytes are not saved.

  Args:
    w: float32 or bfloat16, 2-D.
    transpose_w: w is [N, K].

  Returns:
    uint8 [prepacked_bytes(K, N, w.dtype)], for `matmul_prepacked`.

  Raises:
    RuntimeError: the kernel is unavailable here.
    ValueError: w is not 2-D float32 or bfloat16.
  """
  if w.ndim != 2 or jnp.dtype(w.dtype) not in DTYPES:
    raise ValueError(f"oneDNN packs 2-D float32 or bfloat16 weights, not {w.shape} {w.dtype}")
  k, n = w.shape[::-1] if transpose_w else w.shape
  out = jax.ShapeDtypeStruct((prepacked_bytes(k, n, w.dtype),), jnp.uint8)
  return jax.ffi.ffi_call(PREPACK_TARGET, out)(w, transpose_w=bool(transpose_w))


def matmul_prepacked(
    x_MxK: jax.Array, packed: jax.Array, n: int, out_dtype=None, rows: jax.Array | None = None
) -> jax.Array:
  """x @ w by oneDNN, w [K, N] given prepacked (`prepack`, in x's dtype). Not differentiable.

  Args:
    x_MxK: float32 or bfloat16.
    packed: `prepack(w)` for w of x's dtype, K and this n.
    n: the output size.
    out_dtype: x's dtype (when None) or float32.
    rows: None, or an int32 scalar r: only the first r rows (rounded up to ROW_GRAIN, at most M)
      are computed and the rest are zeros (a serving step's padding rows).

  Returns:
    [M, N] in out_dtype, accumulated in float32.

  Raises:
    RuntimeError: the kernel is unavailable here.
    ValueError: dtypes, or a packed size that is not this K, n and dtype's (N is padded to
      oneDNN's blocks: weights packed for a nearby N are not told apart here, but by
      `ops.matmul.Prepacked`'s shape).
  """
  out_dtype = jnp.dtype(out_dtype or x_MxK.dtype)
  if x_MxK.ndim != 2 or x_MxK.dtype not in DTYPES or out_dtype not in (x_MxK.dtype, jnp.float32):
    raise ValueError(
        f"the packed oneDNN matmul takes x [M, K] float32 or bfloat16 giving its dtype or float32, "
        f"not x {x_MxK.shape} {x_MxK.dtype} -> {out_dtype}"
    )
  size = prepacked_bytes(x_MxK.shape[1], n, x_MxK.dtype)
  if packed.dtype != jnp.uint8 or packed.shape != (size,):
    raise ValueError(
        f"packed weights of {packed.shape} {packed.dtype} are not [{x_MxK.shape[1]}, {n}] "
        f"{x_MxK.dtype} weights packed (uint8 [{size}]); pack them with `prepack`"
    )
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], n), out_dtype)
  threads = _threads(_shard_map_devices())
  if rows is None:
    return jax.ffi.ffi_call(PREPACKED_TARGET, out)(x_MxK, packed, threads=threads)
  rows = jnp.asarray(rows, jnp.int32).reshape(())
  return jax.ffi.ffi_call(ROWS_TARGET, out)(x_MxK, packed, rows, threads=threads)


def matmul(
    x_MxK: jax.Array, w: jax.Array, out_dtype=None, *, transpose_w: bool = False
) -> jax.Array:
  """x @ w by oneDNN, where w is [K, N], or with transpose_w [N, K] and its transpose is used.

  Differentiable: the gradients are oneDNN products too (dx = g @ w^T with w read in place, dw =
  x^T @ g after XLA transposes x), taken in x's dtype and accumulated in float32.

  Args:
    x_MxK: float32 or bfloat16.
    w: the weight, of x's dtype.
    out_dtype: x's dtype (when None) or float32.
    transpose_w: w is [N, K] (read in place, as a tied embedding for the output head).

  Returns:
    [M, N] in out_dtype, accumulated in float32.

  Raises:
    RuntimeError: the kernel is unavailable here (the reason).
    ValueError: dtypes or shapes it does not take.
  """
  _check_available()
  out_dtype = jnp.dtype(out_dtype or x_MxK.dtype)
  if (
      x_MxK.dtype not in DTYPES
      or w.dtype != x_MxK.dtype
      or out_dtype not in (x_MxK.dtype, jnp.float32)
  ):
    raise ValueError(
        "the oneDNN matmul takes x and w both float32 (giving float32) or both bfloat16 (giving "
        f"bfloat16 or float32), not x {x_MxK.dtype}, w {w.dtype} -> {out_dtype}"
    )
  k, n = w.shape[::-1] if transpose_w else w.shape
  if x_MxK.ndim != 2 or w.ndim != 2 or x_MxK.shape[1] != k:
    raise ValueError(
        f"the oneDNN matmul takes x [M, K] and w [K, N] (or [N, K] transposed), not x "
        f"{x_MxK.shape} and w {w.shape}{' transposed' if transpose_w else ''}"
    )
  return _product(x_MxK, w, out_dtype, bool(transpose_w))


def _shard_map_devices() -> int:
  """The devices of the `shard_map` being traced, each running its own calls; 0 outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.size if mesh.manual_axes else 0


def _threads(devices: int) -> int:
  """oneDNN's threads for one device's call while `devices` run theirs at once: its share of this
  process's cores; 0 (every core) for a call on one device."""
  return 0 if devices <= 1 else max(1, len(os.sched_getaffinity(0)) // devices)


def _ffi(x_MxK: jax.Array, w: jax.Array, out_dtype, transpose_w: bool, threads: int) -> jax.Array:
  """The FFI call itself (arguments checked): one device's whole product."""
  n = w.shape[0] if transpose_w else w.shape[1]
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_MxK.shape[0], n), out_dtype))
  return call(x_MxK, w, transpose_w=transpose_w, threads=threads)


def _call(x_MxK: jax.Array, w: jax.Array, out_dtype, transpose_w: bool) -> jax.Array:
  """The product, each device computing its share of a sharded one.

  XLA's partitioner replicates an FFI call's operands: x sharded over a data axis would be
  gathered and every device would run the whole batch's product. Partitioned here instead: y's
  rows follow x's, its columns w's, and a sharded contraction is summed across its axes. Inside
  `shard_map` each device's call is already its own share.
  """
  if devices := _shard_map_devices():
    return _ffi(x_MxK, w, out_dtype, transpose_w, _threads(devices))
  return _partitioned(jnp.dtype(out_dtype).name, transpose_w)(x_MxK, w)


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _split(x_spec, w_spec, transpose_w: bool):
  """(x's, w's and y's PartitionSpecs, the contraction's axes) for the shardings proposed.

  Rows keep x's axes and columns w's, unless they share one (then columns are gathered); the
  contraction stays sharded only where x and w shard it alike, and on no axis of rows or columns.
  """
  x_spec, w_spec = (tuple(s) + (None,) * (2 - len(s)) for s in (x_spec, w_spec))
  m, k_x = x_spec
  n, k_w = w_spec if transpose_w else w_spec[::-1]
  if set(_axes(m)) & set(_axes(n)):
    n = None
  k = k_x if _axes(k_x) == _axes(k_w) else None
  if set(_axes(k)) & (set(_axes(m)) | set(_axes(n))):
    k = None
  w = P(n, k) if transpose_w else P(k, n)
  return P(m, k), w, P(m, n), _axes(k)


@functools.cache
def _partitioned(out_dtype: str, transpose_w: bool):
  """The product of x [M, K] and w as a `custom_partitioning` (see `_call`), one per variant."""

  @custom_partitioning
  def product(x_MxK, w):  # one device's (XLA partitions nothing then)
    return _ffi(x_MxK, w, out_dtype, transpose_w, 0)

  def shardings(arg_shapes):
    x, w = (a.sharding for a in arg_shapes)
    return _split(x.spec, w.spec, transpose_w)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, shardings(arg_shapes)[2])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x, w, y, summed = shardings(arg_shapes)
    threads = _threads(mesh.size)

    def local(x_MxK, w):
      if not summed:
        return _ffi(x_MxK, w, out_dtype, transpose_w, threads)
      # each device holds a part of the sum: add them in float32, round once
      part = _ffi(x_MxK, w, jnp.float32, transpose_w, threads)
      return jax.lax.psum(part, summed).astype(out_dtype)

    arg = (NamedSharding(mesh, x), NamedSharding(mesh, w))
    return mesh, local, NamedSharding(mesh, y), arg

  product.def_partition(
      partition=partition,
      infer_sharding_from_operands=infer,
      sharding_rule="m k, n k -> m n" if transpose_w else "m k, k n -> m n",
      reduction_factors=("k",),
  )
  return product


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(x_MxK, w, out_dtype, transpose_w):
  return _call(x_MxK, w, out_dtype, transpose_w)


def _product_fwd(x_MxK, w, out_dtype, transpose_w):
  return _call(x_MxK, w, out_dtype, transpose_w), (x_MxK, w)


def _product_bwd(out_dtype, transpose_w, saved, g_MxN):
  del out_dtype
  x_MxK, w = saved
  g_MxN, f32 = g_MxN.astype(x_MxK.dtype), jnp.float32
  if transpose_w:  # y = x @ w^T, w [N, K]
    dx_MxK = _call(g_MxN, w, f32, False)
    dw = _call(g_MxN.T, x_MxK, f32, False)  # [N, K]
  else:  # y = x @ w, w [K, N]
    dx_MxK = _call(g_MxN, w, f32, True)
    dw = _call(x_MxK.T, g_MxN, f32, False)  # [K, N]
  return dx_MxK.astype(x_MxK.dtype), dw.astype(w.dtype)


_product.defvjp(_product_fwd, _product_bwd)
