"""The named mesh built from the config."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from configs import tiny
from jaxpipe.training.config import ConfigError
from jaxpipe.training.mesh import batch_sharding, make_mesh


def _mesh_cfg(**sizes):
  c = tiny.get_config().mesh
  for k, v in sizes.items():
    c[k] = v
  return c


def test_default_mesh_is_data_parallel_over_all_devices():
  mesh = make_mesh(_mesh_cfg())
  assert jax.device_count() == 8
  assert dict(mesh.shape) == {"pp": 1, "dp": 8, "ep": 1, "cp": 1, "tp": 1}
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 5


def test_axis_sizes_and_order():
  mesh = make_mesh(_mesh_cfg(pp=2, ep=2))
  assert mesh.axis_names == ("pp", "dp", "ep", "cp", "tp")
  assert mesh.devices.shape == (2, 2, 2, 1, 1)
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
  mesh = make_mesh(_mesh_cfg(dp=2, cp=2, pp=2))
  assert dict(mesh.shape) == {"pp": 2, "dp": 2, "ep": 1, "cp": 2, "tp": 1}
  mesh = make_mesh(_mesh_cfg(dp=2, cp=2, tp=2))
  assert dict(mesh.shape) == {"pp": 1, "dp": 2, "ep": 1, "cp": 2, "tp": 2}


def test_subset_of_devices():
  mesh = make_mesh(_mesh_cfg(pp=2), devices=jax.devices()[:4])
  assert dict(mesh.shape)["dp"] == 2 and mesh.devices.size == 4


def test_product_must_equal_device_count():
  with pytest.raises(ConfigError, match=r"= 4 devices, but 8 are available"):
    make_mesh(_mesh_cfg(dp=2, cp=2))


def test_batch_is_split_over_data_and_expert_axes():
  mesh = make_mesh(_mesh_cfg(dp=2, ep=2, cp=2))
  sharding = batch_sharding(mesh)
  assert sharding.spec == P(("dp", "ep"), "cp")
  # A [8, 4] batch: each device holds 2 rows (8 / (dp*ep)) and 2 columns (4 / cp).
  assert sharding.shard_shape((8, 4)) == (2, 2)
