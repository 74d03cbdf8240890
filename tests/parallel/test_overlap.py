"""Chunked projection + all-to-all equals the unfused composition and the dense global math."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe.parallel import overlap


def _mesh(cp):
  return jax.make_mesh(
      (cp,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:cp]
  )


def _rel(a, b) -> float:
  a, b = np.asarray(a), np.asarray(b)  # numpy: no per-shape compilation
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


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


FUSED = {
    "ring": (overlap.proj_a2a_local, overlap.a2a_proj_local),
    "chunked": (
        functools.partial(overlap.proj_a2a_chunked_local, chunks=2),
        functools.partial(overlap.a2a_proj_chunked_local, chunks=2),
    ),
}


@pytest.mark.parametrize("variant", list(FUSED))
@pytest.mark.parametrize("cp", [2, 4])
def test_input_side_equals_unfused_and_dense(cp, variant):
  mesh = _mesh(cp)
  kx, kw, kc = jax.random.split(jax.random.key(cp), 3)
  x = jax.random.normal(kx, (2, 4 * cp, 16))
  w = jax.random.normal(kw, (16, 2 * cp, 8))
  ct = jax.random.normal(kc, (2, 4 * cp, 2 * cp, 8))
  wrap = lambda f: jax.shard_map(
      functools.partial(f, axis_name="cp"),
      mesh=mesh,
      in_specs=(P(None, "cp"), P()),
      out_specs=P(None, None, "cp"),
  )
  fused, unfused, dense = _fused_unfused_dense(
      wrap(FUSED[variant][0]),
      wrap(overlap.proj_then_a2a_local),
      lambda x, w: jnp.einsum("bld,dnk->blnk", x, w),
      ct,
      x,
      w,
  )
  for label, a, b, c in zip(("out", "dx", "dw"), fused, unfused, dense):
    assert _rel(a, b) < 1e-5, label
    assert _rel(a, c) < 1e-5, label


@pytest.mark.parametrize("variant", list(FUSED))
@pytest.mark.parametrize("cp", [2, 4])
def test_output_side_equals_unfused_and_dense(cp, variant):
  mesh = _mesh(cp)
  ko, kw, kc = jax.random.split(jax.random.key(10 + cp), 3)
  o = jax.random.normal(ko, (2, 4 * cp, 2 * cp, 8))
  w = jax.random.normal(kw, (2 * cp, 8, 16))
  ct = jax.random.normal(kc, (2, 4 * cp, 16))
  wrap = lambda f: jax.shard_map(
      functools.partial(f, axis_name="cp"),
      mesh=mesh,
      in_specs=(P(None, None, "cp"), P()),
      out_specs=P(None, "cp"),
  )
  fused, unfused, dense = _fused_unfused_dense(
      wrap(FUSED[variant][1]),
      wrap(overlap.a2a_then_proj_local),
      lambda o, w: jnp.einsum("blnk,nkd->bld", o, w),
      ct,
      o,
      w,
  )
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

  sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P(None, "cp"),) + (P(),) * 4, out_specs=P(None, "cp")
  )
  args = (x, wq, wk, wv, wo)
  got, want = jax.jit(lambda ct, *a: [_value_and_grads(f, *a)(ct, *a) for f in (sharded, dense)])(
      ct, *args
  )
  for label, a, b in zip(("y", "dx", "dwq", "dwk", "dwv", "dwo"), got, want):
    assert _rel(a, b) < 1e-5, label


def test_heads_not_divisible_raise():
  mesh = _mesh(4)
  fn = jax.shard_map(
      overlap.proj_a2a_local,
      mesh=mesh,
      in_specs=(P(None, "cp"), P()),
      out_specs=P(None, None, "cp"),
  )
  with pytest.raises(ValueError, match="6 heads do not divide over 4 context ranks"):
    fn(jnp.zeros((1, 8, 4)), jnp.zeros((4, 6, 2)))


@pytest.fixture(scope="module")
def lm_problem():
  """A tiny LM (grouped-query heads at cp = 2 and 4), a batch, and jax.grad on one device."""
  from jaxpipe.models import transformer

  cfg = transformer.TransformerConfig(
      vocab=32, d_model=16, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=4, d_ff=32
  )
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab)
  batch = dict(
      tokens=tokens, targets=jnp.roll(tokens, -1, axis=1), mask=jnp.ones((4, 16)).at[:, -1].set(0.0)
  )

  def mean_loss(params):
    total, count = transformer.loss(cfg, params, batch["tokens"], batch["targets"], batch["mask"])
    return total / count

  return cfg, params, batch, jax.jit(jax.value_and_grad(mean_loss))(params)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def lm(request, lm_problem):
  """The LM's compiled (loss, grads) over dp = 2 x cp ranks, with cp_overlap off and on."""
  from jaxpipe.training.losses import context_parallel_loss_and_grads

  cfg, params, batch, dense = lm_problem
  cp = request.param
  mesh = jax.make_mesh(
      (2, 1, cp),
      ("dp", "ep", "cp"),
      axis_types=(jax.sharding.AxisType.Auto,) * 3,
      devices=jax.devices()[: 2 * cp],
  )
  compiled = {}
  for overlapped in (False, True):
    fn = context_parallel_loss_and_grads(dataclasses.replace(cfg, cp_overlap=overlapped), mesh)
    compiled[overlapped] = jax.jit(fn).lower(params, batch).compile()
  return compiled, dense, params, batch


def test_lm_with_cp_overlap_equals_plain_ulysses_and_one_device(lm):
  compiled, (want_loss, want_grads), params, batch = lm
  plain_loss, plain_grads, _ = compiled[False](params, batch)
  loss, grads, _ = compiled[True](params, batch)
  for got in (float(loss), float(plain_loss)):
    assert abs(got - float(want_loss)) < 1e-5 * abs(float(want_loss))
  want = jax.tree.leaves(want_grads)
  for (path, g), p, w in zip(
      jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(plain_grads), want
  ):
    assert _rel(g, w) < 1e-5, jax.tree_util.keystr(path)
    assert _rel(g, p) < 1e-5, jax.tree_util.keystr(path)


def test_lm_cp_overlap_runs_the_ring_not_all_to_all(lm):
  """The overlapped program moves activations by collective-permutes only; plain Ulysses by
  all-to-alls (the rest of the step has neither)."""
  compiled, *_ = lm
  plain, fused = (compiled[k].as_text() for k in (False, True))
  assert re.search(r"\ball-to-all(-start)?\(", plain)
  assert not re.search(r"\bcollective-permute(-start)?\(", plain)
  assert not re.search(r"\ball-to-all", fused)
  assert re.search(r"\bcollective-permute(-start)?\(", fused)


def test_cp_overlap_must_be_a_bool():
  from jaxpipe.training import config as config_lib

  c = config_lib.default_config()
  with c.ignore_type():
    c.model.cp_overlap = 1
  with pytest.raises(config_lib.ConfigError, match="model.cp_overlap=1 must be True or False"):
    config_lib.validate(c, 8)


def test_chunked_variant_uses_all_to_alls_only():
  """The chunked form runs `chunks` all-to-alls per side and no ppermute (so it can sit inside
  a branch that other devices do not take); chunks must divide the rank's tokens."""
  mesh = _mesh(2)
  fn = lambda x, w, wo: overlap.a2a_proj_chunked_local(
      overlap.proj_a2a_chunked_local(x, w, chunks=4), wo, chunks=4
  )
  sharded = jax.jit(
      jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "cp"), P(), P()), out_specs=P(None, "cp"))
  )
  hlo = sharded.lower(jnp.zeros((1, 16, 8)), jnp.zeros((8, 4, 2)), jnp.zeros((4, 2, 8))).as_text()
  assert hlo.count("all_to_all") + hlo.count("all-to-all") >= 8
  assert "collective_permute" not in hlo and "collective-permute" not in hlo
  with pytest.raises(ValueError, match="chunks=3 must be >= 1 and divide this rank's 8 tokens"):
    jax.shard_map(
        functools.partial(overlap.proj_a2a_chunked_local, chunks=3),
        mesh=mesh,
        in_specs=(P(None, "cp"), P()),
        out_specs=P(None, None, "cp"),
    )(jnp.zeros((1, 16, 8)), jnp.zeros((8, 4, 2)))
