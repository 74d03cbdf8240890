"""The trainer with mesh.pp > 1: one step of the real LM equals the unpipelined gradient."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.training import config as config_lib
from jaxpipe.training.losses import data_parallel_loss_and_grads
from jaxpipe.training.trainer import Trainer
from tests import helpers


def tiny_config(pp, schedule, microbatches=4, n_layers=4):
  c = tiny.get_config()
  c.model.n_layers = n_layers
  c.mesh.pp = pp
  c.pipeline.schedule = schedule
  c.pipeline.microbatches = microbatches
  return c


@pytest.mark.parametrize("pp,schedule", [(2, "dualpipe"), (4, "1f1b")])
def test_pipelined_loss_and_grads_equal_unpipelined(pp, schedule):
  microbatches = 4 if schedule != "dualpipe" else 2 * pp
  trainer = Trainer(tiny_config(pp, schedule, microbatches))
  cfg = trainer.model_cfg
  params = transformer.init_params(cfg, jax.random.key(0))
  batch = trainer.batch(0)
  if schedule == "dualpipe":  # stores each layer twice, rank by rank
    with pytest.raises(ValueError, match="has 4 entries but this step takes 8.*stored_params"):
      trainer.loss_and_grads(params, batch)
  loss, grads, metrics = jax.jit(trainer.loss_and_grads)(trainer.stored_params(params), batch)
  grads = trainer.model_params(grads)
  want_loss, want_grads, want_metrics = jax.jit(data_parallel_loss_and_grads(cfg))(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert float(metrics["tokens"]) == float(want_metrics["tokens"])
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  assert len(flat) == len(want)
  for path, g in flat:
    w = np.asarray(want[path])
    np.testing.assert_allclose(
        g, w, rtol=0, atol=1e-5 * np.max(np.abs(w)), err_msg=jax.tree_util.keystr(path)
    )


def _assert_layers_split_over_pp(trainer, state, pp):
  """pp rank r stores layers [r·L/pp, (r+1)·L/pp) of params and moments; other leaves whole."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  layers = [(p, x) for p, x in flat if "'layers'" in jax.tree_util.keystr(p)]
  assert len(layers) == 3 * len(jax.tree.leaves(state.params["layers"]))  # params, mu, nu
  for path, x in flat:
    n = x.shape[0] if x.shape else 0
    for shard in x.addressable_shards:
      if (path, x) in layers:
        r = int(np.argwhere(trainer.mesh.devices == shard.device)[0][0])  # pp is the first axis
        assert shard.data.shape == (n // pp,) + x.shape[1:], jax.tree_util.keystr(path)
        assert shard.index[0] == slice(r * n // pp, (r + 1) * n // pp)
      else:
        assert shard.data.shape == x.shape, jax.tree_util.keystr(path)


def test_trainer_steps_with_pipeline():
  # The quickstart's pp = 2 path: the first step's loss and gradient norm are the unpipelined ones.
  trainer = Trainer(tiny_config(2, "zb-h1"))
  state = trainer.init()
  _assert_layers_split_over_pp(trainer, state, 2)
  bytes_of = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  state_bytes, layer_bytes = bytes_of(state), bytes_of(state.params["layers"])
  batch = trainer.batch(0)
  want_loss, want_grads, _ = jax.jit(data_parallel_loss_and_grads(trainer.model_cfg))(
      state.params, batch
  )
  want_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want_grads)))
  first = trainer.step(batch)  # donates `state`
  np.testing.assert_allclose(first["loss"], want_loss, rtol=1e-5)
  np.testing.assert_allclose(first["grad_norm"], want_norm, rtol=1e-5)
  trainer.step(batch)  # warm-up starts at lr 0, so the second step is the first to move
  third = trainer.step(batch)  # the same batch: lower after a step down its gradient
  assert float(third["loss"]) < float(first["loss"])
  assert int(trainer.state.step) == 3
  _assert_layers_split_over_pp(trainer, trainer.state, 2)
  # The compiled step's inputs per device: the state with its layers (params, Adam's two moments)
  # halved, and a quarter of the batch (dp = 4).
  memory = trainer._train_step.lower(trainer.state, batch).compile().memory_analysis()
  assert memory.argument_size_in_bytes == state_bytes - 3 * layer_bytes // 2 + bytes_of(batch) // 4


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def test_pipeline_checkpoint_resumes_exactly(tmp_path):
  """pp = 2: a run resumed from a checkpoint repeats the uninterrupted run's steps bit for bit."""
  c = tiny_config(2, "zb-h1", microbatches=2)
  c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every = 4, 1, 0, 2
  c.optimizer.warmup_steps = 1
  workdir = str(tmp_path)
  first = Trainer(c, workdir)
  first.train(progress=False)
  want = jax.device_get(first.state)
  assert first.checkpointer.steps() == [2, 4]
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))  # as if killed before saving step 4
  logged = _losses(workdir)

  second = Trainer(c, workdir)
  state = second.init()
  assert second.resumed_from == 2 and int(state.step) == 2
  _assert_layers_split_over_pp(second, state, 2)  # restored onto the split, not replicated
  # the same config's compiled step and evaluation: saves two compiles
  second._train_step, second._eval_step = first._train_step, first._eval_step
  second.train(progress=False)
  losses = _losses(workdir)
  assert [s for s, _ in losses] == [1, 2, 3, 4]  # steps 3 and 4 logged once, by the resumed run
  assert losses == logged  # bit-identical
  for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(jax.device_get(second.state))
  ):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))

  # Layers are stored in canonical order, so the checkpoint also restores without a pipeline.
  c1 = tiny_config(1, "zb-h1", microbatches=2)
  plain = Trainer(c1, workdir, existing_run="resume_changed")  # tiny's own steps and warm-up
  restored = jax.device_get(plain.init())
  assert plain.resumed_from == 4
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_layers_must_split_into_the_schedule_stages():
  # zb-v puts 2p model stages on p ranks: 4 stages do not split 6 layers (caught by validation)
  with pytest.raises(
      config_lib.ConfigError, match="n_layers=6 .*does not split into the 4 model stages"
  ):
    Trainer(tiny_config(2, "zb-v", n_layers=6))


@pytest.mark.parametrize("cp_overlap", [False, True])
def test_pipeline_with_context_parallelism(cp_overlap):
  """pp = 2 x dp = 2 x cp = 2 with a split backward: each stage holds half of every sequence and
  runs Ulysses all-to-alls over cp inside the ticks (with cp_overlap, chunked ones fused with the
  projections, and no ppermute but the pipeline's); loss and gradients are the unpipelined ones."""
  c = tiny_config(2, "zb-h2")
  c.mesh.cp, c.mesh.dp = 2, 2
  c.model.cp_overlap = cp_overlap
  trainer = Trainer(c)
  params = transformer.init_params(trainer.model_cfg, jax.random.key(0))
  batch = trainer.batch(0)
  compiled = jax.jit(trainer.loss_and_grads).lower(params, batch).compile()
  loss, grads, _ = compiled(params, batch)
  want_loss, want_grads, _ = jax.jit(data_parallel_loss_and_grads(trainer.model_cfg))(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    w = np.asarray(want[path])
    np.testing.assert_allclose(
        g, w, rtol=0, atol=1e-5 * np.max(np.abs(w)), err_msg=jax.tree_util.keystr(path)
    )
  hlo = compiled.as_text().splitlines()
  a2a = [l for l in hlo if " all-to-all(" in l]
  # q, k, v in and o out in F; their transposes in I (twice as many in 2 chunks with cp_overlap)
  assert len(a2a) >= (16 if cp_overlap else 8)
  pp_groups = [set(g) for g in helpers.axis_groups(trainer.mesh, "pp")]
  for line in (l for l in hlo if " collective-permute(" in l):
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
    assert pairs and all(any({int(a), int(b)} <= g for g in pp_groups) for a, b in pairs), line
  names = " ".join(l.split('op_name="')[1].split('"')[0] for l in a2a)
  assert "/tick/F/" in names and "/tick/I/" in names, names
  for line in a2a:
    assert helpers.groups(line) == helpers.axis_groups(trainer.mesh, "cp"), line.strip()[:200]


def test_v_schedule_stores_each_ranks_stages_and_checkpoints_model_order(tmp_path):
  """ZB-V on pp = 2: rank r stores exactly the stages it runs (r and 3 - r), the step moves no
  parameter between pipeline ranks, the first step is the unpipelined one, and the checkpoint
  holds the model's layer order, restored as such by a 1F1B trainer."""
  from jaxpipe.training.pipeline_lm import lm_schedule

  trainer = Trainer(tiny_config(2, "zb-v", n_layers=4), workdir=str(tmp_path))
  assert trainer.layer_order.tolist() == [0, 3, 1, 2]
  state = trainer.init()
  model = transformer.init_params(trainer.model_cfg, jax.random.key(trainer.config.train.seed))
  placement = lm_schedule(trainer.config.pipeline, 2).placement
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]:
    want = np.asarray(dict(jax.tree_util.tree_flatten_with_path(model["layers"])[0])[path])
    for shard in leaf.addressable_shards:
      r = int(np.argwhere(trainer.mesh.devices == shard.device)[0][0])  # pp is the first axis
      stages = [placement.stage_model[s] for s in placement.rank_stages(r)]
      # (init compiled in another program: equal up to float32 rounding)
      np.testing.assert_allclose(
          shard.data, want[stages], rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path)
      )
  for a, b in zip(jax.tree.leaves(trainer.model_params()), jax.tree.leaves(model)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(trainer.stored_params(model)), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)

  batch = trainer.batch(0)
  step = trainer.build_train_step().lower(state, batch).compile().as_text()
  # Stored in model order, the gather to each rank's stages (and the scatter of their gradients
  # back) would add collective-permutes of their own; only the executor's ppermute remains.
  permutes = [l for l in step.splitlines() if " collective-permute(" in l]
  assert permutes
  for line in permutes:
    assert re.search(r'op_name="[^"]*/ppermute"', line), f"parameters move: {line.strip()[:200]}"
  want_loss, want_grads, _ = jax.jit(data_parallel_loss_and_grads(trainer.model_cfg))(model, batch)
  first = trainer.step(batch)
  np.testing.assert_allclose(first["loss"], want_loss, rtol=1e-5)
  want_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want_grads)))
  np.testing.assert_allclose(first["grad_norm"], want_norm, rtol=1e-5)

  trainer.train(steps=2, progress=False)
  expect = jax.device_get(trainer.model_params())
  other = Trainer(tiny_config(2, "1f1b", n_layers=4), workdir=str(tmp_path))
  assert other.layer_order is None
  restored = other.init()
  assert other.resumed_from == 2
  for a, b in zip(jax.tree.leaves(jax.device_get(restored.params)), jax.tree.leaves(expect)):
    np.testing.assert_array_equal(a, b)
  # resuming ZB-V puts the layers back rank by rank, moments included
  again = Trainer(tiny_config(2, "zb-v", n_layers=4), workdir=str(tmp_path))
  resumed = jax.device_get(again.init())
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(jax.device_get(trainer.state))):
    np.testing.assert_array_equal(a, b)
