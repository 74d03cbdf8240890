"""The named device mesh: axes pp, dp, ep, cp, tp, sized from the config."""

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.training.config import MESH_AXES, mesh_order, mesh_shape
from jaxpipe.training.state import BATCH_AXES


def make_mesh(
    mesh_cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A mesh with every axis of MESH_AXES (size-1 axes included), Auto axis types.

  Devices are laid out in `mesh.order`, outermost first: `jax.make_mesh` places the device list
  (process by process) on that order's axes, then the grid is transposed to MESH_AXES. So the
  outermost axes are the ones that span processes (hosts): with 2 processes of 4 devices and
  pp = 4, dp = 2, order 'pp,...' puts pipeline stages 0-1 on one process and 2-3 on the other,
  order 'dp,...' each data replica's whole pipeline on one process.

  Args:
    mesh_cfg: the config's `mesh` section: axis sizes (dp None: the rest of the devices) and
      order.
    devices: the devices to lay out; None: `jax.devices()`.

  Returns:
    The `Mesh`, axes in MESH_AXES order.

  Raises:
    ConfigError: sizes that do not fit the devices, or a bad order (`mesh_shape`,
      `mesh_order`).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  order = mesh_order(mesh_cfg)
  laid = jax.make_mesh(
      tuple(shape[a] for a in order),
      order,
      devices=devices,
      axis_types=(jax.sharding.AxisType.Auto,) * len(order),
  )
  grid = laid.devices.transpose([order.index(a) for a in MESH_AXES])
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def axes_across_processes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes along which neighbouring devices belong to different processes.

  Args:
    mesh: the device mesh.

  Returns:
    Those axes' names, in the mesh's order.
  """
  process_of = np.vectorize(lambda d: d.process_index)(mesh.devices)
  return tuple(
      a
      for i, a in enumerate(mesh.axis_names)
      if process_of.shape[i] > 1 and np.any(np.diff(process_of, axis=i))
  )


def describe(mesh: Mesh) -> str:
  """The axis sizes and devices, and across processes which axes span them.

  Args:
    mesh: the device mesh.

  Returns:
    One line of text.
  """
  sizes = str(dict(mesh.shape))
  where = f"on {mesh.devices.size} {mesh.devices.flat[0].platform} devices"
  processes = jax.process_count()
  if processes == 1:
    return f"{sizes} {where}"
  across = axes_across_processes(mesh)
  within = [a for a, n in mesh.shape.items() if n > 1 and a not in across]
  return (
      f"{sizes} {where} in {processes} processes x {len(mesh.local_devices)}: across "
      f"processes {', '.join(across) or 'none'}, within each {', '.join(within) or 'none'}"
  )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of `[batch, seq]` arrays: batch over BATCH_AXES, sequence over cp.

  Args:
    mesh: the device mesh.

  Returns:
    The `NamedSharding`.
  """
  return NamedSharding(mesh, P(BATCH_AXES, "cp"))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full array on every device.

  Args:
    mesh: the device mesh.

  Returns:
    The `NamedSharding` with an empty spec.
  """
  return NamedSharding(mesh, P())
