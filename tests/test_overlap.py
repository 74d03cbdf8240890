"""Chunked projection + all-to-all equals the unfused composition and the dense global math."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe.parallel import overlap


def _mesh(cp):
  return jax.make_mesh((cp,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:cp])


def _rel(a, b) -> float:
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _value_and_grads(fn, *args):
  """fn(*args) and the gradient of <fn(*args), cotangent> for all args (to be traced in a jit)."""
  def run(ct, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(ct))
  return run


def _fused_unfused_dense(fused, unfused, dense, ct, *args):
  """The three variants' outputs and gradients, compiled as one program."""
  def run(ct, *args):
    return [_value_and_grads(f, *args)(ct, *args) for f in (fused, unfused, dense)]
  return jax.jit(run)(ct, *args)


@pytest.mark.parametrize("cp", [2, 4])
def test_input_side_equals_unfused_and_dense(cp):
  mesh = _mesh(cp)
  kx, kw, kc = jax.random.split(jax.random.key(cp), 3)
  x = jax.random.normal(kx, (2, 4 * cp, 16))
  w = jax.random.normal(kw, (16, 2 * cp, 8))
  ct = jax.random.normal(kc, (2, 4 * cp, 2 * cp, 8))
  wrap = lambda f: jax.shard_map(functools.partial(f, axis_name="cp"), mesh=mesh,
                                 in_specs=(P(None, "cp"), P()), out_specs=P(None, None, "cp"))
  fused, unfused, dense = _fused_unfused_dense(
      wrap(overlap.proj_a2a_local), wrap(overlap.proj_then_a2a_local),
      lambda x, w: jnp.einsum("bld,dnk->blnk", x, w), ct, x, w)
  for label, a, b, c in zip(("out", "dx", "dw"), fused, unfused, dense):
    assert _rel(a, b) < 1e-5, label
    assert _rel(a, c) < 1e-5, label


@pytest.mark.parametrize("cp", [2, 4])
def test_output_side_equals_unfused_and_dense(cp):
  mesh = _mesh(cp)
  ko, kw, kc = jax.random.split(jax.random.key(10 + cp), 3)
  o = jax.random.normal(ko, (2, 4 * cp, 2 * cp, 8))
  w = jax.random.normal(kw, (2 * cp, 8, 16))
  ct = jax.random.normal(kc, (2, 4 * cp, 16))
  wrap = lambda f: jax.shard_map(functools.partial(f, axis_name="cp"), mesh=mesh,
                                 in_specs=(P(None, None, "cp"), P()), out_specs=P(None, "cp"))
  fused, unfused, dense = _fused_unfused_dense(
      wrap(overlap.a2a_proj_local), wrap(overlap.a2a_then_proj_local),
      lambda o, w: jnp.einsum("blnk,nkd->bld", o, w), ct, o, w)
  for label, a, b, c in zip(("out", "do", "dw"), fused, unfused, dense):
    assert _rel(a, b) < 1e-5, label
    assert _rel(a, c) < 1e-5, label


def test_overlapped_attention_sublayer_equals_dense():
  """x -> q,k,v (fused proj+A2A) -> attention on head shards -> (fused A2A+proj) -> y."""
  cp, batch, seq, d, heads, kv_heads, hd = 2, 2, 16, 16, 4, 2, 8
  mesh = _mesh(cp)
  ks = jax.random.split(jax.random.key(7), 6)
  x = jax.random.normal(ks[0], (batch, seq, d))
  wq = jax.random.normal(ks[1], (d, heads, hd)) / 4
  wk = jax.random.normal(ks[2], (d, kv_heads, hd)) / 4
  wv = jax.random.normal(ks[3], (d, kv_heads, hd)) / 4
  wo = jax.random.normal(ks[4], (heads, hd, d)) / 4
  ct = jax.random.normal(ks[5], (batch, seq, d))

  def local(x, wq, wk, wv, wo):
    q, k, v = (overlap.proj_a2a_local(x, w) for w in (wq, wk, wv))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return overlap.a2a_proj_local(o, wo)

  def dense(x, wq, wk, wv, wo):
    q, k, v = (jnp.einsum("bld,dnk->blnk", x, w) for w in (wq, wk, wv))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jnp.einsum("blnk,nkd->bld", o, wo)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "cp"),) + (P(),) * 4,
                          out_specs=P(None, "cp"))
  args = (x, wq, wk, wv, wo)
  got, want = jax.jit(lambda ct, *a: [_value_and_grads(f, *a)(ct, *a) for f in (sharded, dense)])(
      ct, *args)
  for label, a, b in zip(("y", "dx", "dwq", "dwk", "dwv", "dwo"), got, want):
    assert _rel(a, b) < 1e-5, label


def test_heads_not_divisible_raise():
  mesh = _mesh(4)
  fn = jax.shard_map(overlap.proj_a2a_local, mesh=mesh, in_specs=(P(None, "cp"), P()),
                     out_specs=P(None, None, "cp"))
  with pytest.raises(ValueError, match="6 heads do not divide over 4 context ranks"):
    fn(jnp.zeros((1, 8, 4)), jnp.zeros((4, 6, 2)))
