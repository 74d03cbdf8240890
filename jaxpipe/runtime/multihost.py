"""What the processes of a multi-process run (`jax.distributed`) agree on; host reads across them.

Each function is a collective: every process calls it at the same point of the program. In a
single process each returns at once, without device work.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process.

  A collective: all processes get the same answer. In a single process it returns at once.

  Args:
    flag: this process's value.

  Returns:
    True if `flag` is true on at least one process.
  """
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.max(multihost_utils.process_allgather(np.int32(bool(flag)))))


def barrier(name: str) -> None:
  """Returns once every process has reached `barrier(name)`.

  Returns at once in a single process.

  Args:
    name: the barrier's name, the same on every process.
  """
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def leave_together(timeout_s: float) -> bool:
  """Holds process 0 until every process has reached `leave_together` (each on its way out of a
  failure they all share), up to `timeout_s`; the others say they are here and return at once.

  Process 0 hosts the coordination service: once it exits, another process still at work (closing
  its checkpointer, printing its error) aborts at its next call to the service, before it has said
  why. So process 0 leaves last: after the others have arrived, and a moment for their exits. A
  process that is stuck, or dead, never arrives: the wait then ends at `timeout_s`. Returns at once
  in a single process; a service already gone ends the wait too.

  Args:
    timeout_s: process 0's longest wait, in seconds.

  Returns:
    True if every process arrived in time (on process 0; True on the others).
  """
  if jax.process_count() == 1:
    return True
  from jax._src import distributed  # the coordination service's client has no public handle

  client = distributed.global_state.client
  here = "jaxpipe/leaving/"
  try:
    client.key_value_set(f"{here}{jax.process_index()}", "")
    if jax.process_index() != 0:
      return True
    deadline, pause = time.monotonic() + timeout_s, 1e-3
    while len(client.key_value_dir_get(here)) < jax.process_count():
      if time.monotonic() > deadline:
        return False
      time.sleep(pause)
      pause = min(2 * pause, 0.05)
  except jax.errors.JaxRuntimeError:  # the service or a peer is gone: nothing left to wait for
    return False
  time.sleep(0.25)  # the others exit as soon as they have said they are here
  return True


def to_host(tree):
  """NumPy copies of a tree of arrays, whole.

  An array split over devices of other processes (pipeline-split layers, say) is gathered from
  them (`process_allgather`), which `np.asarray` and `jax.device_get` cannot do.

  Args:
    tree: a pytree of arrays (`jax.Array` or anything `np.asarray` takes).

  Returns:
    The same tree with every leaf a whole `np.ndarray`.
  """

  def read(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))

  return jax.tree.map(read, tree)


class OneStepLate:
  """The maximum over processes of an integer each process posts once per call, answered one call
  late: call i posts its value and returns the maximum of call i-1's (0 on the first call).

  Reading the reduction posted a step earlier keeps the host from waiting on the step it has just
  dispatched, as a per-step agreement would make it; every process still gets the same answer
  at the same call.
  """

  def __init__(self):
    count = jax.process_count()
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(count)]
    mesh = Mesh(np.array(by_process), ("process", "local"))
    self._count, self._posted = count, NamedSharding(mesh, P("process"))
    self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
    self._pending: jax.Array | None = None

  def __call__(self, value: int) -> int:
    """Posts `value` and returns the maximum over processes of the previous call's values.

    Args:
      value: this process's integer for this call.

    Returns:
      The maximum over processes of the values posted at the previous call; 0 on the first call.
    """
    posted = jax.make_array_from_process_local_data(
        self._posted, np.array([value], np.int32), (self._count,)
    )
    previous, self._pending = self._pending, self._max(posted)
    return 0 if previous is None else int(previous)


class Broken(RuntimeError):
  """A BreakableBarrier was broken by `process`, for the reason `why`."""

  def __init__(self, process: int, why: str):
    super().__init__(f"process {process}: {why}")
    self.process, self.why = process, why


class BreakableBarrier:
  """Barriers between the processes of a run that any process can break: every wait, now or
  later, then raises Broken at once rather than waiting out its timeout for a process that will
  never arrive. Called as `barrier(key=..., timeout_ms=...)` (orbax's BarrierSyncFn); a key may
  be used again: each process's n-th wait on a key meets the others' n-th. A wait that times out
  breaks it too.

  Made by every process with the same `name`; kept in the coordination service's key-value store.
  Each process waits at its barriers one after another, in the same order as the others.
  """

  def __init__(self, name: str):
    from jax._src import distributed  # the coordination service's client has no public handle

    self._client = distributed.global_state.client
    self._root = f"jaxpipe/{name}"
    self._waits: dict[str, int] = {}
    self._arrived: str | None = None  # this process's key at its last barrier
    self._lock = threading.Lock()  # orbax waits from several threads (one at a time)

  def break_(self, why: str) -> None:
    """Breaks the barrier for every process.

    The first process to break it gives the reason; later breaks keep it.

    Args:
      why: the reason, reported by every later wait's `Broken`.
    """
    try:
      self._client.key_value_set(f"{self._root}/broken/first", f"{jax.process_index()} {why}")
    except jax.errors.JaxRuntimeError as e:
      if "ALREADY_EXISTS" not in str(e):
        raise

  def broken(self) -> Broken | None:
    """Who broke the barrier first, and why; None while it holds."""
    for _, value in self._client.key_value_dir_get(f"{self._root}/broken/"):
      process, why = value.split(" ", 1)
      return Broken(int(process), why)
    return None

  def __call__(self, *, key: str, timeout_ms: int) -> None:
    """Waits until every process has reached this barrier.

    Each process's n-th wait on `key` meets the others' n-th.

    Args:
      key: the barrier's key; may be used again.
      timeout_ms: how long to wait for the other processes, in milliseconds.

    Raises:
      Broken: the barrier is broken, by any process, before or during the wait.
      TimeoutError: the others did not arrive within `timeout_ms`; the barrier is then broken for
        every process.
    """
    with self._lock:
      n = self._waits[key] = self._waits.get(key, 0) + 1
    here = f"{self._root}/wait/{key}/{n}/"
    mine = f"{here}{jax.process_index()}"
    self._client.key_value_set(mine, "")
    deadline, pause = time.monotonic() + timeout_ms / 1e3, 1e-3
    while True:
      broken = self.broken()
      if broken is not None:
        raise broken
      if len(self._client.key_value_dir_get(here)) == jax.process_count():
        break
      if time.monotonic() > deadline:  # a later arrival must not pass: gone, and broken
        self._client.key_value_delete(mine)
        why = f"waited {timeout_ms / 1e3:.0f} s at barrier {key!r} (wait {n}) for the others"
        self.break_(why)
        raise TimeoutError(why)
      time.sleep(pause)
      pause = min(2 * pause, 0.05)
    with self._lock:  # all processes have reached this barrier, so all have left the one before
      previous, self._arrived = self._arrived, mine
    if previous is not None:
      self._client.key_value_delete(previous)
