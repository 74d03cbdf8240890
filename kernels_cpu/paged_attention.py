"""Ragged paged attention on the CPU: `paged_attention.cc` through XLA's FFI.

The C++ source is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`),
for this CPU (`-march=native`), into a cache directory (`$JAXPIPE_KERNEL_CACHE`, else
`~/.cache/jaxpipe/kernels_cpu`, else one under the system's temporary directory) keyed by the
source, the flags, the compiler, the CPU and jaxlib, so that later processes load it in
milliseconds. `unavailable()` says why the kernel cannot run here (no compiler, a failed build),
and callers then take the XLA path.

Why a kernel: on CPU, XLA gathers a step's pages into a copy and reads the copy again in a
separate fusion for every (block, key chunk) round (`jaxpipe.ops.attention._block_attention`);
this kernel reads each page in place once per tile of queries, with the online softmax in
registers and scratch (docs/serving.md, "A CPU kernel").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "jaxpipe_ragged_paged_attention"
TARGET_INT8 = "jaxpipe_ragged_paged_attention_int8"  # int8 pools with a float32 scale per slot
TARGET_BF16 = "jaxpipe_ragged_paged_attention_bf16"  # bfloat16 pools
HEAD_DIM_MULTIPLE = 8  # the kernel's register blocks (8 floats)
POOL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)
# a bfloat16 pool may also come as its bits (uint16), which XLA:CPU updates in place
BF16_BITS = jnp.uint16
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         "-fopenmp-simd")  # fmt: skip


def _cache_dir() -> Path:
  """$JAXPIPE_KERNEL_CACHE, else ~/.cache/jaxpipe/kernels_cpu, else (a home that cannot be
  written) a directory of this user's under the system's temporary directory, which must be
  this user's own and writable by no one else (it holds libraries this process loads)."""
  root = os.environ.get("JAXPIPE_KERNEL_CACHE")
  if root:
    return Path(root)
  home = Path.home() / ".cache" / "jaxpipe" / "kernels_cpu"
  try:
    home.mkdir(parents=True, exist_ok=True)
    if os.access(home, os.W_OK):
      return home
  except OSError:
    pass
  tmp = Path(tempfile.gettempdir()) / f"jaxpipe-kernels-cpu-{os.getuid()}"
  tmp.mkdir(mode=0o700, exist_ok=True)
  st = tmp.stat()
  if st.st_uid != os.getuid() or st.st_mode & 0o022:
    raise OSError(f"{tmp} is not this user's alone; set $JAXPIPE_KERNEL_CACHE to a directory")
  return tmp


def _cpu() -> str:
  """What -march=native compiles for: the CPU's model and features (x86 and Arm lines)."""
  keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
  try:
    with open("/proc/cpuinfo") as f:
      lines = [x for x in f if x.startswith(keys)]
    return platform.machine() + "".join(sorted(set(lines)))
  except OSError:
    return platform.machine() + platform.processor()


def _compiler() -> tuple[str, str]:
  """(the compiler's path, its --version) -> FileNotFoundError naming $CXX when there is none."""
  name = os.environ.get("CXX", "c++")
  path = shutil.which(name)
  if path is None:
    raise FileNotFoundError(f"no C++ compiler {name!r} on PATH (set $CXX or install g++)")
  version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
  return path, version.stdout


def build() -> Path:
  """The compiled library, built now unless the cache holds it; an error says why not."""
  compiler, version = _compiler()
  include = jax.ffi.include_dir()
  key = hashlib.sha256()
  for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu().encode(),
               jaxlib.version.__version__.encode(), include.encode()):  # fmt: skip
    key.update(part)
  out = _cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed: processes that build at once (test workers) each
  # rename a whole library, never load a half-written one.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    run = subprocess.run(
        [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode:
      tail = "\n".join(run.stderr.strip().splitlines()[-5:])
      raise RuntimeError(f"compiling {SOURCE.name} with {compiler} failed:\n{tail}")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o755 & ~umask)  # readable by whoever shares the cache, as the linker's output
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.cache
def unavailable() -> str | None:
  """None once the kernel is built and registered with XLA for the CPU; else the reason."""
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in ((TARGET, "JaxpipeRaggedPagedAttention"),
                           (TARGET_BF16, "JaxpipeRaggedPagedAttentionBf16"),
                           (TARGET_INT8, "JaxpipeRaggedPagedAttentionInt8")):  # fmt: skip
      jax.ffi.register_ffi_target(
          target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
      )
  except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
    return str(e)
  return None


def ragged_paged_attention(
    q_TxHxK: jax.Array,
    k_pages_GxPxSxK: jax.Array,
    v_pages_GxPxSxK: jax.Array,
    tables_BxN: jax.Array,
    starts_B: jax.Array,
    counts_B: jax.Array,
    cached_B: jax.Array,
    *,
    sm_scale: float,
    k_scales_GxPxS: jax.Array | None = None,
    v_scales_GxPxS: jax.Array | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Each token of each row over its sequence's keys at positions 0..its own -> [T, H, K]
  float32 (zeros for tokens of no row). Row b: counts_B[b] tokens from flat token starts_B[b],
  at positions cached_B[b] onward, its pages tables_BxN[b]. Pools: float32, bfloat16, or int8
  with a float32 scale per (head, page, slot) (`jaxpipe.serve.model.quantize`'s cache).

  window: > 0, a token at position p sees the keys at p - window + 1 .. p only, and only their
  pages are read (a traced int32 may vary by layer); softcap: > 0, scores become
  softcap·tanh(s / softcap) before the softmax."""
  reason = unavailable()
  if reason is not None:
    raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {reason}")
  dtype = k_pages_GxPxSxK.dtype
  if dtype == BF16_BITS and v_pages_GxPxSxK.dtype == dtype:
    dtype = jnp.dtype(jnp.bfloat16)  # read as the bits they are
  elif dtype not in POOL_DTYPES or v_pages_GxPxSxK.dtype != dtype:
    raise ValueError(f"the CPU kernel reads float32, bfloat16 or int8 pools, not {dtype}")
  scaled = k_scales_GxPxS is not None and v_scales_GxPxS is not None
  if scaled != (dtype == jnp.int8) or (k_scales_GxPxS is None) != (v_scales_GxPxS is None):
    raise ValueError("the CPU kernel takes K and V scales with int8 pools, and only then")
  if q_TxHxK.shape[-1] % HEAD_DIM_MULTIPLE:
    raise ValueError(
        f"the CPU kernel needs a head dim that is a multiple of {HEAD_DIM_MULTIPLE}, "
        f"not {q_TxHxK.shape[-1]}"
    )
  pools = tuple(
      jax.lax.bitcast_convert_type(x, BF16_BITS) if x.dtype == jnp.bfloat16 else x
      for x in (k_pages_GxPxSxK, v_pages_GxPxSxK)
  )
  if scaled:
    pools += (k_scales_GxPxS.astype(jnp.float32), v_scales_GxPxS.astype(jnp.float32))
  target = TARGET_INT8 if scaled else TARGET_BF16 if dtype == jnp.bfloat16 else TARGET
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_TxHxK.shape, jnp.float32))
  return call(
      q_TxHxK.astype(jnp.float32),
      *pools,
      *(x.astype(jnp.int32) for x in (tables_BxN, starts_B, counts_B, cached_B)),
      jnp.asarray(window, jnp.int32).reshape(()),
      sm_scale=np.float32(sm_scale),
      softcap=np.float32(softcap),
  )
