"""On a CUDA GPU: the compiled kernels and the ragged dispatch against their references.

Skipped elsewhere (CI has no GPU); `bash experiments/gpu_check.sh` runs them with the benches.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernels_pallas.flash_attention import flash_attention
from tests import helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]


def _xla_f32(causal, q, k, v, do):
  """The XLA reference in float32 at full matmul precision (no TF32)."""
  f32 = lambda x: x.astype(jnp.float32)
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
  with jax.default_matmul_precision("highest"):
    return helpers.out_and_grads(xla, f32(q), f32(k), f32(v), f32(do))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq,heads,kv_heads,head_dim", [(1000, 8, 4, 64), (1024, 8, 2, 128)])
def test_compiled_flash_attention_float32(causal, seq, heads, kv_heads, head_dim):
  q, k, v, do = helpers.flash_inputs(2, seq, seq, heads, kv_heads, head_dim, dtype=jnp.float32)
  compiled = functools.partial(flash_attention, causal=causal, interpret=False)
  got = helpers.out_and_grads(compiled, q, k, v, do)
  want = _xla_f32(causal, q, k, v, do)
  for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert helpers.rel(g, w) < 1e-5, label


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_flash_attention_half_within_rounding(dtype, causal):
  """Against float32 on the same rounded inputs: within one ulp of the largest entry, or (as
  FlashAttention's tests hold it) within twice the error of XLA run in the same dtype."""
  q, k, v, do = helpers.flash_inputs(2, 512, 512, 8, 2, 128, dtype=dtype, seed=1)
  compiled = functools.partial(flash_attention, causal=causal, interpret=False)
  got = helpers.out_and_grads(compiled, q, k, v, do)
  want = _xla_f32(causal, q, k, v, do)
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
  same_dtype = helpers.out_and_grads(xla, q, k, v, do)
  for label, g, w, h in zip(("out", "dq", "dk", "dv"), got, want, same_dtype):
    assert g.dtype == dtype, label
    err = helpers.rel(g, w)
    assert err < max(float(jnp.finfo(dtype).eps), 2 * helpers.rel(h, w)), (
        label,
        err,
        helpers.rel(h, w),
    )


def test_compiled_flash_attention_segments():
  q, k, v, do = helpers.flash_inputs(2, 300, 300, 4, 2, 64, dtype=jnp.float32, seed=2)
  seg = jnp.concatenate(
      [
          jnp.ones((2, 120), jnp.int32),
          2 * jnp.ones((2, 150), jnp.int32),
          jnp.zeros((2, 30), jnp.int32),
      ],
      axis=1,
  )
  got = helpers.out_and_grads(
      lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg, interpret=False),
      q,
      k,
      v,
      do,
  )
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  xla = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation="xla"
  )
  with jax.default_matmul_precision("highest"):
    want = helpers.out_and_grads(xla, q, k, v, do)
  for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert helpers.rel(g, w) < 1e-5, label


def test_attention_backends_agree_on_gpu():
  """auto resolves to a GPU backend; pallas and cudnn match xla on a bf16 causal GQA call."""
  from jaxpipe.ops.attention import attention, resolve_backend

  q, k, v, _ = helpers.flash_inputs(2, 1024, 1024, 8, 2, 128, dtype=jnp.bfloat16, seed=3)
  assert resolve_backend("auto", q, k, v) in ("cudnn", "pallas")
  with jax.default_matmul_precision("highest"):
    want = attention(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        causal=True,
        backend="xla",
    )
  for backend in ("pallas", "cudnn"):
    got = jax.jit(functools.partial(attention, causal=True, backend=backend))(q, k, v)
    assert helpers.rel(got, want) < float(jnp.finfo(jnp.bfloat16).eps), backend


def test_ragged_dispatch_equals_padded():
  """Dropless MoE through jax.lax.ragged_all_to_all equals the padded all_to_all path and the
  emulated ragged one (on one GPU the exchange is a local copy: offsets between devices need
  several)."""
  from jaxpipe.models import moe

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
  base = moe.MoEConfig(num_experts=8 * n, top_k=2, d_ff=64, dispatch="dropless")
  params = moe.init_moe_params(base, jax.random.key(0), 32)
  x = jax.random.normal(jax.random.key(1), (4 * n, 64, 32), jnp.float32)
  results = {}
  for impl in ("ragged", "padded", "ragged_emulated"):
    cfg = dataclasses.replace(base, dropless_impl=impl)

    def loss(params, x, cfg=cfg):
      y, aux = moe.moe_layer(cfg, params, x, mesh=mesh, ep_axis="ep", batch_axes=("ep",))
      return jnp.sum(y * jnp.cos(x)), aux["tokens_per_expert"]

    (value, counts), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
    results[impl] = (value, counts, grads)
  v_r, c_r, g_r = results["ragged"]
  for other in ("padded", "ragged_emulated"):
    v_o, c_o, g_o = results[other]
    np.testing.assert_array_equal(c_r, c_o, err_msg=other)
    assert helpers.rel(v_r, v_o) < 1e-5, other
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_r), jax.tree.leaves(g_o)):
      assert helpers.rel(a, b) < 1e-5, (other, jax.tree_util.keystr(path))


def test_gemm_a2a_kernel_runs_on_all_gpus():
  """The Mosaic GPU kernel compiles and equals heads_to_seq + projection on the GPUs present
  (on one GPU only its local GEMM path runs; the transfers need several)."""
  from jax.lax import all_to_all

  from jaxpipe.ops.attention import _gpu_major
  from kernels_pallas import gemm_a2a as ga

  if _gpu_major() != 9:
    pytest.skip("the kernel uses Hopper wgmma")
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
  heads, head_dim, d = 4 * n, 64, 256
  keys = jax.random.split(jax.random.key(0), 2)
  o = jax.random.normal(keys[0], (2, 128 * n, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (heads, head_dim, d), jnp.float32) / 16).astype(jnp.bfloat16)

  def reference(o_local, w):
    o_seq = all_to_all(o_local, "cp", split_axis=1, concat_axis=2, tiled=True)
    return jnp.einsum(
        "blnk,nkd->bld", o_seq.astype(jnp.float32), w.astype(jnp.float32), precision="highest"
    )

  specs = dict(
      mesh=mesh, in_specs=(P(None, None, "cp"), P()), out_specs=P(None, "cp"), check_vma=False
  )
  got = jax.jit(jax.shard_map(functools.partial(ga.gemm_a2a, axis_name="cp"), **specs))(o, w)
  want = jax.jit(jax.shard_map(reference, **specs))(o, w)
  assert got.shape == want.shape
  # bf16 output of a float32 accumulation: one bf16 rounding of the largest entry
  assert helpers.rel(got, want) < float(jnp.finfo(jnp.bfloat16).eps)


def test_proj_a2a_kernel_runs_on_all_gpus():
  """The input-side Mosaic GPU kernel compiles and equals projection + seq_to_heads on the GPUs
  present (on one GPU its stores all go to the device itself)."""
  from jaxpipe.ops.attention import _gpu_major
  from jaxpipe.parallel.overlap import proj_then_a2a_local
  from kernels_pallas import proj_a2a as pa

  if _gpu_major() != 9:
    pytest.skip("the kernel uses Hopper wgmma")
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
  keys = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(keys[0], (2, 128 * n, 256), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (256, 2 * n, 64), jnp.float32) / 16).astype(jnp.bfloat16)
  reference = lambda x, w: proj_then_a2a_local(x.astype(jnp.float32), w.astype(jnp.float32))
  specs = dict(
      mesh=mesh, in_specs=(P(None, "cp"), P()), out_specs=P(None, None, "cp"), check_vma=False
  )
  got = jax.jit(jax.shard_map(functools.partial(pa.proj_a2a, axis_name="cp"), **specs))(x, w)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(jax.shard_map(reference, **specs))(x, w)
  assert got.shape == want.shape
  assert helpers.rel(got, want) < float(jnp.finfo(jnp.bfloat16).eps)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,k_splits", [(32, 8, 1), (32, 8, 4), (16, 16, 2)])
def test_compiled_paged_attention(dtype, heads, kv_heads, k_splits):
  """Compiled PagedAttention against the gather reference in float32, stale slots NaN, and
  beside JAX's own Pallas paged kernel (which takes q pre-scaled)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

  from kernels_pallas.paged_attention import paged_attention, paged_attention_reference

  page = 16
  q, k, v, tables, lens = helpers.paged_inputs(
      [1, 100, 511, 512, 300, 17, 256, 64], heads, kv_heads, head_dim=128, page=page, seed=4
  )
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  got = paged_attention(q, k, v, tables, lens, k_splits=k_splits)
  want = paged_attention_reference(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), tables, lens
  )
  assert np.isfinite(np.asarray(got, np.float32)).all()
  tol = 1e-5 if dtype == jnp.float32 else 2 * float(jnp.finfo(dtype).eps)
  assert helpers.rel(got, want) < tol
  clean = lambda x: jnp.nan_to_num(x)  # JAX's kernel reads stale slots (0 x NaN) unmasked
  theirs = jax_paged.paged_attention(
      q / jnp.sqrt(jnp.asarray(128.0, dtype)),
      clean(k),
      clean(v),
      tables,
      lens,
      k_splits=1,
      pages_per_compute_block=1,
  )
  assert helpers.rel(theirs, want) < tol


def test_compiled_paged_attention_int8():
  from kernels_pallas.paged_attention import paged_attention, paged_attention_reference

  q, k, v, tables, lens = helpers.paged_inputs([33, 200, 7], 16, 4, head_dim=64, page=16, seed=5)
  (k8, ks), (v8, vs) = helpers.quantize(k, jnp.int8), helpers.quantize(v, jnp.int8)
  scales = dict(k_scales_GxPxS=ks, v_scales_GxPxS=vs)
  got = paged_attention(q, k8, v8, tables, lens, **scales, k_splits=2)
  assert helpers.rel(got, paged_attention_reference(q, k8, v8, tables, lens, **scales)) < 1e-5


def test_engine_on_gpu_equals_recompute_oracle():
  """The engine with the compiled kernel (attention 'auto' resolves to it) against the
  training forward pass recomputed at every step."""
  from jaxpipe.serve import Engine

  engine = Engine(
      helpers.CONFIGS["dense"], helpers.engine_params("dense"), num_pages=17, **helpers.ENGINE_ARGS
  )
  assert engine.backend == "pallas"
  prompts = helpers.prompts(seed=6)
  assert engine.generate(prompts, max_tokens=10) == helpers.oracle("dense", prompts, 10)


def test_compiled_rows_kernel_and_the_engine_on_it():
  """The rows kernel (`pallas_ragged`) compiled: every query of prefill blocks after a cached
  prefix against the per-token gather reference, then the engine on it against the recompute
  oracle."""
  from jaxpipe.ops import attention as attn
  from jaxpipe.serve import Engine

  q, k, v, tables, _ = helpers.paged_inputs([300, 77, 129, 512], 32, 8, head_dim=128, page=16)
  counts = np.asarray([64, 77, 1, 33], np.int32)
  cached = np.asarray([236, 0, 128, 479], np.int32)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  rows = attn.RaggedRows(jnp.asarray(tables), jnp.asarray(starts), counts, cached)
  q_TxHxK = np.random.default_rng(1).standard_normal((int(counts.sum()), 32, 128), np.float32)
  got = attn.ragged_paged_attention(q_TxHxK, k, v, rows, kernel="pallas")
  row = np.repeat(np.arange(4), counts)
  lens = np.concatenate([np.arange(c, c + n) + 1 for c, n in zip(cached, counts)]).astype(np.int32)
  want = attn.paged_attention(q_TxHxK, k, v, tables[row], lens, backend="xla")
  assert helpers.rel(got, want) < 1e-5
  engine = Engine(
      helpers.CONFIGS["dense"],
      helpers.engine_params("dense"),
      num_pages=17,
      attention="pallas_ragged",
      **helpers.ENGINE_ARGS,
  )
  prompts = helpers.prompts(seed=6)
  assert engine.generate(prompts, max_tokens=10) == helpers.oracle("dense", prompts, 10)
