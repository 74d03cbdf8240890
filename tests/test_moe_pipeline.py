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
from jaxpipe.pipeline.executor import Model, param_specs_key
from jaxpipe.trainer import Trainer
from test_moe_lm import _close, _one_device_objective, _path_config, _random_params

E, EP = 8, 2
EXPERT_DIMS = {(E, 32, 16), (E, 16, 32)}  # full [E, D, F] and [E, F, D] (d_model 32, d_ff 16)


@pytest.fixture(scope="module")
def run():
  c = _path_config(pp=2)  # zb-h1, 2 micro-batches, 2 layers with an MoE FFN each, dp = ep = 2
  c.model.moe.dispatch = "dropless"
  c.model.moe.dropless_impl = "padded"
  trainer = Trainer(c)
  assert dict(trainer.mesh.shape) == {"pp": 2, "dp": 2, "ep": 2, "cp": 1, "tp": 1}
  params = jax.device_put(_random_params(trainer.model_cfg), trainer.state_sharding.params)
  host = trainer.source.batch("train", 0, 16, 8)
  batch = trainer.shard_batch(host)
  compiled = jax.jit(trainer.loss_and_grads).lower(params, batch).compile()
  loss, grads, metrics = compiled(params, batch)
  return dict(trainer=trainer, params=params, host=host, hlo=compiled.as_text(), loss=loss,
              grads=grads, metrics=metrics)


def _groups(line: str) -> list[list[int]]:
  """Replica groups of an HLO collective, explicit ({{0,1},...}) or iota ([a,b]<=[dims]T(perm))."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return sorted(sorted(int(i) for i in g.split(",")) for g in re.findall(r"\{([\d,]*)\}", m[1]))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  dims = [int(d) for d in m[3].split(",")]
  ids = np.arange(np.prod(dims)).reshape(dims)
  if m[4]:
    ids = ids.transpose([int(p) for p in m[4].split(",")])
  return sorted(sorted(g) for g in ids.reshape(int(m[1]), int(m[2])).tolist())


def _axis_groups(mesh, axis: str) -> list[list[int]]:
  """Logical device ids (positions in the mesh) that differ only in `axis`."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  ids = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
  return sorted(sorted(g) for g in ids.reshape(-1, mesh.shape[axis]).tolist())


def _shapes(line: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", line)]


def test_loss_and_every_gradient_equal_one_device(run):
  trainer, host = run["trainer"], run["host"]
  cfg = trainer.model_cfg
  params = jax.tree.map(jnp.asarray, _random_params(cfg))
  objective = jax.value_and_grad(functools.partial(_one_device_objective, cfg, microbatches=2),
                                 has_aux=True)
  (_, (want_loss, _)), want = jax.jit(objective)(params, host)
  assert float(run["metrics"]["tokens"]) == host["mask"].sum()
  _close(run["loss"], want_loss, "loss (cross-entropy)")
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  flat = jax.tree_util.tree_flatten_with_path(run["grads"])[0]
  assert len(flat) == len(want_flat)
  for path, g in flat:
    _close(g, want_flat[path], jax.tree_util.keystr(path))


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
  reductions = [l for l in run["hlo"].splitlines() if " all-reduce(" in l
                and any(s[-3:] in local for s in _shapes(l.split(" all-reduce(")[0]))]
  assert reductions
  for line in reductions:
    assert _groups(line) == _axis_groups(mesh, "dp"), line.strip()[:200]


def test_tokens_reach_their_experts_by_all_to_all_inside_the_ticks(run):
  lines = [l for l in run["hlo"].splitlines() if " all-to-all(" in l]
  # dispatch and combine, forward and backward, in the branches of the per-tick switch
  assert len(lines) >= 4
  want = _axis_groups(run["trainer"].mesh, "ep")
  for line in lines:
    op_name = re.search(r'op_name="([^"]*)"', line)[1]
    assert "/tick/" in op_name and "branch_" in op_name, op_name
    assert _groups(line) == want, line.strip()[:200]
  names = " ".join(re.search(r'op_name="([^"]*)"', l)[1] for l in lines)
  assert "/tick/F/" in names and re.search(r"/tick/(I|B)/", names), names


def test_param_specs_must_name_data_axes_and_match_the_params():
  mesh = jax.make_mesh((2, 4), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = Model(lambda w, x: x @ w, lambda h, y, t: jnp.sum((y - t) ** 2))
  stage = jnp.ones((2, 4, 4))
  xs = jnp.ones((2, 8, 4))
  schedule = resolve_schedule("gpipe", pp=2, microbatches=2)
  with pytest.raises(ValueError, match=r"shards over \['pp'\], which are not data axes"):
    pipeline_value_and_grad(model, stage, xs, xs, schedule=schedule, mesh=mesh,
                            param_specs=P("pp"))
  with pytest.raises(ValueError, match="param_specs has structure"):
    pipeline_value_and_grad(model, stage, xs, xs, schedule=schedule, mesh=mesh,
                            param_specs={"w": P()})
  with pytest.raises(TypeError, match="must be PartitionSpec or None"):
    param_specs_key({"w": "dp"})
