"""A run's config resolved and checked before a `Trainer` is built.

`resolve` does, in order, what must hold before any device work: the config is validated
against the devices (`config.validate`), the workdir is locked and its run checked against the
config (`training.workdir`: one process at a time, one config per run), and
`pipeline.schedule='auto'` is replaced by the chosen schedule (measured, or the planner's
layout with `pipeline.auto_layout`; `auto.json` in the workdir keeps the choice for a resumed
run). The command (`python -m jaxpipe.train`) calls it, then builds the Trainer from the result;
a notebook may do the same to read the choice before training:

    run = resolve(config, workdir)
    print(run.auto_report)
    trainer = Trainer(run)        # takes the workdir's lock over from `run`

`Trainer(config, workdir)` calls `resolve` itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref

import jax
import ml_collections

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.runtime import files, multihost
from jaxpipe.training import config as config_lib
from jaxpipe.training.workdir import EXISTING_RUN, Workdir, WorkdirError


@dataclasses.dataclass
class ResolvedConfig:
  """A config that can run here, with what resolving it found out."""

  config: ml_collections.ConfigDict  # as it runs: pipeline.schedule='auto' replaced by the choice
  mesh_shape: dict[str, int]  # devices per mesh axis
  model_cfg: TransformerConfig  # the model the config describes
  workdir: str | None  # where the run writes; None: nowhere
  auto_report: str | None = None  # pipeline.schedule='auto': the ranking and why the choice won
  notices: list[str] = dataclasses.field(default_factory=list)  # what the workdir check accepted
  # releases the workdir's lock (process 0 holds it); also called when garbage-collected
  release: weakref.finalize | None = dataclasses.field(default=None, repr=False)

  def close(self) -> None:
    """Releases the workdir's lock (a Trainer built from this does it in its `close`)."""
    if self.release is not None:
      self.release()


def resolve(
    config: ml_collections.ConfigDict, workdir: str | None = None, existing_run: str = "resume"
) -> ResolvedConfig:
  """Checks a config, takes its workdir and chooses an 'auto' schedule.

  Args:
    config: the run's config (`config.default_config` and overrides).
    workdir: where checkpoints, metrics and config.json go; None: nothing is written.
    existing_run: what to do with a run the workdir already holds: 'resume' it (refused if the
      config changes what is trained), 'resume_changed' (continue it under the changed config)
      or 'restart' (move it to previous-<n>/ and start over).

  Returns:
    The resolved config, holding the workdir's lock until it (or the Trainer built from it)
    is closed.

  Raises:
    ConfigError: the config cannot run here; the message names the field and the fix.
    WorkdirError: the workdir is busy or holds a run the config does not continue.
  """
  if existing_run not in EXISTING_RUN:
    raise ValueError(f"existing_run={existing_run!r} must be one of {EXISTING_RUN}")
  mesh_shape = config_lib.validate(config, jax.device_count(), jax.default_backend())
  run = ResolvedConfig(config, mesh_shape, config_lib.model_config(config), workdir)
  if workdir is not None:  # before any device work: a busy or mismatched workdir stops here
    # Process 0 takes the lock and checks the config for the whole run; the others wait for its
    # verdict, so that none of them goes on to a collective that process 0 never reaches.
    lock = Workdir(workdir)
    run.release = weakref.finalize(run, lock.unlock)
    refused = None
    if jax.process_index() == 0:
      try:
        lock.lock()
        run.notices = lock.check_config(config, existing_run)
      except BaseException as e:  # noqa: BLE001 -- re-raised below, once the others know
        refused = e
    if multihost.any_process(refused is not None):
      run.close()
      raise refused or WorkdirError(f"process 0 refused --workdir {workdir}; its error says why")
    for notice in run.notices:
      logging.warning("%s", notice)
  if config.pipeline.schedule == config_lib.AUTO:  # after the workdir check: this measures
    try:
      _choose_schedule(run, afresh=existing_run == "restart")
    except BaseException:
      run.close()
      raise
  return run


def _choose_schedule(run: ResolvedConfig, afresh: bool) -> None:
  """pipeline.schedule = 'auto' -> `run.config` a copy running the best-ranked candidate.

  The choice (and, when measured here, the costs) go to `auto.json` (`costs.json`) in the
  workdir; a run resumed there keeps its first choice unless `afresh` (a restart).
  """
  from jaxpipe.planning import auto as auto_lib
  from jaxpipe.planning import costs as costs_lib
  from jaxpipe.training import plan, stage_timing

  config, workdir = run.config, run.workdir
  path = os.path.join(workdir, "auto.json") if workdir else None
  if path and os.path.exists(path) and not afresh:
    with open(path) as f:
      saved = json.load(f)
    choice, run.auto_report = saved["choice"], saved["report"]
  elif config.pipeline.auto_layout:  # the planner's layout: nothing measured
    chosen = plan.choose_layout(config, jax.device_count(), jax.default_backend())
    choice, run.auto_report = chosen.fields, chosen.report
    logging.info("%s", chosen.report)
    if path and jax.process_index() == 0:
      os.makedirs(workdir, exist_ok=True)
      files.write_json(path, {"choice": choice, "report": run.auto_report}, indent=1)
  else:
    try:
      ranking, measured = stage_timing.choose(config, run.mesh_shape)
    except (auto_lib.AutoError, costs_lib.CostFileError) as e:
      raise config_lib.ConfigError(f"pipeline.schedule='auto': {e}") from e
    choice, run.auto_report = dict(auto_lib.choice_config(ranking.best)), ranking.report()
    if path and jax.process_index() == 0:
      os.makedirs(workdir, exist_ok=True)
      if measured is not None:
        costs_lib.dump(measured, os.path.join(workdir, "costs.json"))
      files.write_json(path, {"choice": choice, "report": run.auto_report}, indent=1)
  run.config = plan.with_fields(config, choice)  # a copy: the caller's config stays 'auto'
  run.model_cfg = config_lib.model_config(run.config)  # auto_layout may set remat, sp
  run.mesh_shape = config_lib.validate(run.config, jax.device_count(), jax.default_backend())
