"""pipeline.auto_layout (jaxpipe.training.plan): the layout planner picks a layout that fits the
memory limit where the config's own layout does not, measured on the compiled step; bad
settings stop at the config. The choice is made by `resolve`, before a Trainer is built."""

import functools
import json
import os

import jax
import pytest

from configs import moe_quickstart, quickstart
from jaxpipe.training import config as config_lib
from jaxpipe.training import plan
from jaxpipe.training.resolve import resolve
from jaxpipe.training.trainer import Trainer
from jaxpipe.training.workdir import Workdir

LIMIT_GB = 0.03  # the quickstart's replicated step needs about 32 MB per device


def _config(auto: bool, limit: float = LIMIT_GB):
  c = quickstart.get_config()
  c.data.source = "synthetic"
  c.train.eval_every = 0
  if auto:
    c.pipeline.schedule, c.pipeline.auto_layout, c.pipeline.memory_limit_gb = "auto", True, limit
  return c


@functools.cache
def _peak_bytes(auto: bool, workdir: str | None = None) -> tuple[int, Trainer]:
  trainer = Trainer(_config(auto), workdir)
  trainer.compile()
  return trainer.compile_stats["peak_bytes"], trainer


def test_auto_layout_fits_where_the_replicated_layout_does_not(tmp_path):
  """compiled.memory_analysis(): the config's own layout (dp 8, replicated) needs more than the
  limit; the layout auto_layout picks needs less, and the run records its choice."""
  replicated, _ = _peak_bytes(False)
  chosen, trainer = _peak_bytes(True, str(tmp_path))
  assert replicated > LIMIT_GB * 1e9 >= chosen
  assert trainer.auto_report.startswith("auto_layout: ")
  with open(os.path.join(tmp_path, "auto.json")) as f:
    saved = json.load(f)["choice"]
  for key, value in saved.items():  # the run's config is the recorded choice
    section, name = key.split(".")
    assert trainer.config[section][name] == value, key
  assert trainer.config.pipeline.schedule != "auto" and not trainer.config.pipeline.auto_layout
  trainer.close()


def test_no_fitting_layout_is_one_line():
  with pytest.raises(config_lib.ConfigError, match=r"no layout of 8 devices is predicted to fit"):
    plan.choose_layout(_config(True, limit=1e-5), jax.device_count())


def test_auto_layout_needs_a_memory_limit():
  c = _config(True, limit=0.0)
  with pytest.raises(config_lib.ConfigError, match=r"pipeline.auto_layout=True searches layouts"):
    config_lib.validate(c, 8)


def test_the_trainer_runs_the_chosen_remat_and_split():
  """A limit that takes selective recomputation and zero2: the model the trainer builds (not
  only its config) recomputes the attention core, and its state's moments are split."""
  trainer = Trainer(_config(True, limit=0.020))
  fields = plan.choose_layout(_config(True, limit=0.020), jax.device_count()).fields
  assert fields["model.remat"] == "selective" and fields["optimizer.shard"] == "zero2"
  assert trainer.model_cfg.remat == "selective"
  assert trainer.model_cfg.sequence_parallel == fields["model.sequence_parallel"]
  assert trainer.config.optimizer.shard == "zero2"


def test_the_planner_prices_the_stack_as_the_step_runs_it():
  """plan.unrolled follows model.unroll_layers: the quickstart's 4 layers unrolled, a loop under
  remat, fsdp or a pipeline, or when the stack is longer than unroll_layers."""
  shape = {"pp": 1, "dp": 8, "tp": 1, "cp": 1, "ep": 1}
  c = _config(False)
  assert c.model.unroll_layers >= c.model.n_layers and plan.unrolled(c, shape)
  for key, value in (
      ("model.remat", "selective"),
      ("model.remat", True),
      ("model.n_layers", c.model.unroll_layers + 1),
  ):
    section, name = key.split(".")
    other = _config(False)
    other[section][name] = value
    assert not plan.unrolled(other, shape), key
  fsdp = _config(False)
  fsdp.optimizer.shard = "fsdp"
  assert not plan.unrolled(fsdp, shape)
  assert not plan.unrolled(c, dict(shape, pp=2, dp=4))
  assert not plan.unrolled(moe_quickstart.get_config(), dict(shape, dp=2, ep=4))
  # priced apart: the unrolled fit holds fewer copies than the loop's
  loop = _config(False)
  loop.model.unroll_layers = 0
  assert plan.predict(c, shape).activations < plan.predict(loop, shape).activations
  # unrolled, zero2 keeps its gradients whole (measured): priced as zero1; in the loop, less
  total = {}
  for unroll in (16, 0):
    for shard in ("zero1", "zero2"):
      x = _config(False)
      x.model.unroll_layers, x.optimizer.shard = unroll, shard
      total[unroll, shard] = plan.predict(x, shape).total
  assert total[16, "zero2"] == total[16, "zero1"]
  assert total[0, "zero2"] < total[0, "zero1"]


def test_the_search_ranges_over_the_splits_priced_as_stored():
  """The layouts priced as jaxpipe stores them are searched: an optimizer split beside cp (over
  dp x ep x cp), zero2 and fsdp in a pipeline, MoE at tp 2 (experts whole over tp)."""
  c = moe_quickstart.get_config()
  c.data.source = "synthetic"
  c.pipeline.schedule, c.pipeline.auto_layout, c.pipeline.memory_limit_gb = "auto", True, 1.0
  lines = plan.choose_layout(c, jax.device_count(), top=10_000).report.splitlines()[1:]
  labels = [line.split("  ")[0] for line in lines]
  assert any("cp2" in x and "zero1" in x for x in labels)
  assert any("pp2" in x and "zero2" in x for x in labels)
  assert any("pp2" in x and "fsdp" in x for x in labels)
  assert any(x.startswith("tp2x") for x in labels)


def test_full_recomputation_in_a_pipeline_is_the_executors():
  """The executor recomputes by pipeline.recompute (model.remat does not reach it)."""
  staged = plan._fields(plan.L.Layout(pp=2, dp=4, recompute="full"))
  assert staged["pipeline.recompute"] is True and staged["model.remat"] is False
  flat = plan._fields(plan.L.Layout(dp=8, recompute="full"))
  assert flat["pipeline.recompute"] is False and flat["model.remat"] is True


def test_the_config_is_resolved_and_the_workdir_held_before_a_trainer_is_built(tmp_path):
  """`resolve` makes the auto_layout choice and takes the workdir before any Trainer exists (the
  command prints the choice from it); `Trainer(run)` takes the lock over and releases it."""
  lock_file = Workdir(str(tmp_path))._lock_path
  given = _config(True)
  run = resolve(given, str(tmp_path))
  assert run.auto_report.startswith("auto_layout: ")
  assert run.config.pipeline.schedule != "auto" and given.pipeline.schedule == "auto"
  assert run.mesh_shape == config_lib.validate(run.config, jax.device_count())
  assert open(lock_file).read().strip()  # held: the holder is written in the lock file
  with pytest.raises(ValueError, match="a ResolvedConfig carries its workdir"):
    Trainer(run, str(tmp_path))
  trainer = Trainer(run)
  assert (trainer.config, trainer.auto_report) == (run.config, run.auto_report)
  del run
  assert open(lock_file).read().strip()  # the trainer holds it now
  trainer.close()
  assert not open(lock_file).read().strip()


def test_a_bad_existing_run_is_refused_before_the_workdir_is_touched(tmp_path):
  with pytest.raises(ValueError, match=r"existing_run='resum' must be one of \('resume'"):
    resolve(_config(False), str(tmp_path / "run"), existing_run="resum")
  assert not os.path.exists(tmp_path / "run")
