"""FP8 GEMMs (jaxpipe.ops.fp8): format bounds, TE's delayed scaling, DeepSeek-V3's tiles,
the HLO's FP8 operands, delayed scaling's state through every training path and a checkpoint."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.ops import fp8
from jaxpipe.training.config import ConfigError, model_config, validate
from jaxpipe.training.restore import restore_params
from jaxpipe.training.trainer import Trainer

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def _unit_roundoff(dtype) -> float:
  return 2.0 ** -(jnp.finfo(dtype).nmant + 1)  # half a unit in the last place, relative


def _error_bound(v, scale, dtype):
  """|qdq(v) - v| for round-to-nearest into `dtype` after dividing by `scale` (no overflow):
  half an ulp relative, or half the subnormal spacing (times the scale) near zero."""
  half_sub = float(jnp.finfo(dtype).smallest_subnormal) / 2
  return np.maximum(_unit_roundoff(dtype) * np.abs(v), half_sub * np.asarray(scale))


def _log_uniform(rng, shape, lo=-24, hi=8):
  """Signed values spanning 2^lo .. 2^hi, with some exact zeros."""
  v = np.sign(rng.standard_normal(shape)) * 2.0 ** rng.uniform(lo, hi, shape)
  v[rng.random(shape) < 0.02] = 0.0
  return v.astype(np.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_round_trip_within_format_bound(name):
  dtype = FORMATS[name]
  x = _log_uniform(np.random.default_rng(0), (4096,))
  scale = np.float32(np.abs(x).max() / fp8.fp8_max(dtype))
  q = np.asarray(fp8.quantize(jnp.asarray(x), dtype, jnp.float32(scale)))
  # the cast is ml_dtypes' round-to-nearest-even of x / scale
  want = (x / scale).astype(getattr(ml_dtypes, np.dtype(dtype).name))
  np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
  err = np.abs(q.astype(np.float32) * scale - x)
  bound = _error_bound(x, scale, dtype)
  assert np.all(err <= bound * (1 + 1e-6)), np.max(err / bound)
  assert np.max(err / bound) > 0.9  # the bound is attained: rounding is to nearest, no coarser


def test_overflow_clamps_to_the_largest_value_instead_of_nan():
  x = jnp.asarray([1000.0, -1e6, 448.0, 449.0, 1e30])
  assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)[0])  # what a plain cast does
  got = np.asarray(fp8.quantize(x, jnp.float8_e4m3fn, jnp.float32(1.0)), np.float32)
  np.testing.assert_array_equal(got, [448, -448, 448, 448, 448])
  got = np.asarray(fp8.quantize(x * 100, jnp.float8_e5m2, jnp.float32(1.0)), np.float32)
  np.testing.assert_array_equal(got, [57344, -57344, 40960, 40960, 57344])
  # a stale delayed scale (amax history far below this x): the GEMM clamps, it does not NaN
  w = jnp.eye(5)
  y = fp8.dot(x[None], w, 1, "delayed", jnp.ones(3), jnp.float32)
  np.testing.assert_array_equal(np.asarray(y)[0], [448, -448, 448, 448, 448])


def _te_delayed_step(history, scale, amax_now, algo, margin, fp8_max):
  """Transformer Engine's delayed scaling, transcribed from its documented rule
  (`_default_get_amax_and_update_history`, `_default_sf_compute`): the cast writes this step's amax
  into history[0]; amax = max of the history ('max') or history[0] ('most_recent'); scale =
  (fp8_max / amax) / 2^margin, the old scale kept where amax is 0 or not finite; then the history
  rolls by one and history[0] is cleared. `scale` is TE's quantisation factor (1 / scale_inv)."""
  history = history.copy()
  history[0] = amax_now
  amax = history.max(axis=0) if algo == "max" else history[0]
  with np.errstate(divide="ignore", invalid="ignore"):
    sf = (fp8_max / amax) / 2.0**margin
  sf = np.where(amax > 0.0, sf, scale)
  sf = np.where(np.isfinite(amax), sf, scale)
  history = np.roll(history, -1, axis=0)
  history[0] = 0.0
  return history, sf.astype(np.float32)


@pytest.mark.parametrize("algo,margin", [("max", 0), ("max", 2), ("most_recent", 1)])
def test_delayed_scaling_follows_transformer_engine(algo, margin):
  rng = np.random.default_rng(1)
  steps, length, layers = 40, 8, 2
  fmax = np.array([448.0, 448.0, 57344.0], np.float32)
  amaxes = 2.0 ** rng.uniform(-12, 6, (steps, layers, 3)).astype(np.float32)
  amaxes[5, 0, 1] = 0.0  # keeps the old scale
  amaxes[9, 1, 2] = np.inf  # keeps the old scale while it is in the history
  amaxes[[13, 14, 15]] *= 2.0**10  # a spike that leaves the history `length` steps later
  scales = {"fp8_scale": jnp.ones((layers, 3))}
  history = {"fp8_scale": jnp.zeros((layers, 3, length))}
  te_history = np.zeros((length, layers, 3), np.float32)
  te_scale = np.ones((layers, 3), np.float32)
  for t in range(steps):
    scales, history = fp8.advance(
        scales, history, {"fp8_scale": jnp.asarray(amaxes[t])}, margin, algo
    )
    te_history, te_scale = _te_delayed_step(te_history, te_scale, amaxes[t], algo, margin, fmax)
    np.testing.assert_allclose(
        1.0 / np.asarray(scales["fp8_scale"]), te_scale, rtol=2e-7, err_msg=f"step {t}"
    )
  assert len(set(np.round(np.log2(te_scale.ravel())))) > 3  # the scales really moved


def test_block_scaling_scales_every_tile():
  rng = np.random.default_rng(2)
  x = (
      rng.standard_normal((200, 384)) * 2.0 ** rng.integers(-8, 8, (200, 3)).repeat(128, 1)
  ).astype(np.float32)
  for tile in [(1, 128), (128, 128), (128, 1)]:
    q, s = _tiles(jnp.asarray(x), tile)
    tr, tc = tile
    rows, cols = -(-200 // tr), -(-384 // tc)
    padded = np.zeros((rows * tr, cols * tc), np.float32)
    padded[:200, :384] = x
    amax = np.abs(padded.reshape(rows, tr, cols, tc)).max(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(s), amax / 448.0, rtol=1e-6, err_msg=str(tile))
    s_full = np.repeat(np.repeat(np.asarray(s), tr, 0), tc, 1)[:200, :384]
    want = np.clip(x / s_full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.mean(np.asarray(q).view(np.uint8) == want.view(np.uint8)) > 0.999, tile
    back = np.asarray(_untiles(q, s, tile, jnp.float32))
    assert np.all(np.abs(back - x) <= _error_bound(x, s_full, jnp.float8_e4m3fn) * (1 + 1e-5))


def test_a_tile_of_vanishing_values_quantises_to_zeros_not_nan():
  """amax under fp8_max / float32's largest (here 1e-37): flax's scale formula overflows to a
  scale of 0, and x / 0 would be NaN (an all-zero value, 0 / 0, too); the tile takes scale 1.
  Such amaxes are real: without denormals flushed (the suite's -O0 flags), a block-scaled model
  with head_dim 64 had NaN gradients from them."""
  x = np.zeros((2, 256), np.float32)
  x[0, :128] = 1e-37 * np.linspace(-1, 1, 128)  # a tile of vanishing values
  x[1, 128:] = np.linspace(-3, 3, 128)  # an ordinary tile beside them
  q, s = _tiles(jnp.asarray(x), (1, 128))
  q, s = np.asarray(q).astype(np.float32), np.asarray(s)
  assert np.all(np.isfinite(q)) and np.all(np.isfinite(s)) and np.all(s > 0)
  assert s[0, 0] == 1.0 and np.all(q[0, :128] == 0.0)
  np.testing.assert_allclose(s[1, 1], 3.0 / 448.0, rtol=1e-6)
  assert float(fp8.current_scale(jnp.float32(1e-37), fp8.E4M3)) == 1.0


_tiles = jax.jit(fp8.quantize_tiles, static_argnums=1)
_untiles = jax.jit(fp8.dequantize_tiles, static_argnums=(2, 3))


def _product_bound(a, ea, b, eb):
  """Largest |(a + da) @ (b + db) - a @ b| over |da| <= ea, |db| <= eb, elementwise."""
  a, b = np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)
  return ea @ b + a @ eb + ea @ eb


def _expected_bounds(recipe, x, w, g, delayed_scales):
  """Elementwise bounds on y, dx, dw of the recipe's GEMM against exact products."""
  if recipe == "block":
    rows = lambda v: np.repeat(np.asarray(_tiles(jnp.asarray(v), (1, 128))[1]), 128, 1)[
        :, : v.shape[1]
    ]
    cols = lambda v: np.repeat(np.asarray(_tiles(jnp.asarray(v), (128, 1))[1]), 128, 0)[
        : v.shape[0]
    ]
    sw = (
        np.asarray(_tiles(jnp.asarray(w), (128, 128))[1])
        .repeat(128, 0)
        .repeat(128, 1)[: w.shape[0], : w.shape[1]]
    )
    e4 = jnp.float8_e4m3fn
    ex, ew, eg = _error_bound(x, rows(x), e4), _error_bound(w, sw, e4), _error_bound(g, rows(g), e4)
    x1 = np.asarray(_untiles(*_tiles(jnp.asarray(x), (1, 128)), (1, 128), jnp.float32))
    ex_cols = ex + _error_bound(x1, cols(x1), e4)  # re-quantised along tokens for the W gradient
    eg_cols = _error_bound(g, cols(g), e4)
    return (
        _product_bound(x, ex, w, ew),
        _product_bound(g, eg, w.T, ew.T),
        _product_bound(x.T, ex_cols.T, g, eg_cols),
    )
  if recipe == "current":
    sx, sw, sg = (
        np.abs(v).max() / fp8.fp8_max(f)
        for v, f in ((x, jnp.float8_e4m3fn), (w, jnp.float8_e4m3fn), (g, jnp.float8_e5m2))
    )
  else:
    sx, sw, sg = delayed_scales
  ex = _error_bound(x, sx, jnp.float8_e4m3fn)
  ew = _error_bound(w, sw, jnp.float8_e4m3fn)
  eg = _error_bound(g, sg, jnp.float8_e5m2)
  return (
      _product_bound(x, ex, w, ew),
      _product_bound(g, eg, w.T, ew.T),
      _product_bound(x.T, ex.T, g, eg),
  )


def _value_and_vjp(fn, *args):
  """(fn(*args[:-1]), its vjp at cotangent args[-1]), compiled as one program."""

  def run(*a):
    y, vjp = jax.vjp(fn, *a[:-1])
    return y, vjp(a[-1])

  return jax.jit(run)(*args)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_matmul_and_its_gradients_within_the_quantisation_bound(recipe):
  """y = x w, dx = g w^T, dw = x^T g against float64 products: each element lies within the
  bound that the recipe's per-element quantisation errors allow (a product of perturbed factors),
  and the FP8 error is really there (relative Frobenius error of a few percent)."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((96, 256)).astype(np.float32)
  x[:, :128] *= 8.0  # tiles of different magnitudes
  w = (rng.standard_normal((256, 160)) / 16).astype(np.float32)
  g = (rng.standard_normal((96, 160)) * 1e-3).astype(np.float32)
  # delayed: scales from an amax history 1.5x above these tensors (the previous steps')
  amaxes = np.array([np.abs(x).max(), np.abs(w).max(), np.abs(g).max()], np.float32)
  delayed = (1.5 * amaxes / np.array([448.0, 448.0, 57344.0])).astype(np.float32)
  scale_3 = jnp.asarray(delayed) if recipe == "delayed" else None
  y, (dx, dw, seen) = _value_and_vjp(
      lambda a, b, s: fp8.dot(a, b, 1, recipe, s, jnp.float32), x, w, scale_3, g
  )
  exact = (x.astype(np.float64) @ w, g.astype(np.float64) @ w.T, x.T.astype(np.float64) @ g)
  bounds = _expected_bounds(recipe, x, w, g, delayed)
  for what, got, want, bound in zip(("y", "dx", "dw"), (y, dx, dw), exact, bounds):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound + 1e-5 * np.abs(want) + 1e-30), (what, np.max(err / bound))
    rel = np.linalg.norm(err) / np.linalg.norm(want)
    assert 1e-3 < rel < 0.08, (what, rel)
  if recipe == "delayed":  # the scales' cotangent is what this GEMM saw: amax of x, w, g
    np.testing.assert_array_equal(np.asarray(seen), amaxes)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_grouped_gemm_equals_each_groups_gemm(recipe):
  """MoE experts' grouped GEMM: each group's rows are that group's GEMM (per-tensor scales shared
  by all groups; block scales per expert and, with 128-row groups, per group of tokens)."""
  rng = np.random.default_rng(4)
  sizes = np.array([128, 256, 128])
  x = jnp.asarray(rng.standard_normal((512, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 128, 256)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((512, 256)) * 1e-2, jnp.float32)
  scale_3 = jnp.asarray([0.01, 0.002, 1e-6]) if recipe == "delayed" else None
  y, (dx, dw, seen) = _value_and_vjp(
      lambda a, b, s: fp8.grouped(a, b, jnp.asarray(sizes, jnp.int32), recipe, s), x, w, scale_3, g
  )
  if recipe == "current":  # per-tensor: one scale for all experts, so compare as delayed
    scale_3 = jnp.stack(
        [
            fp8.current_scale(fp8.amax(v), f)
            for v, f in ((x, fp8.E4M3), (w, fp8.E4M3), (g, fp8.E5M2))
        ]
    )
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for e in range(3):
    rows = slice(starts[e], starts[e + 1])
    want_y, (want_dx, want_dw) = _value_and_vjp(
        lambda a, b: fp8.dot(
            a,
            b,
            1,
            "block" if recipe == "block" else "delayed",
            None if recipe == "block" else scale_3,
            jnp.float32,
        ),
        x[rows],
        w[e],
        g[rows],
    )
    for what, got, want in (
        ("y", y[rows], want_y),
        ("dx", dx[rows], want_dx),
        ("dw", dw[e], want_dw),
    ):
      np.testing.assert_allclose(
          got,
          want,
          rtol=1e-5,
          atol=1e-6 * float(jnp.max(jnp.abs(want))),
          err_msg=f"{what} of group {e}",
      )
  if recipe == "delayed":
    np.testing.assert_array_equal(seen, [fp8.amax(x), fp8.amax(w), fp8.amax(g)])


def _config(recipe="delayed", **overrides):
  c = tiny.get_config()
  c.model.fp8 = recipe
  c.train.eval_every = 0
  for key, value in overrides.items():
    section, field = key.split("__")
    c[section][field] = value
  return c


def _dot_types(hlo: str) -> list[tuple[str, str]]:
  """Element types of every stablehlo.dot_general's two operands."""
  return re.findall(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", hlo)


def _f8_types(hlo: str) -> list[tuple[str, str]]:
  return [t for t in _dot_types(hlo) if any(e.startswith("f8") for e in t)]


def _lowered_step(recipe: str, **overrides) -> str:
  trainer = Trainer(_config(recipe, **overrides))
  return trainer.build_train_step().lower(trainer.state_shapes, trainer.batch(0)).as_text()


@pytest.mark.parametrize("recipe,pp", [("delayed", 1), ("delayed", 2), ("current", 1)])
def test_step_hlo_has_fp8_dot_operands(recipe, pp):
  """The lowered train step's projections are FP8 dots: E4M3 x E4M3 forward, an E5M2 gradient
  against an E4M3 operand for both backward GEMMs; nothing else is FP8."""
  f8 = _f8_types(_lowered_step(recipe, mesh__pp=pp, pipeline__microbatches=2))
  fwd = f8.count(("f8E4M3FN", "f8E4M3FN"))
  dgrad, wgrad = f8.count(("f8E5M2", "f8E4M3FN")), f8.count(("f8E4M3FN", "f8E5M2"))
  assert fwd + dgrad + wgrad == len(f8), f8
  projections = 7  # q, k, v, o, gate, up, down
  if pp == 1:  # the layer scan's body holds each GEMM once
    assert (fwd, dgrad, wgrad) == (projections,) * 3, (fwd, dgrad, wgrad)
  else:  # the executor's branches hold F, I (dgrad), W (wgrad) and B (both) of a layer
    assert fwd >= projections and dgrad >= projections and wgrad >= projections
  if recipe == "delayed":
    assert not _f8_types(_lowered_step("none", mesh__pp=pp, pipeline__microbatches=2))


def test_block_step_casts_to_e4m3_and_multiplies_in_the_compute_dtype():
  """Block scaling's step casts tiles to E4M3 only (no E5M2 anywhere) and, with no block-scaled
  GEMM in XLA, multiplies the dequantised tiles: no FP8 dot."""
  hlo = _lowered_step("block", model__d_model=128, model__d_ff=128, model__head_dim=32)
  assert not _f8_types(hlo)
  casts = re.findall(r"stablehlo\.convert .*-> tensor<[^>]*x(f8\w+)>", hlo)
  # per projection: x, w and the gradient's row tiles, x's and the gradient's column tiles
  assert len(casts) >= 7 * 5 and set(casts) == {"f8E4M3FN"}, casts


@jax.jit
def _one_device_seen(params, host):
  """Oracle: the amaxes every GEMM saw on the unsplit batch, on one device (the tiny model)."""

  def loss(p):
    return transformer.loss(_MODEL, p, host["tokens"], host["targets"], host["mask"])[0]

  return fp8.state_of(jax.grad(loss)(params))


_MODEL = model_config(_config())
_init_on_one_device = jax.jit(lambda key: transformer.init_params(_MODEL, key))


def _seen_on_one_device(params, host):
  return jax.device_get(_one_device_seen(*jax.device_put((params, host), jax.devices()[0])))


def _assert_seen(got, want, what):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.slow  # the pipeline and cp programs: a minute; tp x pp runs in test_tensor
def test_delayed_amaxes_are_maxima_through_pipeline_and_context_parallelism():
  """The pipeline executor (pp = 2, 2 micro-batches, dp = 4), context parallelism (cp = 2,
  2 micro-batches) and tensor parallelism in the pipeline (tp = 2, pp = 2) report, for every
  GEMM, the amax of x, w and g over the whole batch, as one device sees it: combined by max
  over micro-batches, shards and ranks, never summed."""
  host = Trainer(_config()).source.batch("train", 7, 16, 16)
  host["mask"] = np.ones_like(host["mask"])  # every path then weighs tokens alike
  params = jax.device_get(_init_on_one_device(jax.random.key(0)))
  # delayed scales as after a step: from the amaxes of this batch
  scales = jax.tree.map(
      lambda a: (a / np.array([448.0, 448.0, 57344.0])).astype(np.float32),
      _seen_on_one_device(params, host),
  )
  params = fp8.with_state(params, scales)
  want = _seen_on_one_device(params, host)
  for overrides in (
      dict(mesh__pp=2, pipeline__microbatches=2),
      dict(mesh__cp=2, pipeline__microbatches=2),
      # tensor parallel inside the pipeline: amaxes of split tensors reduced over tp, and the
      # gradients' those of the one loss (each tp rank seeds 1/tp of it)
      dict(mesh__tp=2, mesh__pp=2, pipeline__microbatches=2, model__sequence_parallel=True),
  ):
    trainer = Trainer(_config(**overrides))
    stored = trainer.stored_params(jax.device_put(params, trainer.state_sharding.params))
    _, grads, _ = jax.jit(trainer.loss_and_grads)(stored, trainer.shard_batch(host))
    _assert_seen(jax.device_get(fp8.state_of(grads)), want, overrides)


def test_delayed_amaxes_of_expert_parallel_moe_are_maxima():
  """An MoE layer with its experts split over ep = 4 (dp = 2) reports each grouped GEMM's amax of
  x, w and g over all tokens and experts, as the one-device layer does."""
  from jaxpipe.models import moe

  cfg = moe.MoEConfig(num_experts=8, top_k=2, d_ff=32, num_shared_experts=1, dropless_impl="padded")
  rng = jax.random.split(jax.random.key(0), 3)
  params = moe.init_moe_params(cfg, rng[0], 32)
  params.update({name: jnp.asarray([0.01, 0.002, 1e-4]) for name in moe.fp8_state_names(cfg)})
  x = jax.random.normal(rng[1], (8, 16, 32))
  g = jax.random.normal(rng[2], (8, 16, 32))
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def seen(mesh):
    def y_dot_g(p):
      return jnp.sum(moe.moe_layer(cfg, p, x, mesh=mesh, fp8="delayed")[0] * g)

    return jax.device_get(fp8.state_of(jax.jit(jax.grad(y_dot_g))(params)))

  want = seen(None)
  assert set(want) == set(moe.fp8_state_names(cfg))
  _assert_seen(seen(mesh), want, "dp x ep")


def test_executor_combines_stage_copies_by_max():
  """Bidirectional schedules run a stage on two ranks: its ordinary gradients add up, the
  leaves the model combines by max (delayed scaling's amaxes) take the larger copy, whether the
  copies stay resident (`sum_copies`) or are gathered into one stack (`from_local`)."""
  from jaxpipe.pipeline.api import copy_partners, sum_copies
  from jaxpipe.pipeline.executor import Model, from_local

  model = Model(stage_fn=None, loss_fn=None, max_grads=fp8.is_state)
  local = {
      "kernel": jnp.asarray([[[1.0], [2.0]], [[3.0], [4.0]]]),  # [ranks, chunks, ...]
      "fp8_scale": jnp.asarray([[[1.0], [5.0]], [[3.0], [4.0]]]),
  }
  layout = np.array([[0, 1], [1, 0]])  # rank 0 holds stages 0, 1; rank 1 stages 1, 0
  got = from_local(local, layout, 2, model)
  np.testing.assert_array_equal(got["kernel"], [[1.0 + 4.0], [2.0 + 3.0]])
  np.testing.assert_array_equal(got["fp8_scale"], [[4.0], [5.0]])
  mesh = jax.make_mesh(
      (2,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
  )
  both = sum_copies(
      local, copy_partners(layout), mesh, "pp", jax.sharding.PartitionSpec("pp"), model
  )
  np.testing.assert_array_equal(both["kernel"], [[[5.0], [5.0]], [[5.0], [5.0]]])
  np.testing.assert_array_equal(both["fp8_scale"], [[[4.0], [5.0]], [[5.0], [4.0]]])


def test_delayed_run_resumes_exactly_from_a_checkpoint(tmp_path):
  """Data-parallel training with 2 micro-batches: step 1's history holds the amaxes one device
  sees on its batch; stopping after step 2 and restoring gives steps 3 and 4 the same losses and
  amax histories as running on (the scales live in the params, the histories in TrainState.fp8),
  and serving restores step 2's parameters from the same checkpoint."""
  c = _config(train__steps=4, pipeline__microbatches=2)
  trainer = Trainer(c, str(tmp_path))
  trainer.init()
  params = jax.device_get(trainer.model_params())
  losses = [float(trainer.step()["loss"])]
  first = jax.tree.map(lambda h: h[..., 0], jax.device_get(trainer.state.fp8))
  _assert_seen(
      first, _seen_on_one_device(params, trainer.source.batch("train", 0, 16, 16)), "step 1"
  )
  losses.append(float(trainer.step()["loss"]))
  trainer.checkpointer.save(2, trainer._checkpoint_state())
  trainer.checkpointer.wait()
  at_two = jax.device_get(trainer.state.params)
  losses += [float(trainer.step()["loss"]) for _ in range(2)]
  straight = jax.device_get(trainer.state)
  assert np.count_nonzero(np.asarray(straight.fp8["layers"]["mlp"]["up"]["fp8_scale"])) == 4 * 2 * 3
  trainer.close()
  step, served = restore_params(str(tmp_path), c)  # serving reads the parameters, fp8_scale too
  assert step == 2
  jax.tree.map(np.testing.assert_array_equal, served, at_two)

  resumed = Trainer(c, str(tmp_path))
  resumed._train_step = trainer._train_step  # the same compiled step: only the state is new
  resumed.init()
  assert resumed.resumed_from == 2
  again = [float(resumed.step()["loss"]) for _ in range(2)]
  assert again == losses[2:]
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state)), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(a, b)


def test_hf_export_writes_the_weights_without_delayed_state():
  """A delayed run's parameters export to transformers' layout as the same weights without FP8
  would: the scales are training state, not model tensors."""
  from jaxpipe.models import hf

  params = jax.device_get(_init_on_one_device(jax.random.key(0)))
  plain = model_config(_config("none"))
  strip = lambda t: {
      k: strip(v) if isinstance(v, dict) else v
      for k, v in t.items()
      if not k.startswith(fp8.STATE_PREFIX)
  }
  without = dict(hf.hf_tensors(plain, strip(params), "llama"))
  got = dict(hf.hf_tensors(_MODEL, params, "llama"))
  assert got.keys() == without.keys() and not any("fp8" in name for name in got)
  for name, array in got.items():
    np.testing.assert_array_equal(array, without[name], err_msg=name)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(model__fp8="fp4"), "model.fp8='fp4' is unknown"),
        (dict(model__fp8="block"), "model.d_model=32 is not a multiple of 128"),
        (
            dict(model__fp8="block", model__d_model=128, model__d_ff=128, model__head_dim=16),
            "model.n_heads * head_dim=64 is not a multiple of 128",
        ),
        (dict(model__fp8_history=0), "model.fp8_history=0 must be a positive integer"),
        (dict(model__fp8_margin=-1), "model.fp8_margin=-1 must be an integer >= 0"),
        (dict(model__fp8_amax="mean"), "model.fp8_amax='mean' is unknown"),
        (
            dict(model__fp8="current", model__cp_overlap=True, mesh__cp=2),
            "set --config.model.cp_overlap",
        ),
        (
            dict(model__fp8="delayed", model__attention="pallas", mesh__cp=2),
            "set --config.model.attention=xla",
        ),
        (  # fsdp at pp = 1 runs the same shard_map
            dict(model__fp8="delayed", model__attention="pallas", optimizer__shard="fsdp"),
            "optimizer.shard='fsdp'): the amaxes",
        ),
        (
            dict(model__fp8="delayed", model__attention="pallas", mesh__tp=2),
            "set --config.model.attention=xla",
        ),
    ],
)
def test_bad_fp8_config_is_refused(overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    validate(_config("none", **overrides), 8)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (cuBLAS FP8 GEMMs)")
def test_gpu_compiles_delayed_gemms_to_cublas_fp8():
  """On a Hopper GPU the three GEMMs of a delayed projection become cuBLASLt FP8 GEMMs."""
  x = jnp.ones((256, 512), jnp.bfloat16)
  w = jnp.ones((512, 384), jnp.bfloat16)
  fn = jax.jit(
      jax.value_and_grad(
          lambda a, b: jnp.sum(fp8.dot(a, b, 1, "delayed", jnp.ones(3), jnp.bfloat16)),
          argnums=(0, 1),
      )
  )
  assert fn.lower(x, w).compile().as_text().count("__cublas$lt$matmul$f8") == 3
