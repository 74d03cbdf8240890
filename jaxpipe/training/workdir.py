"""A run's directory: one run at a time in it (a lock), and one config per run (checked on resume).

Two processes training into one workdir would interleave their checkpoints and metrics, so a
run holds an exclusive `flock` on `<workdir>/.lock` (in a multi-process run, process 0 holds it
for all). The kernel drops the lock when its process dies, so a run killed with -9 blocks
nothing; the pid it left in the file is reported when the next run takes the lock over.

A workdir holds one run: resuming it under a config that trains something else would splice two
runs into one set of checkpoints and one metrics file. `check_config` compares the config with
the stored `config.json`, field by field:

- cadence fields (logging, evaluation, checkpoint cadence) change freely;
- layout fields (mesh, its device order, pipeline schedule and micro-batches, recomputation,
  attention backend) change how the same model is computed, not what: they pass with a notice
  (the losses equal an unchanged run's up to float rounding). Not under MoE where they change
  the objective: micro-batches (the auxiliary losses are averaged per micro-batch) and, with
  capacity dispatch, the mesh's sizes (they set which tokens overflow);
- every other field (model, optimizer, data, train.steps, train.seed) refuses, unless nothing
  has been trained yet (no checkpoint, or only the step-0 one an import writes: there is no run
  to splice into), or the
  caller chose 'resume_changed' (continue under the new config) or 'restart' (move the old run
  aside and start over). train.steps is one of them on purpose: it sets the length of the
  learning-rate schedule, so extending a finished run splices a new schedule onto the old one.

Accepted changes, and restarts, are appended to `config_history.jsonl`.
"""

import datetime
import fcntl
import json
import logging
import os
import socket
import sys
from typing import Any

import ml_collections

from jaxpipe.runtime import files
from jaxpipe.runtime.checkpoint import is_committed
from jaxpipe.training import config as config_lib

EXISTING_RUN = ("resume", "resume_changed", "restart")
CADENCE = (
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.async_save",
    "train.pool_host_memory",  # how the host allocator serves the step, not what it computes
    "train.matmul",  # which library runs the GEMMs (float32 rounding apart, the same step)
)
LAYOUT = (
    "pipeline.schedule",
    "pipeline.chunks",
    "pipeline.recompute",
    "pipeline.microbatches",
    "model.attention",
    "model.remat",
    "model.cp_overlap",
    "model.sequence_parallel",
    "model.unroll_layers",
    "model.moe.dropless_impl",
    "optimizer.shard",
)
# What a run leaves in its workdir; --restart moves these to previous-<n>/.
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.json")
_ABSENT = "(absent)"

# Locks this process holds: workdir -> [file descriptor, holders]. Reentrant within a process,
# so a notebook can build a second Trainer on the workdir before dropping the first.
_HELD: dict[str, list[int]] = {}


class WorkdirError(config_lib.ConfigError):
  """The workdir cannot be used (a file, not writable) or holds a run with another config."""


class WorkdirBusy(RuntimeError):
  """Another live process holds the workdir's lock."""


def field_kind(key: str, config: ml_collections.ConfigDict) -> str:
  """'cadence', 'layout' or 'run' (see the module docstring) for a dotted config key.

  Args:
    key: a dotted config key, e.g. 'mesh.pp'.
    config: the new config (whether it has MoE layers and capacity dispatch).

  Returns:
    The key's kind.
  """
  if key in CADENCE:
    return "cadence"
  if key.startswith("mesh.") or key in LAYOUT:
    moe = config.model.moe
    if (
        key != "mesh.order"
        and moe is not None
        and (
            key == "pipeline.microbatches"
            or (
                (key.startswith("mesh.") or key == "model.sequence_parallel")
                and moe.dispatch == "capacity"
            )
        )
    ):
      return "run"
    return "layout"
  return "run"


def config_changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
  """(dotted key, old value, new value) for each field that differs between two config dicts.

  Args:
    old: the stored config, as nested dicts.
    new: the new config, as nested dicts.
    prefix: the dotted key of the section being compared ('' at the top).

  Returns:
    The changes, the new config's keys first; a field only one side has is compared with an
    absent marker.
  """
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for k in list(new) + [k for k in old if k not in new]:
      out += config_changes(old.get(k, _ABSENT), new.get(k, _ABSENT), f"{prefix}{k}.")
    return out
  return [] if old == new else [(prefix[:-1], old, new)]


def _as_dict(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort())


def _with_defaults(stored: dict, defaults: dict) -> dict:
  """`stored` with the fields it predates filled in from `defaults`."""
  out = dict(stored)
  for k, v in defaults.items():
    if k not in out:
      out[k] = v
    elif isinstance(v, dict) and isinstance(out[k], dict):
      out[k] = _with_defaults(out[k], v)
  return out


def _describe(changes: list[tuple[str, Any, Any]]) -> str:
  show = lambda v: v if v == _ABSENT else json.dumps(v)
  return "; ".join(
      f"{k} {show(a)} -> {show(b)}"
      + (
          " (the learning-rate schedule's length: continuing splices the new schedule onto the old)"
          if k == "train.steps"
          else ""
      )
      for k, a, b in changes
  )


def _holder() -> str:
  now = datetime.datetime.now().isoformat(timespec="seconds")
  return json.dumps(
      {
          "pid": os.getpid(),
          "host": socket.gethostname(),
          "since": now,
          "command": " ".join(sys.argv),
      }
  )


def _describe_holder(text: str) -> str:
  try:
    h = json.loads(text)
    return f"process {h['pid']} on {h['host']} (since {h['since']}: {h['command']})"
  except (ValueError, KeyError, TypeError):
    return "another process"


class Workdir:
  """The run directory `path`, created if missing; ConfigError-like WorkdirError if unusable."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise WorkdirError(
          f"--workdir {path} is a file, not a directory; pass a directory (it is "
          "created if missing)"
      )
    try:
      os.makedirs(self.path, exist_ok=True)
    except OSError as e:
      raise WorkdirError(
          f"--workdir {path} cannot be created: {e.strerror}; pass a directory you can write to"
      ) from e
    self._lock_path = os.path.join(self.path, ".lock")

  # -- the lock ----------------------------------------------------------------------------------

  def lock(self) -> None:
    """Holds the workdir for this process (again, if it already does); WorkdirBusy if another live
    process holds it. Released by `unlock`, or by the kernel when the process ends."""
    held = _HELD.get(self.path)
    if held is not None:
      held[1] += 1
      return
    try:
      fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirError(
          f"--workdir {self.path} is not writable ({e.strerror}: {self._lock_path})"
          "; pass a directory you can write to"
      ) from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
      os.close(fd)
      raise WorkdirBusy(
          f"{self.path} is in use by {holder}: two runs in one workdir would "
          "interleave their checkpoints and metrics; wait for it to finish, stop it, "
          "or pass another --workdir"
      ) from None
    left = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if left:
      logging.warning(
          "took over the lock of %s from %s, which is no longer running",
          self.path,
          _describe_holder(left),
      )
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder() + "\n").encode(), 0)
    _HELD[self.path] = [fd, 1]

  def unlock(self) -> None:
    """Drops one hold; the last one empties the lock file (a clean exit leaves no holder)."""
    held = _HELD.get(self.path)
    if held is None:
      return
    held[1] -= 1
    if held[1] == 0:
      del _HELD[self.path]
      os.ftruncate(held[0], 0)
      os.close(held[0])

  # -- one config per run ------------------------------------------------------------------------

  def latest_step(self) -> int | None:
    """The newest committed checkpoint step, from the directory listing alone."""
    d = os.path.join(self.path, "checkpoints")
    steps = [
        int(n)
        for n in (os.listdir(d) if os.path.isdir(d) else [])
        if n.isdigit() and is_committed(os.path.join(d, n))
    ]
    return max(steps, default=None)

  def check_config(
      self, config: ml_collections.ConfigDict, existing_run: str = "resume", write: bool = True
  ) -> list[str]:
    """Compares `config` with the run the workdir holds (see the module docstring).

    With `write` (process 0) it records the config in config.json, accepted changes in
    config_history.jsonl, and carries out a restart.

    Args:
      config: the new run's config.
      existing_run: 'resume', 'resume_changed' or 'restart' (EXISTING_RUN).
      write: record and restart (process 0); False only checks.

    Returns:
      Notices to show.

    Raises:
      WorkdirError: to refuse: a config that changes what is trained under 'resume' once
        something has been trained, or train.steps below the newest checkpoint's step.
      ValueError: an unknown `existing_run`.
    """
    if existing_run not in EXISTING_RUN:
      raise ValueError(f"existing_run={existing_run!r} must be one of {EXISTING_RUN}")
    path = os.path.join(self.path, "config.json")
    new = _as_dict(config)
    changes, notices = [], []
    if os.path.exists(path):
      try:
        with open(path) as f:
          stored = json.load(f)
        data = stored.get("data")
        if isinstance(data, dict) and "tokenizer" not in data:
          # a run from before data.tokenizer read its workdir's hf/ tokenizer if there was one
          has_hf = os.path.isfile(os.path.join(self.path, "hf", "tokenizer.json"))
          data["tokenizer"] = "hf" if has_hf else "bytes"
        old = _with_defaults(stored, _as_dict(config_lib.default_config()))
      except ValueError:
        logging.warning("%s does not parse; taking the current config as the run's", path)
      else:
        changes = config_changes(old, new)
    kinds = {
        kind: [c for c in changes if field_kind(c[0], config) == kind]
        for kind in ("cadence", "layout", "run")
    }
    step = self.latest_step()
    at = f"checkpoint at step {step}" if step is not None else "no checkpoint yet"
    if step is not None and config.train.steps < step and existing_run != "restart":
      raise WorkdirError(
          f"train.steps={config.train.steps} is below the {at} in {self.path}: nothing to train. "
          f"Raise train.steps above {step}, or pass another --workdir (or --restart)"
      )
    if existing_run == "restart":
      moved = self._set_aside_run() if write else None
      if moved:
        notices.append(f"--restart: moved the previous run ({at}) to {moved}")
        self._record(write, "restart", changes, step, moved)
    elif kinds["run"] and existing_run == "resume" and step:
      raise WorkdirError(
          f"{self.path} holds a run with another config ({at}): {_describe(kinds['run'])}. Pass "
          "another --workdir for a new run; or rerun with --resume_changed (Trainer(..., "
          "existing_run='resume_changed')) to continue this one under the new config; or with "
          f"--restart to start over here (the old run moves to {self._next_previous()})"
      )
    else:
      if kinds["run"] and not step:
        notices.append(
            f"nothing trained yet ({at}): taking the new config (recorded in "
            f"config_history.jsonl): {_describe(kinds['run'])}"
        )
      elif kinds["run"]:
        notices.append(
            f"resuming ({at}) under a changed config (recorded in config_history.jsonl)"
            f": {_describe(kinds['run'])}"
        )
      if kinds["layout"]:
        notices.append(
            f"resuming ({at}) with another layout: {_describe(kinds['layout'])} (the "
            "same model and optimizer; losses equal the unchanged run's up to float "
            "rounding)"
        )
      if changes:
        self._record(write, existing_run, changes, step)
    if write:
      files.write_atomically(path, config.to_json_best_effort(indent=2))
    return notices

  def _next_previous(self) -> str:
    n = 1
    while os.path.exists(os.path.join(self.path, f"previous-{n}")):
      n += 1
    return os.path.join(self.path, f"previous-{n}")

  def _set_aside_run(self) -> str | None:
    """Moves what a run left here into previous-<n>/; its path, or None if there was nothing."""
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(self.path, n))]
    if not present:
      return None
    target = self._next_previous()
    os.makedirs(target)
    for name in present:
      os.rename(os.path.join(self.path, name), os.path.join(target, name))
    return target

  def _record(
      self, write: bool, choice: str, changes: list, step: int | None, moved: str | None = None
  ) -> None:
    if not write:
      return
    entry = {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "choice": choice,
        "step": step,
        "changes": {k: [a, b] for k, a, b in changes},
    }
    if moved:
      entry["moved_to"] = moved
    with open(os.path.join(self.path, "config_history.jsonl"), "a") as f:
      f.write(json.dumps(entry) + "\n")
