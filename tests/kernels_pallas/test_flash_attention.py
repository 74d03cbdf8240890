"""Pallas flash attention (interpret mode on CPU) against jax.nn.dot_product_attention (XLA)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.flash_attention import attention_reference, flash_attention
from tests import helpers

# Small blocks so that every case spans several blocks and exercises the causal block skipping.
BLOCKS = dict(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)

# (name, batch, q_len, kv_len, heads, kv_heads, head_dim, causal)
CASES = [
    ("causal_mha_one_block", 2, 16, 16, 4, 4, 16, True),
    ("causal_gqa2_ragged", 2, 40, 40, 4, 2, 32, True),
    ("causal_gqa4", 1, 80, 80, 4, 1, 16, True),
    ("full_mha_odd_len", 2, 37, 37, 2, 2, 16, False),
    ("full_gqa2_hd64", 1, 64, 64, 4, 2, 64, False),
    ("full_gqa4", 2, 24, 24, 4, 1, 32, False),
    ("full_cross_lengths", 1, 24, 56, 2, 1, 16, False),
]


@functools.cache
def _case_results(name):
  case = next(c for c in CASES if c[0] == name)
  _, batch, q_len, kv_len, heads, kv_heads, head_dim, causal = case
  q, k, v, do = helpers.flash_inputs(batch, q_len, kv_len, heads, kv_heads, head_dim)
  pallas = functools.partial(flash_attention, causal=causal, interpret=True, **BLOCKS)
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
  return helpers.out_and_grads(pallas, q, k, v, do), helpers.out_and_grads(xla, q, k, v, do)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_forward_matches_xla(name):
  (out, *_), (ref, *_) = _case_results(name)
  assert out.shape == ref.shape
  assert helpers.rel(out, ref) < 1e-5


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_gradients_match_xla(name):
  (_, *grads), (_, *ref_grads) = _case_results(name)
  for label, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert g.shape == r.shape, label
    assert helpers.rel(g, r) < 1e-5, label


def test_segment_ids_with_padding_match_masked_xla():
  """Two packed documents plus trailing padding (its own id), causal, GQA 2, ragged length."""
  q, k, v, do = helpers.flash_inputs(2, 40, 40, 4, 2, 16, seed=1)
  seg = jnp.array([[1] * 15 + [2] * 20 + [0] * 5, [1] * 33 + [0] * 7], jnp.int32)
  pallas = lambda q, k, v: flash_attention(
      q, k, v, causal=True, segment_ids=seg, interpret=True, **BLOCKS
  )
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  xla = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation="xla"
  )
  got, want = helpers.out_and_grads(pallas, q, k, v, do), helpers.out_and_grads(xla, q, k, v, do)
  for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert helpers.rel(g, w) < 1e-5, label


def test_query_that_sees_no_key_gives_zero():
  q, k, v, do = helpers.flash_inputs(1, 20, 24, 2, 2, 16, seed=2)
  q_ids = jnp.array([[1] * 10 + [7] * 3 + [2] * 7], jnp.int32)  # id 7 has no key
  kv_ids = jnp.array([[1] * 12 + [2] * 12], jnp.int32)
  fn = lambda q, k, v: flash_attention(
      q, k, v, segment_ids=(q_ids, kv_ids), interpret=True, **BLOCKS
  )
  out, dq, dk, dv = helpers.out_and_grads(fn, q, k, v, do)
  assert np.all(np.asarray(out[:, 10:13]) == 0.0)
  assert np.all(np.asarray(dq[:, 10:13]) == 0.0)
  keep = np.r_[0:10, 13:20]
  mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  do_kept = do.at[:, 10:13].set(0.0)  # the empty rows' cotangent must not reach k, v
  r_out, r_dq, r_dk, r_dv = helpers.out_and_grads(xla, q, k, v, do_kept)
  assert helpers.rel(out[:, keep], r_out[:, keep]) < 1e-5
  assert helpers.rel(dq[:, keep], r_dq[:, keep]) < 1e-5
  assert helpers.rel(dk, r_dk) < 1e-5 and helpers.rel(dv, r_dv) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_within_rounding(dtype):
  """Half inputs against float32 on the same (rounded) inputs: within one ulp of the max."""
  q, k, v, do = helpers.flash_inputs(1, 48, 48, 4, 2, 32, dtype=dtype, seed=3)
  fn = functools.partial(flash_attention, causal=True, interpret=True, **BLOCKS)
  got = helpers.out_and_grads(fn, q, k, v, do)
  f32 = lambda x: x.astype(jnp.float32)
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
  want = helpers.out_and_grads(xla, f32(q), f32(k), f32(v), f32(do))
  ulp = float(jnp.finfo(dtype).eps)
  for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == dtype, label
    # p and dS are rounded to the input dtype before their matmuls, as in every flash kernel.
    assert helpers.rel(g, w) < ulp, label


def test_default_blocks_and_scale():
  q, k, v, _ = helpers.flash_inputs(1, 50, 50, 2, 1, 32, seed=4)
  out = jax.jit(functools.partial(flash_attention, causal=True, sm_scale=0.3, interpret=True))(
      q, k, v
  )
  ref = jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True, implementation="xla")
  assert helpers.rel(out, ref) < 1e-5


def test_reference_matches_xla():
  q, k, v, _ = helpers.flash_inputs(2, 33, 33, 4, 2, 16, seed=5)
  ref = attention_reference(q, k, v, causal=True)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  assert helpers.rel(ref, want) < 1e-5


@pytest.mark.parametrize(
    "shapes,dtype,kwargs,match",
    [
        (((1, 8, 3, 16), (1, 8, 2, 16)), jnp.float32, {}, "multiple of key/value heads"),
        (((1, 8, 2, 512), (1, 8, 2, 512)), jnp.float32, {}, "head_dim 512"),
        (((1, 8, 2, 16), (1, 8, 2, 16)), jnp.int32, {}, "dtype int32"),
        (((1, 8, 2, 16), (1, 8, 2, 16)), jnp.float32, {"block_q": 48}, "block_q=48"),
        (((1, 8, 2, 16), (2, 8, 2, 16)), jnp.float32, {}, "batch and head_dim"),
    ],
)
def test_bad_inputs_raise(shapes, dtype, kwargs, match):
  q = jnp.zeros(shapes[0], dtype)
  k = jnp.zeros(shapes[1], dtype)
  with pytest.raises(ValueError, match=match):
    flash_attention(q, k, k, interpret=True, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_for_gpu(dtype):
  """Pallas' Triton lowering (run here on CPU) accepts all three kernels at GPU block sizes."""
  q = jax.ShapeDtypeStruct((2, 256, 8, 128), dtype)
  kv = jax.ShapeDtypeStruct((2, 256, 2, 128), dtype)
  seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)

  def grads(q, k, v, seg):
    loss = lambda q, k, v: jnp.sum(
        flash_attention(q, k, v, causal=True, segment_ids=seg, interpret=False).astype(jnp.float32)
    )
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = jax.jit(grads).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ
