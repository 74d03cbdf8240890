"""Ragged paged attention on the CPU: `paged_attention.cc` through XLA's FFI.

The C++ source is compiled on first use (`kernels_cpu.build`: the machine's C++ compiler, for
this CPU, cached across processes). `unavailable()` says why the kernel cannot run here (no
compiler, a failed build), and callers then take the XLA path.

Why a kernel: on CPU, XLA gathers a step's pages into a copy and reads the copy again in a
separate fusion for every (block, key chunk) round (`jaxpipe.ops.attention._block_attention`);
this kernel reads each page in place once per tile of queries, with the online softmax in
registers and scratch (docs/serving.md, "A CPU kernel").
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu import build as build_lib

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


def build() -> Path:
  """The compiled library, built now unless the cache holds it; an error says why not."""
  return build_lib.library(SOURCE, FLAGS)


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
    library.JaxpipeBf16ScoreItems.restype = ctypes.c_int64
    library.JaxpipeWorkItems.restype = ctypes.c_int64
    _LOADED.append(library)
  except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
    return str(e)
  return None


_LOADED: list[ctypes.CDLL] = []  # the library, once `unavailable()` has loaded it


def _check_available() -> None:
  reason = unavailable()
  if reason is not None:
    raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {reason}")


def bf16_score_items() -> int | None:
  """Work items of this process whose scores ran as bfloat16 dot products; None where the
  kernel was built without them (a CPU without AVX512_BF16).

  Every tile (a prefill's many query vectors or decode's few) over a bfloat16 pool scores its
  keys so when every query value is a bfloat16 value (a bfloat16 model's queries): the
  products are exact either way, at twice float32's multiply-adds a cycle.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  _check_available()
  items = int(_LOADED[0].JaxpipeBf16ScoreItems())
  return None if items < 0 else items


def work_items() -> int:
  """Work items this process's calls made so far: each a row's tile of up to 64 tokens under
  one KV head, or of up to 16 where a call's 64-token items would be fewer than 4 for each of
  the intra-op pool's threads.

  Raises:
    RuntimeError: the kernel is unavailable here.
  """
  _check_available()
  return int(_LOADED[0].JaxpipeWorkItems())


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
  _check_available()
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
