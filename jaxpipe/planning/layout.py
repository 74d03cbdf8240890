"""The layout planner's model: per-device bytes and step time of a model x layout x cluster.
No JAX.

`python -m experiments.plan_layout` prints its tables and checks it against compiled programs.

A layout is a mesh (pp, dp, tp, ep, cp), a pipeline schedule with its micro-batch and chunk
counts, an optimizer sharding (none, zero1, zero2, fsdp), sequence parallelism and
recomputation. Per device it holds:

- parameters, gradients and optimizer state, per `Precision` and `optimizer.shard`: with p, g,
  m, o the bytes per parameter of the weights, gradients, master copy and Adam moments, and Nd
  the group jaxpipe's distributed optimizer splits over (`jaxpipe/training/zero.py`: dp x ep x
  cp for dense weights, dp x cp for experts, which ep splits already),
  replicated p + g + m + o, ZeRO-1 p + g + (m + o)/Nd, ZeRO-2 p + (g + m + o)/Nd, ZeRO-3/FSDP
  (p + g + m + o)/Nd (Rajbhandari et al., SC20: 16, 4 + 12/Nd, 2 + 14/Nd, 16/Nd with mixed
  precision). With a pipeline (pp > 1) the executor adds the micro-batches' gradients into a
  whole accumulator and reduce-scatters it after its loop, so there ZeRO-2 holds p + g + g/Nd
  + (m + o)/Nd (the whole gradients and their split copy); FSDP gathers each layer inside its
  stage, as without a pipeline, and only the embedding and head whole. Layers split over pp
  (twice under bidirectional schedules), heads, d_ff and the vocabulary over tp (Megatron),
  routed experts over ep; experts (routed and shared) stay whole over tp, as jaxpipe keeps them;
- activations: what one layer keeps per token for its backward (`Activations`), times the
  tokens of one micro-batch, times the layers of one virtual stage, times the residual slots
  the schedule's executor tables keep in flight (`lower`'s `res_slots`); without a pipeline
  one micro-batch's residuals of every layer (gradient accumulation runs them one at a time);
  plus the stage inputs and cotangents in flight, the larger of a running part's workspace and
  what a split backward's I keeps for its W (`kept_elements`, per layer of a stage and wg slot:
  the same values, held across ticks) and the logits of one micro-batch;
- collective buffers: FSDP's gathered layer (two, one prefetched), the gradient accumulator.

Step time: 6 x active parameters x tokens plus attention's 12 x layers x heads x head_dim x
seq^2/2 per sequence (forward 2 FLOPs per multiply-add, backward twice the forward, causal
half; recomputation adds a forward; MoE at tp > 1 without sp adds tp - 1 copies of the experts'
FLOPs, every tp rank running the same tokens through whole experts) on the chips' peak at an
achievable fraction, stretched by the schedule's bubble (asynchronous makespan of its tables),
plus the communication each axis cannot hide: tp's all-reduces (or all-gather/reduce-scatter
pairs under sequence parallelism) and ep's and cp's all-to-alls are on the critical path;
pipeline sends are; the data-parallel gradient reduction overlaps the backward and only its
excess counts. Each axis runs over
NVLink when it and every axis inside it fit in one node, else over the network.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

SHARDS = ("none", "zero1", "zero2", "fsdp")
RECOMPUTE = ("none", "selective", "full")
AXES = ("tp", "cp", "ep", "dp", "pp")  # innermost (fastest link) first, Megatron's order


class LayoutError(ValueError):
  """A layout that cannot run the model; the message is one line naming the value and the fix."""


# --- the model ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
  """A decoder-only transformer's shape, as the planner needs it."""

  name: str  # for tables
  vocab: int  # vocabulary size
  d_model: int  # residual width
  n_layers: int  # decoder layers
  n_heads: int  # query heads
  n_kv_heads: int  # key/value heads
  head_dim: int  # width of one head
  d_ff: int  # SwiGLU hidden width of the dense FFN
  tied_embeddings: bool = False  # head reuses the embedding matrix
  qk_norm: bool = False  # RMSNorm scales on q and k heads
  experts: int = 0  # routed experts per MoE layer; 0 = dense model
  top_k: int = 0  # experts per token
  expert_d_ff: int = 0  # hidden width of one expert
  shared_experts: int = 0  # always-on experts, fused into one SwiGLU of width n x expert_d_ff
  moe_every: int = 1  # layers k-1, 2k-1, ... are MoE (jaxpipe's model.moe.every)
  dense_first: int = 0  # leading dense layers before the MoE ones (DeepSeek-V3: 3)
  attn_params: int = 0  # weights of one attention block if not GQA's (MLA); 0 = from the shape
  router_bias: bool = False  # a balancing bias per expert (sigmoid router with bias updates)
  capacity_factor: float = 0.0  # capacity dispatch: rows per token = cf x min(top_k, ep); 0 = top_k

  @property
  def moe_layers(self) -> int:
    if not self.experts:
      return 0
    if self.dense_first:
      return self.n_layers - self.dense_first
    return self.n_layers // self.moe_every

  @property
  def attention_params(self) -> int:
    if self.attn_params:
      return self.attn_params
    d, h, g, k = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
    return d * (h + 2 * g) * k + h * k * d

  def layer_params(self, moe: bool) -> dict[str, int]:
    """One layer's weights by how they split.

    jaxpipe keeps every expert whole over tp (`jaxpipe/parallel/tensor.py`).

    Args:
      moe: a MoE layer (else a dense one).

    Returns:
      Parameter counts under 'tp' (heads, d_ff: over tp), 'expert' (routed experts: over ep,
      whole over tp), 'shared' (shared experts' matrices: whole over tp and ep) and 'replicated'
      (norms, router).
    """
    d = self.d_model
    norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
    if not moe:
      return {
          "tp": self.attention_params + 3 * d * self.d_ff,
          "expert": 0,
          "shared": 0,
          "replicated": norms,
      }
    shared = 3 * d * self.shared_experts * self.expert_d_ff
    router = d * self.experts + (self.experts if self.router_bias else 0)
    return {
        "tp": self.attention_params,
        "expert": self.experts * 3 * d * self.expert_d_ff,
        "shared": shared,
        "replicated": norms + router,
    }

  @property
  def embedding_params(self) -> int:
    return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

  @property
  def params(self) -> int:
    """Every parameter, counted once."""
    dense = self.n_layers - self.moe_layers
    total = sum(self.layer_params(False).values()) * dense
    total += sum(self.layer_params(True).values()) * self.moe_layers
    return total + self.embedding_params + self.d_model

  @property
  def active_params(self) -> int:
    """Parameters one token multiplies (the routed experts it uses, not all of them)."""
    if not self.experts:
      return self.params
    unused = (self.experts - self.top_k) * 3 * self.d_model * self.expert_d_ff
    return self.params - unused * self.moe_layers

  def training_flops_per_token(self, seq_len: int) -> float:
    """Forward + backward model FLOPs per token, as `jaxpipe.models.flops` counts them.

    Matmuls, 2 per multiply-add, backward = 2 x forward, causal attention half, with the active
    weights; the embedding lookup is no matmul, the head is.

    Args:
      seq_len: tokens per sequence (attention's cost grows with it).

    Returns:
      The FLOPs of one token.
    """
    matmul = self.active_params - self.embedding_params - self._norm_params
    matmul += self.vocab * self.d_model  # the head
    attn = 2 * 2 * seq_len * self.n_heads * self.head_dim / 2  # scores and values, causal
    return 3 * (2 * matmul + self.n_layers * attn)

  @property
  def _norm_params(self) -> int:
    dense = self.n_layers - self.moe_layers
    rep = self.layer_params(False)["replicated"] * dense
    rep += self.layer_params(True)["replicated"] * self.moe_layers
    return rep + self.d_model


# --- the layout --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a model is split over devices and scheduled."""

  pp: int = 1  # pipeline ranks
  dp: int = 1  # data-parallel ranks
  tp: int = 1  # tensor-parallel ranks (Megatron: heads, d_ff, vocabulary)
  ep: int = 1  # expert-parallel ranks (also split the batch outside MoE layers, as jaxpipe does)
  cp: int = 1  # context-parallel ranks (Ulysses: the sequence, heads around attention)
  schedule: str = "1f1b"  # pipeline schedule (jaxpipe.pipeline.SCHEDULE_NAMES); unused at pp = 1
  microbatches: int = 1  # micro-batches per step (gradient accumulation at pp = 1)
  chunks: int | None = None  # model chunks per rank; None: the schedule's own
  shard: str = "none"  # optimizer sharding over the data-parallel group: SHARDS
  sp: bool = False  # Megatron sequence parallelism (norms and residuals split over tp)
  recompute: str = "none"  # RECOMPUTE: selective drops attention scores, full keeps layer inputs
  # stages of unequal layer counts (the largest ceil(layers / stages), as DeepSeek-V3's 61 layers
  # at pp 16): priced, the busiest stage setting the pace, but not a layout jaxpipe runs
  uneven: bool = False

  @property
  def devices(self) -> int:
    return self.pp * self.dp * self.tp * self.ep * self.cp

  def label(self) -> str:
    parts = [
        f"{a}{getattr(self, a)}" for a in ("tp", "pp", "cp", "ep", "dp") if getattr(self, a) > 1
    ]
    mesh = "x".join(parts) or "1 device"
    sched = ""
    if self.pp > 1:
      v = f" v{self.chunks}" if self.chunks else ""
      sched = f" {self.schedule}{v}"
    extra = [f"m{self.microbatches}"]
    if self.shard != "none":
      extra.append(self.shard)
    if self.sp:
      extra.append("sp")
    if self.recompute != "none":
      extra.append(f"rc-{self.recompute}")
    if self.uneven:
      extra.append("uneven")
    return f"{mesh}{sched} {' '.join(extra)}"


@dataclasses.dataclass(frozen=True)
class Batch:
  """One optimizer step's data."""

  sequences: int  # global batch, sequences per step
  seq_len: int  # tokens per sequence


@dataclasses.dataclass(frozen=True)
class Precision:
  """Bytes per element of what a device holds."""

  param: int = 2  # weights as the matmuls read them
  grad: int = 2  # gradients (as reduced over the data-parallel group)
  master: int = 4  # fp32 master weights; 0 when the weights are already fp32
  moments: int = 8  # Adam's two fp32 moments
  act: int = 2  # activations
  logits: int = 4  # logits and their gradient (fp32 for the loss)

  @property
  def state(self) -> int:
    return self.param + self.grad + self.master + self.moments


MIXED = Precision()  # bf16 weights, fp32 master and moments: 16 bytes per parameter
FP32 = Precision(param=4, grad=4, master=0, moments=8, act=4, logits=4)  # jaxpipe's training today


def zero_bytes_per_param(shard: str, group: int, precision: Precision = MIXED) -> float:
  """Bytes per parameter a device holds for weights, gradients and optimizer state.

  Args:
    shard: the optimizer sharding, one of SHARDS.
    group: Nd, the ranks the optimizer splits over.
    precision: bytes per element of what a device holds.

  Returns:
    p + g + o (none), p + g + o/Nd (zero1), p + (g + o)/Nd (zero2) or (p + g + o)/Nd (fsdp),
    with o the master and moments' bytes.

  Raises:
    LayoutError: an unknown `shard`.
  """
  p, g, o = precision.param, precision.grad, precision.master + precision.moments
  if shard == "none":
    return p + g + o
  if shard == "zero1":
    return p + g + o / group
  if shard == "zero2":
    return p + (g + o) / group
  if shard == "fsdp":
    return (p + g + o) / group
  raise LayoutError(f"optimizer shard {shard!r} is unknown; use one of {', '.join(SHARDS)}")


@dataclasses.dataclass(frozen=True)
class Activations:
  """What one layer keeps for its backward, per token, in multiples of the widths involved.

  Defaults count the tensors a Llama block saves (bf16 on GPU, flash attention): the block's
  input, its two norms' outputs and the residual after attention (4 x d_model, split over tp
  only under sequence parallelism); q, k, v and the attention output (2 x heads x head_dim +
  2 x kv heads x head_dim, split over tp); gate, up and their product (3 x d_ff, split over tp);
  a MoE layer's experts keep gate, up, product and input per routed copy (top_k x (3 x expert
  d_ff + d_model)) and the shared experts 3 x their width. Scores: attention probabilities,
  heads x seq per token, kept only without flash attention (0 here). For Llama-3-8B this is
  34 x d_model bytes per token, Megatron's 34 sbh (Korthikanti et al., 2022) without dropout.
  """

  d: float = 4.0  # copies of d_model
  attn: float = 1.0  # copies of (2 h k + 2 g k)
  ffn: float = 3.0  # copies of d_ff (dense) or of expert_d_ff per routed copy
  expert_in: float = 1.0  # copies of d_model per routed copy (the dispatched token)
  scores: float = 0.0  # copies of heads x seq
  logits: float = 2.0  # copies of vocab per token at the last stage (logits and gradient)
  work: float = 0.0  # pipelined: copies of one layer's residuals a running part adds
  cp_attn: float = 0.0  # cp > 1: extra copies of (2 h k + 2 g k) (Ulysses' all-to-all buffers)
  tp_d: float = 0.0  # tp > 1: extra copies of d_model (partial sums kept beside reduced ones)
  padded_experts: bool = False  # every received row runs through every local expert (masked)

  def layer_elements(self, model: Model, layout: Layout, seq_len: int, moe: bool) -> float:
    """Elements one layer keeps per token of a device's micro-batch (tokens not split by tp).

    Args:
      model: the model's shape.
      layout: its tp, ep, cp, sequence parallelism and recomputation count.
      seq_len: tokens per sequence (for the attention scores).
      moe: a MoE layer (else a dense one).

    Returns:
      The elements per token.
    """
    t, d = layout.tp, model.d_model
    h, g, k = model.n_heads, model.n_kv_heads, model.head_dim
    if layout.recompute == "full":
      return d / (t if layout.sp else 1)
    d_part = self.d * d / (t if layout.sp else 1) + (self.tp_d * d if t > 1 else 0.0)
    attn = self.attn * (2 * h * k + 2 * g * k) / t
    scores = 0.0 if layout.recompute == "selective" else self.scores * h * seq_len / t
    if layout.cp > 1:
      attn += self.cp_attn * (2 * h * k + 2 * g * k) / t
    if moe:  # experts whole over tp: every tp rank runs its tokens' experts (sp: L/tp tokens)
      e, st = layout.ep, (t if layout.sp else 1)
      rows = model.capacity_factor * min(model.top_k, e) if model.capacity_factor else model.top_k
      local = model.experts / e if self.padded_experts else 1
      ffn = rows * (self.ffn * model.expert_d_ff * local + self.expert_in * d) / st
      ffn += self.ffn * model.shared_experts * model.expert_d_ff / st
    else:
      ffn = self.ffn * model.d_ff / t
    return d_part + attn + scores + ffn


GPU_ACTIVATIONS = Activations()


def kept_elements(model: Model, layout: Layout, moe: bool) -> float:
  """Elements a split backward's I keeps for its W per token of a layer.

  As jaxpipe's `split_backward` keeps them: the cotangents at each weight product's output (q,
  k, v; gate and up, of every routed row under MoE, with the router's logits; the two products
  into the residual stream); the norms' scale cotangents are one value per feature and layer,
  left out. Under full recomputation, the layer's output cotangent.

  Args:
    model: the model's shape.
    layout: its tp, ep, sequence parallelism and recomputation.
    moe: a MoE layer (else a dense one).

  Returns:
    The elements per token.
  """
  t, d = layout.tp, model.d_model
  st = t if layout.sp else 1
  if layout.recompute == "full":
    return d / st
  attn = (model.n_heads + 2 * model.n_kv_heads) * model.head_dim / t
  if not moe:
    return attn + 2 * model.d_ff / t + 2 * d / st
  e = layout.ep
  rows = model.capacity_factor * min(model.top_k, e) if model.capacity_factor else model.top_k
  experts = rows * (2 * model.expert_d_ff + d) + model.experts
  shared = 2 * model.shared_experts * model.expert_d_ff
  return attn + d / st + (experts + shared) / st


@dataclasses.dataclass(frozen=True)
class Link:
  """One class of interconnect, as a collective sees it per device."""

  name: str  # for tables
  gbps: float  # GB/s per device, one direction (bus bandwidth of ring collectives)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Devices, their memory and speed, and how they connect."""

  name: str  # for tables
  devices: int  # accelerators in all
  memory_gb: float  # HBM per device, 10^9 bytes
  peak_tflops: float  # dense bf16 peak per device
  mfu_ceiling: float  # the fraction of peak the matmuls reach with no bubble and no exposed comm
  node: int  # devices per node (NVLink domain)
  nvlink: Link  # within a node
  network: Link  # across nodes
  reserve_gb: float = 0.0  # kept free per device (framework, NCCL, fragmentation)


def h200(devices: int) -> Cluster:
  """A cluster of H200 SXM nodes of 8.

  141 GB HBM3e, 989 TFLOP/s dense bf16, NVLink 900 GB/s, 400 Gb/s (50 GB/s) of network per GPU;
  6 GB kept free; matmuls at 60% of peak with no bubble and no exposed communication (an
  assumption: a ceiling near the best published MFUs).

  Args:
    devices: GPUs in all.

  Returns:
    The `Cluster`.
  """
  return Cluster(
      f"{devices} x H200",
      devices,
      141.0,
      989.0,
      0.60,
      8,
      Link("NVLink", 900.0),
      Link("network", 50.0),
      reserve_gb=6.0,
  )


# --- checks ------------------------------------------------------------------------------------


def check(model: Model, layout: Layout, batch: Batch) -> None:
  """Checks that a layout can run the model.

  Args:
    model: the model's shape.
    layout: the layout.
    batch: one step's data.

  Raises:
    LayoutError: (one line) a layout that cannot run the model: a count below 1, an unknown
      shard or recompute, tp, cp or ep not dividing what they split, the batch not splitting
      into dp x ep x microbatches, sp without tp, or layers not splitting into the stages.
  """
  for name in ("pp", "dp", "tp", "ep", "cp", "microbatches"):
    v = getattr(layout, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise LayoutError(f"{name}={v!r} must be a positive integer")
  if layout.shard not in SHARDS:
    raise LayoutError(f"shard={layout.shard!r} is unknown; use one of {', '.join(SHARDS)}")
  if layout.recompute not in RECOMPUTE:
    raise LayoutError(
        f"recompute={layout.recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}"
    )
  t = layout.tp
  for what, n in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads)):
    if n % t and not (what == "n_kv_heads" and t % n == 0):
      raise LayoutError(f"tp={t} does not divide {what}={n}; use a tp that divides {n}")
  if model.d_ff % t:
    raise LayoutError(f"tp={t} does not divide d_ff={model.d_ff}")
  if model.experts and model.expert_d_ff % t:
    raise LayoutError(f"tp={t} does not divide expert_d_ff={model.expert_d_ff}")
  if layout.ep > 1 and not model.experts:
    raise LayoutError(f"ep={layout.ep} needs a MoE model; {model.name} is dense")
  if model.experts and model.experts % layout.ep:
    raise LayoutError(f"ep={layout.ep} does not divide the {model.experts} experts")
  c = layout.cp
  if (model.n_heads // max(t, 1)) % c or batch.seq_len % c:
    raise LayoutError(
        f"cp={c} must divide the heads per tensor rank ({model.n_heads // t}) and "
        f"seq_len={batch.seq_len} (Ulysses)"
    )
  replicas = layout.dp * layout.ep * layout.microbatches
  if batch.sequences % replicas:
    raise LayoutError(
        f"batch of {batch.sequences} sequences does not split into dp x ep x microbatches = "
        f"{replicas}"
    )
  if layout.sp and t == 1:
    raise LayoutError("sp=True needs tp > 1 (sequence parallelism splits over the tp ranks)")
  if layout.pp > 1:
    stages = pipeline(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    units = model.n_layers
    if units % stages.stages and not layout.uneven:
      raise LayoutError(
          f"{units} layers do not split into the {stages.stages} stages of "
          f"{layout.schedule} at pp={layout.pp}; jaxpipe's stages hold equal layer counts "
          "(uneven=True prices the largest stage setting the pace)"
      )


def stage_imbalance(model: Model, layout: Layout) -> float:
  """The busiest pipeline stage's layers over the average: 1 unless `layout.uneven`.

  Args:
    model: the model's shape.
    layout: the layout.

  Returns:
    ceil(layers / stages) / (layers / stages); 1.0 at pp = 1 or with equal stages.
  """
  if layout.pp == 1 or not layout.uneven:
    return 1.0
  stages = pipeline(layout.schedule, layout.pp, layout.microbatches, layout.chunks).stages
  return math.ceil(model.n_layers / stages) / (model.n_layers / stages)


# --- the pipeline --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """What a schedule's executor tables keep in flight per rank, and its bubble."""

  stages: int  # model stages (blocks of layers)
  virtual: int  # virtual stages (chunks over ranks, copies included)
  copies: int  # resident copies of each stage (2 for bidirectional)
  act_slots: int
  res_slots: int
  cot_slots: int
  wg_slots: int
  bubble: float  # idle fraction of the asynchronous makespan (unit costs F = I = W = 1)


@functools.lru_cache(maxsize=512)
def pipeline(name: str, pp: int, microbatches: int, chunks: int | None) -> Pipeline:
  """The schedule lowered as the executor lowers it (`lower`).

  Args:
    name: the schedule (jaxpipe.pipeline.SCHEDULE_NAMES).
    pp: pipeline ranks.
    microbatches: micro-batches per step.
    chunks: model chunks per rank; None: the schedule's own.

  Returns:
    The `Pipeline`: stages, slots in flight and bubble.

  Raises:
    LayoutError: the schedule cannot run these counts.
  """
  from jaxpipe.pipeline.ir.lower import lower  # numpy: only when a pipeline is planned
  from jaxpipe.pipeline.ir.schedules import make_schedule

  try:
    s = make_schedule(name, pp=pp, microbatches=microbatches, chunks=chunks)
  except ValueError as e:
    raise LayoutError(
        f"schedule {name!r} cannot run pp={pp} with {microbatches} micro-batches: "
        + str(e).splitlines()[0]
    ) from None
  low = lower(s)
  pl = s.placement
  return Pipeline(
      stages=s.num_stages,
      virtual=pl.num_virtual_stages,
      copies=pl.copies,
      act_slots=low.act_slots,
      res_slots=low.res_slots,
      cot_slots=low.cot_slots,
      wg_slots=low.wg_slots,
      bubble=low.async_bubble,
  )


# --- memory --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device (the busiest rank: the pipeline's first for residuals, its last for the
  logits, both counted)."""

  params: float  # parameters on this device (count, not bytes)
  weights: float  # parameter bytes
  grads: float  # gradient bytes (and the accumulator)
  optimizer: float  # master weights and moments
  activations: float  # residuals in flight
  buffers: float  # stage inputs and cotangents in flight, logits, FSDP gathers, work
  batch: float = 0.0  # the step's input arrays

  @property
  def total(self) -> float:
    return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.batch


def device_params(model: Model, layout: Layout) -> dict[str, float]:
  """Parameters on one device of the busiest pipeline rank.

  By the group jaxpipe's distributed optimizer splits them over (`zero_groups`).

  Args:
    model: the model's shape.
    layout: the layout.

  Returns:
    {'dense': count (over dp x ep x cp), 'expert': count (routed experts, over dp x cp; split
    over ep already, whole over tp)}.

  Raises:
    LayoutError: with pp > 1, a schedule that cannot run (`pipeline`).
  """
  pp_stages = 1 if layout.pp == 1 else None
  copies = 1
  if layout.pp > 1:
    pl = pipeline(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    copies = pl.copies
    pp_stages = layout.pp
  t, e = layout.tp, layout.ep
  share = copies / pp_stages * stage_imbalance(model, layout)
  dense_layers = model.n_layers - model.moe_layers
  dense = expert = 0.0
  for moe, n in ((False, dense_layers), (True, model.moe_layers)):
    p = model.layer_params(moe)
    dense += n * share * (p["tp"] / t + p["shared"] + p["replicated"])
    expert += n * share * p["expert"] / e
  # embedding and head are vocabulary-parallel over tp; both sit on every rank in jaxpipe
  dense += model.embedding_params / t + model.d_model
  return {"dense": dense, "expert": expert}


def zero_groups(layout: Layout) -> tuple[int, int]:
  """The ranks jaxpipe's distributed optimizer splits dense and expert weights over.

  As `jaxpipe/training/zero.py` (`OPTIMIZER_AXES`) splits them: dp x ep x cp for dense weights,
  dp x cp for the routed experts (ep splits them already). cp's ranks hold the same parameters
  and sum their gradients as data ranks do, so they split the state as Megatron's distributed
  optimizer does over dp x cp.

  Args:
    layout: the layout.

  Returns:
    (dense group, expert group) sizes.
  """
  return layout.dp * layout.ep * layout.cp, layout.dp * layout.cp


def memory(
    model: Model,
    layout: Layout,
    batch: Batch,
    precision: Precision = MIXED,
    acts: Activations = GPU_ACTIVATIONS,
    grad_accumulator: bool | None = None,
) -> Memory:
  """Per-device bytes of `layout` training `model` on `batch`.

  Args:
    model: the model's shape.
    layout: the layout.
    batch: one step's data.
    precision: bytes per element of what a device holds.
    acts: what one layer keeps for its backward.
    grad_accumulator: a separate gradient buffer summed over micro-batches (None: when there
      are several micro-batches); jaxpipe's executor keeps one beside the gradients it returns.

  Returns:
    The `Memory` of the busiest device.

  Raises:
    LayoutError: a layout that cannot run the model (`check`).
  """
  check(model, layout, batch)
  par = device_params(model, layout)
  group_dense, group_expert = zero_groups(layout)
  n = par["dense"] + par["expert"]
  p, g, o = precision.param, precision.grad, precision.master + precision.moments
  s = layout.shard
  # With a pipeline the executor adds the micro-batches' gradients into a whole accumulator and
  # zero2 reduce-scatters it after its loop (the split result a copy beside it); fsdp gathers
  # each layer inside its stage and reduce-scatters its gradient per micro-batch, so only the
  # embedding, final norm and head are gathered whole (where the executor begins) and their
  # gradients returned whole.
  staged = layout.pp > 1 and s == "zero2"
  outer = model.embedding_params / layout.tp + model.d_model if s == "fsdp" else 0.0
  outer_whole = outer if layout.pp > 1 else 0.0

  def split(count: float, group: int) -> tuple[float, float, float]:
    weights = count * p / (group if s == "fsdp" else 1)
    grads = count * g / (group if s in ("zero2", "fsdp") else 1)
    if staged:
      grads += count * g  # the executor's whole gradients beside their split copy
    return weights, grads, count * o / (group if s != "none" else 1)

  wd, gd, od = split(par["dense"], group_dense)
  we, ge, oe = split(par["expert"], group_expert)
  weights, grads, opt = wd + we, gd + ge, od + oe
  weights, grads = weights + outer_whole * p, grads + outer_whole * g
  m = layout.microbatches
  seqs = batch.sequences // (layout.dp * layout.ep * m)
  tokens = seqs * batch.seq_len / layout.cp  # one micro-batch on one device
  a = precision.act
  moe_of_layer = [_is_moe(model, i) for i in range(model.n_layers)]
  per_layer = [acts.layer_elements(model, layout, batch.seq_len, x) for x in moe_of_layer]
  width = model.d_model / (layout.tp if layout.sp else 1)
  if layout.pp > 1:
    pl = pipeline(layout.schedule, layout.pp, m, layout.chunks)
    layers = model.n_layers / pl.stages  # per virtual stage
    step = math.ceil(layers)  # the largest stage's (uneven: one more than some)
    # per-layer elements -> the largest virtual stage's sum
    biggest = lambda per: max(sum(per[i : i + step]) for i in range(0, len(per), step))
    residual = tokens * biggest(per_layer) * a
    activations = pl.res_slots * residual
    slots = max(pl.act_slots, 1) + max(pl.cot_slots, 1)
    kept = biggest([kept_elements(model, layout, x) for x in moe_of_layer])
    # What I keeps for W (per layer of a stage and wg slot) are the values a running backward
    # part's workspace (`work`) holds, kept across ticks: the larger of the two is charged.
    work = acts.work * residual / layers
    buffers = slots * tokens * width * a + max(work, pl.wg_slots * tokens * kept * a)
  else:
    residual = tokens * sum(per_layer) * a
    activations = residual
    buffers = 0.0
  if layout.recompute == "full":  # one layer's full working set is rebuilt at a time
    full = dataclasses.replace(layout, recompute="none")
    buffers += (
        tokens
        * max(
            acts.layer_elements(model, full, batch.seq_len, x)
            for x in {False, True} & set(moe_of_layer)
        )
        * a
    )
  buffers += tokens * acts.logits * model.vocab / layout.tp * precision.logits
  if grad_accumulator if grad_accumulator is not None else (m > 1 or layout.pp > 1):
    if s == "fsdp":  # split as the gradients are; the pipeline's embedding and head whole
      layers = (par["dense"] - outer) / group_dense + par["expert"] / group_expert
      grads += (layers + (outer_whole or outer / group_dense)) * g
    elif layout.pp > 1 or s != "zero2":  # the executor's accumulator is whole
      grads += n * g
    else:
      grads += (par["dense"] / group_dense + par["expert"] / group_expert) * g
  if s == "fsdp":  # the gathered weights of the running layer and the next
    biggest = max(
        (
            model.layer_params(x)["tp"] / layout.tp
            + model.layer_params(x)["shared"]
            + model.layer_params(x)["expert"] / layout.ep
        )
        for x in set(moe_of_layer)
    )
    buffers += 2 * biggest * p
  return Memory(n, weights, grads, opt, activations, buffers)


def _is_moe(model: Model, layer: int) -> bool:
  if not model.experts:
    return False
  if model.dense_first:
    return layer >= model.dense_first
  return layer % model.moe_every == model.moe_every - 1


# --- step time ---------------------------------------------------------------------------------


def _ring(volume: float, n: int) -> float:
  """Bytes each device sends in a ring all-reduce of `volume` bytes over n devices."""
  return 2 * volume * (n - 1) / n if n > 1 else 0.0


def axis_links(layout: Layout, cluster: Cluster) -> dict[str, Link]:
  """Each axis' link: NVLink when it and the axes inside it (AXES order) fit in a node.

  Args:
    layout: the mesh's axis sizes.
    cluster: devices per node and the two links.

  Returns:
    The `Link` of each axis in AXES.
  """
  inner, out = 1, {}
  for axis in AXES:
    inner *= getattr(layout, axis)
    out[axis] = cluster.nvlink if inner <= cluster.node else cluster.network
  return out


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Predicted seconds of one optimizer step, by part."""

  compute_s: float  # matmuls at the achievable fraction of peak, recomputation included
  bubble_s: float  # the schedule's idle time
  comm_s: dict  # exposed seconds per axis
  flops: float  # model FLOPs of the step (no recomputation)

  @property
  def step_s(self) -> float:
    return self.compute_s + self.bubble_s + sum(self.comm_s.values())

  def mfu(self, cluster: Cluster) -> float:
    """Model FLOPs utilization of the predicted step.

    Args:
      cluster: the devices and their peak.

    Returns:
      The step's model FLOPs over what the devices' peak does in its time.
    """
    return self.flops / (self.step_s * cluster.devices * cluster.peak_tflops * 1e12)


def step_time(
    model: Model, layout: Layout, batch: Batch, cluster: Cluster, precision: Precision = MIXED
) -> StepTime:
  """Seconds per step at cluster scale (see the module docstring for what counts).

  Args:
    model: the model's shape.
    layout: the layout.
    batch: one step's data.
    cluster: the devices, their speed and links.
    precision: bytes per element (for what the collectives move).

  Returns:
    The `StepTime`, by part.

  Raises:
    LayoutError: a layout that cannot run the model (`check`).
  """
  check(model, layout, batch)
  tokens = batch.sequences * batch.seq_len
  flops = model.training_flops_per_token(batch.seq_len) * tokens
  extra = {"none": 0.0, "selective": 0.0, "full": 1 / 3}[layout.recompute]
  rate = cluster.devices * cluster.peak_tflops * 1e12 * cluster.mfu_ceiling
  # experts are whole over tp: without sp every tp rank runs the same tokens' experts
  redundant = 0.0
  if model.experts and layout.tp > 1 and not layout.sp:
    per_token = 6 * (model.top_k + model.shared_experts) * 3 * model.d_model * model.expert_d_ff
    redundant = (layout.tp - 1) * per_token * model.moe_layers * tokens
  # the busiest stage sets every rank's pace
  compute = (flops + redundant) * (1 + extra) / rate * stage_imbalance(model, layout)
  bubble = 0.0
  m = layout.microbatches
  if layout.pp > 1:
    pl = pipeline(layout.schedule, layout.pp, m, layout.chunks)
    bubble = compute * pl.bubble / (1 - pl.bubble)
  links = axis_links(layout, cluster)
  bw = lambda axis: links[axis].gbps * 1e9
  a = precision.act
  dev_tokens = tokens / (layout.dp * layout.ep * layout.cp)  # per device, whole step
  layers_here = model.n_layers / layout.pp
  moe_here = model.moe_layers / layout.pp
  comm = {}
  t = layout.tp
  if t > 1:  # per layer 2 all-reduces forward, 2 backward (sp: all-gather + reduce-scatter)
    comm["tp"] = 4 * layers_here * _ring(dev_tokens * model.d_model * a, t) / bw("tp")
  if layout.cp > 1:  # Ulysses: q, k, v and the output through all-to-alls, forward and backward
    c = layout.cp
    h, g, k = model.n_heads / t, model.n_kv_heads / t, model.head_dim
    vol = dev_tokens * (2 * h + 2 * g) * k * a * (c - 1) / c
    comm["cp"] = 2 * layers_here * vol / bw("cp")
  if layout.ep > 1 and model.experts:  # dispatch and combine, forward and backward
    e = layout.ep  # every tp rank dispatches its tokens (all of them without sp)
    vol = dev_tokens * model.top_k * model.d_model * a * (e - 1) / e / (t if layout.sp else 1)
    comm["ep"] = 4 * moe_here * vol / bw("ep")
  if layout.pp > 1:  # each micro-batch's stage output forward and its cotangent back
    pl = pipeline(layout.schedule, layout.pp, m, layout.chunks)
    hops = pl.virtual / layout.pp
    vol = dev_tokens / m * model.d_model * a / (t if layout.sp else 1)
    comm["pp"] = 2 * m * hops * vol / bw("pp")
  group = layout.dp * layout.cp * layout.ep
  if group > 1:  # gradients reduced (or reduce-scattered and gathered): overlaps the backward
    par = device_params(model, layout)
    grads = (par["dense"] + par["expert"]) * precision.grad
    # fsdp gathers every layer in each micro-batch's forward and again in its backward, and
    # reduce-scatters its gradient there: 1.5 all-reduces' volume per micro-batch
    factor = 1.5 * m if layout.shard == "fsdp" else 1.0
    dp_s = factor * _ring(grads, group) / bw("dp")
    comm["dp"] = max(0.0, dp_s - compute * 2 / 3)
  return StepTime(compute, bubble, comm, flops)


# --- search ------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
  out, x = [], 1
  while x <= n:
    out.append(x)
    x *= 2
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  layout: Layout
  memory: Memory
  time: StepTime
  fits: bool


def search(
    model: Model,
    batch: Batch,
    cluster: Cluster,
    schedules: Sequence[str] = ("1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"),
    shards: Sequence[str] = SHARDS,
    recomputes: Sequence[str] = ("none", "full"),
    max_microbatches: int = 32,
    precision: Precision = MIXED,
    acts: Activations = GPU_ACTIVATIONS,
) -> list[Plan]:
  """Every layout of `cluster.devices` devices the planner considers, priced.

  tp within a node, pp dividing the layers, a micro-batch of one sequence (`candidates`);
  layouts that cannot run are left out.

  Args:
    model: the model's shape.
    batch: one step's data.
    cluster: the devices, their memory, speed and links.
    schedules: pipeline schedules to try at pp > 1.
    shards: optimizer shardings to try.
    recomputes: recomputation choices to try.
    max_microbatches: the most micro-batches per step.
    precision: bytes per element of what a device holds.
    acts: what one layer keeps for its backward.

  Returns:
    The plans: fitting ones (memory within the device's less its reserve) first, by step time,
    then memory.
  """
  budget = (cluster.memory_gb - cluster.reserve_gb) * 1e9
  plans = []
  n = cluster.devices
  for layout in candidates(
      model, batch, n, cluster.node, schedules, shards, recomputes, max_microbatches
  ):
    try:
      mem = memory(model, layout, batch, precision, acts)
      st = step_time(model, layout, batch, cluster, precision)
    except LayoutError:
      continue
    plans.append(Plan(layout, mem, st, mem.total <= budget))
  plans.sort(key=lambda p: (not p.fits, round(p.time.step_s, 3), p.memory.total))
  return plans


def candidates(
    model: Model,
    batch: Batch,
    devices: int,
    node: int,
    schedules: Iterable[str],
    shards: Iterable[str],
    recomputes: Iterable[str],
    max_microbatches: int,
) -> Iterable[Layout]:
  """Layouts over `devices`.

  tp a power of two within a node, cp and ep powers of two, pp a power of two dividing the
  layers (or the layers' stages), micro-batches so that one micro-batch is one sequence per
  device (capped), every schedule, shard and recompute.

  Args:
    model: the model's shape (ep must divide its experts).
    batch: one step's data.
    devices: devices in all.
    node: devices per node.
    schedules: pipeline schedules at pp > 1.
    shards: optimizer shardings (only 'none' where no rank shares the optimizer).
    recomputes: recomputation choices.
    max_microbatches: the cap on micro-batches per step.

  Returns:
    The layouts, lazily (a generator); `check` may still refuse some.
  """
  eps = [e for e in _pow2_upto(min(devices, 64)) if not model.experts or model.experts % e == 0]
  eps = eps if model.experts else [1]
  for tp in [t for t in _pow2_upto(node) if devices % t == 0]:
    for cp in [c for c in _pow2_upto(8) if devices % (tp * c) == 0]:
      for ep in [e for e in eps if devices % (tp * cp * e) == 0]:
        for pp in [p for p in _pow2_upto(16) if devices % (tp * cp * ep * p) == 0]:
          dp = devices // (tp * cp * ep * pp)
          if batch.sequences % (dp * ep):
            continue
          per = batch.sequences // (dp * ep)
          m = min(per, max_microbatches)
          while per % m:
            m -= 1
          for shard in shards:
            if dp * cp * ep == 1 and shard != "none":
              continue
            for rc in recomputes:
              for sp in (False, True) if tp > 1 else (False,):
                if pp == 1:
                  yield Layout(1, dp, tp, ep, cp, "1f1b", m, None, shard, sp, rc)
                  continue
                for s in schedules:
                  yield Layout(pp, dp, tp, ep, cp, s, m, None, shard, sp, rc)


def fmt_bytes(b: float) -> str:
  """Bytes as GB (10^9) with one decimal, for tables.

  Args:
    b: bytes.

  Returns:
    The text, without a unit.
  """
  return f"{b / 1e9:.1f}"


def round_up(x: float, q: int) -> int:
  """`x` rounded up to a multiple of `q`.

  Args:
    x: the value.
    q: the multiple.

  Returns:
    The smallest multiple of q not below x.
  """
  return int(math.ceil(x / q) * q)
