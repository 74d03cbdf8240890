"""`PipelineSharding`: where a pipelined model's stages, batch and parameters sit on a mesh."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

PyTree = Any


def as_axes(axes: str | Sequence[str] | None) -> tuple[str, ...]:
  """A mesh axis name or a sequence of them as a tuple of names.

  Args:
    axes: one mesh axis name, a sequence of them, or None.

  Returns:
    The names as a tuple; `()` for None.
  """
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def data_axes_of(
    mesh: Mesh, pp_axis: str, data_axes: str | Sequence[str] | None, seq_axes: tuple[str, ...]
) -> tuple[str, ...]:
  """The axes that split the batch.

  Args:
    mesh: the device mesh.
    pp_axis: the mesh axis the stages are placed on.
    data_axes: the batch axes (one name or a sequence of them), or None for the default: every
      mesh axis but `pp_axis` and the sequence axes.
    seq_axes: the sequence (context-parallel) axes.

  Returns:
    The batch axes as a tuple of names.
  """
  if data_axes is None:
    return tuple(a for a in mesh.axis_names if a != pp_axis and a not in seq_axes)
  return as_axes(data_axes)


def param_specs_key(param_specs: PyTree | None) -> tuple | None:
  """A stage's spec pytree as a hashable key.

  Args:
    param_specs: a pytree of PartitionSpec or None leaves, or None.

  Returns:
    `(treedef, leaves)`, a None leaf as `P()`; None for None.

  Raises:
    TypeError: a leaf is neither a PartitionSpec nor None.
  """
  if param_specs is None:
    return None
  leaves, treedef = jax.tree.flatten(param_specs, is_leaf=lambda v: v is None or isinstance(v, P))
  bad = [v for v in leaves if v is not None and not isinstance(v, P)]
  if bad:
    raise TypeError(f"param_specs leaves must be PartitionSpec or None, got {bad[0]!r}")
  return treedef, tuple(P() if v is None else v for v in leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSharding:
  """How a pipelined model is split over a device mesh: stages, batch, sequence, parameters.

  Axis fields take one mesh axis name or a sequence of them and hold a tuple. Spec fields are
  pytrees like the parameters they split (`param_specs` and `grad_specs` like one stage's) of
  PartitionSpec (or None: replicated) leaves over a leaf's own dimensions; the leading [ranks,
  chunks] axes of stage leaves are the executor's. A leaf split over a data axis is sliced there
  (experts over 'ep'); one split over data or sequence axes that the stage gathers is FSDP (the
  gather's transpose sums its gradient); one split over a model axis is that rank's
  tensor-parallel slice. A `grad_specs` entry repeats the `param_specs` one but may add data axes
  on one dimension that one leaves whole: that gradient is then reduce-scattered over them
  instead of summed (ZeRO-2). Instances compare and hash by their mesh, axes and specs, so
  compiled programs are cached per sharding.

  Raises:
    TypeError: `mesh` is not a `jax.sharding.Mesh`, or a spec leaf is not a PartitionSpec or
      None.
  """

  mesh: Mesh  # the device mesh, every axis of type Auto
  pp_axis: str = "pp"  # the mesh axis the stages are placed on
  data_axes: tuple[str, ...] | None = None  # split the batch; None: all but pp and seq axes
  seq_axes: tuple[str, ...] = ()  # split axis 2 of the inputs, the sequence (context parallel)
  model_axes: tuple[str, ...] = ()  # tensor-parallel: their ranks compute one loss together
  param_specs: PyTree | None = None  # splits of one stage's params over data/seq/model axes
  head_specs: PyTree | None = None  # like param_specs, for the loss function's parameters
  embed_specs: PyTree | None = None  # like param_specs, for the embed function's parameters
  grad_specs: PyTree | None = None  # ZeRO-2: param_specs plus data axes to reduce-scatter over

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise TypeError(
          f"PipelineSharding(mesh={_brief(self.mesh)}): the mesh must be a jax.sharding.Mesh"
      )
    if self.data_axes is not None:
      object.__setattr__(self, "data_axes", as_axes(self.data_axes))
    object.__setattr__(self, "seq_axes", as_axes(self.seq_axes))
    object.__setattr__(self, "model_axes", as_axes(self.model_axes))
    # the spec keys once: they validate the specs, and hashing reads them on every lookup
    keys = tuple(
        param_specs_key(s)
        for s in (self.param_specs, self.head_specs, self.embed_specs, self.grad_specs)
    )
    object.__setattr__(self, "_keys", keys)

  @property
  def param_key(self) -> tuple | None:
    """`param_specs` as a `param_specs_key`."""
    return self._keys[0]

  @property
  def head_key(self) -> tuple | None:
    """`head_specs` as a `param_specs_key`."""
    return self._keys[1]

  @property
  def embed_key(self) -> tuple | None:
    """`embed_specs` as a `param_specs_key`."""
    return self._keys[2]

  @property
  def grad_key(self) -> tuple | None:
    """`grad_specs` as a `param_specs_key`."""
    return self._keys[3]

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes that split the batch (`data_axes`, or its default)."""
    return data_axes_of(self.mesh, self.pp_axis, self.data_axes, self.seq_axes)

  @property
  def token_axes(self) -> tuple[str, ...]:
    """Batch then sequence axes: their shards hold different tokens, so sums over the tokens run
    over all of them."""
    return self.batch_axes + self.seq_axes

  @property
  def model_size(self) -> int:
    """The number of model-axis ranks that compute one loss together."""
    return math.prod(self.mesh.shape[a] for a in self.model_axes)

  def local_spec(self, key: tuple | None) -> PyTree:
    """The spec of stage leaves [ranks, chunks, ...] whose own dimensions `key` splits.

    Args:
      key: a `param_specs_key`; None: replicated.

    Returns:
      A pytree of PartitionSpecs over [ranks, chunks, ...], ranks on `pp_axis`; `P(pp_axis)` for
      None.
    """
    if key is None:
      return P(self.pp_axis)
    treedef, leaf_specs = key
    return jax.tree.unflatten(treedef, [P(self.pp_axis, None, *ls) for ls in leaf_specs])

  @staticmethod
  def spec_tree(key: tuple | None) -> PyTree:
    """The PartitionSpec pytree of a `param_specs_key`.

    Args:
      key: a `param_specs_key`, or None (every leaf replicated).

    Returns:
      The pytree of PartitionSpecs, None leaves as `P()`; `P()` for None.
    """
    return P() if key is None else jax.tree.unflatten(key[0], list(key[1]))

  def _identity(self) -> tuple:
    return (self.mesh, self.pp_axis, self.data_axes, self.seq_axes, self.model_axes, self._keys)

  def __eq__(self, other):
    return isinstance(other, PipelineSharding) and self._identity() == other._identity()

  def __hash__(self):
    return hash(self._identity())


def as_sharding(sharding: PipelineSharding | Mesh) -> PipelineSharding:
  """The `sharding` argument of the pipeline's entry points as a `PipelineSharding`.

  Args:
    sharding: a PipelineSharding, or a bare Mesh, which stands for `PipelineSharding(mesh)`
      (the pipeline axis 'pp', every other axis a data axis, every parameter replicated).

  Returns:
    The PipelineSharding.

  Raises:
    TypeError: `sharding` is neither; the one-line message names the value and the fix.
  """
  if isinstance(sharding, PipelineSharding):
    return sharding
  if isinstance(sharding, Mesh):
    return PipelineSharding(sharding)
  raise TypeError(
      f"sharding={_brief(sharding)} ({type(sharding).__name__}): pass "
      "sharding=PipelineSharding(mesh, ...) from jaxpipe.pipeline, or a jax.sharding.Mesh for "
      "PipelineSharding(mesh)"
  )


def _brief(value, width: int = 80) -> str:
  """repr(value) on one line, cut to `width` characters."""
  text = " ".join(repr(value).split())
  return text if len(text) <= width else text[: width - 3] + "..."
