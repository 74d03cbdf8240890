"""`jaxpipe.pipeline.value_and_grad`: any schedule, any stage function, exact gradients."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.pipeline import loss as loss_lib
from jaxpipe.pipeline.executor import (
    ExecSpec,
    Model,
    check_param_specs,
    combines_by_max,
    from_local,
    io_spec,
    is_contiguous,
    make_executor,
    scatter_of,
    to_local,
    with_aux,
)
from jaxpipe.pipeline.ir.lower import Lowered, lower
from jaxpipe.pipeline.ir.schedule import Schedule
from jaxpipe.pipeline.ir.schedules import make_schedule
from jaxpipe.pipeline.sharding import PipelineSharding, as_sharding

PyTree = Any


def resolve_schedule(
    schedule: Schedule | str, *, pp: int, microbatches: int, chunks: int | None = None
) -> Schedule:
  """A Schedule, a generator name, or a path to a torch-format CSV as a validated Schedule.

  Args:
    schedule: a `Schedule`, a schedule name (`make_schedule`), or the path of a torch-format CSV
      (a name ending in .csv, or an existing file).
    pp: pipeline ranks, for a schedule given by name.
    microbatches: micro-batches per step, for a schedule given by name.
    chunks: virtual stages per rank, for a schedule given by name; None: the schedule's own.

  Returns:
    The validated `Schedule`.

  Raises:
    TypeError: `schedule` is none of these.
    FileNotFoundError: a .csv path that does not exist.
    ValueError: an invalid schedule, an unknown name or a bad count.
  """
  if isinstance(schedule, Schedule):
    return schedule.validate()
  if not isinstance(schedule, (str, os.PathLike)):
    raise TypeError(f"schedule={schedule!r}: pass a Schedule, a schedule name or a CSV path")
  path = os.fspath(schedule)
  if path.endswith(".csv") or os.path.isfile(path):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no such schedule file {path!r}")
    return Schedule.from_csv(path)
  return make_schedule(path, pp=pp, microbatches=microbatches, chunks=chunks)


def _key(schedule: Schedule):
  return (schedule.name, schedule.placement, schedule.ranks, schedule.microbatch_route)


_LOWERED: dict = {}


def lowered_for(schedule: Schedule) -> Lowered:
  """`lower(schedule)`, memoised on the schedule's contents.

  Args:
    schedule: a validated schedule.

  Returns:
    The `Lowered` tables.
  """
  key = _key(schedule)
  if key not in _LOWERED:
    if len(_LOWERED) > 256:
      _LOWERED.clear()
    _LOWERED[key] = lower(schedule)
  return _LOWERED[key]


def check_inputs(
    schedule: Schedule,
    mesh: Mesh,
    pp_axis: str,
    stage_params: PyTree,
    xs: PyTree,
    targets: PyTree,
    data_axes: tuple[str, ...],
    seq_axes: tuple[str, ...] = (),
    stage_copies: bool = False,
    side_inputs: PyTree = (),
) -> None:
  """Checks that the schedule, the mesh and the inputs agree.

  Args:
    schedule: the schedule to run.
    mesh: the device mesh, every axis of type Auto.
    pp_axis: the mesh axis the stages are placed on; its size must be the schedule's ranks.
    stage_params: leaves [stages, ...]: one entry per model stage, or per stage copy with
      `stage_copies`.
    xs: leaves [microbatches, batch, ...], the embed function's (or first stage's) inputs.
    targets: leaves [microbatches, batch, ...], the loss function's targets.
    data_axes: the mesh axes that split the batch (axis 1); it must divide over them.
    seq_axes: the mesh axes that split the sequence (axis 2); it must divide over them.
    stage_copies: stage_params holds every copy of a stage the placement has (placement order).
    side_inputs: per-micro-batch side inputs, split as xs is (`Model.side_inputs`).

  Raises:
    ValueError: the first disagreement between the schedule and the inputs, named.
  """
  if pp_axis not in mesh.axis_names:
    raise ValueError(
        f"mesh axes {mesh.axis_names} lack the pipeline axis {pp_axis!r}; name it "
        "or pass pp_axis="
    )
  if schedule.num_ranks != mesh.shape[pp_axis]:
    raise ValueError(
        f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but mesh "
        f"axis {pp_axis!r} has {mesh.shape[pp_axis]} devices; build the schedule "
        f"with pp={mesh.shape[pp_axis]}"
    )
  leaves = jax.tree.leaves(stage_params)
  if not leaves:
    raise ValueError("stage_params has no arrays")
  lead = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
  pl = schedule.placement
  want = pl.num_virtual_stages if stage_copies else schedule.num_stages
  if lead != {want}:
    what = (
        f"holds {want} stage copies ({pl.copies} of each of its {schedule.num_stages} "
        "stages); stack one entry per copy, rank by rank"
        if stage_copies
        else f"has {want} model stages; stack one entry per stage on axis 0"
    )
    raise ValueError(
        f"stage_params leaves have leading sizes {sorted(lead, key=str)} but schedule "
        f"{schedule.name!r} {what}"
    )
  m = schedule.num_microbatches
  for what, axes in (("data_axes", data_axes), ("seq_axes", seq_axes)):
    for a in axes:
      if a not in mesh.axis_names or a == pp_axis or (what == "seq_axes" and a in data_axes):
        raise ValueError(
            f"{what} entry {a!r} must be a mesh axis {mesh.axis_names} other than "
            f"the pipeline axis {pp_axis!r}"
            + (f" and the data axes {data_axes}" if what == "seq_axes" else "")
        )
  explicit = [
      a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Auto
  ]
  if explicit:
    raise ValueError(
        f"mesh axes {explicit} are not Auto; the executor places its inputs itself: "
        "build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * ndim"
    )
  data = math.prod(mesh.shape[a] for a in data_axes)
  seq = math.prod(mesh.shape[a] for a in seq_axes)
  for what, tree in (("xs", xs), ("targets", targets), ("side_inputs", side_inputs)):
    for a in jax.tree.leaves(tree):
      shape = jnp.shape(a)
      if len(shape) < 2 or shape[0] != m:
        raise ValueError(
            f"{what} has shape {shape}; the schedule runs {m} micro-batches, so it "
            f"must be [{m}, batch, ...]"
        )
      if shape[1] % data:
        raise ValueError(
            f"{what} has batch {shape[1]} per micro-batch, not divisible by the "
            f"{data} data-parallel shards of mesh axes {data_axes}"
        )
      if seq_axes and (len(shape) < 3 or shape[2] % seq):
        raise ValueError(
            f"{what} has shape {shape}; its sequence axis (axis 2) must divide into "
            f"the {seq} context-parallel shards of mesh axes {seq_axes}"
        )


def check_model(
    model: Model,
    stage_params: PyTree,
    xs,
    targets,
    head_params: PyTree,
    embed_params: PyTree,
    mesh: Mesh | None = None,
    data_axes: tuple[str, ...] = (),
    seq_axes: tuple[str, ...] = (),
    param_specs: tuple | None = None,
    side_inputs: PyTree = (),
    head_specs: tuple | None = None,
    embed_specs: tuple | None = None,
) -> None:
  """Traces (without compiling) one stage and the loss on one micro-batch to check shapes.

  Given a mesh, the functions are traced inside a `shard_map` over it on the slices the executor
  gives them (batch over `data_axes`, sequence over `seq_axes`, parameter leaves split by
  `param_specs`, a `param_specs_key`; head and embedding parameters by `head_specs` and
  `embed_specs`), so they may use collectives over those axes.

  Args:
    model: the stage, embed and loss functions.
    stage_params: leaves [stages, ...]; one stage's shapes are traced.
    xs: leaves [microbatches, batch, ...], the embed function's (or first stage's) inputs.
    targets: leaves [microbatches, batch, ...], the loss function's targets.
    head_params: the loss function's parameters.
    embed_params: the embed function's parameters.
    mesh: the device mesh to trace on, or None to trace unsplit.
    data_axes: the mesh axes that split the batch (axis 1).
    seq_axes: the mesh axes that split the sequence (axis 2).
    param_specs: a `param_specs_key` of one stage's params, or None: replicated.
    side_inputs: per-micro-batch side inputs, leaves [microbatches, batch, ...] split as xs is.
    head_specs: a `param_specs_key` of `head_params`, or None: replicated.
    embed_specs: a `param_specs_key` of `embed_params`, or None: replicated.

  Raises:
    ValueError: the stage changes its input's shape or dtype, or the loss is not a scalar.
  """
  if mesh is not None:
    if param_specs is None:
      params_spec = P()
    else:
      treedef, leaf_specs = param_specs
      params_spec = jax.tree.unflatten(treedef, [P(None, *ls) for ls in leaf_specs])
    io = io_spec(tuple(data_axes), tuple(seq_axes))
    in_specs = (
        params_spec,
        jax.tree.map(lambda _: io, xs),
        jax.tree.map(lambda _: io, targets),
        *(
            P() if k is None else jax.tree.unflatten(k[0], list(k[1]))
            for k in (head_specs, embed_specs)
        ),
        jax.tree.map(lambda _: io, side_inputs),
    )

    def local(params, xs, targets, head_params, embed_params, side_inputs):
      check_model(model, params, xs, targets, head_params, embed_params, side_inputs=side_inputs)
      return jnp.zeros(())

    jax.eval_shape(
        jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False),
        stage_params,
        xs,
        targets,
        head_params,
        embed_params,
        side_inputs,
    )
    return
  params0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), stage_params)
  x0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), xs)
  t0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), targets)
  if model.embed_fn is not None:
    x0 = jax.eval_shape(model.embed_fn, embed_params, x0)
  side0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), side_inputs)
  stage_fn = with_aux(model.stage_fn, model.stage_aux, model.side_inputs, model.unit_index)
  if model.unit_index:  # stage 0's layers
    side0 = (side0, jax.ShapeDtypeStruct((), jnp.int32))
  y0 = jax.eval_shape(stage_fn, params0, x0, side0)[0]
  if jax.tree.structure(y0) != jax.tree.structure(x0) or (y0.shape, y0.dtype) != (
      x0.shape,
      x0.dtype,
  ):
    raise ValueError(
        f"stage_fn maps one micro-batch of shape {x0.shape} {x0.dtype} to "
        f"{getattr(y0, 'shape', y0)} {getattr(y0, 'dtype', '')}; a pipeline stage "
        "must keep its input's shape and dtype"
    )
  loss = jax.eval_shape(model.loss_fn, head_params, y0, t0)
  if not hasattr(loss, "shape") or loss.shape != ():
    raise ValueError(
        f"loss_fn must return a scalar for one micro-batch, got {getattr(loss, 'shape', loss)}"
    )


def copy_partners(layout: np.ndarray) -> tuple[tuple, tuple] | None:
  """Where the other copy of each rank's chunks lives.

  Every stage must have two copies, and all of a rank's partners must sit on one rank (as in
  bidirectional placements).

  Args:
    layout: the model stage of each rank's chunk, [ranks, chunks] (`Lowered.layout()`).

  Returns:
    `(pairs, chunks)`: the ppermute pairs `(holder, rank)`, one per rank, and the holder's chunk
    for each `[rank][chunk]`; None without copies.

  Raises:
    ValueError: a stage without exactly two copies, a rank whose partners sit on several ranks,
      or holders that are not a permutation of the ranks.
  """
  holders: dict[int, list[tuple[int, int]]] = {}
  for (r, c), stage in np.ndenumerate(layout):
    holders.setdefault(int(stage), []).append((r, c))
  if all(len(h) == 1 for h in holders.values()):
    return None
  partner_rank, partner_chunk = {}, {}
  for stage, h in holders.items():
    if len(h) != 2:
      raise ValueError(
          f"stage {stage} has {len(h)} copies at (rank, chunk) {h}; resident copies "
          "need exactly two of every stage; pass stages in model order"
      )
    for (r, c), (r2, c2) in (h, h[::-1]):
      partner_rank.setdefault(r, set()).add(r2)
      partner_chunk[r, c] = c2
  if any(len(v) != 1 for v in partner_rank.values()):
    raise ValueError(
        f"the copies of rank-local stages {layout.tolist()} sit on several ranks; "
        "resident copies need each rank's partners on one rank; pass stages in "
        "model order"
    )
  holder = {r: v.pop() for r, v in partner_rank.items()}
  if sorted(holder.values()) != sorted(holder):
    raise ValueError(
        f"copy holders {holder} are not a permutation of the ranks; pass stages in model order"
    )
  pairs = tuple((holder[r], r) for r in range(layout.shape[0]))
  chunks = tuple(
      tuple(partner_chunk[r, c] for c in range(layout.shape[1])) for r in range(layout.shape[0])
  )
  return pairs, chunks


def sum_copies(
    tree: PyTree,
    partners: tuple[tuple, tuple],
    mesh: Mesh,
    pp_axis: str,
    spec: PyTree,
    model: Model | None = None,
) -> PyTree:
  """Each copy of a stage's value as the sum of both copies' values.

  One ppermute between the two holders (`copy_partners`); the leaves `model` combines by max
  get their max instead of their sum.

  Args:
    tree: leaves [ranks, chunks, ...], split over `pp_axis` as `spec` says.
    partners: `(pairs, chunks)` from `copy_partners`.
    mesh: the device mesh.
    pp_axis: the mesh axis the stages are placed on.
    spec: the PartitionSpec pytree of `tree`'s leaves.
    model: the model whose `Model.max_grads` picks the leaves combined by max, or None.

  Returns:
    `tree` with both copies of each stage holding the combined value, leaves as in `tree`.
  """
  pairs, chunks = partners
  chunk_of = np.asarray(chunks, np.int32)

  def local(t):
    with jax.named_scope("sum_copies"):
      other = jax.lax.ppermute(t, pp_axis, pairs)
      mine = jnp.asarray(chunk_of)[jax.lax.axis_index(pp_axis)]
      # a + b and b + a round alike: both holders get bit-identical sums
      both = lambda p, a, b: (jnp.maximum if combines_by_max(model, p) else jnp.add)(
          a, jnp.take(b, mine, axis=1)
      )
      return jax.tree_util.tree_map_with_path(both, t, other)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)(tree)


@functools.lru_cache(maxsize=64)
def _program(
    model: Model,
    spec: ExecSpec,
    sharding: PipelineSharding,
    num_stages: int,
    contiguous: bool,
    partners: tuple | None = None,
) -> Callable:
  """The jitted step; `partners` (`copy_partners`): stage copies stored resident, their
  gradients (and aux) summed between their two holders."""
  run = make_executor(model, spec, sharding)
  mesh, pp_axis = sharding.mesh, sharding.pp_axis
  if partners is not None:
    local_spec = sharding.local_spec(sharding.grad_key or sharding.param_key)
    aux_spec = P(pp_axis, None, sharding.token_axes or None)
  # A contiguous layout is fixed by its shape: a reshape, so stage parameters already split
  # over the pipeline axis in stage order need no communication. Other layouts stay arguments.
  fixed = (
      np.arange(spec.num_ranks * spec.chunks, dtype=np.int32).reshape(spec.num_ranks, spec.chunks)
      if contiguous
      else None
  )

  @jax.jit
  def program(table, layout, stage_params, xs, targets, head_params, embed_params, side, stages):
    layout = fixed if contiguous else layout
    local = to_local(stage_params, layout)
    loss, local_grads, head_g, embed_g, *stats = run(
        table, local, xs, targets, head_params, embed_params, side, stages
    )
    if partners is not None:
      local_grads = sum_copies(local_grads, partners, mesh, pp_axis, local_spec, model)
      stats = [sum_copies(s, partners, mesh, pp_axis, aux_spec) for s in stats]
    # copies of a stage (bidirectional schedules) ran different micro-batches: their aux adds up
    return (
        loss,
        from_local(local_grads, layout, num_stages, model),
        head_g,
        embed_g,
        *(from_local(s, layout, num_stages) for s in stats),
    )

  return program


@functools.lru_cache(maxsize=64)
def _headless(loss_fn: Callable) -> Callable:
  return lambda head_params, y, target: loss_fn(y, target)


def pipeline_value_and_grad(
    model: Model,
    stage_params: PyTree,
    xs,
    targets,
    *,
    schedule: Schedule,
    sharding: PipelineSharding | Mesh,
    head_params: PyTree = (),
    embed_params: PyTree = (),
    recompute: bool = False,
    stage_order: str = "model",
    side_inputs: PyTree = (),
):
  """Loss and gradients of a model run by a pipeline schedule; the trainer's path.

  Every micro-batch runs through the schedule's tables: `model.embed_fn` feeds the first stage of
  each route, the stages follow, `model.loss_fn` closes the last. The result equals
  `jax.value_and_grad` of the unpipelined model summed over the micro-batches.

  Args:
    model: the stage, embed and loss functions (`executor.Model`, or `layered` for a stack of
      layers per stage).
    stage_params: leaves [stages, ...], one entry per virtual stage (see `stage_order`).
    xs: leaves [microbatches, batch, ...], the embed function's inputs.
    targets: leaves [microbatches, batch, ...], the loss function's targets.
    schedule: the schedule (`jaxpipe.pipeline.make_schedule`), lowered to tick tables here.
    sharding: where the model sits on the mesh, a `PipelineSharding`: the pipeline axis the
      stages are placed on, the axes that split the batch (by default every mesh axis but the
      pipeline and sequence axes) and the sequence (axis 2 of xs and targets, context
      parallelism: every function sees its slice and may run collectives over them), the
      tensor-parallel model axes, and the splits of the stage, head and embed parameters and of
      the returned stage gradients. A bare Mesh stands for `PipelineSharding(mesh)`.
    head_params: the loss function's parameters, replicated over the pipeline (their gradient
      summed over it).
    embed_params: the embed function's parameters, likewise.
    recompute: rerun each stage's forward in its backward instead of keeping its residuals.
    stage_order: 'model' (stages in model order) or 'placement' (rank by rank, each rank's
      chunks in order, `Lowered.layout()` flattened: a stack split over the pipeline axis sits
      where it runs; a stage that runs on two ranks, as in Chimera and DualPipe, takes both
      copies and returns each the sum of the two copies' gradients).
    side_inputs: with `model.side_inputs`, leaves [microbatches, batch, ...] split as xs is (a
      packed batch's segment ids and positions), passed to every stage undifferentiated.

  Returns:
    (loss, stage grads, head grads, embed grads), and with `model.stage_aux` a fifth item: the
    stages' aux summed over micro-batches, leaves [stages, data shards, ...] (per layer after
    stages for a layered stage; shards over the data axes then the sequence axes), not reduced.

  Raises:
    TypeError: `sharding` is neither a PipelineSharding nor a Mesh.
    ValueError: the schedule, the sharding, the inputs or the model disagree.
  """
  sharding = as_sharding(sharding)
  if stage_order not in ("model", "placement"):
    raise ValueError(f"stage_order={stage_order!r}: use 'model' or 'placement'")
  if jax.tree.leaves(side_inputs) and not model.side_inputs:
    raise ValueError(
        "side_inputs given but the model's stage function takes none; build the Model with "
        "side_inputs=True and a stage (or layer) function (params, x, side)"
    )
  mesh, pp_axis = sharding.mesh, sharding.pp_axis
  data_axes, seq_axes, model_axes = sharding.batch_axes, sharding.seq_axes, sharding.model_axes
  check_inputs(
      schedule,
      mesh,
      pp_axis,
      stage_params,
      xs,
      targets,
      data_axes,
      seq_axes,
      stage_copies=stage_order == "placement",
      side_inputs=side_inputs,
  )
  specs_key, grad_key = sharding.param_key, sharding.grad_key
  if specs_key is not None:
    check_param_specs(specs_key, data_axes, seq_axes, pp_axis, stage_params, model_axes)
  if grad_key is not None:
    check_param_specs(grad_key, data_axes, seq_axes, pp_axis, stage_params, model_axes)
    scatter_of(grad_key, specs_key, sharding.token_axes)
  for key, tree in ((sharding.head_key, head_params), (sharding.embed_key, embed_params)):
    if key is not None:
      check_param_specs(key, data_axes, seq_axes, pp_axis, tree, model_axes)
  check_model(
      model,
      stage_params,
      xs,
      targets,
      head_params,
      embed_params,
      mesh,
      data_axes,
      seq_axes,
      specs_key,
      side_inputs,
      sharding.head_key,
      sharding.embed_key,
  )
  lowered = lowered_for(schedule)
  spec = ExecSpec.covering([lowered], recompute=recompute)
  layout = lowered.layout()
  stages = layout  # the model stage of each rank's chunk, whatever order params come in
  contiguous = is_contiguous(layout) and layout.size == schedule.num_stages
  stored, partners = schedule.num_stages, None
  if stage_order == "placement":
    partners = copy_partners(layout)
    stored = layout.size
    layout, contiguous = np.arange(layout.size, dtype=np.int32).reshape(layout.shape), True
  program = _program(model, spec, sharding, stored, contiguous, partners)
  return program(
      lowered.table,
      layout,
      stage_params,
      xs,
      targets,
      head_params,
      embed_params,
      side_inputs,
      stages,
  )


def value_and_grad(
    stage_fn: Callable,
    stage_params: PyTree,
    xs: jax.Array,
    targets: PyTree,
    loss_fn: Callable,
    *,
    schedule: Schedule | str,
    sharding: PipelineSharding | Mesh,
    chunks: int | None = None,
    recompute: bool = False,
    check_mean: bool = True,
):
  """Pipelined `jax.value_and_grad` of the loss over all micro-batches; -> (loss, grads).

  f applies stage 0, 1, ..., S-1 in turn: `stage_fn(stage_params[s], x) -> x` (same shape).

  `loss_fn(y, target)` sees one micro-batch's slice on one data (and sequence) shard, and the
  results are added over micro-batches and shards. Return either
  - the loss summed (not averaged) over the slice: the result is then
    `jax.value_and_grad(lambda ps: sum_i loss_fn(f(ps, xs[i]), targets[i]))`, as on one device;
  - or a pair (loss_sum, weight), e.g. (masked token losses summed, valid tokens): the summed
    loss and its gradients are divided by the weight summed over all micro-batches and shards,
    the globally normalised loss (Megatron's token scaling; the weight must come from the
    targets, not from y).
  A loss averaged over its slice would come out scaled by the number of shards; with
  `check_mean` (and concrete inputs on a mesh with data or sequence shards) loss_fn is run once
  on a doubled micro-batch and a result that does not grow is refused with a ValueError.
  A stage made of layers is best given as `jaxpipe.pipeline.layered(layer_fn)` with leaves
  [S, layers_per_stage, ...]: split backwards (zero-bubble schedules) then redo no work.

  Args:
    stage_fn: `(params of one stage, x) -> x` of the same shape and dtype.
    stage_params: leaves [S, ...], S the schedule's model stages (pp * chunks for interleaved
      and V schedules; pp for bidirectional ones, whose two copies of each stage get the same
      parameters and summed gradients).
    xs: [microbatches, batch, ...], the first stage's inputs.
    targets: leaves [microbatches, batch, ...], loss_fn's targets.
    loss_fn: `(y, target) -> loss` or `-> (loss_sum, weight)` on one micro-batch's slice.
    schedule: a Schedule, a name (built for the mesh and microbatch count, `chunks` per rank) or
      a torch-format CSV path.
    sharding: a `PipelineSharding` (see `pipeline_value_and_grad`): the batch is split over
      `data_axes` (by default every mesh axis but `pp_axis` and `seq_axes`); `seq_axes` split
      axis 2 of xs and targets instead, for context-parallel stages that run their own
      collectives over them; `param_specs` splits stage_params leaves over data axes,
      `grad_specs` the returned gradients (reduce-scattered over data axes). A bare Mesh
      stands for `PipelineSharding(mesh)`.
    chunks: stages per rank, for a schedule given by name.
    recompute: rerun each stage's forward in its backward instead of keeping its residuals.
    check_mean: refuse a loss_fn that averages over its slice (see above).

  Returns:
    (loss, grads), grads like stage_params.

  Raises:
    TypeError: `sharding` is neither a PipelineSharding nor a Mesh.
    ValueError: the schedule, the sharding, the inputs or loss_fn disagree.
  """
  sharding = as_sharding(sharding)
  mesh, pp_axis = sharding.mesh, sharding.pp_axis
  if pp_axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} lack the pipeline axis {pp_axis!r}")
  m = jnp.shape(xs)[0] if jnp.ndim(xs) else 0
  schedule = resolve_schedule(schedule, pp=mesh.shape[pp_axis], microbatches=m, chunks=chunks)
  seq_axes, data_axes = sharding.seq_axes, sharding.batch_axes
  check_inputs(schedule, mesh, pp_axis, stage_params, xs, targets, data_axes, seq_axes)
  weighted = loss_lib.is_weighted(loss_fn, mesh, xs, targets, data_axes, seq_axes)
  if check_mean:
    loss_lib.check_not_mean(loss_fn, weighted, mesh, xs, targets, data_axes, seq_axes)
  model = Model(stage_fn, _headless(loss_lib.summed(loss_fn) if weighted else loss_fn))
  loss, grads, _, _ = pipeline_value_and_grad(
      model,
      stage_params,
      xs,
      targets,
      schedule=schedule,
      sharding=sharding,
      recompute=recompute,
  )
  if not weighted:
    return loss, grads
  weight = loss_lib.global_weight(loss_fn, mesh, xs, targets, data_axes, seq_axes)
  denom = jnp.where(weight == 0, 1.0, weight)  # nothing weighed: the sum, 0 for a masked loss
  return loss / denom, jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
