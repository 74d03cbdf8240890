"""MoE FFNs in the LM and the trainer: expert-parallel steps equal the one-device model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import moe, transformer
from jaxpipe.training.state import TrainState
from jaxpipe.training.trainer import Trainer
from tests import helpers


@functools.cache
def _trainer(**moe_kwargs):
  return Trainer(helpers.moe_config(**moe_kwargs))


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
  params = helpers.random_params(cfg)
  batch = trainer.batch(0)
  loss, grads, metrics = jax.jit(trainer.loss_and_grads)(params, batch)
  host = jax.device_get(batch)
  (_, (want, aux)), want_grads = jax.jit(
      jax.value_and_grad(functools.partial(helpers.one_device_objective, cfg), has_aux=True)
  )(params, host)
  helpers.close(loss, want, "loss (cross-entropy)")
  helpers.close(metrics["moe_aux_loss"], np.sum(aux["loss"]), "aux loss")
  counts = np.asarray(aux["tokens_per_expert"])
  np.testing.assert_array_equal(metrics["moe_tokens_per_expert"], counts)
  helpers.close(metrics["moe_imbalance"], (counts.max(1) / counts.mean(1)).max(), "imbalance")
  helpers.close(metrics["moe_lb_loss"], np.mean(aux["lb_loss"]), "lb_loss")
  assert float(metrics["moe_dropped_frac"]) == 0.0
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    helpers.close(g, want_flat[path], jax.tree_util.keystr(path), rtol=2e-5)


def test_attached_aux_loss_is_in_the_gradient_and_not_in_forwards():
  """`apply_layers` (what pipeline and context-parallel paths call) trains the aux losses too;
  `forward`'s logits carry none, and `loss` (CE value, CE + aux gradient) refuses MoE models."""
  cfg = transformer.TransformerConfig(
      vocab=64,
      d_model=32,
      n_layers=2,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      d_ff=48,
      moe=moe.MoEConfig(**{**helpers.MOE_KWARGS, "every": 1}),
  )
  params = helpers.random_params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
  mask = jnp.ones((2, 8))
  with pytest.raises(
      ValueError, match="transformer.loss takes dense models; with cfg.moe use loss_and_aux"
  ):
    transformer.loss(cfg, params, tokens, tokens, mask)

  def attached(p):
    x = transformer.apply_layers(cfg, p["layers"], transformer.embed(cfg, p, tokens))
    return transformer.head_loss(cfg, p, x, tokens, mask)[0]

  def explicit(p, with_aux):
    total, _, aux = transformer.loss_and_aux(cfg, p, tokens, tokens, mask)
    return total + with_aux * aux["loss"].sum() * tokens.size

  def via_forward(p):  # the summed cross-entropy, from the logits
    logits_BxLxV = transformer.forward(cfg, p, tokens)
    target_BxL = jnp.take_along_axis(logits_BxLxV, tokens[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_BxL)

  got, want, no_aux, forward = jax.jit(
      lambda p: (
          jax.grad(attached)(p),
          jax.grad(explicit)(p, 1.0),
          jax.grad(explicit)(p, 0.0),
          jax.grad(via_forward)(p),
      )
  )(params)
  router = want["layers"]["moe"]["moe"]["router_DxE"]
  router_no_aux = no_aux["layers"]["moe"]["moe"]["router_DxE"]
  assert np.abs(np.asarray(router - router_no_aux)).max() > 1e-4 * np.abs(np.asarray(router)).max()
  flat = lambda tree: dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  for path, g in flat(got).items():
    helpers.close(g, flat(want)[path], jax.tree_util.keystr(path))
  for path, g in flat(forward).items():
    helpers.close(g, flat(no_aux)[path], jax.tree_util.keystr(path))


def test_train_step_moves_balancing_bias_by_the_sign_rule():
  rate = 0.01
  trainer = _trainer(router="sigmoid", bias_update_rate=rate, lb_loss_coef=0.0)
  before = helpers.random_params(trainer.model_cfg)
  state = TrainState(jnp.zeros((), jnp.int32), before, jax.jit(trainer.optimizer.init)(before))
  trainer.state = jax.device_put(state, trainer.state_sharding)
  batch = trainer.batch(0)
  metrics = trainer.step(batch)
  assert "moe_tokens_per_expert" not in metrics and np.isfinite(float(metrics["moe_imbalance"]))
  cfg = trainer.model_cfg
  objective = jax.jit(functools.partial(helpers.one_device_objective, cfg))
  _, (_, aux) = objective(before, jax.device_get(batch))
  load = np.asarray(aux["tokens_per_expert"], np.float64)
  step = rate * np.sign(load.mean(1, keepdims=True) - load)
  after = jax.device_get(trainer.state.params)["layers"]["moe"]["moe"]["expert_bias_E"]
  np.testing.assert_allclose(
      after, before["layers"]["moe"]["moe"]["expert_bias_E"] + step, rtol=0, atol=1e-7
  )


def test_bad_moe_configs_fail_before_device_work():
  with pytest.raises(
      ValueError, match="num_experts=6 is not divisible by the expert axis size ep=4"
  ):
    Trainer(helpers.moe_config(num_experts=6))
  with pytest.raises(ValueError, match="model.n_layers=4 is not a multiple of model.moe.every=3"):
    Trainer(helpers.moe_config(every=3))
  with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
    Trainer(helpers.moe_config(top_k=9))


PATHS = [
    ("dp4 x ep2", {}),
    ("pp2 x dp2 x ep2", {"pp": 2}),
    ("cp2 x dp2 x ep2", {"cp": 2}),
    ("pp2 x cp2 x ep2", {"pp": 2, "cp": 2, "dp": 1}),
]
RATE = 0.01  # balancing-bias step


@pytest.fixture(scope="module")
def every_path():
  """One train step on each path (2 micro-batches of one padded batch, sigmoid router with a
  balancing bias), keeping what its `loss_and_grads` returned: loss, grads, the routing counts."""
  params = host = None
  steps = {}
  for name, mesh in PATHS:
    c = helpers.path_config(**mesh)
    c.model.moe.update(router="sigmoid", bias_update_rate=RATE)
    trainer = Trainer(c)
    if params is None:
      params = helpers.random_params(trainer.model_cfg)  # numpy: the steps donate their state
      host = trainer.source.batch("train", 0, 16, 8)
    real = trainer.loss_and_grads

    def keep(p, b, real=real):
      loss, grads, metrics = real(p, b)
      # the step consumes moe_tokens_per_expert (to move the biases); keep a copy
      return (
          loss,
          grads,
          {**metrics, "grads": grads, "ce": loss, "counts": metrics["moe_tokens_per_expert"]},
      )

    trainer.loss_and_grads = keep
    state = TrainState(jnp.zeros((), jnp.int32), params, jax.jit(trainer.optimizer.init)(params))
    trainer.state = jax.device_put(state, trainer.state_sharding)
    metrics = jax.device_get(trainer.step(host))
    assert "moe_tokens_per_expert" not in metrics
    metrics["bias"] = jax.device_get(trainer.state.params)["layers"]["moe"]["moe"]["expert_bias_E"]
    steps[name] = metrics
  return dict(cfg=trainer.model_cfg, params=params, host=host, steps=steps)


def test_aux_loss_convention_is_the_same_on_every_path(every_path):
  """dp x ep, pp = 2 (executor, aux attached), cp = 2 (Ulysses, aux attached) and pp x cp (both),
  2 micro-batches of a padded batch: the same loss and gradients as the one-device objective."""
  cfg, params, host = every_path["cfg"], every_path["params"], every_path["host"]
  valid = host["mask"].reshape(8, 2, 8).sum((0, 2))  # valid tokens of micro-batches 0 and 1
  assert valid[0] != valid[1] and valid.sum() < host["mask"].size  # padding, unequal micro-batches

  def per_valid_token(p):
    """The convention not chosen: each micro-batch's aux weighted by its valid tokens."""
    total = 0.0
    for j in range(2):
      t, n, aux = transformer.loss_and_aux(
          cfg, p, host["tokens"][j::2], host["targets"][j::2], host["mask"][j::2]
      )
      total = total + t + aux["loss"].sum() * n
    return total / host["mask"].sum()

  objective = jax.value_and_grad(
      functools.partial(helpers.one_device_objective, cfg, microbatches=2), has_aux=True
  )
  ((_, (want_loss, _)), want), other = jax.jit(
      lambda p: (objective(p, host), jax.grad(per_valid_token)(p))
  )(params)
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  router = lambda g: np.asarray(g["layers"]["moe"]["moe"]["router_DxE"])
  # the two conventions differ by more than the tolerance below
  assert np.abs(router(other) - router(want)).max() > 1e-2 * np.abs(router(want)).max()
  for name, metrics in every_path["steps"].items():
    assert float(metrics["tokens"]) == host["mask"].sum()
    helpers.close(metrics["ce"], want_loss, f"{name}: loss (cross-entropy)")
    helpers.close(metrics["loss"], want_loss, f"{name}: reported loss")
    for path, g in jax.tree_util.tree_flatten_with_path(metrics["grads"])[0]:
      helpers.close(g, want_flat[path], f"{name}: {jax.tree_util.keystr(path)}")


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


def _routed_counts(cfg, params, host, microbatches, monkeypatch):
  """One device, micro-batch by micro-batch: ([MoE layers, experts] assignments summed over
  micro-batches, counted with numpy from the router's inputs as the top-k of sigmoid(x W) + bias;
  the mean over micro-batches of the summed aux losses)."""
  from jaxpipe.models import router as router_lib

  seen = []
  real = router_lib.route

  def spy(cfg_, w_DxE, bias_E, x_TxD, rng=None):
    jax.debug.callback(
        lambda *a: seen.append([np.asarray(v, np.float64) for v in a]),
        w_DxE,
        bias_E,
        x_TxD,
        ordered=True,
    )
    return real(cfg_, w_DxE, bias_E, x_TxD, rng)

  monkeypatch.setattr(router_lib, "route", spy)
  m = microbatches
  run = jax.jit(
      lambda p, b: sum(
          transformer.loss_and_aux(cfg, p, b["tokens"][j::m], b["targets"][j::m], b["mask"][j::m])[
              2
          ]["loss"].sum()
          for j in range(m)
      )
      / m
  )
  aux_loss = float(run(params, host))
  jax.effects_barrier()
  monkeypatch.setattr(router_lib, "route", real)
  units = cfg.n_layers // cfg.moe.every
  assert len(seen) == units * m
  counts = np.zeros((units, cfg.moe.num_experts), np.int64)
  for i, (w, bias, x) in enumerate(seen):
    select = 1 / (1 + np.exp(-(x @ w))) + bias
    top = np.argsort(-select, axis=1)[:, : cfg.moe.top_k]
    counts[i % units] += np.bincount(top.ravel(), minlength=cfg.moe.num_experts)
  return counts, aux_loss


def test_routing_statistics_and_bias_step_are_the_same_on_every_path(every_path, monkeypatch):
  """dp x ep, pp = 2, cp = 2 and pp x cp on one batch: the tokens per expert, imbalance, dropped
  fraction and aux loss they report, and the bias their train step leaves, equal an independent
  count of the router's top-k on one device."""
  cfg, params, host = every_path["cfg"], every_path["params"], every_path["host"]
  counts, want_aux = _routed_counts(cfg, params, host, 2, monkeypatch)
  assert counts.sum() == host["tokens"].size * cfg.moe.top_k * counts.shape[0]
  assert counts.max() > counts.min()  # not trivially balanced
  before = np.asarray(params["layers"]["moe"]["moe"]["expert_bias_E"])
  want_bias = before + RATE * np.sign(counts.mean(1, keepdims=True) - counts)
  assert np.sum(np.abs(want_bias - before) > RATE / 2) > counts.size // 2  # most biases move
  for name, metrics in every_path["steps"].items():
    np.testing.assert_array_equal(metrics["counts"], counts, err_msg=name)
    helpers.close(
        metrics["moe_imbalance"], (counts.max(1) / counts.mean(1)).max(), f"{name}: imbalance"
    )
    assert float(metrics["moe_dropped_frac"]) == 0.0, name
    helpers.close(metrics["moe_aux_loss"], want_aux, f"{name}: aux loss")
    np.testing.assert_allclose(metrics["bias"], want_bias, rtol=0, atol=1e-7, err_msg=name)


def test_the_context_parallel_path_unrolls_its_layer_groups():
  """model.unroll_layers on the shard_map path (cp 2, MoE): its layer groups leave the while
  loop, and the loss and gradients are the loop's."""
  got, whiles = {}, {}
  for unroll in (0, 16):
    c = helpers.path_config(cp=2)
    c.model.unroll_layers = unroll
    trainer = Trainer(c)
    params = helpers.random_params(trainer.model_cfg)
    batch = trainer.source.batch("train", 0, 16, 8)
    lowered = jax.jit(trainer.loss_and_grads).lower(params, batch)
    whiles[unroll] = lowered.as_text().count("stablehlo.while")
    got[unroll] = jax.device_get(lowered.compile()(params, batch)[:2])
  assert whiles[16] < whiles[0], whiles  # the micro-batch loop stays
  (loss, grads), (want_loss, want_grads) = got[16], got[0]
  helpers.close(loss, want_loss, "loss")
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    helpers.close(g, want_flat[path], jax.tree_util.keystr(path))
