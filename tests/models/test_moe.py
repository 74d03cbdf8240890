"""The expert-parallel MoE layer equals a dense one-device reference, outputs and gradients."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpipe.models import moe
from jaxpipe.models import router as router_lib

D, F, E = 16, 8, 8
B, L = 8, 8  # 64 tokens, 8 per device
N_DEV = 8
CF = 0.75  # small enough that capacity mode drops at every ep
TOP_KS = (1, 2, 4)


def _mesh(ep):
  return jax.make_mesh(
      (N_DEV // ep, ep), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


@functools.cache
def _data():
  kx, kg = jax.random.split(jax.random.key(0))
  return jax.random.normal(kx, (B, L, D)), jax.random.normal(kg, (B, L, D))


def _base(cfg):
  """The reference and the parameters do not depend on how tokens travel."""
  return dataclasses.replace(cfg, dispatch="dropless", dropless_impl="auto", fp8_dispatch=False)


@functools.cache
def _params(cfg: moe.MoEConfig):
  p = moe.init_moe_params(_base(cfg), jax.random.key(1), D)
  if "expert_bias_E" in p:  # a bias that changes choices, so that its use is tested
    p["expert_bias_E"] = 0.3 * jax.random.normal(jax.random.key(2), (E,))
  return p


def _layer_loss(cfg, mesh, params, x, g):
  y, aux = moe.moe_layer(cfg, params, x, mesh=mesh)
  return jnp.sum(y * g) + aux["loss"], (y, aux)


@functools.cache
def _layer_results(cfgs: tuple[moe.MoEConfig, ...], ep: int):
  """Loss, outputs, statistics and gradients of several configs from one compiled program."""
  mesh = _mesh(ep)
  x, g = _data()

  @jax.jit
  def run(params_list, x, g):
    return [
        jax.value_and_grad(functools.partial(_layer_loss, c, mesh), argnums=(0, 1), has_aux=True)(
            p, x, g
        )
        for c, p in zip(cfgs, params_list)
    ]

  return run([_params(c) for c in cfgs], x, g)


def _ref_loss(cfg, params, x, g, keep):
  y, aux = moe.dense_reference(cfg, params, x.reshape(-1, D), keep)
  idx = router_lib.route(
      cfg, params["router_DxE"], params.get("expert_bias_E"), x.reshape(-1, D)
  ).idx_TxK
  return jnp.sum(y.reshape(g.shape) * g) + aux["loss"], (y, aux, idx)


@functools.cache
def _ref_fn(cfg: moe.MoEConfig):
  return jax.jit(
      jax.value_and_grad(functools.partial(_ref_loss, cfg), argnums=(0, 1), has_aux=True)
  )


def _keep_oracle(idx, ep, top_k, capacity_factor):
  """Per source device, (token, rank) pairs fill each rank's buffer in token order."""
  t = idx.shape[0] // N_DEV
  cap = min(t, math.ceil(capacity_factor * t * min(top_k, ep) / ep))
  rank = idx // (E // ep)
  keep = np.ones(idx.shape, bool)
  dropped_pairs = 0
  for dev in range(N_DEV):
    used = np.zeros(ep, int)
    for row in range(dev * t, (dev + 1) * t):
      for r in sorted(set(rank[row].tolist())):
        if used[r] >= cap:
          keep[row, rank[row] == r] = False
          dropped_pairs += 1
        used[r] += 1
  return keep, dropped_pairs


def _close(a, b, rtol=1e-5, what=""):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(1e-3, np.abs(b).max()), err_msg=what)


def _check(cfg, ep, result, expect_drops=False, rtol=1e-5):
  """Compares one layer result with the dense reference."""
  x_ref, g = _data()
  params = _params(cfg)
  (_, (y, aux)), grads = result
  ref = _ref_fn(_base(cfg))
  keep = np.ones((B * L, cfg.top_k), bool)
  (_, (y_ref, aux_ref, idx)), grads_ref = ref(params, x_ref, g, keep)
  idx = np.asarray(idx)
  dropped_pairs = 0
  if cfg.dispatch == "capacity":
    keep, dropped_pairs = _keep_oracle(idx, ep, cfg.top_k, cfg.capacity_factor)
    (_, (y_ref, aux_ref, _)), grads_ref = ref(params, x_ref, g, keep)
  tag = f"{cfg.dispatch} ep={ep} top_k={cfg.top_k}"
  _close(y.reshape(-1, D), y_ref, rtol, f"output, {tag}")
  for name in ("loss", "lb_loss", "z_loss", "imbalance"):
    _close(aux[name], aux_ref[name], rtol, f"{name}, {tag}")
  counts = np.bincount(idx.ravel(), minlength=E)
  np.testing.assert_array_equal(aux["tokens_per_expert"], counts)
  _close(aux["imbalance"], counts.max() / counts.mean(), rtol, f"imbalance, {tag}")
  assert int(aux["dropped"]) == int((~keep).sum()), tag
  assert int(aux["dropped_pairs"]) == dropped_pairs, tag
  if expect_drops:
    assert int(aux["dropped"]) > 0, tag
  for name in params:
    _close(grads[0][name], grads_ref[0][name], rtol, f"d{name}, {tag}")
  _close(grads[1], grads_ref[1], rtol, f"dx, {tag}")
  return idx, aux


@pytest.mark.parametrize(
    # ep = 4 and 8 (a minute) run with -m slow: ep = 2 already splits the experts over ranks
    "ep",
    [1, 2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)],
)
def test_layer_equals_dense_reference(ep):
  """Dropless exactly; capacity mode exactly with the dropped assignments zeroed, count checked."""
  dropless = tuple(moe.MoEConfig(num_experts=E, top_k=k, d_ff=F) for k in TOP_KS)
  capacity = tuple(
      dataclasses.replace(c, dispatch="capacity", capacity_factor=CF) for c in dropless
  )
  results = _layer_results(dropless + capacity, ep)
  for cfg, res in zip(dropless + capacity, results):
    _, aux = _check(cfg, ep, res, expect_drops=cfg.dispatch == "capacity")
    if cfg.dispatch == "dropless":
      assert int(aux["dropped"]) == 0


def test_sigmoid_group_limited_with_shared_experts():
  """DeepSeek-V3 routing (bias, groups = ranks, scaling) plus shared experts at ep = 4."""
  cfg = moe.MoEConfig(
      num_experts=E,
      top_k=3,
      d_ff=F,
      router="sigmoid",
      routed_scaling=2.5,
      n_groups=4,
      topk_groups=2,
      num_shared_experts=2,
  )
  (res,) = _layer_results((cfg,), 4)
  idx, _ = _check(cfg, 4, res)
  ranks_per_token = [len(set(r)) for r in (idx // (E // 4)).tolist()]
  assert max(ranks_per_token) <= 2 and min(ranks_per_token) == 2


def test_ragged_layout_equals_dense_reference():
  """The packed layout and offsets of the ragged_all_to_all path, moved by its CPU emulation."""
  cfgs = tuple(
      moe.MoEConfig(num_experts=E, top_k=k, d_ff=F, dropless_impl="ragged_emulated") for k in (2, 4)
  )
  for cfg, res in zip(cfgs, _layer_results(cfgs, 4)):
    _check(cfg, 4, res)


def _fp8_round_trip(x, block):
  """Per-row, per-block scale amax/448 and an e4m3 cast, in numpy."""
  xb = np.asarray(x, np.float32).reshape(-1, D // block, block)
  scale = np.abs(xb).max(-1, keepdims=True) / 448.0
  scale = np.where(scale > 0, scale, 1.0)
  q = (xb / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return (q * scale).reshape(x.shape)


def test_fp8_dispatch_is_the_reference_on_round_tripped_tokens():
  """Experts see the e4m3 round trip of x, the router sees x; gradients pass the round trip."""
  cfg = moe.MoEConfig(num_experts=E, top_k=2, d_ff=F, fp8_dispatch=True, fp8_block=8)
  (res,) = _layer_results((cfg,), 4)
  (_, (y, aux)), grads = res
  x, g = _data()
  xq = jnp.asarray(_fp8_round_trip(x, 8))
  block_max = np.abs(np.asarray(x)).reshape(-1, D // 8, 8).max(-1, keepdims=True)
  err = np.abs(np.asarray(xq - x)).reshape(-1, D // 8, 8) / block_max
  assert 0 < err.max() <= 2.0**-4  # e4m3: 3 mantissa bits, half an ulp of the block's largest value
  p = _params(cfg)

  def ref_loss(params, x):
    x_expert = x + jax.lax.stop_gradient(xq - x)  # value of the round trip, identity gradient
    y, aux = moe.dense_reference(
        _base(cfg), params, x.reshape(-1, D), x_expert_TxD=x_expert.reshape(-1, D)
    )
    return jnp.sum(y.reshape(g.shape) * g) + aux["loss"], y

  (_, y_ref), grads_ref = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)(p, x)
  _close(y.reshape(-1, D), y_ref, 1e-5, "fp8 output")
  for name in p:
    _close(grads[0][name], grads_ref[0][name], 1e-5, f"fp8 d{name}")
  _close(grads[1], grads_ref[1], 1e-5, "fp8 dx")
  (_, (y_plain, _, _)), _ = _ref_fn(_base(cfg))(p, x, g, np.ones((B * L, 2), bool))
  rel = np.abs(np.asarray(y).reshape(-1, D) - y_plain).max() / np.abs(y_plain).max()
  assert 0 < rel < 2.0**-4, rel


@pytest.mark.parametrize(
    "kwargs, ep, match",
    [
        (dict(num_experts=6), 4, "num_experts=6 is not divisible by the expert axis size ep=4"),
        (dict(top_k=9), None, "top_k=9 exceeds num_experts=8"),
        (dict(capacity_factor=0.0), None, "capacity_factor=0.0 must be > 0"),
        (dict(capacity_factor=-1.0, dispatch="capacity"), None, "capacity_factor=-1.0 must be > 0"),
        (dict(n_groups=3), None, "n_groups=3 must divide num_experts=8"),
        (dict(n_groups=4, topk_groups=5), None, "topk_groups=5 must lie in"),
        (dict(n_groups=4, topk_groups=1, top_k=3), None, "top_k=3 exceeds the 2 experts"),
        (dict(num_experts=12, n_groups=3, topk_groups=2), 4, "n_groups=3 does not fit ep=4"),
        (dict(router="relu"), None, "router='relu' is unknown"),
        (dict(dispatch="sparse"), None, "dispatch='sparse' is unknown"),
        (dict(bias_update_rate=0.001), None, "needs router='sigmoid'"),
    ],
)
def test_bad_config_errors(kwargs, ep, match):
  with pytest.raises(ValueError, match=match):
    moe.MoEConfig(**kwargs).validate(ep or 1)


def test_layer_checks_mesh_at_call():
  cfg = moe.MoEConfig(num_experts=6, top_k=2, d_ff=F)
  params = moe.init_moe_params(cfg, jax.random.key(0), D)
  with pytest.raises(
      ValueError, match="num_experts=6 is not divisible by the expert axis size ep=4"
  ):
    moe.moe_layer(cfg, params, _data()[0], mesh=_mesh(4))
  cfg = moe.MoEConfig(num_experts=E, top_k=2, d_ff=F, fp8_dispatch=True)  # fp8_block 128 > D
  with pytest.raises(ValueError, match="d_model=16 divisible by fp8_block=128"):
    moe.moe_layer(cfg, moe.init_moe_params(cfg, jax.random.key(0), D), _data()[0], mesh=_mesh(4))
