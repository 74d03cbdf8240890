"""The named device mesh: axes pp, dp, ep, cp, tp, sized from the config."""
from typing import Sequence

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpipe.config import MESH_AXES, mesh_shape

# The batch is split over data and expert ranks (expert ranks act as data ranks outside MoE
# layers), the sequence over context ranks.
BATCH_AXES = ("dp", "ep")


def make_mesh(mesh_cfg: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with every axis of MESH_AXES (size-1 axes included), Auto axis types."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  return jax.make_mesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of `[batch, seq]` arrays: batch over BATCH_AXES, sequence over cp."""
  return NamedSharding(mesh, P(BATCH_AXES, "cp"))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full array on every device."""
  return NamedSharding(mesh, P())
