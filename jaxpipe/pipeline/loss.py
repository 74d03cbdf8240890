"""How `value_and_grad` reads a loss: a plain sum, or (sum, weight) divided by the global weight.

The executor applies the loss function to every micro-batch on every data and sequence shard and
adds the results. A loss summed over its batch therefore adds up to the whole batch's sum, as on
one device; a loss written as a mean adds up to a sum of per-shard means, too large by the number
of shards (and, with padding, weighing shards rather than tokens). The (sum, weight) form is
Megatron's global token scaling: the weights (e.g. valid tokens) are added over all micro-batches
and shards, and the summed loss and its gradients are divided by that total once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.pipeline.executor import _depends_on_inputs, io_spec


def _local(
    fn: Callable, mesh: Mesh, data_axes: tuple[str, ...], seq_axes: tuple[str, ...], targets_def
) -> Callable:
  """fn(xs shard, targets shard) -> scalar, as a shard_map over the data and sequence shards."""
  io = io_spec(data_axes, seq_axes)
  in_specs = (io, jax.tree.unflatten(targets_def, [io] * targets_def.num_leaves))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)


def is_weighted(
    loss_fn: Callable,
    mesh: Mesh,
    xs,
    targets,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> bool:
  """Whether `loss_fn(y, target)` returns `(loss_sum, weight)` rather than a scalar sum.

  Traced (not run) on one micro-batch's shard, so collectives over the data and sequence axes
  are allowed.

  Args:
    loss_fn: `(y, target) -> loss` on one micro-batch's shard.
    mesh: the device mesh.
    xs: the first stage's inputs, [microbatches, batch, ...] (the first micro-batch's stands in
      for the stage output y).
    targets: the targets, a pytree of leaves [microbatches, batch, ...].
    data_axes: the mesh axes that split the batch.
    seq_axes: the mesh axes that split the sequence (axis 2).

  Returns:
    True for a pair of scalars `(loss_sum, weight)`, False for a scalar.

  Raises:
    ValueError: `loss_fn` returns anything else, or a weight computed from y.
  """
  found = {}

  def local(xs_shard, targets_shard):
    y, t = xs_shard[0], jax.tree.map(lambda a: a[0], targets_shard)
    out = loss_fn(y, t)
    found["out"] = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), out
    )
    if isinstance(out, tuple) and len(out) == 2:
      found["weight_from_y"] = _depends_on_inputs(
          jax.make_jaxpr(lambda y_: loss_fn(y_, t)[1])(y).jaxpr, [0]
      )[0]
    return jnp.zeros(())

  jax.eval_shape(_local(local, mesh, data_axes, seq_axes, jax.tree.structure(targets)), xs, targets)
  out = found["out"]
  scalar = lambda s: isinstance(s, jax.ShapeDtypeStruct) and s.shape == ()
  if scalar(out):
    return False
  if not (isinstance(out, tuple) and len(out) == 2 and all(map(scalar, out))):
    raise ValueError(
        f"loss_fn must return a scalar (the loss summed over its batch) or a pair of "
        f"scalars (loss_sum, weight), got {out}"
    )
  if found["weight_from_y"]:
    raise ValueError(
        "loss_fn returns (loss_sum, weight) with a weight computed from the stage "
        "output y; compute it from the targets alone (e.g. the mask's sum), it is "
        "the normaliser, not part of the loss"
    )
  return True


@functools.lru_cache(maxsize=64)
def summed(loss_fn: Callable) -> Callable:
  """The loss_sum part of a `(loss_sum, weight)` loss, a stable function (compiled once).

  Args:
    loss_fn: `(y, target) -> (loss_sum, weight)`.

  Returns:
    `(y, target) -> loss_sum`, the same function for the same `loss_fn` (cached).
  """
  return lambda y, target: loss_fn(y, target)[0]


@functools.lru_cache(maxsize=64)
def _weight_program(
    loss_fn: Callable,
    mesh: Mesh,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    targets_def,
) -> Callable:
  def local(xs_shard, targets_shard):
    per_mb = lax.map(
        lambda a: loss_fn(a[0], a[1])[1].astype(jnp.float32), (xs_shard, targets_shard)
    )
    return lax.psum(jnp.sum(per_mb), data_axes + seq_axes)

  return jax.jit(_local(local, mesh, data_axes, seq_axes, targets_def))


def global_weight(
    loss_fn: Callable,
    mesh: Mesh,
    xs,
    targets,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> jax.Array:
  """The weights `loss_fn` returns, added over all micro-batches and data and sequence shards.

  Args:
    loss_fn: `(y, target) -> (loss_sum, weight)` on one micro-batch's shard.
    mesh: the device mesh.
    xs: the first stage's inputs, [microbatches, batch, ...] (each micro-batch's stands in for
      the stage output y).
    targets: the targets, a pytree of leaves [microbatches, batch, ...].
    data_axes: the mesh axes that split the batch.
    seq_axes: the mesh axes that split the sequence (axis 2).

  Returns:
    The total weight, a float32 scalar.
  """
  program = _weight_program(loss_fn, mesh, data_axes, seq_axes, jax.tree.structure(targets))
  return program(xs, targets)


@functools.lru_cache(maxsize=64)
def _mean_probe(
    loss_fn: Callable,
    weighted: bool,
    mesh: Mesh,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    targets_def,
) -> Callable:
  copies = 2 ** (1 + bool(seq_axes))  # the batch doubled, and the sequence slice too

  def twice(a):
    a = jnp.concatenate([a, a], axis=0)
    return jnp.concatenate([a, a], axis=1) if seq_axes and a.ndim > 1 else a

  def local(xs_shard, targets_shard):
    y, t = xs_shard[0], jax.tree.map(lambda a: a[0], targets_shard)
    part = (lambda out: out[0]) if weighted else (lambda out: out)
    once = part(loss_fn(y, t)).astype(jnp.float32)
    more = part(loss_fn(twice(y), jax.tree.map(twice, t))).astype(jnp.float32)
    # a sum grows `copies`-fold; a mean over the batch (or the tokens) stays put or grows less
    ratio = more / jnp.where(once == 0, 1.0, once)
    mean = (jnp.abs(once) > 1e-30) & (jnp.abs(ratio - 1) < jnp.abs(ratio - copies))
    return lax.pmax(mean.astype(jnp.int32), data_axes + seq_axes)

  return jax.jit(_local(local, mesh, data_axes, seq_axes, targets_def))


def check_not_mean(
    loss_fn: Callable,
    weighted: bool,
    mesh: Mesh,
    xs,
    targets,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> None:
  """Checks that `loss_fn` does not average over its shard where the shards' results are added.

  Runs loss_fn on the first micro-batch (its input standing in for y) and on that micro-batch
  doubled: a sum doubles, a mean does not. Only where it can: with more than one data or
  sequence shard and concrete inputs (not under an outer jit), and a loss that accepts the
  doubled shapes; otherwise it returns without a verdict.

  Args:
    loss_fn: `(y, target) -> loss_sum`, or `-> (loss_sum, weight)` on one micro-batch's shard.
    weighted: whether `loss_fn` returns `(loss_sum, weight)` (`is_weighted`); then its
      loss_sum is probed.
    mesh: the device mesh.
    xs: the first stage's inputs, [microbatches, batch, ...] (the first micro-batch's stands in
      for the stage output y).
    targets: the targets, a pytree of leaves [microbatches, batch, ...].
    data_axes: the mesh axes that split the batch.
    seq_axes: the mesh axes that split the sequence (axis 2).

  Raises:
    ValueError: `loss_fn` (its loss_sum part) averages over its batch.
  """
  shards = math.prod(mesh.shape[a] for a in data_axes + seq_axes)
  if shards == 1 or any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((xs, targets))):
    return
  try:
    probe = _mean_probe(loss_fn, weighted, mesh, data_axes, seq_axes, jax.tree.structure(targets))
    mean = bool(probe(xs, targets))
  except Exception:  # a loss tied to its shapes: no verdict
    return
  if mean:
    what = "the loss_sum part of loss_fn" if weighted else "loss_fn"
    raise ValueError(
        f"{what} averages over its batch: doubling one micro-batch left it unchanged. The "
        f"pipeline applies it to each of the {shards} data/sequence shards of every micro-batch "
        "and adds the results, so a mean comes out scaled by the shard count. Return the sum over "
        "the batch, or (loss_sum, weight) such as (masked sum, number of valid tokens) to get the "
        "loss divided by the global weight; pass check_mean=False if this loss is not a mean"
    )
