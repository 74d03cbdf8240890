"""The distributed optimizer (`optimizer.shard`): ZeRO-1, ZeRO-2 and FSDP over the data and
context axes.

  none   every data rank holds the whole parameters, gradients and Adam moments
  zero1  the moments (mu, nu) are split over the data axes; gradients are all-reduced whole,
         each rank updates its slice, the new parameters are all-gathered
  zero2  the gradients are also reduce-scattered onto the moments' split instead of all-reduced
  fsdp   the parameters are stored split too; each layer's weights are all-gathered just
         before use inside the layer scan (again in the backward, never kept as residuals)
         and their gradients reduce-scattered there

The axes the optimizer splits over (`OPTIMIZER_AXES`; "the data axes" below) are the batch's,
`state.BATCH_AXES` (dp, ep), and cp: context-parallel ranks hold the same parameters and sum
their gradients as data ranks do, so Megatron's distributed optimizer splits over dp x cp too.
Expert weights, already split over ep, split over dp and cp only. Each leaf splits along one
dimension: the largest that the data-parallel degree divides among those not already split
(pp's layer axis, ep's expert axis, tp's dimension) and not a layer axis (so that the scan
reads one layer's slice of every rank's shard). A leaf with no such dimension stays whole;
under fsdp a weight matrix like that is refused at the config (`check`), vectors (norm
scales, biases) stay whole.

Without a pipeline, fsdp runs in one shard_map (`losses.context_parallel_loss_and_grads`,
whatever tp and cp are) that takes the parameters split over the data axes and all-gathers them
inside (`gather_local`: the embedding and head at the start, each layer in the layer scan,
`local_layer_scan`), so that the gathers' transposes reduce-scatter the gradients. zero2 there
gathers every parameter at the start on the tensor- and context-parallel paths; on the plain
data-parallel path it is the train step's gradient sharding (`gradient_shardings`). In a
pipeline the executor takes each stage's parameters whole over the data axes under zero1 and
zero2 (and reduce-scatters zero2's gradients), split under fsdp, whose stage gathers each layer
(docs/tensor_parallel.md#distributed-optimizer).
"""

import functools
import math
from typing import Any

import jax
import ml_collections
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.training.state import BATCH_AXES, state_shardings

MODES = ("none", "zero1", "zero2", "fsdp")  # optimizer.shard's values
OPTIMIZER_AXES = BATCH_AXES + ("cp",)  # what the state splits over, outermost first
GATHERED = "fsdp_gathered"  # checkpoint name of a layer's all-gathered weights


def _keys(path) -> list:
  return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def layer_axes(keys: list) -> int:
  """Leading stacked axes of a leaf: the layer (unit) axis, and an MoE group's dense layers.

  Args:
    keys: the leaf's path, as dict keys.

  Returns:
    0 outside `layers`, 2 under a group's `dense` layers, else 1.
  """
  if "layers" not in keys:
    return 0
  return 2 if "dense" in keys else 1


def data_axes(keys: list, sizes: dict[str, int]) -> tuple[str, ...]:
  """The axes (size > 1) a leaf splits over: dp, ep and cp; dp and cp for expert weights.

  Args:
    keys: the leaf's path, as dict keys.
    sizes: axis sizes of the mesh.

  Returns:
    The axes, outermost first (OPTIMIZER_AXES order).
  """
  expert = keys and keys[-1] in moe_lib.EXPERT_WEIGHTS
  axes = tuple(a for a in OPTIMIZER_AXES if not (expert and a == "ep"))
  return tuple(a for a in axes if sizes.get(a, 1) > 1)


def split_dim(keys: list, shape: tuple[int, ...], taken: tuple, degree: int) -> int | None:
  """The dimension a leaf splits along over `degree` data ranks (None: it stays whole).

  The largest free one `degree` divides, the first of equals; layer axes are never free.

  Args:
    keys: the leaf's path, as dict keys.
    shape: the leaf's shape.
    taken: one entry per dimension (possibly fewer); `taken[i]` set: dimension i is split
      already.
    degree: the data ranks the leaf splits over.

  Returns:
    The dimension, or None.
  """
  free = [
      i
      for i in range(layer_axes(keys), len(shape))
      if (i >= len(taken) or taken[i] is None) and shape[i] % degree == 0
  ]
  return max(free, key=lambda i: (shape[i], -i)) if free else None


def data_split(tree: Any, mesh: Mesh, base: Any | None = None) -> Any:
  """NamedShardings of a params-like tree split over the data axes on top of `base`.

  A delayed-scaling scale stays whole (its gradient is an amax, combined by max).

  Args:
    tree: a params-like tree (arrays or shapes).
    mesh: the device mesh (or an abstract one).
    base: the shardings to add the data split to; None: `state_shardings(tree, mesh)`.

  Returns:
    A tree of `NamedSharding`s with the structure of `tree`.
  """
  base = state_shardings(tree, mesh) if base is None else base
  sizes = dict(mesh.shape)

  def split(path, leaf, sharding):
    keys = _keys(path)
    axes = data_axes(keys, sizes)
    degree = math.prod(sizes[a] for a in axes)
    # a delayed-scaling scale's gradient is the amax its GEMMs saw, combined by max: a
    # reduce-scatter would add its slices, so it stays whole
    if degree == 1 or not leaf.shape or fp8_lib.is_state(path):
      return sharding
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    dim = split_dim(keys, leaf.shape, spec, degree)
    if dim is None:
      return sharding
    spec = spec[:dim] + (axes if len(axes) > 1 else axes[0],) + spec[dim + 1 :]
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(split, tree, base)


def train_state_shardings(state: Any, mesh: Mesh, mode: str) -> Any:
  """The TrainState's shardings under `optimizer.shard=mode`.

  `state_shardings`, with the optimizer's moments (every non-scalar leaf of opt_state) split over
  the data axes unless mode is 'none', and the parameters too under 'fsdp'.

  Args:
    state: the TrainState (arrays or shapes).
    mesh: the device mesh.
    mode: one of MODES.

  Returns:
    A tree of `NamedSharding`s with the structure of `state`.
  """
  base = state_shardings(state, mesh)
  if mode == "none":
    return base
  split = data_split(state, mesh, base)

  def pick(path, whole, divided):
    field = _keys(path)[0]
    return divided if field == "opt_state" or (mode == "fsdp" and field == "params") else whole

  return jax.tree_util.tree_map_with_path(pick, base, split)


def gradient_shardings(params: Any, mesh: Mesh, mode: str) -> Any | None:
  """Where the train step puts the gradients.

  Whole over the data axes under zero1 (the all-reduce of ZeRO-1), split like the moments under
  zero2 and fsdp (a reduce-scatter).

  Args:
    params: the params tree (arrays or shapes).
    mesh: the device mesh.
    mode: one of MODES.

  Returns:
    A tree of `NamedSharding`s, or None (mode 'none': wherever the gradient path leaves them).
  """
  if mode == "none":
    return None
  if mode == "zero1":
    return state_shardings(params, mesh)
  return data_split(params, mesh)


def check(config: ml_collections.ConfigDict, shape: dict[str, int]) -> None:
  """optimizer.shard against the mesh and the model.

  Under fsdp every weight matrix must split over the data ranks.

  Args:
    config: the run's config.
    shape: axis sizes of the mesh.

  Raises:
    ValueError: (the config turns it into ConfigError) naming the value and the fix.
  """
  mode = config.optimizer.shard
  if mode != "fsdp":
    return
  cfg = TransformerConfig(**config.model.to_dict())
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
  split = data_split(params, mesh)
  whole = state_shardings(params, mesh)
  for (path, leaf), s, w in zip(
      jax.tree_util.tree_flatten_with_path(params)[0],
      jax.tree.leaves(split),
      jax.tree.leaves(whole),
      strict=True,
  ):
    keys = _keys(path)
    axes = data_axes(keys, shape)
    degree = math.prod(shape[a] for a in axes)
    matrix = len(leaf.shape) - layer_axes(keys) >= 2
    if degree > 1 and matrix and s.spec == w.spec:
      where = " x ".join(f"mesh.{a}" for a in axes)
      raise ValueError(
          f"optimizer.shard='fsdp' splits each weight over the {degree} data-parallel ranks "
          f"({where}), but params{jax.tree_util.keystr(path)} {list(leaf.shape)} has no "
          f"dimension {degree} divides (layer axes and split ones aside); use a data-parallel "
          "size dividing one of its dimensions, or optimizer.shard='zero2'"
      )


# -- fsdp inside a shard_map (every path: the step's shard_map, or the pipeline's stages) -------


def _data_split_of(spec: P) -> tuple[tuple[str, ...], int] | None:
  """(data axes, dimension) of a `gather_specs` entry, None if it splits nothing."""
  for dim, entry in enumerate(spec):
    if entry:
      return ((entry,) if isinstance(entry, str) else tuple(entry)), dim
  return None


def gather_specs(params: Any, mesh: Mesh) -> Any:
  """Per leaf, only the split `data_split` adds to `state_shardings`: what the shard_map gathers.

  Expert weights keep their `ep` split, which is no data split of theirs.

  Args:
    params: the params tree (arrays or shapes).
    mesh: the device mesh.

  Returns:
    A tree of `PartitionSpec`s with the structure of `params`.
  """

  def added(split, base):
    whole = tuple(base.spec) + (None,) * (len(split.spec) - len(base.spec))
    return P(*(s if s != b else None for s, b in zip(split.spec, whole)))

  return jax.tree.map(
      added,
      data_split(params, mesh),
      state_shardings(params, mesh),
      is_leaf=lambda v: isinstance(v, NamedSharding),
  )


def local_specs(params: Any, mesh: Mesh) -> Any:
  """PartitionSpecs of `data_split`: what a shard_map takes fsdp's stored parameters as.

  The tp, ep and pp splits, and the data axes.

  Args:
    params: the params tree (arrays or shapes).
    mesh: the device mesh.

  Returns:
    A tree of `PartitionSpec`s with the structure of `params`.
  """
  return jax.tree.map(lambda s: s.spec, data_split(params, mesh))


def gather_local(tree: Any, specs: Any, lead: int = 0) -> Any:
  """Inside a shard_map: each leaf all-gathered over the data axes `specs` split it on.

  The transpose, in the backward, is the reduce-scatter of its gradient.

  Args:
    tree: this rank's local leaves.
    specs: the tree's `gather_specs`.
    lead: leading axes of the specs that are absent from the leaves (a scan's slice drops the
      layer axis).

  Returns:
    The tree with the split leaves gathered whole over the data axes.
  """

  def one(x, spec):
    split = _data_split_of(spec)
    if split is None:
      return x
    axes, dim = split
    return jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim - lead, tiled=True)

  return jax.tree.map(one, tree, specs, is_leaf=lambda v: isinstance(v, P))


# the gather and what only re-types or casts its output (a varying-axes cast, the compute dtype),
# and the barrier that ties it to the layer's input
_GATHER_CASTS = (
    "all_gather",
    "pbroadcast",
    "pvary",
    "convert_element_type",
    "optimization_barrier",
)


def _save_all_but_local_gathers(prim, *_, **params) -> bool:
  # Residuals are saved as without fsdp, except a layer's gathered weights and what only re-types
  # or casts them: the backward gathers each layer again instead of keeping L whole layers.
  if prim.name == "name":
    return params["name"] != GATHERED
  return prim.name not in _GATHER_CASTS


def gathered_layer(fn, unit_specs: Any, full_remat: bool = False, tie: bool = False):
  """`fn(unit, x, *rest)` for a layer (unit) whose leaves arrive split over the data axes.

  Each leaf is all-gathered just before use, again in the backward (not kept).

  Args:
    fn: the layer, `fn(unit, x, *rest)`, on whole weights.
    unit_specs: the layer's `gather_specs`, with the layer axis (absent from the unit's
      leaves).
    full_remat: the whole layer recomputed in the backward.
    tie: the gather waits on `x` (an optimization barrier). The pipeline needs it: its tick
      loop runs the same layers for every micro-batch, and where XLA unrolls the loop over a
      stage's layers it hoists their gathers out of the tick loop and keeps the whole gathered
      stage through the step. Only under a shard_map without varying-axes checks (the
      executor's): the barrier joins the varying axes of the unit and `x`.

  Returns:
    The checkpointed layer, with `fn`'s signature.
  """

  def gathered(unit, x, *rest):
    if tie:
      unit, x = jax.lax.optimization_barrier((unit, x))
    unit = checkpoint_name(gather_local(unit, unit_specs, lead=1), GATHERED)
    return fn(unit, x, *rest)

  return jax.checkpoint(gathered, policy=None if full_remat else _save_all_but_local_gathers)


def local_layer_scan(cfg: TransformerConfig, body, layer_specs: Any):
  """`body(x, unit, *rest)` for a scan over stacked layers whose leaves arrive split.

  The leaves arrive split over the data axes. Each layer is gathered just before use, again in
  the backward (not kept); with `cfg.remat is True` the whole layer is recomputed.

  Args:
    cfg: the model (its remat).
    body: the scan body on whole weights, `body(x, unit, *rest)`.
    layer_specs: the layers' `gather_specs`.

  Returns:
    The scan body, with `body`'s signature.
  """
  layer = gathered_layer(
      lambda unit, x, *rest: body(x, unit, *rest), layer_specs, cfg.remat is True
  )
  return lambda x, unit, *rest: layer(unit, x, *rest)
