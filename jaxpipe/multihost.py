"""What the processes of a multi-process run (`jax.distributed`) agree on; host reads across them.

Each function is a collective: every process calls it at the same point of the program. In a
single process each returns at once, without device work.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (all processes get the same answer)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.max(multihost_utils.process_allgather(np.int32(bool(flag)))))


def barrier(name: str) -> None:
  """Returns once every process has reached `barrier(name)`."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def to_host(tree):
  """numpy copies of a tree of arrays, whole: an array split over devices of other processes
  (pipeline-split layers, say) is gathered from them (`process_allgather`), which `np.asarray`
  and `jax.device_get` cannot do."""
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
    posted = jax.make_array_from_process_local_data(self._posted, np.array([value], np.int32),
                                                    (self._count,))
    previous, self._pending = self._pending, self._max(posted)
    return 0 if previous is None else int(previous)
