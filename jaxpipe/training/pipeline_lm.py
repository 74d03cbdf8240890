"""The Transformer LM on the pipeline executor: the trainer's `loss_and_grads` when mesh.pp > 1.

Stage s runs layers [s*k, (s+1)*k) (`transformer.apply_unit`: one layer, or one group of
layers ending in an MoE layer, at a time); the first virtual stage of every route also embeds
the tokens and the last applies the final norm, the head and the loss (the executor's
`embed_fn` and `loss_fn`, whose parameters are replicated over the pipeline and whose gradients
are summed over it).

The head weighs each token's cross-entropy by `transformer.mean_weights` (mask · N / valid
tokens, N the step's tokens) and MoE groups attach their auxiliary losses weighted by the N/m
tokens of their micro-batch; the executor sums both over micro-batches and data shards, and
dividing that and the gradients by N gives the trainer's objective (mean cross-entropy plus the
mean over micro-batches of the aux losses) with nothing data-dependent inside the stages. The
reported loss is the cross-entropy alone.

Expert parallelism runs inside the stages: expert weights stay split over `ep` as the trainer
stores them (the executor's `param_specs`), each MoE layer moves its tokens with `all_to_all`
over `ep` to the ranks holding their experts, and expert gradients are reduced over `dp` and
`cp` only (reduce-scattered onto the optimizer's split under zero2 and fsdp).
That collective sits inside the executor's per-tick `lax.switch`, which is safe because the
devices of one ep group share their pp rank, hence their table row, branch and tick.

Context parallelism runs the same way: with mesh.cp > 1 the executor splits every
micro-batch's sequence over `cp` (its `seq_axes`), each stage runs norms and MLPs on its
L/cp tokens with rotary positions offset to its slice, and attention's Ulysses all-to-alls
over `cp` sit inside the branch beside the MoE ones, for the same reason. A ppermute there would
wait for every device of the program, so `cp_overlap` runs its chunked all-to-all form.

Packed rows (the batch's optional `segment_ids` and `positions`, `transformer.packed_keys`)
reach every stage as the executor's side inputs: each stage reads the segment ids and positions
of the micro-batch it runs (its slice of the sequence under cp), so attention stays inside each
document on every rank, and the residuals derived from them are stored like the activations'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import mtp as mtp_lib
from jaxpipe.models import transformer
from jaxpipe.models.attention import context_parallel
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.parallel.tensor import tensor_parallel
from jaxpipe.parallel.ulysses import positions_local
from jaxpipe.pipeline.api import lowered_for, pipeline_value_and_grad
from jaxpipe.pipeline.executor import Model, layered
from jaxpipe.pipeline.ir.schedule import Schedule
from jaxpipe.pipeline.sharding import PipelineSharding, param_specs_key
from jaxpipe.training import config as config_lib
from jaxpipe.training import microbatch, zero
from jaxpipe.training.state import BATCH_AXES, param_axes

CONTEXT_AXIS = "cp"  # mesh axis that splits the sequence
TENSOR_AXIS = "tp"  # mesh axis that splits the layers (Megatron's tensor parallelism)


def lm_schedule(pipeline: ml_collections.ConfigDict, pp: int) -> Schedule:
  """The validated schedule of `config.pipeline` for `pp` ranks (as config validation builds it).

  Args:
    pipeline: the config's `pipeline` section.
    pp: pipeline ranks.

  Returns:
    The validated `Schedule`.

  Raises:
    ConfigError: the schedule cannot be built, or a CSV disagrees with `pp`, the micro-batch
      count or the chunk count.
  """
  return config_lib.pipeline_schedule(pipeline, pp)


@functools.lru_cache(maxsize=16)
def lm_model(
    cfg: TransformerConfig,
    context_axis: str | None = None,
    tensor_axis: str | None = None,
    layer_gather: tuple | None = None,
) -> Model:
  """Stage, embedding and head functions of the LM; cached so compiled programs are reused.

  With `context_axis` (the executor's `seq_axes`) each stage holds a contiguous slice of every
  sequence and attention runs Ulysses over that axis. With `tensor_axis` (the executor's
  `model_axes`) every function runs Megatron's tensor parallelism over it
  (`jaxpipe.parallel.tensor`; with `cfg.sequence_parallel` the activations passed between
  stages hold a 1/tp slice of the sequence). The layers take the executor's side inputs: a dict
  of the micro-batch's packed-row keys (`segment_ids`, `positions`), empty for unpacked rows.

  With `layer_gather` (fsdp: (treedef, leaf specs) of one unit's `zero.gather_specs`, the layer
  axis kept) each unit's parameters arrive split over the data axes and are all-gathered just
  before use, inside the per-tick branch (the devices of a data group share their pp rank),
  and again in the backward (`zero.gathered_layer`: a checkpoint policy keeps no gathered
  weight, and a barrier on the unit's input keeps XLA from hoisting the gathers out of the
  tick loop); the gather's transpose reduce-scatters the unit's gradient over those axes.

  Args:
    cfg: the model's configuration.
    context_axis: the mesh axis that splits the sequence (Ulysses attention), or None.
    tensor_axis: the mesh axis of Megatron's tensor parallelism, or None.
    layer_gather: under fsdp, `(treedef, leaf specs)` of one unit's `zero.gather_specs`; None:
      the units' parameters arrive whole.

  Returns:
    The executor's `Model`: a `layered` stage of units, the embedding and the head's loss, with
    the MoE routing statistics as stage aux (`cfg.moe`), the fp8 scaling state's gradients
    combined by max (`cfg.fp8 == "delayed"`), the packed-row keys as side inputs, and each
    layer's index (`cfg.mixed_layers`).
  """
  placed = lambda: tensor_parallel(tensor_axis, cfg.sequence_parallel)

  def positions_of(side, seq):
    positions_L = side.get("positions")  # this rank's slice of the rows' positions
    if positions_L is None and context_axis is None:
      return jnp.arange(seq)
    if positions_L is None:
      return positions_local(seq, context_axis)
    return positions_L

  def layer_fn(unit, x_BxLxD, side, index=None):
    # a layer, or with cfg.moe a group of layers ending in MoE whose auxiliary loss rides on
    # the gradient of its output and whose routing statistics are the executor's stage aux
    # ppermute has no place in the per-tick branch: cp_overlap runs its chunked all_to_alls
    side = side or {}
    with context_parallel(context_axis, point_to_point=False), placed():
      seq = x_BxLxD.shape[1] * tp_lib.token_split()  # this context rank's tokens
      positions_L = positions_of(side, seq)
      seg = side.get("segment_ids")
      if cfg.moe is None:
        return transformer.apply_unit(cfg, unit, x_BxLxD, positions_L, True, seg, index)
      # The executor seeds each tensor rank's backward with 1/tp of the loss and sums their
      # gradients, so each rank weighs the aux loss by 1/tp of the micro-batch's tokens.
      tokens = x_BxLxD.shape[0] * seq / tp_lib.size()
      return transformer.moe_unit(cfg, unit, x_BxLxD, positions_L, seg, tokens, index)

  def embed_fn(embed_params, xs):
    # with cfg.first_dense, xs holds the tokens and the packed-row keys: the first dense layers
    # run here, on the stage that embeds (`pipeline_lm_inputs`)
    if not cfg.first_dense:
      with placed():
        return transformer.embed(cfg, embed_params, xs)
    with context_parallel(context_axis, point_to_point=False), placed():
      tokens_BxL = xs["tokens"]
      positions_L = positions_of(xs, tokens_BxL.shape[1])
      return transformer.embed_first(
          cfg, embed_params, tokens_BxL, positions_L, xs.get("segment_ids")
      )

  def loss_fn(head_params, x_BxLxD, target):
    # target: `targets`, `mask` (mean-weighted); with cfg.mtp_depth also `mtp_weights` and the
    # packed-row keys (`lm_targets`)
    with placed():
      ce = transformer.head_loss(cfg, head_params, x_BxLxD, target["targets"], target["mask"])[0]
      if not cfg.mtp_depth:
        return ce
    # The prediction modules run here, on the stage that holds the head they share (under cp
    # each slice continued by the next rank's first tokens). Their loss, and their MoE layers'
    # aux weighed as layer_fn weighs the stages', rides on the gradient: the value stays the
    # cross-entropy every path reports.
    with context_parallel(context_axis, point_to_point=False), placed():
      seq = x_BxLxD.shape[1] * tp_lib.token_split()  # this context rank's tokens
      extra, aux = mtp_lib.loss(
          cfg,
          head_params,
          x_BxLxD,
          target["targets"],
          jnp.moveaxis(target["mtp_weights"], 2, 0),  # [B, L, D]: the sequence at axis 2
          positions_of(target, seq),
          target.get("segment_ids"),
          None if context_axis is None else mtp_lib.ahead_over(context_axis),
      )
      if aux:
        extra = extra + aux["loss"].sum() * x_BxLxD.shape[0] * seq / tp_lib.size()
      return ce + (extra - lax.stop_gradient(extra))

  if layer_gather is not None:  # fsdp: each unit gathered just before use, again in the backward
    layer_fn = zero.gathered_layer(layer_fn, jax.tree.unflatten(*layer_gather), tie=True)

  # Unit by unit, so a split backward's W needs no recomputation (the same function as
  # transformer.apply_layers; cfg.remat is replaced by pipeline.recompute here).
  return Model(
      layered(layer_fn),
      loss_fn,
      embed_fn,
      stage_aux=cfg.moe is not None,
      max_grads=fp8_lib.is_state if cfg.fp8 == "delayed" else None,
      side_inputs=True,
      unit_index=cfg.mixed_layers,  # sliding and full layers: each takes its place's kind
  )


def placement_order(schedule: Schedule, units: int) -> np.ndarray | None:
  """The order of the layer stack that puts on each pipeline rank exactly the stages it runs.

  When the stack is split over pp, each rank then holds its stages: stage by stage as
  `Lowered.layout()` lists them, rank by rank. A placement that runs a stage on two ranks
  (bidirectional: Chimera, DualPipe) lists its units twice, one resident copy on each rank that
  runs them.

  Args:
    schedule: the validated schedule.
    units: the entries of the layer stack, a multiple of the schedule's stages.

  Returns:
    The indices into the stack's units, one per stored entry (a unit once per copy of its
    stage); None when that is the model's own order (contiguous placements).
  """
  layout = lowered_for(schedule).layout().ravel()
  if np.array_equal(layout, np.arange(layout.size)):
    return None
  per_stage = units // schedule.num_stages
  return (layout[:, None] * per_stage + np.arange(per_stage)).ravel()


def lm_layer_order(
    cfg: TransformerConfig, pipeline: ml_collections.ConfigDict, pp: int
) -> np.ndarray | None:
  """`placement_order` of the LM's layer stack (an entry per layer, or per moe.every group).

  Args:
    cfg: the model's configuration.
    pipeline: the config's `pipeline` section.
    pp: pipeline ranks.

  Returns:
    The order of the stack's entries, or None for the model's own order.

  Raises:
    ConfigError: the schedule cannot be built (`lm_schedule`).
  """
  return placement_order(lm_schedule(pipeline, pp), cfg.stack_units)


def layer_order(
    config: ml_collections.ConfigDict, cfg: TransformerConfig, mesh_shape: dict[str, int]
) -> np.ndarray | None:
  """The order in which the Trainer stacks params['layers'] (None: the model's own order).

  Under interleaved and V-shaped placements the stages a pipeline rank runs are not one
  contiguous block of the model's layers; stacking them rank by rank instead means the pp split
  of the stack gives each rank exactly its stages, and no parameter moves inside a step.
  Bidirectional placements (Chimera, DualPipe) run every stage on two ranks: the order lists
  each layer twice, a resident copy on each of them.

  Args:
    config: the training config (its `pipeline` section is read).
    cfg: the model's configuration.
    mesh_shape: the mesh's axis sizes, with a `pp` entry.

  Returns:
    The order of the stack's entries (`placement_order`); None for the model's own order, and
    always with `mesh_shape["pp"] == 1`.

  Raises:
    ConfigError: the schedule cannot be built (`lm_schedule`).
  """
  if mesh_shape["pp"] == 1:
    return None
  return lm_layer_order(cfg, config.pipeline, mesh_shape["pp"])


def io_params(params: dict) -> tuple[dict, dict]:
  """The parameters outside the stages: the head's (all but the layer stacks) and the
  embedding's (the embedding, and with `first_dense` the first dense layers, which run with it).

  Args:
    params: the model's parameters.

  Returns:
    `(head_params, embed_params)` for the executor's `loss_fn` and `embed_fn`.
  """
  head = {k: v for k, v in params.items() if k not in ("layers", "first_layers")}
  return head, {k: params[k] for k in ("embed", "first_layers") if k in params}


def lm_targets(cfg: TransformerConfig, split: dict) -> dict:
  """The head's targets (`lm_model`'s loss_fn) from the split batch.

  Args:
    cfg: the model.
    split: leaves [microbatches, batch, ...]: `targets`, `mask` (weighted), and with
      `cfg.mtp_depth` `mtp_weights` ([.., batch, seq, depth]) and any packed-row keys.

  Returns:
    The loss function's target dict.
  """
  keys = ("targets", "mask") + (
      ("mtp_weights", "positions", "segment_ids") if cfg.mtp_depth else ()
  )
  return {k: split[k] for k in keys if k in split}


def stage_param_specs(stage_layers, ep_axis: str | None = "ep", tp: int = 1, tp_axis: str = "tp"):
  """PartitionSpecs over one stage's layer params.

  Expert weights [..., E, in, out] are split on E over `ep_axis`, Megatron's tensor-parallel
  dims over `tp_axis` (`jaxpipe.parallel.tensor.split_dim`).

  Args:
    stage_layers: the stage-stacked layer params, leaves [stages, ...].
    ep_axis: the expert axis; None: experts not split.
    tp: tensor-parallel ranks.
    tp_axis: the tensor-parallel axis.

  Returns:
    A pytree like `stage_layers` of PartitionSpecs that leave out the stage axis.
  """
  return io_param_specs(stage_layers, ep_axis, tp, tp_axis, lead=1)


def io_param_specs(params, ep_axis=None, tp: int = 1, tp_axis: str = "tp", lead: int = 0):
  """PartitionSpecs of parameter leaves, their first `lead` axes left out.

  Args:
    params: a pytree of parameter leaves (arrays or shapes), keyed by dict keys.
    ep_axis: the expert axis; None: experts not split.
    tp: tensor-parallel ranks.
    tp_axis: the tensor-parallel axis.
    lead: the number of leading axes (stacking) the specs leave out.

  Returns:
    A pytree like `params` of PartitionSpecs (`state.param_axes`).
  """

  def spec(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    return P(*param_axes(keys, leaf.shape[lead:], ep_axis, tp, tp_axis))

  return jax.tree_util.tree_map_with_path(spec, params)


def pipeline_loss_and_grads(
    cfg: TransformerConfig,
    pipeline: ml_collections.ConfigDict,
    mesh: Mesh,
    layers_in_placement_order: bool = False,
    shard: str = "none",
):
  """`loss_and_grads(params, batch) -> (loss, grads, metrics)` run as a pipeline.

  Args:
    cfg: the model's configuration; its layer units must split evenly into the schedule's
      stages.
    pipeline: the config's `pipeline` section (schedule, micro-batches, recompute).
    mesh: the device mesh: `pp`, the data axes (dp, ep), `cp` and `tp`; every other axis of
      size 1.
    layers_in_placement_order: params['layers'] (and the layer gradients and per-layer
      statistics returned) are stacked in `placement_order(schedule, units)` where that is not
      None, so that no parameter moves between pipeline ranks inside the step; under
      bidirectional placements that holds each layer twice, and both copies get the sum of
      their gradients.
    shard: `optimizer.shard`. Under 'fsdp' params['layers'] arrive split over the data axes
      (`zero.data_split`, as the Trainer stores them) and each unit is all-gathered inside its
      stage just before use (`lm_model`'s `layer_gather`), its gradient reduce-scattered by the
      gather's transpose; the embedding, final norm and head arrive whole. Under 'zero2' the
      executor reduce-scatters the stage gradients over the data axes (its `grad_specs`)
      instead of all-reducing them.

  Returns:
    `loss_and_grads(params, batch) -> (loss, grads, metrics)`: the loss (the cross-entropy
    alone) and the gradients like params, both divided by the batch's tokens (the fp8
    delayed-scaling state's gradients aside); metrics: `tokens`, and with MoE layers the
    routing statistics of the data/expert-parallel path (`moe.step_metrics`,
    `moe_tokens_per_expert`) from the stages' aux. It raises ValueError when params['layers']
    does not hold the number of entries the step takes.

  Raises:
    ValueError: a mesh axis other than pp, data, context and tensor axes has size > 1, or
      `cfg.n_layers` does not split into the schedule's model stages.
    ConfigError: the schedule cannot be built (`lm_schedule`).
  """
  for axis in mesh.axis_names:
    if axis not in ("pp", CONTEXT_AXIS, TENSOR_AXIS) + BATCH_AXES and mesh.shape[axis] > 1:
      raise ValueError(
          f"mesh.{axis}={mesh.shape[axis]}: the pipeline executor combines pp with "
          f"data ({', '.join(BATCH_AXES)}), context ({CONTEXT_AXIS}) and tensor "
          f"({TENSOR_AXIS}) parallelism only; set mesh.{axis}=1"
      )
  schedule = lm_schedule(pipeline, mesh.shape["pp"])
  stages = schedule.num_stages
  every = cfg.moe.every if cfg.moe is not None else 1
  units = cfg.stack_units  # entries on params['layers'] leading axis
  if units % stages:
    what = f"{units} groups of moe.every={every} layers" if every > 1 else f"{units} layers"
    first = f" after model.first_dense={cfg.first_dense}" if cfg.first_dense else ""
    raise ValueError(
        f"model.n_layers={cfg.n_layers} ({what}{first}) does not split into the "
        f"{stages} model stages of schedule {schedule.name!r}; use a multiple of "
        f"{stages * every}" + (" plus first_dense" if cfg.first_dense else "")
    )
  m = schedule.num_microbatches
  order = placement_order(schedule, units) if layers_in_placement_order else None
  in_placement = order is not None
  entries = order.size // (units // stages) if in_placement else stages  # stage blocks stored
  # each unit's first copy in the stored order (all of them without copies): metrics count once
  once = np.unique(order, return_index=True)[1] if in_placement else None
  seq_axes = (CONTEXT_AXIS,) if mesh.shape.get(CONTEXT_AXIS, 1) > 1 else ()
  tp = mesh.shape.get(TENSOR_AXIS, 1)
  model_axes = (TENSOR_AXIS,) if tp > 1 else ()
  data_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  ep_axis = "ep" if cfg.moe is not None and "ep" in mesh.axis_names else None
  split_specs = gather = None  # zero2, fsdp: stage leaves' data split; fsdp: each unit's gather
  if shard in ("zero2", "fsdp"):
    shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
    # the stored layers' split (`zero.data_split`): the leaves' own dimensions, whatever the
    # number of stacked entries; within a stage the layer axis stays whole
    split_specs = jax.tree.map(
        lambda sp: P(None, *tuple(sp)[1:]),
        zero.local_specs(shapes, mesh)["layers"],
        is_leaf=lambda v: isinstance(v, P),
    )
  if shard == "fsdp":  # hashable, for lm_model's cache
    gather = param_specs_key(zero.gather_specs(shapes, mesh)["layers"])
  model = lm_model(
      cfg,
      seq_axes[0] if seq_axes else None,
      model_axes[0] if model_axes else None,
      layer_gather=gather,
  )

  def loss_and_grads(params, batch):
    stored = jax.tree.leaves(params["layers"])[0].shape[0]
    if stored != (order.size if in_placement else units):
      raise ValueError(
          f"params['layers'] has {stored} entries but this step takes "
          + (
              f"{order.size}, the layers stacked rank by rank (each twice under "
              f"{schedule.name!r}); pass Trainer.stored_params(params)"
              if in_placement
              else f"{units}, one per layer unit in the model's order"
          )
      )
    n_tokens = batch["tokens"].size
    count = jnp.sum(batch["mask"].astype(jnp.float32))
    packed_keys = transformer.packed_keys(batch)
    weighted = {
        "tokens": batch["tokens"],
        "targets": batch["targets"],
        "mask": transformer.mean_weights(batch["mask"]),
        **packed_keys,
    }
    if cfg.mtp_depth:  # the whole batch's, split as the rows are, the sequence at axis 2 (cp)
      weighted["mtp_weights"] = jnp.swapaxes(mtp_lib.batch_weights(cfg, batch), 1, 2)
    split = microbatch.split(weighted, m)  # as every path splits
    stage_params = jax.tree.map(
        lambda a: a.reshape(entries, a.shape[0] // entries, *a.shape[1:]), params["layers"]
    )
    head_params, embed_params = io_params(params)
    xs = split["tokens"]
    if cfg.first_dense:  # the first dense layers run with the embedding, on the packed rows too
      xs = {"tokens": xs, **{k: split[k] for k in packed_keys}}
    total, stage_grads, head_grads, embed_grads, *stage_aux = pipeline_value_and_grad(
        model,
        stage_params,
        xs,
        lm_targets(cfg, split),
        schedule=schedule,
        sharding=PipelineSharding(
            mesh,
            data_axes=data_axes,
            seq_axes=seq_axes,
            model_axes=model_axes,
            param_specs=(
                split_specs if shard == "fsdp" else stage_param_specs(stage_params, ep_axis, tp)
            ),
            head_specs=io_param_specs(head_params, tp=tp),
            embed_specs=io_param_specs(embed_params, tp=tp),
            grad_specs=split_specs if shard == "zero2" else None,
        ),
        head_params=head_params,
        embed_params=embed_params,
        recompute=bool(pipeline.recompute),
        stage_order="placement" if in_placement else "model",
        side_inputs={k: split[k] for k in packed_keys},
    )
    grads = dict(head_grads)
    grads["embed"] = grads["embed"] + embed_grads["embed"]
    if cfg.first_dense:
      grads["first_layers"] = embed_grads["first_layers"]
    grads["layers"] = jax.tree.map(
        lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), stage_grads
    )
    grads = fp8_lib.map_grads(lambda g: g / n_tokens, grads)
    metrics = {"tokens": count}
    if stage_aux:
      # [stage blocks, data shards, units per stage, ...]: MoE statistics are sums over every
      # token shard already, the same on each data shard.
      aux = jax.tree.map(lambda a: a[:, 0].reshape(-1, *a.shape[3:]), stage_aux[0])
      counted = (
          aux if once is None or once.size == order.size else jax.tree.map(lambda a: a[once], aux)
      )  # resident copies: both hold the summed statistics
      metrics.update(moe_lib.train_metrics(counted, m, n_tokens, cfg.moe.top_k))
      metrics["moe_tokens_per_expert"] = aux["tokens_per_expert"]  # the stored order's biases
    return total / n_tokens, grads, metrics

  return loss_and_grads
