"""Expert parallelism inside the pipeline executor: pp = 2 x dp = 2 x ep = 2, experts over ep."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe.models import moe
from jaxpipe.pipeline.api import pipeline_value_and_grad, resolve_schedule
from jaxpipe.pipeline.executor import Model
from jaxpipe.pipeline.sharding import PipelineSharding, param_specs_key
from jaxpipe.training.trainer import Trainer
from tests import helpers

E, EP = 8, 2
EXPERT_DIMS = {(E, 32, 16), (E, 16, 32)}  # full [E, D, F] and [E, F, D] (d_model 32, d_ff 16)


@pytest.fixture(scope="module")
def run():
  c = helpers.path_config(
      pp=2
  )  # zb-h1, 2 micro-batches, 2 layers with an MoE FFN each, dp = ep = 2
  c.model.moe.dispatch = "dropless"
  c.model.moe.dropless_impl = "padded"
  trainer = Trainer(c)
  assert dict(trainer.mesh.shape) == {"pp": 2, "dp": 2, "ep": 2, "cp": 1, "tp": 1}
  params = jax.device_put(helpers.random_params(trainer.model_cfg), trainer.state_sharding.params)
  host = trainer.source.batch("train", 0, 16, 8)
  batch = trainer.shard_batch(host)
  compiled = jax.jit(trainer.loss_and_grads).lower(params, batch).compile()
  loss, grads, metrics = compiled(params, batch)
  return dict(
      trainer=trainer,
      params=params,
      host=host,
      hlo=compiled.as_text(),
      loss=loss,
      grads=grads,
      metrics=metrics,
  )


def _shapes(line: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", line)]


def test_loss_and_every_gradient_equal_one_device(run):
  trainer, host = run["trainer"], run["host"]
  cfg = trainer.model_cfg
  params = jax.tree.map(jnp.asarray, helpers.random_params(cfg))
  objective = jax.value_and_grad(
      functools.partial(helpers.one_device_objective, cfg, microbatches=2), has_aux=True
  )
  (_, (want_loss, _)), want = jax.jit(objective)(params, host)
  assert float(run["metrics"]["tokens"]) == host["mask"].sum()
  helpers.close(run["loss"], want_loss, "loss (cross-entropy)")
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  flat = jax.tree_util.tree_flatten_with_path(run["grads"])[0]
  assert len(flat) == len(want_flat)
  for path, g in flat:
    helpers.close(g, want_flat[path], jax.tree_util.keystr(path))


def test_each_device_holds_and_updates_its_experts_only(run):
  mesh = run["trainer"].mesh
  moe_params = run["params"]["layers"]["moe"]["moe"]
  moe_grads = run["grads"]["layers"]["moe"]["moe"]
  for name in moe.EXPERT_WEIGHTS:
    for tree in (moe_params, moe_grads):
      assert tree[name].shape[1] == E
      shards = tree[name].addressable_shards
      assert len(shards) == 8 and {s.data.shape[:2] for s in shards} == {(1, E // EP)}
  # No array of the step, temporaries included, has all E experts' weights.
  for line in run["hlo"].splitlines():
    full = [s for s in _shapes(line) if s[-3:] in EXPERT_DIMS]
    assert not full, f"a full expert tensor {full} in the step: {line.strip()[:200]}"
  # Expert gradients are reduced over dp alone; their ep shards are different experts.
  local = {(E // EP, 32, 16), (E // EP, 16, 32)}
  reductions = [
      l
      for l in run["hlo"].splitlines()
      if " all-reduce(" in l and any(s[-3:] in local for s in _shapes(l.split(" all-reduce(")[0]))
  ]
  assert reductions
  for line in reductions:
    assert helpers.groups(line) == helpers.axis_groups(mesh, "dp"), line.strip()[:200]


def test_tokens_reach_their_experts_by_all_to_all_inside_the_ticks(run):
  lines = [l for l in run["hlo"].splitlines() if " all-to-all(" in l]
  # dispatch and combine, forward and backward, inside the tick's parts (run where the row says)
  assert len(lines) >= 4
  want = helpers.axis_groups(run["trainer"].mesh, "ep")
  for line in lines:
    op_name = re.search(r'op_name="([^"]*)"', line)[1]
    assert re.search(r"/tick/[FIBW]/while/body/", op_name), op_name
    assert helpers.groups(line) == want, line.strip()[:200]
  names = " ".join(re.search(r'op_name="([^"]*)"', l)[1] for l in lines)
  assert "/tick/F/" in names and re.search(r"/tick/(I|B)/", names), names


def test_param_specs_must_name_data_axes_and_match_the_params():
  mesh = jax.make_mesh((2, 4), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = Model(lambda w, x: x @ w, lambda h, y, t: jnp.sum((y - t) ** 2))
  stage = jnp.ones((2, 4, 4))
  xs = jnp.ones((2, 8, 4))
  schedule = resolve_schedule("gpipe", pp=2, microbatches=2)
  with pytest.raises(ValueError, match=r"shards over \['pp'\], which are not data axes"):
    pipeline_value_and_grad(
        model,
        stage,
        xs,
        xs,
        schedule=schedule,
        sharding=PipelineSharding(mesh, param_specs=P("pp")),
    )
  with pytest.raises(ValueError, match="param_specs has structure"):
    pipeline_value_and_grad(
        model,
        stage,
        xs,
        xs,
        schedule=schedule,
        sharding=PipelineSharding(mesh, param_specs={"w": P()}),
    )
  with pytest.raises(TypeError, match="must be PartitionSpec or None"):
    param_specs_key({"w": "dp"})


def _tanh_layer(params, x_BxD):
  return jnp.tanh(x_BxD @ params["w"] + params["b"])


def _layer_with_aux(params, x_BxD):
  y = _tanh_layer(params, x_BxD)
  return y, {"ysum": jnp.sum(y), "rows": jnp.asarray(x_BxD.shape[0], jnp.int32)}


@pytest.mark.parametrize(
    "name,layers,recompute",
    [
        ("dualpipe", True, False),  # bidirectional: two copies of each stage, summed
        ("zb-v", False, True),  # V placement, an opaque stage, recomputed in the backward
        ("interleaved-1f1b", True, False),
    ],
)
def test_stage_aux_is_summed_per_stage_and_data_shard(name, layers, recompute):
  """A stage's aux comes back per stage (and layer) and data shard, summed over micro-batches, as
  an unpipelined loop over stages computes it; loss and gradients stay those of jax.grad."""
  from jaxpipe.pipeline.executor import layered

  pp, dp, m, b, d, per_stage = 2, 2, 4, 4, 8, 2
  mesh = jax.make_mesh((pp, dp), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  schedule = resolve_schedule(
      name, pp=pp, microbatches=m, chunks=2 if name == "interleaved-1f1b" else None
  )
  stages = schedule.num_stages
  rng = np.random.default_rng(0)
  lead = (stages, per_stage) if layers else (stages,)
  params = {
      "w": jnp.asarray(rng.normal(size=(*lead, d, d)) / np.sqrt(d), jnp.float32),
      "b": jnp.asarray(0.1 * rng.normal(size=(*lead, d)), jnp.float32),
  }
  xs = jnp.asarray(rng.normal(size=(m, b, d)), jnp.float32)
  ts = jnp.asarray(rng.normal(size=(m, b, d)), jnp.float32)
  loss_fn = lambda h, y, t: jnp.sum((y - t) ** 2)
  if layers:
    model = Model(layered(_layer_with_aux), loss_fn, stage_aux=True)
  else:
    stage = lambda p, x: (
        _tanh_layer(p, x),
        {"ysum": jnp.sum(_tanh_layer(p, x)), "rows": jnp.asarray(x.shape[0], jnp.int32)},
    )
    model = Model(stage, loss_fn, stage_aux=True)
  loss, grads, _, _, aux = pipeline_value_and_grad(
      model, params, xs, ts, schedule=schedule, sharding=mesh, recompute=recompute
  )
  flat = jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[len(lead) :]), params)

  def unpipelined(flat):
    total, ysum = 0.0, []
    for i in range(m):
      x, row = xs[i], []
      for l in range(flat["w"].shape[0]):
        x = _tanh_layer({"w": flat["w"][l], "b": flat["b"][l]}, x)
        row.append(x.reshape(dp, b // dp, d).sum((1, 2)))
      total, ysum = total + loss_fn(None, x, ts[i]), ysum + [jnp.stack(row)]
    return total, sum(ysum)  # ysum: [layers, data shards]

  (want_loss, want_ysum), want_grads = jax.value_and_grad(unpipelined, has_aux=True)(flat)
  helpers.close(loss, want_loss, "loss")
  for k in params:
    helpers.close(np.asarray(grads[k]).reshape(want_grads[k].shape), want_grads[k], f"grad {k}")
  ysum = np.asarray(want_ysum).reshape(*lead, dp)
  want = np.moveaxis(ysum, -1, 1)  # [stages, data shards(, layers)]
  helpers.close(aux["ysum"], want, "aux ysum")
  np.testing.assert_array_equal(aux["rows"], np.full(want.shape, m * b // dp))
