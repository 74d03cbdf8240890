"""The layout planner (`jaxpipe.planning.layout`) on a jaxpipe config: the planner's model
and layout of a config, its per-device bytes on this machine's XLA:CPU, and the layout search of
`pipeline.auto_layout`.

    python -m jaxpipe.train --config configs/quickstart.py --workdir /tmp/qs_auto \
        --config.pipeline.schedule=auto --config.pipeline.auto_layout=True \
        --config.pipeline.memory_limit_gb=0.03

With `pipeline.auto_layout` the run chooses, among every layout of its devices the planner
considers (tp, pp, cp and dp; `optimizer.shard`; `model.remat`; sequence parallelism; for pp > 1
the schedule and micro-batches), the one with the shortest predicted step whose predicted bytes
per device fit `pipeline.memory_limit_gb`, and keeps the config's own `ep`. Predictions are the
planner's; on CPU host devices its bytes are calibrated against `memory_analysis()`
(`CPU_ACTIVATIONS`, docs/layout_planner.md), on accelerators its GPU defaults apply.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from jaxpipe.models import transformer
from jaxpipe.planning import layout as L
from jaxpipe.training import config as config_lib

CPU_ACTIVATIONS = L.Activations(
    d=7.4,
    attn=2.0,
    ffn=7.25,
    expert_in=7.4,
    scores=2.6,
    logits=0.4,
    work=0.3,
    cp_attn=2.1,
    tp_d=3.5,
    padded_experts=True,
)
"""Copies of each width XLA:CPU keeps per token per layer in float32 for jaxpipe's train step
(no pipeline): fitted once to the quickstart's data-parallel program at batch 8, 16 and 32,
d_ff 768, seq_len 256 and vocab 1,024 (slopes of `memory_analysis()`'s temporaries in tokens,
d_ff, seq_len and vocab); d and attn share one slope (their widths move together in these
shapes). Far more than the 4 + 1 + 3 a GPU keeps: the backward's own temporaries of every layer
are live at once in XLA:CPU's buffer assignment. `tp_d` was fitted once to the quickstart at
tp 2 (the row-parallel partial sums and replicated inputs XLA:CPU keeps beside the reduced
ones); the other tensor-parallel layouts check it."""
CPU_ACTIVATIONS_UNROLLED = L.Activations(
    d=5.6,
    attn=1.5,
    ffn=5.15,
    expert_in=13.5,
    scores=2.0,
    logits=0.9,
    work=0.3,
    cp_attn=0.0,
    tp_d=0.36,
    padded_experts=True,
)
"""The same for a layer stack that runs unrolled (`model.unroll_layers`, `unrolled`): each
layer's residuals stay where it made them instead of in the loop's stacks, so fewer copies are
live. Fitted the same way, to the quickstart with its 4 layers unrolled (dp 8 at batch 8, 16,
32, d_ff 768, seq_len 256, vocabulary 1,024; d and attn in the loop's ratio); `tp_d` to tp 2,
`expert_in` to the MoE quickstart at ep 2. Ulysses' buffers add nothing here (the fit at cp 2
gave -0.1)."""
CPU_UPDATE_BYTES = 1.0  # bytes per parameter XLA:CPU adds for the optimizer update, same fit
CPU_FIXED_BYTES = 40_000  # without a pipeline, per device whatever the shapes: tiny at dp 8
# Host devices are threads of one process: collectives are copies in shared memory. Only the
# ranking matters; the speeds are round figures for a 2-core machine.
CPU_LINK = L.Link("shared memory", 5.0)


def model_of(config: ml_collections.ConfigDict) -> L.Model:
  """The planner's view of a jaxpipe config's model.

  Args:
    config: the run's config.

  Returns:
    The planner's `Model`.

  Raises:
    ConfigError: the model uses latent attention, which the planner does not model.
  """
  m = config.model
  if m.mla is not None:
    raise config_lib.ConfigError(
        "the layout planner models grouped-query attention only, not model.mla (latent "
        "attention); choose the layout yourself (pipeline.auto_layout=False)"
    )
  moe = m.moe
  kw = {}
  if moe is not None:
    kw = dict(
        experts=moe.num_experts,
        top_k=moe.top_k,
        expert_d_ff=moe.d_ff,
        shared_experts=moe.num_shared_experts,
        moe_every=moe.every,
        router_bias=moe.router == "sigmoid",
        capacity_factor=moe.capacity_factor if moe.dispatch == "capacity" else 0.0,
    )
  return L.Model(
      "config",
      m.vocab,
      m.d_model,
      m.n_layers,
      m.n_heads,
      m.n_kv_heads,
      m.head_dim,
      m.d_ff,
      tied_embeddings=m.tied_embeddings,
      qk_norm=m.qk_norm,
      **kw,
  )


def layout_of(config: ml_collections.ConfigDict, mesh_shape: dict) -> L.Layout:
  """The planner's view of a config's layout on a mesh of `mesh_shape`.

  Args:
    config: the run's config.
    mesh_shape: axis sizes.

  Returns:
    The planner's `Layout`; recompute 'full' under pipeline.recompute or model.remat=True.
  """
  p = config.pipeline
  return L.Layout(
      pp=mesh_shape["pp"],
      dp=mesh_shape["dp"],
      tp=mesh_shape["tp"],
      ep=mesh_shape["ep"],
      cp=mesh_shape["cp"],
      schedule=p.schedule,
      microbatches=p.microbatches,
      chunks=None if p.chunks == 1 else p.chunks,
      shard=config.optimizer.shard,
      sp=config.model.sequence_parallel,
      recompute=(
          "full"
          if p.recompute or config.model.remat is True
          else "selective"
          if config.model.remat == "selective"
          else "none"
      ),
  )


def unrolled(config: ml_collections.ConfigDict, mesh_shape: dict) -> bool:
  """Whether the config's train step runs its layer stack unrolled (`model.unroll_layers`).

  Without a pipeline, fsdp or remat, a stack of at most that many layers (MoE: groups).

  Args:
    config: the run's config.
    mesh_shape: axis sizes.

  Returns:
    True if the stack runs unrolled.
  """
  if mesh_shape["pp"] > 1 or config.optimizer.shard == "fsdp":
    return False
  units = config_lib.layer_units(config)
  return units > 1 and transformer.stack_unroll(config_lib.model_config(config), units) == units


def predict(config: ml_collections.ConfigDict, mesh_shape: dict) -> L.Memory:
  """The planner's per-device bytes for a jaxpipe config on XLA:CPU host devices (float32).

  Args:
    config: the run's config.
    mesh_shape: axis sizes.

  Returns:
    The `Memory`, with the optimizer update's bytes in `buffers` and the step's input arrays in
    `batch`.

  Raises:
    LayoutError: a layout the planner finds cannot run the model.
  """
  model, layout = model_of(config), layout_of(config, mesh_shape)
  batch = L.Batch(config.data.batch, config.data.seq_len)
  acts = CPU_ACTIVATIONS
  if unrolled(config, mesh_shape):
    acts = CPU_ACTIVATIONS_UNROLLED
    if layout.shard == "zero2":  # measured: XLA:CPU then keeps the gradients whole, as zero1
      layout = dataclasses.replace(layout, shard="zero1")
  mem = L.memory(model, layout, batch, L.FP32, acts)
  tokens_bytes = 3 * 4 * batch.sequences * batch.seq_len / (layout.dp * layout.ep * layout.cp)
  update = CPU_UPDATE_BYTES * mem.params + (CPU_FIXED_BYTES if layout.pp == 1 else 0)
  return dataclasses.replace(mem, buffers=mem.buffers + update, batch=tokens_bytes)


def cpu_host(devices: int, memory_gb: float) -> L.Cluster:
  """`devices` XLA:CPU host devices of one process, `memory_gb` each (the limit asked for).

  Args:
    devices: host devices.
    memory_gb: memory per device, 10^9 bytes.

  Returns:
    The planner's `Cluster`, one node linked by shared memory.
  """
  return L.Cluster(
      f"{devices} CPU host devices", devices, memory_gb, 0.1, 1.0, devices, CPU_LINK, CPU_LINK
  )


@dataclasses.dataclass(frozen=True)
class Choice:
  """auto_layout's pick: the config fields it sets and a report of the ranking."""

  fields: dict  # dotted config key -> value
  predicted_bytes: float  # per device
  report: str


def with_fields(config: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
  """A copy of the config with dotted `fields` set (a bare key is a pipeline field).

  Args:
    config: the run's config (left unchanged).
    fields: dotted config key -> value, e.g. {'mesh.pp': 2}.

  Returns:
    The changed copy.
  """
  config = config.copy_and_resolve_references()
  for key, value in fields.items():
    section, name = key.split(".", 1) if "." in key else ("pipeline", key)
    if key == "model.remat":  # False, True or 'selective': the copy fixed the field's type
      value = config_dict.FieldReference(value, field_type=object)
    config[section][name] = value
  return config


def _fields(layout: L.Layout) -> dict:
  # the pipeline executor recomputes by pipeline.recompute (it replaces model.remat)
  full = layout.recompute == "full"
  staged = layout.pp > 1
  return {
      "mesh.pp": layout.pp,
      "mesh.dp": layout.dp,
      "mesh.tp": layout.tp,
      "mesh.cp": layout.cp,
      "optimizer.shard": layout.shard,
      "model.sequence_parallel": layout.sp,
      "model.remat": "selective" if layout.recompute == "selective" else full and not staged,
      "pipeline.schedule": layout.schedule if layout.pp > 1 else "1f1b",
      "pipeline.microbatches": layout.microbatches,
      "pipeline.recompute": full and staged,
      "pipeline.auto_layout": False,
  }


def choose_layout(
    config: ml_collections.ConfigDict, devices: int, platform: str = "cpu", top: int = 8
) -> Choice:
  """The fastest layout the planner predicts to fit `pipeline.memory_limit_gb` per device.

  Candidates come from `layout.candidates` with the config's `ep` kept, each priced as jaxpipe
  stores it (the optimizer split over dp x ep x cp, experts over dp x cp; experts whole over
  tp; zero2 with a pipeline holding whole gradients, fsdp gathering one layer at a time:
  `layout.memory`) and checked by the config's own validation (heads, KV heads, d_ff and the
  vocabulary must split over tp, the sequence over cp, the layers into the schedule's stages).
  Among layouts predicted equally fast, the one that changes least wins.

  Args:
    config: the run's config.
    devices: the devices the run has.
    platform: the backend ('cpu': bytes calibrated to XLA:CPU, else the GPU defaults).
    top: rows of the ranking the report shows.

  Returns:
    The `Choice`: the config fields to set, the predicted bytes per device and the report.

  Raises:
    ConfigError: no layout runs the model, or none is predicted to fit; then naming the
      smallest prediction.
  """
  p = config.pipeline
  limit = p.memory_limit_gb * 1e9
  model, batch = model_of(config), L.Batch(config.data.batch, config.data.seq_len)
  cluster = cpu_host(devices, p.memory_limit_gb)
  schedules = tuple(p.auto_schedules) or ("1f1b", "zb-h1")
  ranked = []
  for layout in L.candidates(
      model,
      batch,
      devices,
      devices,
      schedules,
      L.SHARDS,
      L.RECOMPUTE,
      max_microbatches=max(p.auto_microbatches or (8,)),
  ):
    if layout.ep != config.mesh.ep:
      continue
    fields = _fields(layout)
    candidate = with_fields(config, fields)
    try:
      shape = config_lib.validate(candidate, devices, platform)
      mem = predict(candidate, shape) if platform == "cpu" else None
      if mem is None:
        mem = L.memory(model, layout_of(candidate, shape), batch)
      step = L.step_time(model, layout_of(candidate, shape), batch, cluster, L.FP32)
    except (config_lib.ConfigError, L.LayoutError, ValueError):
      continue
    # among layouts predicted equally fast, the one that changes least: no optimizer split,
    # recomputation or model split it does not need
    least = (L.SHARDS.index(layout.shard), L.RECOMPUTE.index(layout.recompute), layout.tp)
    ranked.append((mem.total > limit, round(step.step_s, 6), least, mem.total, layout, fields))
  if not ranked:
    raise config_lib.ConfigError(
        f"pipeline.auto_layout: no layout of {devices} devices runs this model; check the "
        "model's head, KV-head, d_ff and vocabulary sizes against powers of two"
    )
  ranked.sort(key=lambda r: r[:4])
  over, _, _, need, best, fields = ranked[0]
  if over:
    raise config_lib.ConfigError(
        f"pipeline.memory_limit_gb={p.memory_limit_gb:g}: no layout of {devices} devices is "
        f"predicted to fit; the smallest, {best.label()}, needs {need / 1e9:.3g} GB per "
        "device; raise the limit or shrink the batch or the model"
    )
  lines = [f"{'layout':<40} {'GB/device':>10} {'step (relative)':>16}"]
  first = ranked[0][1] or 1.0
  for over_, step_s, _, total, layout, _ in ranked[:top]:
    mark = "  over the limit" if over_ else ""
    lines.append(f"{layout.label():<40} {total / 1e9:>10.4f} {step_s / first:>16.2f}{mark}")
  report = (
      f"auto_layout: {best.label()} (predicted {need / 1e9:.4f} GB per device, limit "
      f"{p.memory_limit_gb:g} GB), fastest predicted of {len(ranked)} layouts\n" + "\n".join(lines)
  )
  return Choice(fields, need, report)
