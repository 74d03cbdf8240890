"""MoE FFNs in the LM and the trainer: expert-parallel steps equal the one-device model."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxpipe import config as config_lib
from jaxpipe.models import moe
from jaxpipe.models import transformer
from jaxpipe.trainer import Trainer, TrainState

MOE = dict(num_experts=8, top_k=2, d_ff=16, every=2, lb_loss_coef=0.1, z_loss_coef=0.01)


def moe_config(ep=4, **moe_kwargs):
  c = config_lib.default_config()
  c.model.vocab = 64
  c.model.d_model = 32
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 8
  c.model.d_ff = 48
  c.model.moe = ml_collections.ConfigDict({**MOE, **moe_kwargs})
  c.data.source = "synthetic"
  c.data.seq_len = 8
  c.data.batch = 16
  c.mesh.ep = ep
  return c


def _random_params(cfg, seed=0):
  """Model-shaped parameters, every leaf random (norm scales and biases too), drawn on the host."""
  shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  rng = np.random.default_rng(seed)

  def draw(path, s):
    fan_in = s.shape[-2] if len(s.shape) >= 2 else 1
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return np.asarray(1 + 0.2 * rng.standard_normal(s.shape), s.dtype)
    if "expert_bias" in name:
      return np.asarray(0.2 * rng.standard_normal(s.shape), s.dtype)
    if "embed" in name:
      return np.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-1]), s.dtype)
    return np.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _one_device_objective(cfg, params, batch):
  """(mean cross-entropy + summed aux loss, aux) with no mesh: every MoE layer on one device."""
  total, count, aux = transformer.loss_and_aux(cfg, params, batch["tokens"], batch["targets"],
                                               batch["mask"])
  return total / count + aux["loss"].sum(), aux


def _close(a, b, what, rtol=1e-5):
  b = np.asarray(b)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-6), err_msg=what)


@functools.lru_cache(maxsize=None)
def _trainer(**moe_kwargs):
  return Trainer(moe_config(**moe_kwargs))


def test_groups_of_layers_stack_uniformly():
  cfg = _trainer().model_cfg
  assert isinstance(cfg.moe, moe.MoEConfig) and cfg.moe.every == 2
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  layers = params["layers"]
  assert layers["moe"]["moe"]["wi_gate_ExDxF"].shape == (2, 8, 32, 16)  # 2 groups of 2 layers
  assert layers["dense"]["mlp"]["up"]["kernel"].shape == (2, 1, 32, 48)
  assert "mlp" not in layers["moe"]


def test_expert_parallel_step_equals_one_device():
  """ep = 4 x dp = 2: loss, every gradient and the routing statistics of the one-device model."""
  trainer = _trainer()
  cfg = trainer.model_cfg
  params = _random_params(cfg)
  batch = trainer.batch(0)
  loss, grads, metrics = jax.jit(trainer.loss_and_grads)(params, batch)
  host = jax.device_get(batch)
  (want, aux), want_grads = jax.jit(jax.value_and_grad(
      functools.partial(_one_device_objective, cfg), has_aux=True))(params, host)
  _close(loss, want, "loss")
  counts = np.asarray(aux["tokens_per_expert"])
  np.testing.assert_array_equal(metrics["moe_tokens_per_expert"], counts)
  _close(metrics["moe_imbalance"], (counts.max(1) / counts.mean(1)).max(), "imbalance")
  _close(metrics["moe_lb_loss"], np.mean(aux["lb_loss"]), "lb_loss")
  assert float(metrics["moe_dropped_frac"]) == 0.0
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    _close(g, want_flat[path], jax.tree_util.keystr(path), rtol=2e-5)


def test_attached_aux_loss_is_in_the_gradient():
  """`apply_layers` (what pipeline and context-parallel paths call) trains the aux losses too."""
  cfg = transformer.TransformerConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      head_dim=8, d_ff=48, moe=moe.MoEConfig(**{**MOE, "every": 1}))
  params = _random_params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
  mask = jnp.ones((2, 8))

  def attached(p):
    return transformer.loss(cfg, p, tokens, tokens, mask)[0]

  def explicit(p, with_aux):
    total, _, aux = transformer.loss_and_aux(cfg, p, tokens, tokens, mask)
    return total + with_aux * aux["loss"].sum() * tokens.size

  got, want, no_aux = jax.jit(lambda p: (jax.grad(attached)(p), jax.grad(explicit)(p, 1.0),
                                         jax.grad(explicit)(p, 0.0)))(params)
  router = want["layers"]["moe"]["moe"]["router_DxE"]
  no_aux = no_aux["layers"]["moe"]["moe"]["router_DxE"]
  assert np.abs(np.asarray(router - no_aux)).max() > 1e-4 * np.abs(np.asarray(router)).max()
  for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    _close(g, dict(jax.tree_util.tree_flatten_with_path(want)[0])[path], jax.tree_util.keystr(path))


def test_train_step_moves_balancing_bias_by_the_sign_rule():
  rate = 0.01
  trainer = _trainer(router="sigmoid", bias_update_rate=rate, lb_loss_coef=0.0)
  before = _random_params(trainer.model_cfg)
  state = TrainState(jnp.zeros((), jnp.int32), before, jax.jit(trainer.optimizer.init)(before))
  trainer.state = jax.device_put(state, trainer.state_sharding)
  batch = trainer.batch(0)
  metrics = trainer.step(batch)
  assert "moe_tokens_per_expert" not in metrics and np.isfinite(float(metrics["moe_imbalance"]))
  cfg = trainer.model_cfg
  _, aux = jax.jit(functools.partial(_one_device_objective, cfg))(before, jax.device_get(batch))
  load = np.asarray(aux["tokens_per_expert"], np.float64)
  step = rate * np.sign(load.mean(1, keepdims=True) - load)
  after = jax.device_get(trainer.state.params)["layers"]["moe"]["moe"]["expert_bias_E"]
  np.testing.assert_allclose(after, before["layers"]["moe"]["moe"]["expert_bias_E"] + step,
                             rtol=0, atol=1e-7)


def test_bad_moe_configs_fail_before_device_work():
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert axis size ep=4"):
    Trainer(moe_config(num_experts=6))
  with pytest.raises(ValueError, match="model.n_layers=4 is not a multiple of model.moe.every=3"):
    Trainer(moe_config(every=3))
  with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
    Trainer(moe_config(top_k=9))


def test_moe_inside_the_pipeline_executor():
  """pp = 2 x dp = 2 x ep = 2: stages of `apply_unit` (aux attached) equal the explicit objective.

  Inside the executor's shard_map the MoE layers find the expert axis manual and take their
  experts from the replicated stage parameters.
  """
  from jaxpipe.mesh import make_mesh
  from jaxpipe.pipeline.api import pipeline_value_and_grad, resolve_schedule
  from jaxpipe.pipeline.executor import Model, layered

  c = moe_config(ep=2)
  c.model.n_layers, c.model.moe.every, c.mesh.pp = 2, 1, 2
  cfg = config_lib.model_config(c)
  mesh = make_mesh(c.mesh)
  m = 2
  schedule = resolve_schedule("zb-h1", pp=2, microbatches=m)
  params = jax.tree.map(jnp.asarray, _random_params(cfg))
  batch = jax.device_get(_trainer(ep=2).batch(0))
  split = {k: np.stack([v[j::m] for j in range(m)]) for k, v in batch.items()}
  model = Model(
      layered(lambda unit, x: transformer.apply_unit(cfg, unit, x, jnp.arange(x.shape[1]))),
      lambda head, x, t: transformer.head_loss(cfg, head, x, *t)[0],
      lambda emb, tokens: transformer.embed(cfg, emb, tokens))
  stage_params = jax.tree.map(lambda a: a.reshape(2, a.shape[0] // 2, *a.shape[1:]), params["layers"])
  head = {k: v for k, v in params.items() if k != "layers"}
  total, stage_g, head_g, embed_g = pipeline_value_and_grad(
      model, stage_params, split["tokens"], (split["targets"], split["mask"]), schedule=schedule,
      mesh=mesh, head_params=head, embed_params={"embed": params["embed"]}, data_axes=("dp", "ep"))

  def objective(p):
    """Per micro-batch: summed cross-entropy plus tokens x aux losses, as `apply_layers` weighs them."""
    ce = obj = 0.0
    for j in range(m):
      t, _, aux = transformer.loss_and_aux(cfg, p, split["tokens"][j], split["targets"][j],
                                           split["mask"][j])
      ce, obj = ce + t, obj + t + aux["loss"].sum() * split["tokens"][j].size
    return obj, ce

  (_, ce), want = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  _close(total, ce, "summed cross-entropy")
  got = {**head_g, "embed": head_g["embed"] + embed_g["embed"],
         "layers": jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), stage_g)}
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    _close(g, want_flat[path], jax.tree_util.keystr(path), rtol=2e-5)


def test_moe_under_context_parallelism():
  """cp = 2 x dp = 2 x ep = 2: the context-parallel trainer path trains the attached aux losses."""
  c = moe_config(ep=2)
  c.model.n_layers, c.model.moe.every, c.mesh.cp = 2, 1, 2
  trainer = Trainer(c)
  cfg = trainer.model_cfg
  params = jax.tree.map(jnp.asarray, _random_params(cfg))
  batch = trainer.batch(0)
  loss, grads, _ = jax.jit(trainer.loss_and_grads)(params, batch)
  host = jax.device_get(batch)

  def objective(p):
    """Mean cross-entropy plus tokens x aux losses over the valid-token count."""
    t, n, aux = transformer.loss_and_aux(cfg, p, host["tokens"], host["targets"], host["mask"])
    return (t + aux["loss"].sum() * host["tokens"].size) / n, t / n

  (_, ce), want = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  _close(loss, ce, "cross-entropy")
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    _close(g, want_flat[path], jax.tree_util.keystr(path), rtol=2e-5)


def test_train_state_splits_experts_over_ep():
  trainer = _trainer()
  sh = trainer.state_sharding
  wi = sh.params["layers"]["moe"]["moe"]["wi_gate_ExDxF"]
  assert wi.spec == jax.sharding.PartitionSpec(None, "ep")
  assert wi.shard_shape((2, 8, 32, 16)) == (2, 2, 32, 16)  # 2 of the 8 experts per ep rank
  mu = jax.tree_util.tree_flatten_with_path(sh.opt_state)[0]
  moments = [s for p, s in mu if jax.tree_util.keystr(p).endswith("['wo_ExFxD']")]
  assert moments and all(s.spec == jax.sharding.PartitionSpec(None, "ep") for s in moments)
  assert sh.params["layers"]["moe"]["moe"]["router_DxE"].spec == jax.sharding.PartitionSpec()
