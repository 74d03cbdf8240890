"""The gradient computation on each parallel path, chosen from the config by
`make_loss_and_grads`:

  loss_and_grads(params, batch) -> (loss, grads, metrics)

`batch` holds global `[batch, seq]` arrays (`tokens`, `targets`, `mask`, and for rows packed from
several documents `segment_ids` and `positions`, see `packed`); `loss` is the masked
cross-entropy divided by the global number of valid tokens (all micro-batches, all data ranks, as
Megatron does); `metrics` is a dict of scalars (at least `tokens`, that count). Everything around
it (optimizer, state, sharding, checkpoints) stays the same whichever function is chosen.

With MoE layers every path (data/expert-parallel, pipeline, context-parallel) differentiates the
same objective,

  cross-entropy summed over valid tokens / valid tokens  +  mean over micro-batches of
  sum over MoE layers of (lb_loss_coef · load-balancing loss + z_loss_coef · z-loss),

each micro-batch's auxiliary losses computed over all of its tokens (on every data rank). This is
Megatron's convention (`MoEAuxLossAutoScaler` scaled by 1/micro-batches): the coefficients weigh
the aux losses exactly as configured, whatever the padding and the micro-batch count. Weighting
them by valid tokens instead would make their strength follow the padding although padded tokens
are routed (and fill expert buffers) like the others. The reported `loss` is the cross-entropy
alone on every path, comparable with dense models and with `Trainer.evaluate`; every MoE path
also reports `moe_aux_loss` and the routing statistics (`moe.train_metrics`), from which the
train step moves the sigmoid router's balancing biases. `moe.aux_objective` is the aux term; with
`moe.lb_loss_form='pooled'` (the plain path only: pp = cp = tp = 1, optimizer.shard not 'fsdp')
its load-balancing part is transformers' form,
pooled over the layers.
"""

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import mtp as mtp_lib
from jaxpipe.models import transformer
from jaxpipe.models.attention import context_parallel
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.parallel.tensor import tensor_parallel
from jaxpipe.parallel.ulysses import positions_local
from jaxpipe.training import config as config_lib
from jaxpipe.training import microbatch, zero
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.state import state_shardings

LossAndGrads = Callable[[dict, dict], tuple[jax.Array, dict, dict]]
packed = transformer.packed_keys  # a batch's packed-row keys (segment_ids, positions), checked


def _packed_kwargs(batch: dict) -> dict:
  """`packed(batch)` as the keyword arguments of `transformer.loss` and `loss_and_aux`."""
  keys = packed(batch)
  return {f"{k}_BxL": v for k, v in keys.items()}


def data_parallel_loss_and_grads(cfg: TransformerConfig, microbatches: int = 1) -> LossAndGrads:
  """`jax.value_and_grad` of the whole model; XLA splits the batch over the data axes.

  With `microbatches > 1` the batch is processed in that many slices (gradient accumulation);
  the result equals the single-slice one up to float rounding.

  Args:
    cfg: the model.
    microbatches: slices the batch is processed in.

  Returns:
    `loss_and_grads(params, batch) -> (loss, grads, metrics)` (module docstring): `batch` holds
    global [batch, seq] arrays, `loss` is a scalar, `grads` has the tree of `params`.
  """

  if cfg.mtp_depth:  # its modules' losses beside the main one, as the MoE path adds them
    return moe_loss_and_grads(cfg, None, microbatches)

  def loss_sum(params, batch):
    return transformer.loss(
        cfg, params, batch["tokens"], batch["targets"], batch["mask"], **_packed_kwargs(batch)
    )

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

  def loss_and_grads(params, batch):
    (total, count), grads = microbatch.accumulate(grad_fn, params, batch, microbatches)
    denom = jnp.maximum(count, 1.0)
    return total / denom, fp8_lib.map_grads(lambda g: g / denom, grads), {"tokens": count}

  return loss_and_grads


def moe_loss_and_grads(cfg: TransformerConfig, mesh, microbatches: int = 1) -> LossAndGrads:
  """`data_parallel_loss_and_grads` for an MoE model, experts split over the mesh's `ep` axis,
  or for a model with multi-token prediction.

  Differentiates the mean cross-entropy plus the mean over micro-batches of the MoE layers'
  weighted auxiliary losses (the module docstring's objective), plus with `cfg.mtp_depth` λ/D
  times each prediction module's loss (`mtp.weights`, over the whole batch); reports the
  cross-entropy as `loss`. Metrics add the routing statistics (`moe.train_metrics`), as every
  MoE path does, and `mtp_loss`, the modules' term.

  Args:
    cfg: the model, with MoE layers or prediction modules (or both).
    mesh: the device mesh, with an `ep` axis; None: no experts to split.
    microbatches: slices the batch is processed in.

  Returns:
    `loss_and_grads(params, batch) -> (loss, grads, metrics)` (module docstring): `batch` holds
    global [batch, seq] arrays, `loss` is a scalar, `grads` has the tree of `params`.
  """
  moe_cfg = cfg.moe

  def objective(params, batch, denom, n_tokens):
    kw = _packed_kwargs(batch)
    with moe_lib.expert_parallel(mesh) if mesh is not None else contextlib.nullcontext():
      x, aux = transformer.hidden_and_aux(cfg, params, batch["tokens"], **kw)
      total, _ = transformer.head_loss(cfg, params, x, batch["targets"], batch["mask"])
      ce, terms = total / denom, {}
      if cfg.mtp_depth:
        weights = jnp.swapaxes(batch["mtp_weights"], 0, 1)
        mtp_sum, mtp_aux = mtp_lib.loss(
            cfg,
            params,
            x,
            batch["targets"],
            weights,
            kw.get("positions_BxL"),
            kw.get("segment_ids_BxL"),
        )
        aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux, mtp_aux)
        terms["mtp_loss"] = mtp_sum / n_tokens
    if moe_cfg is not None:
      terms["moe_aux_loss"] = moe_lib.aux_objective(moe_cfg, aux) / microbatches
    return ce + sum(terms.values()), (ce, terms, aux)

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def loss_and_grads(params, batch):
    n_tokens = batch["tokens"].size
    count = jnp.sum(batch["mask"].astype(jnp.float32))
    denom = jnp.maximum(count, 1.0)
    if cfg.mtp_depth:
      batch = {**batch, "mtp_weights": mtp_lib.batch_weights(cfg, batch)}
    (_, (loss, terms, aux)), grads = microbatch.accumulate(
        grad_fn, params, batch, microbatches, denom, n_tokens
    )
    metrics = {"tokens": count}
    if moe_cfg is not None:
      metrics.update(moe_lib.train_metrics(aux, microbatches, n_tokens, moe_cfg.top_k))
    # after the routing statistics: the objective's moe_aux_loss holds the pooled form's lb
    metrics.update(terms)
    return loss, grads, metrics

  return loss_and_grads


def context_parallel_loss_and_grads(
    cfg: TransformerConfig,
    mesh: Mesh,
    microbatches: int = 1,
    *,
    axis_name: str = "cp",
    batch_axes: tuple[str, ...] = ("dp", "ep"),
    tp_axis: str = "tp",
    shard: str = "none",
):
  """The trainer's `loss_and_grads(params, batch)` with the sequence and the layers split.

  The sequence is split over `axis_name` and the layers over `tp_axis` (each when its mesh axis
  has more than one rank).

  Inside one `shard_map` every rank embeds, normalises and runs the MLPs on its own L/P tokens,
  with rotary positions offset to its slice (for packed rows: its slice of the batch's
  `positions`; attention gathers the `segment_ids`); `attention` runs Ulysses (see
  `jaxpipe.models.attention.context_parallel`). Per-rank loss sums leave the shard_map as
  partials and are added outside, so the gradient of the replicated parameters is the sum of
  every rank's contribution whether or not shard_map checks varying axes.

  As in the pipeline path, tokens are weighted by `transformer.mean_weights` and MoE auxiliary
  losses ride on the gradient weighted by the tokens of their micro-batch, so dividing by the
  step's token count gives the trainer's objective; the reported loss is the cross-entropy.
  With MoE layers the metrics add the routing statistics (`moe.train_metrics`), each MoE layer's
  summed over all token shards inside the shard_map.

  Tensor parallelism (`jaxpipe.parallel.tensor`) runs inside the same shard_map: parameters
  arrive split as the trainer stores them (`state.state_shardings`: heads, d_ff and the
  vocabulary over tp, experts over ep), every tp rank sees the same tokens and ends with the
  same loss sum, so the sums leave over the other axes only.

  Args:
    cfg: the model.
    mesh: the device mesh.
    microbatches: slices the batch is processed in.
    axis_name: the mesh axis the sequence is split over.
    batch_axes: the mesh axes the batch is split over.
    tp_axis: the mesh axis the layers are split over.
    shard: `optimizer.shard`. Under 'zero2' and 'fsdp' the parameters arrive split over the
      data axes too (`zero.data_split`) and are all-gathered inside, so that the transposes of
      those gathers reduce-scatter the gradients: under 'zero2' all of them at the start (the
      parameters are stored whole, so the split costs nothing), under 'fsdp' the embedding,
      head and final norm at the start and each layer inside the layer scan (again in the
      backward).

  Returns:
    `loss_and_grads(params, batch) -> (loss, grads, metrics)` (module docstring): `batch` holds
    global [batch, seq] arrays, `loss` is a scalar, `grads` has the tree of `params`.

  Raises:
    ValueError: model.fp8='delayed' with attention='pallas', which this path cannot run.
  """
  if cfg.fp8 == "delayed" and cfg.attention == "pallas":
    # delayed scaling's amaxes leave the shard_map as the scales' cotangents, max-reduced only
    # where it tracks varying axes, which interpreted Pallas kernels need switched off
    raise ValueError(
        "model.fp8='delayed' with attention='pallas' cannot run the shard_map path (pp = 1 "
        "with mesh.cp > 1, mesh.tp > 1 or optimizer.shard='fsdp'); use attention='xla' or "
        "'cudnn', or mesh.pp > 1"
    )
  cp_axis = axis_name if mesh.shape.get(axis_name, 1) > 1 else None
  split = shard in ("zero2", "fsdp")  # parameters taken split over the data axes
  tp = mesh.shape.get(tp_axis, 1)
  spec = P(batch_axes, axis_name)
  every_axis = P(tuple(a for a in mesh.axis_names if a != tp_axis))  # tp ranks: the same sum
  aux_spec = {k: P() for k in moe_lib.AUX_KEYS} if cfg.moe is not None else {}

  def apply_layers(layers, x_BxSxD, positions_S, segment_ids_BxS, layer_specs=None):
    if cfg.moe is None and layer_specs is None:
      return transformer.apply_layers(cfg, layers, x_BxSxD, positions_S, segment_ids_BxS), {}
    if cfg.moe is None:
      body = lambda x, unit, index: (
          transformer.apply_unit(cfg, unit, x, positions_S, True, segment_ids_BxS, index),
          None,
      )
    else:  # transformer.apply_layers, keeping each MoE group's statistics
      body = lambda x, unit, index: transformer.moe_unit(
          cfg, unit, x, positions_S, segment_ids_BxS, index=index
      )
    units = jax.tree.leaves(layers)[0].shape[0]
    unroll = 1  # fsdp: a loop, so that one layer at a time is gathered whole
    if layer_specs is not None:
      body = zero.local_layer_scan(cfg, body, layer_specs)
    else:
      unroll = transformer.stack_unroll(cfg, units)
      if cfg.remat is True:
        body = jax.checkpoint(body)
    xs = (layers, transformer.unit_indices(cfg, units))
    x_BxSxD, aux = jax.lax.scan(lambda x, xs: body(x, *xs), x_BxSxD, xs, unroll=unroll)
    return x_BxSxD, {} if aux is None else aux

  def local_sums(params, tokens_BxS, targets_BxS, weights_BxS, packed_BxS, mtp_w, specs=None):
    layer_specs = None
    if specs is not None and shard == "zero2":  # all gathered here
      params, specs = zero.gather_local(params, specs), None
    if specs is not None:  # fsdp: all but the layers gathered here, each layer in the scan
      outer = {k: v for k, v in params.items() if k != "layers"}
      params = {
          **zero.gather_local(outer, {k: specs[k] for k in outer}),
          "layers": params["layers"],
      }
      layer_specs = specs["layers"]
    with (
        context_parallel(cp_axis),
        tensor_parallel(tp_axis if tp > 1 else None, cfg.sequence_parallel),
    ):
      positions_S = packed_BxS.get("positions")  # this rank's slice of each row's positions
      if positions_S is None and cp_axis is None:
        positions_S = jnp.arange(tokens_BxS.shape[1])
      elif positions_S is None:
        positions_S = positions_local(tokens_BxS.shape[1], axis_name)
      segment_ids_BxS = packed_BxS.get("segment_ids")
      x_BxSxD = transformer.embed_first(cfg, params, tokens_BxS, positions_S, segment_ids_BxS)
      x_BxSxD, aux = apply_layers(
          params["layers"], x_BxSxD, positions_S, segment_ids_BxS, layer_specs
      )
      total, _ = transformer.head_loss(cfg, params, x_BxSxD, targets_BxS, weights_BxS)
      mtp_sum = jnp.zeros((), jnp.float32)
      if cfg.mtp_depth:  # under cp a module reads the next rank's first tokens too
        mtp_sum, mtp_aux = mtp_lib.loss(
            cfg,
            params,
            x_BxSxD,
            targets_BxS,
            jnp.swapaxes(mtp_w, 0, 1),
            positions_S,
            segment_ids_BxS,
            None if cp_axis is None else mtp_lib.ahead_over(cp_axis),
        )
        extra = mtp_sum
        if mtp_aux:  # the modules' MoE aux, weighed as moe_unit weighs the layers'
          extra = extra + mtp_aux["loss"].sum() * x_BxSxD.shape[0] * x_BxSxD.shape[1]
        # on the gradient only: the value stays the cross-entropy every path reports
        total = total + (extra - jax.lax.stop_gradient(extra))
    return total[None], aux, mtp_sum[None]

  def param_specs(params):
    if split:
      return zero.local_specs(params, mesh)
    return jax.tree.map(lambda s: s.spec, state_shardings(params, mesh))

  sharded = lambda params, *args: jax.shard_map(
      functools.partial(local_sums, specs=zero.gather_specs(params, mesh) if split else None),
      mesh=mesh,
      in_specs=(param_specs(params), spec, spec, spec, spec, P(batch_axes, None, axis_name)),
      out_specs=(every_axis, aux_spec, every_axis),
      check_vma=cfg.attention != "pallas",
  )(params, *args)

  def loss_sum(params, batch):
    total, aux, mtp_sum = sharded(
        params,
        batch["tokens"],
        batch["targets"],
        batch["weights"],
        packed(batch),
        batch.get(
            "mtp_weights", jnp.zeros((batch["tokens"].shape[0], 1, batch["tokens"].shape[1]))
        ),
    )
    return jnp.sum(total), (aux, jnp.sum(mtp_sum))

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

  def loss_and_grads(params, batch):
    n_tokens = batch["tokens"].size
    count = jnp.sum(batch["mask"].astype(jnp.float32))
    given = batch
    batch = {
        "tokens": batch["tokens"],
        "targets": batch["targets"],
        "weights": transformer.mean_weights(batch["mask"]),
        **packed(batch),
    }
    if cfg.mtp_depth:  # the whole batch's weights, split by rows as the rows are
      batch["mtp_weights"] = mtp_lib.batch_weights(cfg, given)
    (total, (aux, mtp_sum)), grads = microbatch.accumulate(grad_fn, params, batch, microbatches)
    metrics = {"tokens": count}
    if cfg.moe is not None:
      metrics.update(moe_lib.train_metrics(aux, microbatches, n_tokens, cfg.moe.top_k))
    if cfg.mtp_depth:
      metrics["mtp_loss"] = mtp_sum / n_tokens
    return total / n_tokens, fp8_lib.map_grads(lambda g: g / n_tokens, grads), metrics

  return loss_and_grads


def make_loss_and_grads(
    config: ml_collections.ConfigDict,
    cfg: TransformerConfig,
    mesh_shape: dict[str, int],
    layers_in_placement_order: bool = False,
) -> LossAndGrads:
  """The gradient computation the config asks for.

  The plain path (`data_parallel_loss_and_grads`, or `moe_loss_and_grads` for MoE) at pp = cp =
  tp = 1 without fsdp; the pipeline's at pp > 1; else `context_parallel_loss_and_grads`.

  Args:
    config: the run's config.
    cfg: the model.
    mesh_shape: axis sizes.
    layers_in_placement_order: with pp > 1, params['layers'] are stacked in the schedule's
      `layer_order` (the Trainer's storage), not the model's order.

  Returns:
    `loss_and_grads(params, batch) -> (loss, grads, metrics)` (module docstring): `batch` holds
    global [batch, seq] arrays, `loss` is a scalar, `grads` has the tree of `params`.

  Raises:
    ConfigError: moe.lb_loss_form='pooled' (with a load-balancing coefficient) off the plain
      path.
  """
  shard = config.optimizer.shard
  one_program = mesh_shape["pp"] == 1 and mesh_shape["cp"] == 1 and mesh_shape["tp"] == 1
  # the plain path: XLA splits the batch, the layers need no collectives of their own (zero1
  # and zero2 are the train step's gradient shardings); fsdp gathers each layer in the scan
  plain = one_program and shard != "fsdp"
  if cfg.moe is not None:
    cfg.moe.validate(mesh_shape["ep"])
    if cfg.moe.lb_loss_form == "pooled" and cfg.moe.lb_loss_coef and not plain:
      raise config_lib.ConfigError(
          "model.moe.lb_loss_form='pooled' couples the load-balancing statistics of all MoE "
          "layers, which the pipeline, context- and tensor-parallel paths and "
          "optimizer.shard='fsdp' keep apart (each layer's loss rides on its own gradient); "
          "set --config.model.moe.lb_loss_form=per_layer (see moe.aux_objective for the "
          "factor between the two) or run with mesh.pp = mesh.cp = mesh.tp = 1 and an "
          "optimizer.shard other than 'fsdp'"
      )
    if plain:
      return moe_loss_and_grads(cfg, make_mesh(config.mesh), config.pipeline.microbatches)
  if mesh_shape["pp"] > 1:
    # One scan over the schedule's tick table (jaxpipe.pipeline.executor).
    from jaxpipe.training.pipeline_lm import pipeline_loss_and_grads

    return pipeline_loss_and_grads(
        cfg, config.pipeline, make_mesh(config.mesh), layers_in_placement_order, shard
    )
  if not plain:
    # One shard_map over the mesh: the sequence split over cp for the whole model (Ulysses
    # all-to-alls around attention), the layers over tp (Megatron's collectives), and under
    # fsdp each layer gathered over the data axes inside the layer scan (its gradient
    # reduce-scattered by the gather's transpose), whatever tp and cp are.
    return context_parallel_loss_and_grads(
        cfg, make_mesh(config.mesh), config.pipeline.microbatches, shard=shard
    )
  return data_parallel_loss_and_grads(cfg, config.pipeline.microbatches)
