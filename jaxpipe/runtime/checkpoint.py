"""Checkpoints: orbax CheckpointManager (async, keep-last-N) that only trusts finished steps.

Orbax lists every integer-named directory as a step, so an empty or half-copied `7/` would be
taken as the latest and, worse, make orbax skip every later save with a smaller step number.
Here a step counts only once orbax has written its commit marker; a step directory without one,
or one that fails to restore while an older one restores, is renamed `<step>.incomplete` or
`<step>.corrupt` (kept for inspection, invisible to orbax). Only the run that writes the
directory renames anything, and in a multi-process run only process 0, before the others list
the directory: every process of the run has started by then and the workdir lock keeps other
runs out, so no writer is still filling an uncommitted step. A reader (`read_only`, e.g. a
server loading the newest checkpoint of a run that may be saving right now) renames nothing.

A save that fails (a full disk, a quota) raises CheckpointSaveError as soon as it is noticed: at
once for a synchronous save, at the next `poll()` for a background one. Before writing, `save`
checks that the filesystem has room for the checkpoint (the state's size before the first save,
the last committed step's size after it), so a full disk is found before anything is written.

In a multi-process run each process writes its own shards. orbax meets the processes at barriers
whose timeout is 20 minutes, and a process whose write failed never reaches the next one, so its
peers would wait that long. Here its barriers are breakable (multihost.BreakableBarrier): the
failing process breaks them, and every process raises CheckpointSaveError after the same training
step, naming the first process that failed and its error. (orbax's synchronous saves meet at
barriers that cannot be broken, so with several processes saves always run in the background;
with async_save off, `save` waits for its own.) A failure in the synchronous start of a save on
one process alone (creating its directories) is not agreed: the others find it when that
process exits.
"""

import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpipe.runtime import multihost

_COMMIT_FILE = "commit_success.txt"
_METADATA_FILE = "_CHECKPOINT_METADATA"


def is_committed(step_dir: str) -> bool:
  """Whether orbax finished writing this step.

  Args:
    step_dir: a step's directory, `<checkpoints>/<step>`.

  Returns:
    True if its commit marker file exists, or its metadata records a commit timestamp.
  """
  if os.path.isfile(os.path.join(step_dir, _COMMIT_FILE)):
    return True
  try:
    with open(os.path.join(step_dir, _METADATA_FILE)) as f:
      return json.load(f).get("commit_timestamp_nsecs") is not None
  except (OSError, ValueError, AttributeError):
    return False


class CheckpointSaveError(OSError):
  """A checkpoint could not be written; the message names the directory, the bytes needed and free,
  and the last good step (which is kept)."""


class CheckpointMismatchError(RuntimeError):
  """No checkpoint has the arrays the model needs (the model config changed under the workdir)."""


def directory_bytes(path: str) -> int:
  """Bytes in the files under `path`.

  Args:
    path: a directory.

  Returns:
    The total size of the files under `path`, recursively, in bytes.
  """
  return sum(
      os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
  )


def _os_cause(error: BaseException) -> str:
  """The operating system's part of a tensorstore/orbax write error (they prefix it with paths)."""
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return text.rsplit('": ', 1)[-1]


def _set_aside(path: str, reason: str) -> str:
  target, n = f"{path}.{reason}", 1
  while os.path.exists(target):
    n += 1
    target = f"{path}.{reason}{n}"
  os.rename(path, target)
  return target


def _by_path(tree: Any) -> dict[tuple[str, ...], tuple[str, tuple[int, ...], np.dtype]]:
  """{path: (name, shape, dtype)} for a state or its checkpoint metadata, keyed alike: orbax
  stores `.params` as `['params']` and optax tuples as lists."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    out[key] = (jax.tree_util.keystr(path), tuple(leaf.shape), np.dtype(leaf.dtype))
  return out


_ITEM = "default"  # the state's directory in a step's (orbax's name for a manager's one item)


class Checkpointer:
  """Saves and restores a state pytree under `directory/<step>`; with `read_only`, restores only
  and never renames or deletes anything (a reader beside a run that may be writing)."""

  def __init__(self, directory: str, keep: int, async_save: bool = True, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    if not read_only:  # a collective in a multi-process run: every process constructs it
      os.makedirs(self.directory, exist_ok=True)
      if jax.process_index() == 0:
        for name in os.listdir(self.directory):
          path = os.path.join(self.directory, name)
          if name.isdigit() and os.path.isdir(path) and not is_committed(path):
            logging.warning(
                "checkpoint %s was never committed (half-written?); moved to %s",
                path,
                _set_aside(path, "incomplete"),
            )
      multihost.barrier(f"jaxpipe.Checkpointer {self.directory}")  # then the others list it
    self._barrier = self._agree = None
    self._broke = False  # this process broke the barrier (its save failed)
    # orbax's synchronous saves meet at barriers that cannot be broken: with several processes
    # orbax saves in the background and `save` itself waits when async_save is off
    self._wait_in_save = not async_save and not read_only and jax.process_count() > 1
    if not read_only and jax.process_count() > 1:
      Checkpointer._writers += 1  # the same count on every process: all construct it
      self._barrier = multihost.BreakableBarrier(f"checkpointer{Checkpointer._writers}")
      self._agree = multihost.OneStepLate()  # which step every process stops after a failure
    options = (
        ocp.CheckpointManagerOptions(read_only=True, create=False)
        if read_only
        else ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save or self._wait_in_save,
            create=True,
            cleanup_tmp_directories=True,
        )
    )
    if self._barrier is not None:
      options.async_options = ocp.AsyncOptions(barrier_sync_fn=self._sync)
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers=ocp.StandardCheckpointHandler(),  # metadata without a save
        options=options,
    )
    self._pending: int | None = None  # the step being saved, until its outcome is known
    self._needed = 0
    self._failed_steps: set[int] = set()  # whose partial writes close() removes again

  _writers = 0

  def _sync(self, *, key: str, timeout_ms: int) -> None:
    """orbax's barrier. A save thread that reaches one while an error propagates (orbax meets the
    other processes in a `finally` after a failed write or commit) breaks it for all of them."""
    error = sys.exc_info()[1]
    if (
        error is not None
        and not isinstance(error, multihost.Broken)
        and threading.current_thread() is not threading.main_thread()
    ):
      self._break(error)
    self._barrier(key=key, timeout_ms=timeout_ms)

  def _break(self, error: BaseException) -> None:
    self._broke = True
    self._barrier.break_(_os_cause(error))

  def steps(self) -> list[int]:
    """Committed steps, oldest first (orbax also lists a step while it is being written)."""
    return [
        s
        for s in sorted(self.manager.all_steps())
        if is_committed(os.path.join(self.directory, str(s)))
    ]

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def needed_bytes(self, state: Any) -> int:
    """Room one more checkpoint of `state` takes.

    Args:
      state: the state pytree, as arrays or their shapes (anything with `.shape` and `.dtype`).

    Returns:
      The newest committed step's size on disk in bytes, or the arrays' own size before any step is
      committed.
    """
    latest = self.latest_step()
    if latest is not None:
      return directory_bytes(os.path.join(self.directory, str(latest)))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))

  def check_space(self, state: Any, step: int | None = None) -> int:
    """Checks that the filesystem has room for a checkpoint of `state`.

    A collective in a multi-process run: if any process lacks the room, all of them raise.

    Args:
      state: the state pytree, as arrays or their shapes.
      step: the step about to be saved, named in the error.

    Returns:
      The bytes a checkpoint of `state` takes.

    Raises:
      CheckpointSaveError: the filesystem has less room (on any process of the run).
    """
    needed, free = self.needed_bytes(state), shutil.disk_usage(self.directory).free
    if multihost.any_process(free < needed):
      what = f"not saving step {step}" if step is not None else "no checkpoint fits"
      raise self._error(
          f"{what} in {self.directory}: {free:,} bytes free there, fewer than the "
          f"{needed:,} bytes a checkpoint takes",
          needed,
      )
    return needed

  def save(self, step: int, state: Any, force: bool = False) -> bool:
    """Starts saving `state` as `step` (in the background when async).

    Args:
      step: the training step to save as.
      state: the state pytree.
      force: passed to orbax's `CheckpointManager.save`: save even where its policy would skip.

    Returns:
      False if orbax skipped the step, else True.

    Raises:
      CheckpointSaveError: before writing, when the disk has no room for it; and when an earlier
        background save failed or this synchronous one fails.
      ValueError: the checkpointer is read-only.
    """
    if self.read_only:
      raise ValueError(f"{self.directory} was opened read-only (a reader); not saving step {step}")
    self.wait()  # orbax would wait for the previous save anyway; its failure is its own
    self._needed = self.check_space(state, step)
    self._pending = step
    try:
      saved = self.manager.save(step, args=ocp.args.StandardSave(state), force=force)
    except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many types for failed writes
      raise self._failed(e) from e
    if self._wait_in_save:
      self.wait()
    self.poll()
    return saved

  def poll(self) -> None:
    """Raises CheckpointSaveError if the background save has failed (returns at once otherwise).

    With several processes, a collective (every process calls it once per step): each learns of
    a failure at its own time, and all raise after the step at which the first one knew."""
    if self._agree is not None:
      if self._agree(int(self._broke)):
        step = self._pending
        self.wait()  # raises if this process's save failed too (its error or the broken barrier)
        raise self._failed(None, step)
    elif self._pending is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Blocks until background saves are committed; CheckpointSaveError if one failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- orbax re-raises the writer thread's error
      raise self._failed(e) from e
    self._pending = None

  def _failed(self, error: BaseException | None, step: int | None = None) -> CheckpointSaveError:
    """The error for the pending save (or `step`), whose partial write is removed (orbax never
    commits it); `error` None: it failed on another process."""
    step, self._pending = self._pending if step is None else step, None
    cause = f": {_os_cause(error)}" if error is not None else None
    if self._barrier is not None:  # the other processes stop too, and all name the same cause
      if error is not None and not isinstance(error, multihost.Broken):
        self._break(error)
      broken = self._barrier.broken()
      if broken is not None:
        cause = f" on process {broken.process}: {broken.why}"
    self._failed_steps.add(step)
    self._remove_partial(step)
    self.manager.reload()
    free = shutil.disk_usage(self.directory).free
    return self._error(
        f"saving step {step} in {self.directory} failed{cause} (a checkpoint "
        f"takes {self._needed:,} bytes, {free:,} are free there)",
        self._needed,
    )

  def _error(self, what: str, needed: int) -> CheckpointSaveError:
    good = self.latest_step()
    return CheckpointSaveError(
        what
        + (
            f". The last good checkpoint, step {good}, is kept"
            if good is not None
            else ". There is no earlier checkpoint"
        )
        + f"; free at least {needed:,} bytes there and rerun the same command to resume"
    )

  def restore_part(self, step: int, name: str, abstract_part: Any) -> Any:
    """One top-level field of step `step`'s state, the rest left unread (an optimizer's moments
    are twice the parameters' bytes).

    Args:
      step: a committed step.
      name: the field, e.g. 'params' (a `TrainState`'s).
      abstract_part: the field's structure and shapes as saved, with the dtypes and shardings
        wanted (`jax.ShapeDtypeStruct` leaves): a leaf saved in another dtype is cast to it as
        it is read, so the field is never held in its saved dtype.

    Returns:
      The field's tree.
    """
    item = {name: abstract_part}
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), abstract_part
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
      restored = reader.restore(
          os.path.join(self.directory, str(step), _ITEM),
          args=ocp.args.PyTreeRestore(item, {name: restore_args}, partial_restore=True),
      )
    return restored[name]

  def restore_latest(
      self, abstract_state: Any, part: tuple[str, Any] | None = None
  ) -> tuple[int, Any] | None:
    """Restores the newest step that restores onto `abstract_state`'s shapes and shardings.

    A newer step that fails (on any process) while an older one restores is corrupt and is set
    aside (left in place by a reader).

    Args:
      abstract_state: the state's structure, shapes, dtypes and shardings (e.g.
        `jax.ShapeDtypeStruct` leaves).
      part: None, or (name, abstract field): read only that field of the state, as
        `restore_part` (its leaves in their own dtypes and shardings); the whole state's
        metadata is still checked against `abstract_state`.

    Returns:
      `(step, state)` of the newest step that restores (with `part`: `(step, the field)`), or
      None when there is no committed step.

    Raises:
      CheckpointMismatchError: no step restores and every step's metadata disagrees with the model
        (a config change).
      RuntimeError: no step restores, for another reason; the newest step's error is its cause.
    """
    failed, first_error, mismatched = [], None, True
    for step in reversed(self.steps()):
      mismatch = self._mismatch(step, abstract_state)
      if mismatch is not None:  # decided from metadata: no array read is started
        logging.warning(
            "checkpoint step %d in %s does not fit the model: %s", step, self.directory, mismatch
        )
        failed.append(step)
        first_error = first_error or ValueError(mismatch)
        continue
      error = None
      try:
        if part is None:
          state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        else:
          state = self.restore_part(step, *part)
      except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many types for bad files
        error = e
      if multihost.any_process(error is not None):  # every process resumes from the same step
        error = error or RuntimeError(f"step {step} does not restore on another process")
        logging.warning(
            "checkpoint step %d in %s does not restore: %s", step, self.directory, error
        )
        failed.append(step)
        first_error, mismatched = first_error or error, False
        continue
      if failed and not self.read_only:
        if jax.process_index() == 0:
          for bad in failed:
            path = os.path.join(self.directory, str(bad))
            logging.warning(
                "checkpoint %s is unreadable; moved to %s and resumed from step %d",
                path,
                _set_aside(path, "corrupt"),
                step,
            )
        multihost.barrier(f"jaxpipe.Checkpointer set aside {self.directory}")
        self.manager.reload()
      return step, state
    if first_error is not None:
      first = (
          str(first_error).strip().splitlines()[0]
          if str(first_error).strip()
          else repr(first_error)
      )
      error = CheckpointMismatchError if mismatched else RuntimeError
      raise error(
          f"no checkpoint in {self.directory} restores onto the current model (steps {failed}); "
          f"the newest failed with: {first}. If the model config changed, use a new --workdir "
          "(or --restart to move the old run aside); if the files are damaged, move those step "
          "directories away"
      ) from first_error
    return None

  def _mismatch(self, step: int, abstract_state: Any) -> str | None:
    """Which array of `abstract_state` the checkpoint holds with another shape or dtype, or lacks
    (or holds beyond it), from `step`'s metadata alone; None when every path pairs up or the
    metadata cannot be read (the restore then reports what is wrong)."""
    try:
      saved = _by_path(self.manager.item_metadata(step).tree)
    except Exception:  # noqa: BLE001 -- missing or unreadable metadata
      return None
    want = _by_path(abstract_state)
    differ = [k for k in want if k in saved and saved[k][1:] != want[k][1:]]
    missing = [k for k in want if k not in saved]
    extra = [k for k in saved if k not in want]
    if not (differ or missing or extra):
      return None
    describe = lambda x: f"{x[0]} {x[1]} {x[2]}"
    if differ:
      name, shape, dtype = want[differ[0]]
      first = (
          f"the checkpoint holds {name} {saved[differ[0]][1]} {saved[differ[0]][2]} where the "
          f"model needs {name} {shape} {dtype}"
      )
    elif missing:
      first = f"the checkpoint has no {describe(want[missing[0]])}"
    else:
      first = f"the checkpoint holds {describe(saved[extra[0]])}, which the model does not have"
    counts = [
        f"{len(x)} {what}"
        for x, what in (
            (differ, "differ in shape or dtype"),
            (missing, "missing"),
            (extra, "extra"),
        )
        if x
    ]
    return f"{first} (of {len(want)} arrays: {', '.join(counts)})"

  def _remove_partial(self, step: int) -> bool:
    """Removes what a failed save of `step` wrote (orbax never commits it);
    True if there was any."""
    found = False
    if jax.process_index() == 0:
      for name in os.listdir(self.directory):
        if name.startswith(f"{step}.orbax-checkpoint-tmp"):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
          found = True
    return found

  def close(self) -> None:
    try:
      self.manager.close()
    finally:
      # tensorstore's other writes of a failed save can still land after its error was raised
      # and the manager closed, recreating the step's temporary directory: remove it until it
      # stays gone for a few tenths of a second (at most a few seconds)
      quiet, deadline = 0, time.monotonic() + 5.0
      while self._failed_steps and quiet < 3 and time.monotonic() < deadline:
        found = [self._remove_partial(step) for step in sorted(self._failed_steps)]
        quiet = 0 if any(found) else quiet + 1
        time.sleep(0.1)
