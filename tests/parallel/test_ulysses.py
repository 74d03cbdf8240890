"""Ulysses attention over the context axis equals single-device attention, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.parallel import ulysses


def _mesh(shape, names):
  return jax.make_mesh(
      shape,
      names,
      axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
      devices=jax.devices()[: int(np.prod(shape))],
  )


def _qkv(batch, seq, heads, kv_heads, head_dim=16, seed=0):
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  return (
      jax.random.normal(kq, (batch, seq, heads, head_dim)),
      jax.random.normal(kk, (batch, seq, kv_heads, head_dim)),
      jax.random.normal(kv, (batch, seq, kv_heads, head_dim)),
      jax.random.normal(kd, (batch, seq, heads, head_dim)),
  )


def _rel(a, b) -> float:
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _out_and_grads(fn):
  """One compiled program returning the output and the vjp of a cotangent."""

  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))

  return jax.jit(run)


def _check_against_single_device(fn, q, k, v, do, mask=None, causal=True):
  ref = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, implementation="xla"
  )
  got = _out_and_grads(fn)(q, k, v, do)
  want = _out_and_grads(ref)(q, k, v, do)
  for label, g, r in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.shape == r.shape, label
    assert _rel(g, r) < 1e-5, label


@pytest.mark.parametrize(
    "cp,heads,kv_heads,causal", [(2, 4, 2, True), (4, 8, 4, False), (8, 8, 8, True)]
)
def test_ulysses_equals_single_device(cp, heads, kv_heads, causal):
  mesh = _mesh((cp,), ("cp",))
  q, k, v, do = _qkv(2, 8 * cp, heads, kv_heads)
  fn = functools.partial(ulysses.ulysses_attention, mesh=mesh, causal=causal)
  _check_against_single_device(fn, q, k, v, do, causal=causal)


@pytest.mark.parametrize(
    "shape,names,batch_axes",
    [
        ((2, 4), ("dp", "cp"), "dp"),
        ((2, 2, 2), ("pp", "dp", "cp"), "dp"),
    ],
)
def test_composes_with_data_and_pipeline_axes(shape, names, batch_axes):
  mesh = _mesh(shape, names)
  q, k, v, do = _qkv(4, 16, 4, 4, seed=1)
  fn = functools.partial(ulysses.ulysses_attention, mesh=mesh, batch_axes=batch_axes)
  _check_against_single_device(fn, q, k, v, do)


def test_segment_ids_and_pallas_backend():
  mesh = _mesh((2,), ("cp",))
  q, k, v, do = _qkv(1, 24, 4, 2, seed=2)
  seg = jnp.array([[0] * 10 + [1] * 14], jnp.int32)
  fn = functools.partial(
      ulysses.ulysses_attention, mesh=mesh, backend="pallas", segment_ids_BxL=seg
  )
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  _check_against_single_device(fn, q, k, v, do, mask=mask)


def test_positions_local_are_global_offsets():
  mesh = _mesh((4,), ("cp",))
  pos = jax.shard_map(
      lambda: ulysses.positions_local(3),
      mesh=mesh,
      in_specs=(),
      out_specs=jax.sharding.PartitionSpec("cp"),
  )()
  np.testing.assert_array_equal(np.asarray(pos), np.arange(12))


@pytest.mark.parametrize(
    "seq,heads,kv_heads,match",
    [
        (30, 8, 4, "sequence length 30 is not divisible by the context axis 'cp' of size 4"),
        (32, 8, 2, "2 key/value heads do not divide over the context axis 'cp' of size 4"),
        (32, 6, 6, "6 query heads do not divide"),
    ],
)
def test_bad_splits_raise(seq, heads, kv_heads, match):
  mesh = _mesh((4,), ("cp",))
  q, k, v, _ = _qkv(1, seq, heads, kv_heads)
  with pytest.raises(ValueError, match=match):
    ulysses.ulysses_attention(q, k, v, mesh=mesh)


@pytest.mark.slow  # the Trainer test below covers microbatches = 1 in CI
@pytest.mark.parametrize("microbatches", [1, 2])
def test_model_loss_and_grads_with_context_parallelism(microbatches):
  """The LM with its sequence over cp=2 (batch over dp=2) equals jax.grad on one device."""
  from jaxpipe.models import transformer
  from jaxpipe.training.losses import context_parallel_loss_and_grads

  cfg = transformer.TransformerConfig(
      vocab=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32
  )
  params = transformer.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab)
  batch = dict(
      tokens=tokens, targets=jnp.roll(tokens, -1, axis=1), mask=jnp.ones((4, 16)).at[:, -1].set(0.0)
  )
  mesh = _mesh((2, 1, 2), ("dp", "ep", "cp"))
  loss, grads, metrics = jax.jit(context_parallel_loss_and_grads(cfg, mesh, microbatches))(
      params, batch
  )

  def mean_loss(params):
    total, count = transformer.loss(cfg, params, batch["tokens"], batch["targets"], batch["mask"])
    return total / count

  want_loss, want_grads = jax.jit(jax.value_and_grad(mean_loss))(params)
  assert float(metrics["tokens"]) == 60.0
  assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    assert _rel(g, w) < 1e-5, jax.tree_util.keystr(path)


def test_quickstart_cp_config_matches_cp1_and_trains():
  """configs/quickstart_cp.py (cp = 2) through the Trainer: its loss and gradients equal the
  cp = 1 trainer's (plain jax.value_and_grad of the model), and its steps lower the loss."""
  from configs import quickstart_cp
  from jaxpipe.training.trainer import Trainer

  def trainer(cp):
    c = quickstart_cp.get_config()
    c.mesh.cp = cp  # dp fills the remaining host devices
    c.model.update(vocab=32, d_model=16, n_layers=1, d_ff=32, head_dim=4)
    c.data.update(source="synthetic", seq_len=16, batch=8)
    t = Trainer(c, workdir=None)
    t.init()
    assert t.mesh.shape["cp"] == cp
    return t

  assert quickstart_cp.get_config().mesh.cp == 2
  cp2, cp1 = trainer(2), trainer(1)
  loss2, grads2, m2 = jax.jit(cp2.loss_and_grads)(cp2.state.params, cp2.batch(0))
  loss1, grads1, m1 = jax.jit(cp1.loss_and_grads)(cp1.state.params, cp1.batch(0))
  assert float(m2["tokens"]) == float(m1["tokens"])
  assert abs(float(loss2) - float(loss1)) < 1e-5 * abs(float(loss1))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads2), jax.tree.leaves(grads1)):
    assert _rel(a, b) < 1e-5, jax.tree_util.keystr(path)
  losses = [float(cp2.step()["loss"]) for _ in range(3)]
  assert losses[0] == pytest.approx(float(loss1), rel=1e-5)
  assert losses[-1] < losses[0]
