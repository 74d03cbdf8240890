"""Routers against small cases worked out by hand."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import router as router_lib
from jaxpipe.models.moe import MoEConfig


def _route(cfg, logits_TxE, bias=None, rng=None):
  """With x = identity the router weight is the logits table."""
  logits = jnp.asarray(logits_TxE, jnp.float32)
  return router_lib.route(cfg, logits, bias, jnp.eye(logits.shape[0]), rng)


def _sig(v):
  return 1.0 / (1.0 + math.exp(-v))


LOGITS = [[1.0, 2.0, 3.0, 0.0], [-1.0, 0.0, 1.0, 0.5]]


def test_softmax_top2_renormalised():
  r = _route(MoEConfig(num_experts=4, top_k=2), LOGITS)
  np.testing.assert_array_equal(r.idx_TxK, [[2, 1], [2, 3]])
  # softmax over the two chosen logits: sigmoid of their difference
  np.testing.assert_allclose(r.w_TxK, [[_sig(1.0), _sig(-1.0)], [_sig(0.5), _sig(-0.5)]], rtol=1e-6)


def test_softmax_top2_unnormalised_and_switch_top1():
  z0 = 1 + math.e + math.e**2 + math.e**3
  r = _route(MoEConfig(num_experts=4, top_k=2, norm_topk_prob=False), LOGITS)
  np.testing.assert_allclose(r.w_TxK[0], [math.e**3 / z0, math.e**2 / z0], rtol=1e-6)
  r = _route(MoEConfig(num_experts=4, top_k=1), LOGITS)  # Switch: the full-softmax probability
  np.testing.assert_array_equal(r.idx_TxK, [[2], [2]])
  z1 = math.exp(-1) + 1 + math.e + math.exp(0.5)
  np.testing.assert_allclose(r.w_TxK[:, 0], [math.e**3 / z0, math.e / z1], rtol=1e-6)


def test_load_balancing_and_z_loss():
  cfg = MoEConfig(num_experts=4, top_k=2)
  r = _route(cfg, LOGITS)
  # Assignments: token 0 -> {2, 1}, token 1 -> {2, 3}; f = counts / (T * K).
  f = np.array([0, 1, 2, 1]) / 4
  p = np.exp(LOGITS) / np.exp(LOGITS).sum(1, keepdims=True)
  expected = 4 * np.sum(f * p.mean(0))  # Switch: E * sum_e f_e P_e
  counts = jnp.zeros(4, jnp.int32).at[r.idx_TxK.ravel()].add(1)
  lb = router_lib.load_balancing_loss(r.probs_TxE.sum(0), counts, 2, 2)
  np.testing.assert_allclose(lb, expected, rtol=1e-6)
  lse = [math.log(sum(math.exp(v) for v in row)) for row in LOGITS]
  np.testing.assert_allclose(
      router_lib.z_loss(r.logits_TxE) / 2, (lse[0] ** 2 + lse[1] ** 2) / 2, rtol=1e-6
  )
  uniform = router_lib.load_balancing_loss(jnp.full((4,), 2.0), jnp.full((4,), 4), 8, 2)
  np.testing.assert_allclose(uniform, 1.0, rtol=1e-6)  # perfect balance scores 1


def test_sigmoid_bias_selects_but_does_not_weigh():
  cfg = MoEConfig(num_experts=4, top_k=2, router="sigmoid", routed_scaling=2.5)
  logits = [[0.0, 1.0, 2.0, -1.0]]
  plain = _route(cfg, logits)
  np.testing.assert_array_equal(plain.idx_TxK, [[2, 1]])
  bias = jnp.array([1.0, 0.0, 0.0, 0.0])
  r = _route(cfg, logits, bias)
  np.testing.assert_array_equal(r.idx_TxK, [[0, 2]])  # 0.5 + 1 beats 0.73 and 0.88
  s0, s2 = _sig(0.0), _sig(2.0)
  np.testing.assert_allclose(r.w_TxK, [[2.5 * s0 / (s0 + s2), 2.5 * s2 / (s0 + s2)]], rtol=1e-6)
  g = jax.grad(lambda b: _route(cfg, logits, b).w_TxK.sum())(bias)
  np.testing.assert_array_equal(g, np.zeros(4))


def _logit(p):
  return math.log(p / (1 - p))


def test_group_limited_sigmoid_uses_top2_group_scores():
  # Groups of two; scores: g0 {.95,.05}=1.0, g1 {.6,.55}=1.15, g2 {.7,.2}=.9, g3 {.1,.1}=.2.
  scores = [0.95, 0.05, 0.6, 0.55, 0.7, 0.2, 0.1, 0.1]
  logits = [[_logit(p) for p in scores]]
  cfg = MoEConfig(num_experts=8, top_k=2, router="sigmoid")
  np.testing.assert_array_equal(_route(cfg, logits).idx_TxK, [[0, 4]])
  grouped = dataclasses.replace(cfg, n_groups=4, topk_groups=2)
  np.testing.assert_array_equal(_route(grouped, logits).idx_TxK, [[0, 2]])  # g2's 0.7 is out
  np.testing.assert_allclose(_route(grouped, logits).w_TxK, [[0.95 / 1.55, 0.6 / 1.55]], rtol=1e-5)


def test_group_limited_softmax_uses_group_max():
  # Groups of two with maxima 3, 2.9, 2.5, 0: the top-2 groups are g0 and g1.
  logits = [[3.0, 0.0, 2.9, 2.8, 2.5, 2.4, 0.0, 0.0]]
  cfg = MoEConfig(num_experts=8, top_k=3, n_groups=4, topk_groups=2)
  np.testing.assert_array_equal(_route(cfg, logits).idx_TxK, [[0, 2, 3]])
  with pytest.raises(ValueError, match="top_k=3 exceeds the 2 experts"):
    MoEConfig(num_experts=8, top_k=3, n_groups=4, topk_groups=1)


def test_bias_update_sign_rule():
  new = router_lib.update_expert_bias(
      jnp.array([0.0, 0.1, 0.0, -0.2]), jnp.array([1, 3, 2, 2]), 0.01
  )
  np.testing.assert_allclose(new, [0.01, 0.09, 0.0, -0.2], rtol=1e-6)


def test_jitter_scales_each_token_input():
  cfg = MoEConfig(num_experts=4, top_k=2, jitter=0.1)
  no_rng = _route(cfg, LOGITS)
  np.testing.assert_allclose(no_rng.logits_TxE, LOGITS)
  noisy = _route(cfg, LOGITS, rng=jax.random.key(0))
  ratio = np.asarray(noisy.logits_TxE)[:, [0, 2]] / np.asarray(LOGITS)[:, [0, 2]]
  # x = identity: token t's only nonzero input is multiplied by one draw from U(0.9, 1.1).
  assert np.all((ratio >= 0.9) & (ratio <= 1.1)) and not np.allclose(ratio, 1.0)
  np.testing.assert_allclose(ratio, ratio[:, :1].repeat(2, 1), rtol=1e-6)


def test_top1_renormalisation_and_unnormalised_sigmoid():
  # Mixtral and Qwen3 renormalise the single chosen weight to 1; Switch keeps the probability.
  r = _route(MoEConfig(num_experts=4, top_k=1, norm_top1=True), LOGITS)
  np.testing.assert_array_equal(r.idx_TxK, [[2], [2]])
  np.testing.assert_array_equal(r.w_TxK, [[1.0], [1.0]])
  g = jax.jit(
      jax.grad(
          lambda w: router_lib.route(
              MoEConfig(num_experts=4, top_k=1, norm_top1=True), w, None, jnp.eye(2)
          ).w_TxK.sum()
      )
  )(jnp.asarray(LOGITS, jnp.float32))
  assert np.abs(g).max() < 1e-7  # a weight of 1 carries no router gradient (but rounding)
  off = _route(MoEConfig(num_experts=4, top_k=1, norm_top1=True, norm_topk_prob=False), LOGITS)
  z0 = 1 + math.e + math.e**2 + math.e**3
  np.testing.assert_allclose(off.w_TxK[0], [math.e**3 / z0], rtol=1e-6)
  # The sigmoid router's raw scores when norm_topk_prob is off (DeepSeek's norm_topk_prob=False).
  cfg = MoEConfig(
      num_experts=4, top_k=2, router="sigmoid", norm_topk_prob=False, routed_scaling=2.5
  )
  r = _route(cfg, [[0.0, 1.0, 2.0, -1.0]])
  np.testing.assert_allclose(r.w_TxK, [[2.5 * _sig(2.0), 2.5 * _sig(1.0)]], rtol=1e-6)


def test_aux_objective_forms_and_the_factor_between_them():
  """Per-layer sum vs transformers' pooled form; (K/G) apart when every layer routes alike."""
  from jaxpipe.models import moe

  rng = np.random.default_rng(0)
  g, t, e, k, coef = 3, 16, 4, 2, 0.1
  logits = rng.standard_normal((g, t, e))
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  idx = np.argsort(-probs, -1)[..., :k]
  counts = np.stack([np.bincount(idx[l].ravel(), minlength=e) for l in range(g)])

  def aux(cfg, layers):
    lb = e * np.sum(counts[layers] / (t * k) * probs[layers].mean(1), -1)
    return {
        "loss": jnp.asarray(coef * lb if cfg.lb_loss_form == "per_layer" else 0 * lb),
        "tokens_per_expert": jnp.asarray(counts[layers]),
        "router_probs": jnp.asarray(probs[layers].mean(1)),
    }, lb

  per_layer = MoEConfig(num_experts=e, top_k=k, lb_loss_coef=coef, z_loss_coef=0.0)
  pooled = dataclasses.replace(per_layer, lb_loss_form="pooled")
  layers = np.arange(g)
  a, lb = aux(per_layer, layers)
  np.testing.assert_allclose(moe.aux_objective(per_layer, a), coef * lb.sum(), rtol=1e-6)
  # transformers' load_balancing_loss_func: num_experts * sum(tokens_per_expert * router_prob),
  # each the mean over all layers' tokens, tokens_per_expert counting top-k assignments.
  hf_lb = e * np.sum(counts.sum(0) / (g * t) * probs.reshape(g * t, e).mean(0))
  np.testing.assert_allclose(
      moe.aux_objective(pooled, aux(pooled, layers)[0]), coef * hf_lb, rtol=1e-6
  )
  same = np.zeros(g, int)  # every layer routes as layer 0
  np.testing.assert_allclose(
      moe.aux_objective(pooled, aux(pooled, same)[0]),
      k / g * moe.aux_objective(per_layer, aux(per_layer, same)[0]),
      rtol=1e-6,
  )
  with pytest.raises(ValueError, match="lb_loss_form='mean' is unknown"):
    MoEConfig(lb_loss_form="mean")
