"""jaxpipe.pipeline.value_and_grad: names, hand-written CSVs, data parallelism, bad input."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpipe.pipeline
from jaxpipe.pipeline import PipelineSharding, api, make_schedule
from tests import helpers

B, L, D = helpers.B, helpers.L, helpers.D


def make_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def sequential(params, xs, ts):
  total = 0.0
  for i in range(xs.shape[0]):
    x = xs[i]
    for s in range(jax.tree.leaves(params)[0].shape[0]):
      x = helpers.stage_fn(jax.tree.map(lambda a: a[s], params), x)
    total = total + helpers.loss_fn(x, ts[i])
  return total


def assert_matches(loss, grads, params, xs, ts, oracle=sequential):
  want_loss, want_grads = jax.jit(jax.value_and_grad(oracle))(params, xs, ts)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in want_grads:
    scale = np.max(np.abs(want_grads[k]))
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=0, atol=1e-5 * scale)


def test_named_schedule_with_data_parallel_axis():
  mesh = make_mesh((2, 2), ("dp", "pp"))
  params, xs, ts = helpers.make_data(2, 4)
  loss, grads = jaxpipe.pipeline.value_and_grad(
      helpers.stage_fn, params, xs, ts, helpers.loss_fn, schedule="zb-h1", sharding=mesh
  )
  assert_matches(loss, grads, params, xs, ts)


# A zero-bubble-like schedule written by hand in torch.distributed.pipelining's CSV:
# split backwards, an idle step and an overlapped F&B pair.
HAND_CSV = """\
0F0,0F1,,0I0,(0F2;0I1)OVERLAP_F_B,0W0,0W1,0I2,0W2
1F0,1I0,1F1,1W0,1I1,1F2,1W1,1I2,1W2
"""


def test_hand_written_csv_schedule(tmp_path):
  path = tmp_path / "hand.csv"
  path.write_text(HAND_CSV)
  mesh = make_mesh((2,), ("pp",))
  params, xs, ts = helpers.make_data(2, 3, seed=1)
  loss, grads = jaxpipe.pipeline.value_and_grad(
      helpers.stage_fn, params, xs, ts, helpers.loss_fn, schedule=str(path), sharding=mesh
  )
  assert_matches(loss, grads, params, xs, ts)


def test_value_and_grad_inside_jit():
  mesh = make_mesh((2,), ("pp",))
  params, xs, ts = helpers.make_data(4, 4, seed=2)
  sched = make_schedule("interleaved-1f1b", pp=2, microbatches=4, chunks=2)
  f = jax.jit(
      lambda ps: jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, ps, xs, ts, helpers.loss_fn, schedule=sched, sharding=mesh
      )
  )
  loss, grads = f(params)
  assert_matches(loss, grads, params, xs, ts)


def expect_error_before_compiling(match, **overrides):
  mesh = make_mesh((2,), ("pp",))
  params, xs, ts = helpers.make_data(2, 4)
  kwargs = dict(
      stage_fn=helpers.stage_fn,
      stage_params=params,
      xs=xs,
      targets=ts,
      loss_fn=helpers.loss_fn,
      schedule="1f1b",
      sharding=mesh,
  )
  kwargs.update(overrides)
  with mock.patch.object(api, "_program", side_effect=AssertionError("compiled")):
    with pytest.raises(ValueError, match=match):
      jaxpipe.pipeline.value_and_grad(**kwargs)


def test_error_schedule_ranks_disagree_with_mesh():
  expect_error_before_compiling(
      "4 ranks but mesh axis 'pp' has 2", schedule=make_schedule("1f1b", pp=4, microbatches=4)
  )


def test_error_stage_count_disagrees_with_params():
  params, _, _ = helpers.make_data(3, 4)
  expect_error_before_compiling("leading sizes \\[3\\].*2 model stages", stage_params=params)


def test_error_microbatches_disagree_with_schedule():
  expect_error_before_compiling(
      "runs 6 micro-batches", schedule=make_schedule("gpipe", pp=2, microbatches=6)
  )


def test_error_forbidden_microbatch_count():
  _, xs, ts = helpers.make_data(2, 2)
  expect_error_before_compiling("dualpipe", schedule="dualpipe", xs=xs, targets=ts)


def test_error_stage_changes_shape():
  expect_error_before_compiling("keep its input's shape", stage_fn=lambda p, x: x[..., :4])


def test_error_targets_shape():
  _, _, ts = helpers.make_data(2, 3)
  expect_error_before_compiling("targets has shape", targets=ts)


def test_error_batch_not_divisible_by_data_axis():
  mesh = make_mesh((4, 2), ("dp", "pp"))
  params, xs, ts = helpers.make_data(2, 4)
  expect_error_before_compiling(
      "not divisible by the 4 data-parallel", sharding=mesh, xs=xs[:, :2], targets=ts[:, :2]
  )


def test_error_mesh_without_pipeline_axis():
  expect_error_before_compiling("lack the pipeline axis 'pp'", sharding=make_mesh((2,), ("x",)))


def test_error_sharding_of_the_wrong_type_names_the_value_and_the_fix():
  from jaxpipe.pipeline.executor import ExecSpec, Model, make_executor

  params, xs, ts = helpers.make_data(2, 4)
  model = Model(helpers.stage_fn, lambda h, y, t: helpers.loss_fn(y, t))
  schedule = make_schedule("1f1b", pp=2, microbatches=4)
  spec = ExecSpec.covering([api.lowered_for(schedule)])
  want = r"^sharding=\('pp', 'dp'\) \(tuple\): pass sharding=PipelineSharding\(mesh, \.\.\.\)"
  calls = (
      lambda bad: jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, params, xs, ts, helpers.loss_fn, schedule="1f1b", sharding=bad
      ),
      lambda bad: api.pipeline_value_and_grad(
          model, params, xs, ts, schedule=schedule, sharding=bad
      ),
      lambda bad: make_executor(model, spec, bad),
  )
  with mock.patch.object(api, "_program", side_effect=AssertionError("compiled")):
    for call in calls:
      with pytest.raises(TypeError, match=want) as raised:
        call(("pp", "dp"))
      assert "\n" not in str(raised.value)
    # a value whose repr runs over many lines: on one line, cut short
    with pytest.raises(
        TypeError, match=r"^sharding=array\(\[\[.{60,}\.\.\. \(ndarray\): pass"
    ) as raised:
      calls[1](np.arange(64).reshape(8, 8))
    assert "\n" not in str(raised.value)
  with pytest.raises(TypeError, match=r"PipelineSharding\(mesh='pp'\): the mesh must be"):
    PipelineSharding("pp")


def test_sharding_normalises_axes_and_compares_by_its_contents():
  from jax.sharding import PartitionSpec as P

  mesh = make_mesh((2, 2), ("pp", "dp"))
  a = PipelineSharding(mesh, seq_axes="dp", param_specs={"w": P(None, "dp"), "b": None})
  b = PipelineSharding(mesh, seq_axes=["dp"], param_specs={"w": P(None, "dp"), "b": P()})
  assert a.seq_axes == ("dp",) and a.batch_axes == () and a.token_axes == ("dp",)
  assert a == b and hash(a) == hash(b)  # one cached program for both
  assert a != PipelineSharding(mesh) and PipelineSharding(mesh).batch_axes == ("dp",)
  with pytest.raises(TypeError, match="must be PartitionSpec or None"):
    PipelineSharding(mesh, grad_specs={"w": "dp"})


def test_residuals_exclude_the_stage_weights():
  # A matmul stage's vjp closure holds its weight; the executor must not store it per slot.
  from jaxpipe.pipeline.executor import _Residuals

  params = {
      "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
      "b": jax.ShapeDtypeStruct((D,), jnp.float32),
  }
  res = _Residuals.probe(helpers.stage_fn, params, jax.ShapeDtypeStruct((B, L, D), jnp.float32))
  assert ("param", 1) in res.kinds  # leaf 1 of {"b", "w"} is w
  assert all(s.shape != (D, D) for s in res.stored)


def scaled_stage_fn(params, x_BxLxD):
  # the closure holds w * scale and its cast, functions of the parameters alone
  w = (params["w"] * params["scale"]).astype(jnp.bfloat16).astype(jnp.float32)
  return jnp.tanh(x_BxLxD @ w) + params["b"]


def test_parameter_derived_residuals_are_recomputed_not_stored():
  from jaxpipe.pipeline.executor import _Residuals

  params = {
      "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
      "b": jax.ShapeDtypeStruct((D,), jnp.float32),
      "scale": jax.ShapeDtypeStruct((), jnp.float32),
  }
  res = _Residuals.probe(scaled_stage_fn, params, jax.ShapeDtypeStruct((B, L, D), jnp.float32))
  assert ("derived",) in res.kinds
  assert all(s.shape != (D, D) for s in res.stored)
  mesh = make_mesh((2,), ("pp",))
  p, xs, ts = helpers.make_data(2, 4, seed=3)
  p["scale"] = jnp.array([0.5, 2.0], jnp.float32)
  for schedule in ("zb-h1",):  # split backward: W rebuilds the closure from the live params
    loss, grads = jaxpipe.pipeline.value_and_grad(
        scaled_stage_fn, p, xs, ts, helpers.loss_fn, schedule=schedule, sharding=mesh
    )
    want_loss, want_grads = jax.jit(jax.value_and_grad(scaled_sequential))(p, xs, ts)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k in want_grads:
      scale = np.max(np.abs(want_grads[k]))
      np.testing.assert_allclose(grads[k], want_grads[k], rtol=0, atol=1e-5 * scale)


def scaled_sequential(params, xs, ts):
  total = 0.0
  for i in range(xs.shape[0]):
    x = xs[i]
    for s in range(2):
      x = scaled_stage_fn(jax.tree.map(lambda a: a[s], params), x)
    total = total + helpers.loss_fn(x, ts[i])
  return total


def test_error_sequence_not_divisible_by_seq_axes():
  from jaxpipe.pipeline.executor import Model

  mesh = make_mesh((2, 2), ("pp", "cp"))
  params, xs, ts = helpers.make_data(2, 4)  # sequence L = 3
  model = Model(helpers.stage_fn, lambda h, y, t: helpers.loss_fn(y, t))
  schedule = make_schedule("1f1b", pp=2, microbatches=4)
  with mock.patch.object(api, "_program", side_effect=AssertionError("compiled")):
    with pytest.raises(
        ValueError,
        match=r"sequence axis \(axis 2\) must divide into the 2 "
        r"context-parallel shards of mesh axes \('cp',\)",
    ):
      api.pipeline_value_and_grad(
          model,
          params,
          xs,
          ts,
          schedule=schedule,
          sharding=PipelineSharding(mesh, seq_axes=("cp",)),
      )
    with pytest.raises(ValueError, match="seq_axes entry 'pp' must be a mesh axis"):
      api.pipeline_value_and_grad(
          model,
          params,
          xs,
          ts,
          schedule=schedule,
          sharding=PipelineSharding(mesh, seq_axes=("pp",)),
      )


def test_sequence_split_over_seq_axes():
  """A stage that mixes the whole sequence through a pmean over 'cp', its sequence split over
  cp = 2 beside dp = 2: the pipelined loss and gradients equal jax.grad of the unsplit model."""
  mesh = make_mesh((2, 2, 2), ("pp", "dp", "cp"))
  params, xs, ts = helpers.make_data(2, 4)
  _, xs2, ts2 = helpers.make_data(2, 4, seed=1)
  xs = jnp.concatenate([xs, xs2], axis=2)  # sequence 6: 3 tokens per cp rank, unrelated halves
  ts = jnp.concatenate([ts, ts2], axis=2)

  seen = set()

  def mixing_stage(params, x_BxSxD, mean=None):
    if mean is None:  # inside the executor: this rank holds a slice of every sequence
      seen.add(x_BxSxD.shape[1])
      mean = jax.lax.pmean(jnp.mean(x_BxSxD, axis=1, keepdims=True), "cp")
    return jnp.tanh(x_BxSxD @ params["w"] + mean) + params["b"]

  def unsplit(params):
    total = 0.0
    for i in range(xs.shape[0]):
      x = xs[i]
      for s in range(2):
        x = mixing_stage(
            jax.tree.map(lambda a: a[s], params), x, jnp.mean(x, axis=1, keepdims=True)
        )
      total = total + helpers.loss_fn(x, ts[i])
    return total

  want_loss, want_grads = jax.value_and_grad(unsplit)(params)
  loss, grads = jaxpipe.pipeline.value_and_grad(
      mixing_stage,
      params,
      xs,
      ts,
      helpers.loss_fn,
      schedule="zb-h1",
      sharding=PipelineSharding(mesh, seq_axes=("cp",)),
  )
  assert seen == {3}
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6)


def test_param_specs_split_leaves_the_stage_gathers():
  """A weight split over dp that the stage all-gathers: the shape check and the executor both
  hand the stage its slice; loss and gradients equal jax.grad of the unsplit model."""
  from jax.sharding import PartitionSpec as P

  mesh = make_mesh((2, 2), ("pp", "dp"))
  params, xs, ts = helpers.make_data(2, 4)

  def gathering_stage(params, x_BxLxD):
    w_DxD = jax.lax.all_gather(params["w"], "dp", axis=1, tiled=True)
    return helpers.stage_fn({"w": w_DxD, "b": params["b"]}, x_BxLxD)

  loss, grads = jaxpipe.pipeline.value_and_grad(
      gathering_stage,
      params,
      xs,
      ts,
      helpers.loss_fn,
      schedule="1f1b",
      sharding=PipelineSharding(mesh, param_specs={"w": P(None, "dp"), "b": None}),
  )
  want_loss, want_grads = jax.value_and_grad(sequential)(params, xs, ts)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6)


def test_error_axes_named_twice_or_not_auto():
  from jaxpipe.pipeline.executor import Model

  params, xs, ts = helpers.make_data(2, 4)
  model = Model(helpers.stage_fn, lambda h, y, t: helpers.loss_fn(y, t))
  schedule = make_schedule("1f1b", pp=2, microbatches=4)
  mesh = make_mesh((2, 2), ("pp", "dp"))
  with mock.patch.object(api, "_program", side_effect=AssertionError("compiled")):
    with pytest.raises(ValueError, match="seq_axes entry 'dp' must be a mesh axis"):
      api.pipeline_value_and_grad(
          model,
          params,
          xs,
          ts,
          schedule=schedule,
          sharding=PipelineSharding(mesh, data_axes=("dp",), seq_axes="dp"),
      )
    explicit = jax.make_mesh((2, 2), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"mesh axes \['pp', 'dp'\] are not Auto"):
      api.pipeline_value_and_grad(model, params, xs, ts, schedule=schedule, sharding=explicit)


def masked_loss(y_BxLxD, target):
  """(cross-entropy summed over the valid tokens, number of valid tokens)."""
  t_BxL, mask_BxL = target
  logp = jax.nn.log_softmax(y_BxLxD, axis=-1)
  nll_BxL = -jnp.take_along_axis(logp, t_BxL[..., None], axis=-1)[..., 0]
  return jnp.sum(nll_BxL * mask_BxL), jnp.sum(mask_BxL)


def padded_data(num_stages, m, seq_halves=1):
  """Params, inputs and (targets, mask) with a random third of the tokens padding."""
  params, xs, ts = helpers.make_data(num_stages, m)
  for seed in range(1, seq_halves):
    _, more_xs, more_ts = helpers.make_data(num_stages, m, seed=seed)
    xs, ts = jnp.concatenate([xs, more_xs], axis=2), jnp.concatenate([ts, more_ts], axis=2)
  mask = np.random.default_rng(7).random(ts.shape) > 1 / 3
  mask[0, 0] = False  # one shard's slice wholly padding in the first micro-batch
  return params, xs, (ts, jnp.asarray(mask, jnp.float32))


def globally_normalised(params, xs, targets):
  """One device: summed masked loss over all micro-batches / all valid tokens."""
  total = count = 0.0
  for i in range(xs.shape[0]):
    x = xs[i]
    for s in range(jax.tree.leaves(params)[0].shape[0]):
      x = helpers.stage_fn(jax.tree.map(lambda a: a[s], params), x)
    loss_sum, weight = masked_loss(x, jax.tree.map(lambda t: t[i], targets))
    total, count = total + loss_sum, count + weight
  return total / count


@pytest.mark.parametrize(
    "shape,names,schedule",
    [
        ((2, 4), ("dp", "pp"), "1f1b"),
        ((2, 2, 2), ("pp", "dp", "cp"), "zb-h1"),
    ],
)
def test_weighted_loss_is_normalised_by_the_global_weight(shape, names, schedule):
  """loss_fn -> (sum, weight): value and gradients of sum over everything / weight over
  everything, whatever the shards' shares of padding."""
  pp = shape[names.index("pp")]
  seq_axes = ("cp",) if "cp" in names else ()
  params, xs, targets = padded_data(pp, 4, seq_halves=2 if seq_axes else 1)
  loss, grads = jaxpipe.pipeline.value_and_grad(
      helpers.stage_fn,
      params,
      xs,
      targets,
      masked_loss,
      schedule=schedule,
      sharding=PipelineSharding(make_mesh(shape, names), seq_axes=seq_axes),
  )
  assert_matches(loss, grads, params, xs, targets, globally_normalised)


def test_per_shard_mean_is_refused():
  mesh = make_mesh((2, 2), ("dp", "pp"))
  params, xs, targets = padded_data(2, 4)
  mean_loss = lambda y, t: masked_loss(y, t)[0] / masked_loss(y, t)[1]
  with mock.patch.object(api, "_program", side_effect=AssertionError("compiled")):
    with pytest.raises(
        ValueError,
        match=r"loss_fn averages over its batch.*each of the 2 "
        r"data/sequence shards.*\(loss_sum, weight\)",
    ):
      jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, params, xs, targets, mean_loss, schedule="1f1b", sharding=mesh
      )
    mean_pair = lambda y, t: (mean_loss(y, t), jnp.ones(()))
    with pytest.raises(ValueError, match="the loss_sum part of loss_fn averages"):
      jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, params, xs, targets, mean_pair, schedule="1f1b", sharding=mesh
      )
    y_weight = lambda y, t: (masked_loss(y, t)[0], jnp.sum(y))
    with pytest.raises(ValueError, match="weight computed from the stage output y"):
      jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, params, xs, targets, y_weight, schedule="1f1b", sharding=mesh
      )
    triple = lambda y, t: masked_loss(y, t) + (1.0,)
    with pytest.raises(ValueError, match=r"a scalar .* or a pair of scalars \(loss_sum, weight\)"):
      jaxpipe.pipeline.value_and_grad(
          helpers.stage_fn, params, xs, targets, triple, schedule="1f1b", sharding=mesh
      )


def test_grad_specs_reduce_scatter_the_gradients_over_data_axes():
  """ZeRO-2's data reduction: a leaf whose grad_specs adds dp on a dimension the parameter
  leaves whole returns its gradient split over dp (each data shard its slice of the sum); the
  values equal jax.grad of the unsplit model. A spec that moves the parameter's own split, or
  adds a non-data axis, is refused."""
  from jax.sharding import PartitionSpec as P

  mesh = make_mesh((2, 2), ("pp", "dp"))
  params, xs, ts = helpers.make_data(2, 4)
  run = lambda **specs: jaxpipe.pipeline.value_and_grad(
      helpers.stage_fn,
      params,
      xs,
      ts,
      helpers.loss_fn,
      schedule="1f1b",
      sharding=PipelineSharding(mesh, **specs),
  )
  loss, grads = run(grad_specs={"w": P(None, "dp"), "b": None})
  assert grads["w"].sharding.shard_shape(grads["w"].shape) == (1, D, D // 2)
  assert grads["b"].sharding.shard_shape(grads["b"].shape) == (1, D)
  want_loss, want_grads = jax.value_and_grad(sequential)(params, xs, ts)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="a gradient may only add data axes"):
    run(param_specs={"w": P(None, "dp"), "b": None}, grad_specs={"w": P("dp", None), "b": None})
  with pytest.raises(ValueError, match=r"shards over \['pp'\], which are not"):
    run(grad_specs={"w": P(None, "pp"), "b": None})
