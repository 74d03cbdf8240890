"""Checkpoints: orbax CheckpointManager (async, keep-last-N) that only trusts finished steps.

Orbax lists every integer-named directory as a step, so an empty or half-copied `7/` would be
taken as the latest and, worse, make orbax skip every later save with a smaller step number.
Here a step counts only once orbax has written its commit marker; a step directory without one,
or one that fails to restore while an older one restores, is renamed `<step>.incomplete` or
`<step>.corrupt` (kept for inspection, invisible to orbax).
"""
import collections
import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_COMMIT_FILE = "commit_success.txt"
_METADATA_FILE = "_CHECKPOINT_METADATA"


def is_committed(step_dir: str) -> bool:
  """Whether orbax finished writing this step (its commit marker or commit timestamp exists)."""
  if os.path.isfile(os.path.join(step_dir, _COMMIT_FILE)):
    return True
  try:
    with open(os.path.join(step_dir, _METADATA_FILE)) as f:
      return json.load(f).get("commit_timestamp_nsecs") is not None
  except (OSError, ValueError, AttributeError):
    return False


def _set_aside(path: str, reason: str) -> str:
  target, n = f"{path}.{reason}", 1
  while os.path.exists(target):
    n += 1
    target = f"{path}.{reason}{n}"
  os.rename(path, target)
  return target


class Checkpointer:
  """Saves and restores a state pytree under `directory/<step>`."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    if jax.process_index() == 0:
      for name in os.listdir(self.directory):
        path = os.path.join(self.directory, name)
        if name.isdigit() and os.path.isdir(path) and not is_committed(path):
          logging.warning("checkpoint %s was never committed (half-written?); moved to %s", path,
                          _set_aside(path, "incomplete"))
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=ocp.StandardCheckpointHandler(),  # metadata without a save
        options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                             enable_async_checkpointing=async_save, create=True))

  def steps(self) -> list[int]:
    """Committed steps, oldest first."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, force: bool = False) -> bool:
    """Starts saving `state` as `step` (in the background when async); False if orbax skipped it."""
    return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any] | None:
    """(step, state) of the newest step that restores onto `abstract_state`'s shapes and shardings.

    A newer step that fails while an older one restores is corrupt and is set aside; if none
    restores, the newest step's error is raised (usually a model/config change, not corruption).
    """
    failed, first_error = [], None
    for step in reversed(self.steps()):
      mismatch = self._mismatch(step, abstract_state)
      if mismatch is not None:  # decided from metadata: no array read is started
        logging.warning("checkpoint step %d in %s does not fit the model: %s", step,
                        self.directory, mismatch)
        failed.append(step)
        first_error = first_error or ValueError(mismatch)
        continue
      try:
        state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
      except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many types for bad files
        logging.warning("checkpoint step %d in %s does not restore: %s", step, self.directory, e)
        failed.append(step)
        first_error = first_error or e
        continue
      if failed and jax.process_index() == 0:
        for bad in failed:
          path = os.path.join(self.directory, str(bad))
          logging.warning("checkpoint %s is unreadable; moved to %s and resumed from step %d", path,
                          _set_aside(path, "corrupt"), step)
        self.manager.reload()
      return step, state
    if first_error is not None:
      raise RuntimeError(
          f"no checkpoint in {self.directory} restores onto the current model (steps {failed}); "
          f"the newest failed with: {first_error}. If the model or mesh config changed, start a new "
          "--workdir; if the files are damaged, move those step directories away") from first_error
    return None

  def _mismatch(self, step: int, abstract_state: Any) -> str | None:
    """Which saved array has no counterpart of its shape and dtype in `abstract_state` (and the
    other way round), from `step`'s metadata alone; None when they pair up or the metadata
    cannot be read (the restore then reports what is wrong)."""
    try:
      saved = [(jax.tree_util.keystr(p), tuple(m.shape), np.dtype(m.dtype)) for p, m in
               jax.tree_util.tree_flatten_with_path(self.manager.item_metadata(step).tree)[0]]
    except Exception:  # noqa: BLE001 -- missing or unreadable metadata
      return None
    want = [(jax.tree_util.keystr(p), tuple(a.shape), np.dtype(a.dtype))
            for p, a in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]
    extra = collections.Counter(x[1:] for x in saved) - collections.Counter(x[1:] for x in want)
    missing = collections.Counter(x[1:] for x in want) - collections.Counter(x[1:] for x in saved)
    if not extra and not missing:
      return None
    describe = lambda x: f"{x[0]} {x[1]} {x[2]}" if x else "nothing"
    ours = next((x for x in saved if x[1:] in extra), None)
    theirs = next((x for x in want if x[1:] in missing), None)
    return (f"the checkpoint holds {describe(ours)} where the model needs {describe(theirs)} "
            f"({sum(extra.values())} of the saved arrays unmatched)")

  def wait(self) -> None:
    """Blocks until background saves are committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
