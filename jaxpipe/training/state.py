"""The train state and where it lives: `TrainState`, the optimizer and the state's shardings on
the mesh (the layers' stored order, rank by rank under interleaved and V placements, is
`pipeline_lm.layer_order`)."""

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.models import moe as moe_lib
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.parallel import tensor as tp_lib

# The batch is split over data and expert ranks (expert ranks act as data ranks outside MoE
# layers), the sequence over context ranks; the optimizer's splits run over the same axes.
BATCH_AXES = ("dp", "ep")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # optimizer steps taken so far
  params: dict
  opt_state: optax.OptState
  fp8: Any = None  # model.fp8='delayed': amax histories, `fp8.state_of(params)` leaves [..., 3, H]


def fresh_state(
    cfg: TransformerConfig, optimizer: optax.GradientTransformation, params: dict
) -> TrainState:
  """Step 0 at `params`.

  The optimizer's initial state and, for model.fp8='delayed', zero amax histories (the
  structure every checkpoint of the run holds).

  Args:
    cfg: the model (its fp8 recipe and history length).
    optimizer: the run's optimizer (`make_optimizer`).
    params: the parameters to start from.

  Returns:
    The `TrainState` at step 0.
  """
  history = fp8_lib.init_history(params, cfg.fp8_history) if cfg.fp8 == "delayed" else None
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), history)


def learning_rate(opt: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
  """Linear warm-up to `opt.lr`, then cosine decay to `opt.lr * opt.min_lr_ratio` at `steps`.

  Args:
    opt: the config's `optimizer` section: lr, warmup_steps, min_lr_ratio.
    steps: the run's steps (the decay ends at warmup_steps + 1 if that is later).

  Returns:
    The optax schedule, step -> learning rate.
  """
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=opt.lr,
      warmup_steps=opt.warmup_steps,
      decay_steps=max(steps, opt.warmup_steps + 1),
      end_value=opt.lr * opt.min_lr_ratio,
  )


def _decays(params: dict) -> dict:
  # Norm scales are stacked into 2-D arrays, so decide by name, not by rank.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) != "scale", params
  )


def clip_by_norm(max_norm: float, norm: Callable[[Any], jax.Array]) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` with the norm computed by `norm` (e.g. `Trainer.grad_norm`).

  Args:
    max_norm: updates whose norm reaches this are scaled down to it.
    norm: tree of updates -> its global norm, a scalar.

  Returns:
    The stateless gradient transformation.
  """

  def update(updates, state, params=None):
    del params
    g_norm = norm(updates)
    trigger = g_norm < max_norm
    return (
        jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates
        ),
        state,
    )

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
    opt: ml_collections.ConfigDict, steps: int, norm: Callable[[Any], jax.Array] | None = None
) -> optax.GradientTransformation:
  """AdamW with warm-up + cosine schedule, after clipping by the global norm.

  Args:
    opt: the config's `optimizer` section; clip_norm 0 leaves out the clipping.
    steps: the run's steps (`learning_rate`).
    norm: tree -> global norm for the clipping (`clip_by_norm`); None: optax's over every leaf.

  Returns:
    The optax gradient transformation.
  """
  adamw = optax.adamw(
      learning_rate(opt, steps),
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      mask=_decays,
  )
  if not opt.clip_norm:
    return adamw
  clip = (
      optax.clip_by_global_norm(opt.clip_norm)
      if norm is None
      else clip_by_norm(opt.clip_norm, norm)
  )
  return optax.chain(clip, adamw)


def reorder_layers(tree: Any, order: np.ndarray, size: int | None = None) -> Any:
  """Leaves under a `layers` key (params, gradients, optimizer moments) re-stacked as `leaf[order]`.

  Everything else is unchanged.

  Args:
    tree: a tree of parameter-like leaves.
    order: [n] the entries of the layer axis to take, in order.
    size: the layer axis the tree must have (default len(order), a permutation; an order that
      repeats or drops entries says it).

  Returns:
    The re-stacked tree, each `layers` leaf [n, ...].

  Raises:
    ValueError: a `layers` leaf whose layer axis is not `size` long.
  """
  size = len(order) if size is None else size

  def reorder(path, x):
    keys = [getattr(k, "key", None) for k in path]
    if "layers" not in keys or not getattr(x, "ndim", 0):
      return x
    if x.shape[0] != size:
      raise ValueError(
          f"{jax.tree_util.keystr(path)} has {x.shape[0]} entries on its layer axis, "
          f"the layer order takes {size}; is this tree the model's?"
      )
    return x[order]

  return jax.tree_util.tree_map_with_path(reorder, tree)


def param_axes(
    keys: list, shape: tuple[int, ...], ep_axis: str | None, tp: int, tp_axis: str = "tp"
) -> list:
  """The mesh axis of each dimension of a parameter-like leaf (None: whole), the pipeline's apart.

  MoE expert weights [..., E, in, out] are split on E over `ep_axis`, Megatron's
  tensor-parallel dims over `tp_axis` (`jaxpipe.parallel.tensor.split_dim`). The one partition
  rule that the trainer's storage and the pipeline's stage specs share.

  Args:
    keys: the leaf's path, as dict keys.
    shape: the leaf's shape.
    ep_axis: the expert axis; None: experts not split.
    tp: tensor-parallel ranks.
    tp_axis: the tensor-parallel axis.

  Returns:
    One mesh axis name or None per dimension of `shape`.
  """
  axes = [None] * len(shape)
  if ep_axis is not None and keys and keys[-1] in moe_lib.EXPERT_WEIGHTS:
    axes[-3] = ep_axis
  dim = tp_lib.split_dim(tuple(keys), shape, tp)
  if dim is not None:
    axes[dim] = tp_axis
  return axes


def state_shardings(
    tree: Any, mesh: Mesh, pp_axis: str = "pp", ep_axis: str = "ep", tp_axis: str = "tp"
) -> Any:
  """NamedShardings for a tree holding parameters or their likes (train state, optimizer moments).

  Leaves under a `layers` key are split over `pp_axis` (when it has more than one rank and
  divides the leading axis) on their leading layer axis, so each pipeline rank stores 1/pp of
  the layer stack, its gradients and its optimizer moments; MoE expert weights are split over
  `ep_axis` on their expert axis; attention heads, the SwiGLU hidden width and the vocabulary
  over `tp_axis` (`jaxpipe.parallel.tensor.split_dim`, Megatron's layout); everything else is
  replicated.

  Rank r holds entries [r·L/pp, (r+1)·L/pp) of the layer axis. The Trainer stacks the layers so
  that this block is what rank r runs (`pipeline_lm.layer_order`): the model's order under
  contiguous placements (GPipe, 1F1B, ZB-H1/H2), rank by rank under interleaved and V-shaped
  ones, and rank by rank with every layer twice (L = 2 × the model's) under bidirectional ones
  (Chimera, DualPipe), which run every stage on two ranks.

  Args:
    tree: the tree (arrays or shapes: leaves need `shape`).
    mesh: the device mesh.
    pp_axis: the pipeline axis.
    ep_axis: the expert axis.
    tp_axis: the tensor-parallel axis.

  Returns:
    A tree of `NamedSharding`s with the structure of `tree`.
  """
  pp = mesh.shape[pp_axis] if pp_axis in mesh.axis_names else 1
  has_ep = ep_axis in mesh.axis_names
  tp = mesh.shape[tp_axis] if tp_axis in mesh.axis_names else 1

  def spec(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    axes = param_axes(keys, leaf.shape, ep_axis if has_ep else None, tp, tp_axis)
    if pp > 1 and "layers" in keys and leaf.shape and leaf.shape[0] % pp == 0:
      axes[0] = pp_axis
    while axes and axes[-1] is None:
      axes.pop()
    return NamedSharding(mesh, P(*axes))

  return jax.tree_util.tree_map_with_path(spec, tree)
