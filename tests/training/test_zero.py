"""The distributed optimizer (`optimizer.shard`, jaxpipe.training.zero): gradients equal the
one-device model's, three steps follow the replicated run, per-device bytes fall by the
data-parallel degree, the compiled step holds the collectives of its layout, checkpoints restore
across layouts, and bad layouts stop at the config."""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.training import config as config_lib
from jaxpipe.training import zero
from jaxpipe.training.losses import make_loss_and_grads
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.trainer import Trainer
from tests import helpers


def _config(shard="none", tp=1, sp=False, cp=1, moe=False, kv_heads=2):
  c = helpers.moe_config(ep=2) if moe else tiny.get_config()
  c.model.n_kv_heads = kv_heads  # 4 for tp 2 x cp 2: a KV head per rank
  c.mesh.tp, c.mesh.cp = tp, cp
  c.model.sequence_parallel = sp
  c.optimizer.shard = shard
  c.data.batch = 8
  c.train.steps = 3
  return c


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _nonzero_bytes_per_device(params, divisor):
  """Per-device bytes of `params` when leaf `path` takes 1/divisor(path) of its bytes."""
  return sum(_nbytes(x) // divisor(path) for path, x in helpers.flat(params).items())


@pytest.mark.parametrize(
    "layout",
    [dict(moe=True), dict(tp=2, sp=True, cp=2, kv_heads=4)],
    ids=["moe-ep2-dp4", "tp2-sp-cp2-dp2"],
)
def test_fsdp_loss_and_gradients_equal_the_one_device_model(layout):
  """Parameters stored split over the data axes (fsdp): the loss and every gradient equal the
  unsharded model's, and the compiled gradient step's arguments hold the parameters' bytes
  split as stored: MoE: 1/8 (experts over ep 2 x dp 4, the rest over dp 4 x ep 2); tp 2 x cp 2
  x dp 2: 1/8 too, Megatron's weights over tp 2 x dp 2 x cp 2, the norms (whole under tp) over
  dp 2 x cp 2 (the optimizer's axes include cp)."""
  c = _config("fsdp", **layout)
  shape = config_lib.validate(c, jax.device_count())
  cfg = config_lib.model_config(c)
  mesh = make_mesh(c.mesh)
  params = helpers.random_params(cfg)
  placed = jax.device_put(params, zero.data_split(params, mesh))
  whole = NamedSharding(mesh, P())
  batch = jax.device_put(helpers.random_batch(c), whole)
  compiled = jax.jit(make_loss_and_grads(c, cfg, shape)).lower(placed, batch).compile()
  data = 8 // c.mesh.tp  # dp x cp (x ep)
  norms = lambda path: data if "scale" in jax.tree_util.keystr(path) else data * c.mesh.tp
  want_args = _nonzero_bytes_per_device(params, norms) + _nbytes(batch)
  assert compiled.memory_analysis().argument_size_in_bytes == want_args
  loss, grads, _ = compiled(placed, batch)
  helpers.assert_one_device(cfg, params, jax.device_get(batch), loss, grads)


@pytest.mark.parametrize("shard", [pytest.param("zero2", marks=pytest.mark.slow), "fsdp"])
def test_moe_on_the_tensor_parallel_path_gathers_only_data_splits(shard):
  """MoE over ep 2 x tp 2 x dp 2 (one shard_map): expert weights keep their ep split and are
  gathered over dp only; loss and gradients equal the one-device model's."""
  c = _config(shard, tp=2, moe=True)
  shape = config_lib.validate(c, jax.device_count())
  cfg = config_lib.model_config(c)
  params = helpers.random_params(cfg)
  placed = jax.device_put(params, zero.data_split(params, make_mesh(c.mesh)))
  batch = helpers.random_batch(c)
  loss, grads, _ = jax.jit(make_loss_and_grads(c, cfg, shape))(placed, batch)
  helpers.assert_one_device(cfg, params, batch, loss, grads)


RUNS = {  # name: (reference run, config overrides)
    "none": ("none", {}),
    "zero1": ("none", dict(shard="zero1")),
    "zero2": ("none", dict(shard="zero2")),
    "fsdp": ("none", dict(shard="fsdp")),
    "tp2-sp-zero2": ("none", dict(shard="zero2", tp=2, sp=True)),
    "tp2-fsdp": ("none", dict(shard="fsdp", tp=2)),
}


@functools.cache
def _run(name):
  """Three steps of one layout: (losses, model-order params, compile stats, optimised HLO)."""
  trainer = Trainer(_config(**RUNS[name][1]))
  compiled = trainer.compile()
  losses = [float(trainer.step()["loss"]) for _ in range(3)]
  return losses, jax.device_get(trainer.model_params()), trainer.compile_stats, compiled.as_text()


@pytest.mark.parametrize("name", [n for n in RUNS if RUNS[n][0] != n])
def test_three_steps_follow_the_replicated_trajectory(name):
  losses, params, _, _ = _run(name)
  want_losses, want_params, _, _ = _run(RUNS[name][0])
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want_params)
  for path, p in helpers.flat(params).items():
    helpers.close(p, want[path], jax.tree_util.keystr(path), rtol=1e-5)


@functools.cache
def _pipelined(shard):
  """Three steps of a 4-layer tiny at pp 2 (1F1B, 4 micro-batches) x dp 4, two layers per
  stage: (losses, params, compile stats, optimised HLO)."""
  c = _config(shard)
  c.model.n_layers = 4
  c.mesh.pp, c.pipeline.microbatches, c.data.batch = 2, 4, 16
  trainer = Trainer(c)
  text = trainer.compile().as_text()
  losses = [float(trainer.step()["loss"]) for _ in range(3)]
  return losses, jax.device_get(trainer.model_params()), trainer.compile_stats, text


@pytest.mark.parametrize("shard", ["zero2", "fsdp"])
def test_the_pipeline_follows_the_replicated_trajectory(shard):
  """pp 2 x dp 4 under zero2 and fsdp: three steps give the replicated run's losses and
  parameters. fsdp: each device stores 1/4 of its pipeline stage's parameters and moments:
  exactly 3/4 of three copies of them fewer argument bytes (every leaf has a dimension 4
  divides); zero2: of two copies (the moments)."""
  losses, params, stats, _ = _pipelined(shard)
  want_losses, want_params, want_stats, _ = _pipelined("none")
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want_params)
  for path, p in helpers.flat(params).items():
    helpers.close(p, want[path], jax.tree_util.keystr(path), rtol=1e-5)
  c = _config()
  c.model.n_layers = 4
  shapes = _model_shapes(c)
  stage = _nbytes(shapes["layers"]) // 2 + _nbytes(
      {k: v for k, v in shapes.items() if k != "layers"}
  )
  copies = 3 if shard == "fsdp" else 2
  assert want_stats["argument_bytes"] - stats["argument_bytes"] == copies * stage * 3 // 4


@functools.cache
def _scheduled(shard, schedule):
  """Three steps of a 4-layer tiny at pp 2 x dp 4 under `schedule` (4 micro-batches)."""
  c = _config(shard)
  c.model.n_layers = 4
  c.mesh.pp, c.pipeline.microbatches, c.data.batch = 2, 4, 16
  c.pipeline.schedule = schedule
  trainer = Trainer(c)
  losses = [float(trainer.step()["loss"]) for _ in range(3)]
  return losses, jax.device_get(trainer.model_params())


@pytest.mark.parametrize(
    "schedule, shard",
    [
        ("dualpipev", "fsdp"),
        pytest.param("dualpipev", "zero2", marks=pytest.mark.slow),
        pytest.param("interleaved-1f1b", "zero2", marks=pytest.mark.slow),
        pytest.param("interleaved-1f1b", "fsdp", marks=pytest.mark.slow),
    ],
)
def test_chunked_and_copied_stages_follow_the_replicated_trajectory(schedule, shard):
  """Two stages per rank (interleaved 1F1B) and stage copies summed between their holders
  (DualPipeV) under zero2's reduce-scattered and fsdp's gathered stages: three steps give the
  replicated run's losses and parameters."""
  losses, params = _scheduled(shard, schedule)
  want_losses, want_params = _scheduled("none", schedule)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want_params)
  for path, p in helpers.flat(params).items():
    helpers.close(p, want[path], jax.tree_util.keystr(path), rtol=1e-5)


PP2_DATA = "replica_groups={{0,1,2,3},{4,5,6,7}}"  # dp 4 inside each pipeline rank


def _data_collectives(text, groups):
  """{(op, 'entry' | 'loop'): arrays} of the collectives over `groups` in optimised HLO, by the
  computation that holds them (the entry computation, or one a loop or branch runs): where
  XLA put them, not where their op_name says they came from."""
  counts, computation = {}, None
  for line in text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      computation = "entry" if line.startswith("ENTRY") else "loop"
    found = re.search(COLLECTIVE, line)
    if found and groups in line:
      key = (found.group(1), computation)
      counts[key] = counts.get(key, 0) + found.group(2).count("%")
  return counts


def test_the_pipeline_reduce_scatters_stage_gradients_and_fsdp_gathers_each_layer():
  """pp 2 x dp 4 (1F1B, m 4, two layers per stage), the data groups' collectives. none: the
  stage's nine layer gradients (and the embedding's) all-reduced once after the tick loop.
  zero2: the nine reduce-scattered there instead, no all-reduce. fsdp: every gather inside
  the tick loop's computations (each layer's nine weights in the forward, its seven matrices
  at least again in the backward), none hoisted into the entry computation, and the nine
  gradients reduce-scattered there, no all-reduce; and no gathered stage is kept: its
  temporaries are below zero2's (zero2 holds the stage's whole gradients; a gathered stage
  kept through the step, as XLA does when it hoists the gathers, puts fsdp above)."""
  layer_leaves = len(jax.tree.leaves(_model_shapes(_config())["layers"]))
  counts = {n: _data_collectives(_pipelined(n)[3], PP2_DATA) for n in ("none", "zero2", "fsdp")}
  assert counts["none"] == {("all-reduce", "entry"): layer_leaves + 1}
  assert counts["zero2"] == {("reduce-scatter", "entry"): layer_leaves}
  fsdp = counts["fsdp"]
  assert set(fsdp) == {("all-gather", "loop"), ("reduce-scatter", "loop")}, fsdp
  assert fsdp[("all-gather", "loop")] >= layer_leaves + 7
  assert fsdp[("reduce-scatter", "loop")] == layer_leaves
  temp = {n: _pipelined(n)[2]["temp_bytes"] for n in ("zero2", "fsdp")}
  assert temp["fsdp"] < temp["zero2"]


def _model_shapes(c):
  cfg = config_lib.model_config(c)
  return jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))


def test_per_device_bytes_fall_by_the_data_parallel_degree():
  """Exact argument bytes of the compiled step: zero1 divides the moments (mu, nu: two copies
  of the parameters' bytes) by dp = 8, fsdp the parameters too; every leaf of the model has
  a dimension 8 divides. (MoE and tp: the gradient test above.)"""
  params = _model_shapes(_config())
  whole = _nbytes(params)
  args = {n: _run(n)[2]["argument_bytes"] for n in ("none", "zero1", "fsdp")}
  assert args["none"] - args["zero1"] == 2 * whole * 7 // 8
  assert args["none"] - args["fsdp"] == 3 * whole * 7 // 8


COLLECTIVE = (
    r"= (?:\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(([^)]*)\)"
)


def _collectives(text):
  """{(op, where): arrays moved}; where: 'forward loop' and 'backward loop' (the layer scan's
  bodies, compiled once for all layers) or 'outside'. Merged collectives count each array."""
  counts = {}
  for line in text.splitlines():
    found = re.search(COLLECTIVE, line)
    if not found:
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    name = name.group(1) if name else ""
    if "transpose(jvp())" in name and "while/body" in name:
      where = "backward loop"
    elif "while/body" in name:
      where = "forward loop"
    else:
      where = "outside"
    key = (found.group(1), where)
    counts[key] = counts.get(key, 0) + found.group(2).count("%")
  return counts


def test_compiled_steps_hold_the_layouts_collectives():
  """dp 8, plain data-parallel path (GSPMD). none: the gradients' all-reduce (per layer in the
  backward loop), nothing gathered. zero1 and zero2: the same, and each parameter all-gathered
  once after its update. (fsdp runs in one shard_map: the test below.)"""
  leaves = len(jax.tree.leaves(_model_shapes(_config())))
  layer = len(jax.tree.leaves(_model_shapes(_config())["layers"]))
  counts = {n: _collectives(_run(n)[3]) for n in ("none", "zero1", "zero2")}
  assert ("all-gather", "outside") not in counts["none"]
  assert counts["none"][("all-reduce", "backward loop")] == layer
  for n in ("zero1", "zero2"):
    assert counts[n][("all-gather", "outside")] == leaves
    assert counts[n][("all-reduce", "backward loop")] == layer


def test_fsdp_with_selective_remat_keeps_its_gather_policy():
  """model.remat='selective' under fsdp: the backward loop gathers the seven matrices again,
  as without remat, not all nine weights of a wholly recomputed layer (remat=True)."""
  counts = {}
  for remat in ("selective", True):
    c = _config("fsdp")
    c.model.remat = remat
    counts[remat] = _collectives(Trainer(c).compile().as_text())
  assert counts["selective"][("all-gather", "backward loop")] == 7
  assert counts[True][("all-gather", "backward loop")] == 9


TP2_DATA = "replica_groups={{0,2,4,6},{1,3,5,7}}"  # dp 4 beside tp 2, the innermost axis
DP8 = "replica_groups={{0,1,2,3,4,5,6,7}}"
# fsdp: each layer's nine weights gathered in the forward loop, the seven matrices again in the
# backward loop (none kept), each layer's gradients reduce-scattered there; the embedding and
# final norm gathered and reduce-scattered once outside
FSDP = {
    ("all-gather", "loop"): 9 + 7,
    ("reduce-scatter", "loop"): 9,
    ("all-gather", "outside"): 2,
    ("reduce-scatter", "outside"): 2,
}


@pytest.mark.parametrize(
    "name, groups, want",
    [
        ("fsdp", DP8, FSDP),  # the plain data-parallel layout: fsdp's one shard_map
        ("tp2-fsdp", TP2_DATA, FSDP),
        # every leaf gathered once at the start, its gradient reduce-scattered once at the end
        (
            "tp2-sp-zero2",
            TP2_DATA,
            {("all-gather", "outside"): 11, ("reduce-scatter", "outside"): 11},
        ),
    ],
)
def test_the_shard_map_path_reduce_scatters_gradients(name, groups, want):
  """fsdp at dp 8 and tp 2 x dp 4, zero2 at tp 2 x dp 4 (each one shard_map): the collectives
  over the data groups in the optimised HLO; no all-reduce of gradients."""
  counts = {}
  for line in _run(name)[3].splitlines():
    found = re.search(r"= \S+ (all-gather|reduce-scatter|all-reduce)(?:-start)?\(", line)
    if found and groups in line:
      key = (found.group(1), "loop" if "while/body" in line else "outside")
      counts[key] = counts.get(key, 0) + 1
  assert counts == want


def test_split_gradients_and_gathered_layers_are_not_kept_whole():
  """Temporaries: zero2 keeps the gradients split (at least half of their bytes saved against
  zero1), and fsdp keeps no gathered layer for the backward: its temporaries exceed zero2's by
  less than one layer's weights (keeping the gathered layers for the backward adds all of
  them)."""
  shapes = _model_shapes(_config())
  whole, layers = _nbytes(shapes), _nbytes(shapes["layers"])
  n_layers = jax.tree.leaves(shapes["layers"])[0].shape[0]
  temp = {n: _run(n)[2]["temp_bytes"] for n in ("zero1", "zero2", "fsdp")}
  assert temp["zero1"] - temp["zero2"] > whole // 2
  assert temp["fsdp"] - temp["zero2"] < layers // n_layers


def test_checkpoints_restore_across_optimizer_layouts(tmp_path):
  """Saved under tp 2 x zero1, restored bit for bit under fsdp (dp 8), onto fsdp's split; and
  saved there, restored under tp 2 x zero1."""
  layouts = [dict(shard="zero1", tp=2, sp=True), dict(shard="fsdp")]
  for i, (saved, restored) in enumerate((layouts, layouts[::-1])):
    workdir = str(tmp_path / str(i))
    c = _config(**saved)
    c.train.steps, c.train.eval_every, c.checkpoint.every = 2, 0, 2
    with Trainer(c, workdir) as first:
      first.train(progress=False)
      want = helpers.flat(jax.device_get(first.state))
    with Trainer(_config(**restored), workdir, existing_run="resume_changed") as other:
      state = other.init()
      assert other.resumed_from == 2
      mu = state.opt_state[1][0].mu["layers"]["mlp"]["up"]["kernel"]  # [layers, 32, 64]
      assert mu.sharding.shard_shape(mu.shape) == ((2, 32, 8) if i == 0 else (2, 8, 32))
      for path, value in helpers.flat(jax.device_get(state)).items():
        np.testing.assert_array_equal(value, want[path], err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optimizer.shard": "zero3"}, "optimizer.shard='zero3' is unknown; use one of none"),
        (
            {"optimizer.shard": "fsdp", "model.vocab": 68, "model.d_model": 36},
            "params['embed'] [68, 36] has no dimension 8 divides",
        ),
    ],
)
def test_bad_layouts_stop_at_the_config(overrides, message):
  helpers.assert_refused(overrides, message)


def test_split_dims_pick_the_largest_free_dimension():
  # layer axis left alone; largest dimension dp divides; ties: the first; split ones skipped
  assert zero.split_dim(["layers", "mlp", "up", "kernel"], (2, 32, 64), (), 8) == 2
  assert zero.split_dim(["layers", "attn", "q", "kernel"], (8, 32, 4, 8), (), 8) == 1
  assert zero.split_dim(["layers", "mlp", "up", "kernel"], (2, 32, 64), (None, None, "tp"), 8) == 1
  assert zero.split_dim(["layers", "dense", "mlp", "up"], (2, 8, 12, 12), (), 8) is None
  assert zero.split_dim(["embed"], (64, 32), (), 8) == 0


def test_delayed_fp8_scales_stay_whole_where_a_weight_of_their_shape_splits():
  """A delayed-scaling scale's gradient is an amax, combined by max: a reduce-scatter would add
  its slices, so `data_split` never splits it, though a weight of its shape splits."""
  mesh = make_mesh(_config().mesh)  # dp 8
  like = jax.ShapeDtypeStruct((2, 8, 16), np.float32)
  tree = {"layers": {"mlp": {"up": {"fp8_scale": like, "kernel": like}}}}
  split = zero.data_split(tree, mesh)["layers"]["mlp"]["up"]
  assert split["kernel"].spec == P(None, None, "dp")
  assert split["fp8_scale"].spec in (P(), P(None, None, None))


def test_pooled_load_balancing_is_refused_under_fsdp_and_kept_under_zero2():
  """transformers' pooled aux loss couples the MoE layers, which fsdp's layer scan (one
  shard_map, each layer's loss on its own gradient) keeps apart: refused before device work,
  naming the fix. zero2 stays on the plain path, which pools them."""
  for shard in ("fsdp", "zero2"):
    c = _config(shard, moe=True)
    c.model.moe.lb_loss_form, c.model.moe.lb_loss_coef = "pooled", 0.01
    shape = config_lib.validate(c, jax.device_count())
    cfg = config_lib.model_config(c)
    if shard == "fsdp":
      with pytest.raises(config_lib.ConfigError, match="optimizer.shard='fsdp' keep apart"):
        make_loss_and_grads(c, cfg, shape)
    else:
      assert callable(make_loss_and_grads(c, cfg, shape))
