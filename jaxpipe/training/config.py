"""Run configuration: the default ml_collections tree, its validation, and gin bindings onto it.

A config file (`configs/*.py`) defines `get_config(arg=None)` that starts from `default_config()`
and overrides fields. The tree is locked, so a misspelt key fails naming the closest valid one.
Validation runs before any device work.
"""

import dataclasses
import difflib
import os
from collections.abc import Iterable

import ml_collections
from ml_collections import config_dict

from jaxpipe.data import source as data_source
from jaxpipe.models.transformer import REMAT, TransformerConfig
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.pipeline import SCHEDULE_NAMES, Placement, Schedule, make_schedule
from jaxpipe.training import zero

# Mesh axes, outermost first: pipeline, data, expert, context, tensor.
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
AUTO = "auto"  # pipeline.schedule: choose among the generators (SCHEDULE_NAMES) from measured costs
DTYPES = ("float32", "bfloat16", "float16")
# Compute dtypes a backend cannot run, and why (found by validation, not by the first step's
# XLA error).
UNSUPPORTED_DTYPES = {
    "cpu": {
        "float16": "XLA:CPU has no float16 matmul with float32 accumulation "
        "(dot_general precision F16_F16_F32)"
    }
}
SOURCES = ("stdlib", "synthetic")
TOKENIZERS = ("bytes", "hf")  # data.tokenizer: what the model reads (jaxpipe.models.tokenizer)
# Sections a gin file can bind, e.g. `model.d_model = 256`.
GIN_SECTIONS = ("model", "mesh", "pipeline", "data", "optimizer", "train", "checkpoint")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the value and the fix."""


def default_config() -> ml_collections.ConfigDict:
  """Every field the trainer reads, with its default; locked."""
  c = ml_collections.ConfigDict()

  # Field meanings and defaults live on TransformerConfig, the one place that defines them.
  c.model = ml_collections.ConfigDict(dataclasses.asdict(TransformerConfig()))
  # False, True or 'selective' (TransformerConfig.remat): a field of either type
  c.model.remat = config_dict.FieldReference(False, field_type=object)

  c.mesh = ms = ml_collections.ConfigDict()
  ms.pp = 1  # pipeline stages
  ms.dp = config_dict.placeholder(int)  # data-parallel size; unset = all devices left over
  ms.ep = 1  # expert-parallel size (also splits the batch outside MoE layers)
  ms.cp = 1  # context-parallel size (splits the sequence)
  ms.tp = 1  # tensor-parallel size (splits heads, d_ff and the vocabulary; Megatron's layout)
  ms.order = ",".join(MESH_AXES)  # device order, outermost (spans processes first) to innermost

  c.pipeline = p = ml_collections.ConfigDict()
  p.schedule = "1f1b"  # one of SCHEDULE_NAMES, "auto", or a torch.distributed.pipelining CSV path
  p.microbatches = 1  # micro-batches per step (gradient accumulation when pp = 1)
  p.chunks = 1  # model chunks per pipeline rank (virtual stages)
  p.recompute = False  # recompute stage forwards in the backward instead of keeping residuals
  p.costs = ""  # auto: cost file (python -m jaxpipe.measure); empty = measure before training
  p.memory_limit_gb = 0.0  # auto: drop schedules predicted to need more per device; 0 = no limit
  p.auto_layout = False  # auto: also choose the mesh, optimizer.shard and remat (training/plan)
  p.auto_microbatches = ()  # auto: micro-batch counts to consider; empty = all the batch allows
  p.auto_schedules = ()  # auto: generators to consider; empty = all of SCHEDULE_NAMES

  c.data = d = ml_collections.ConfigDict()
  d.source = "stdlib"  # 'stdlib': Python's .py files as bytes; 'tokens:DIR': a token store
  d.tokenizer = "bytes"  # the model's: 'bytes' (UTF-8), or 'hf' (the workdir's hf/ directory)
  d.seq_len = 128  # tokens per sequence
  d.batch = 32  # global batch, sequences per step
  d.eval_fraction = 0.02  # tail of the corpus held out for evaluation
  d.seed = 0  # seed of the step-indexed sampler

  c.optimizer = o = ml_collections.ConfigDict()
  o.lr = 3e-3  # peak learning rate
  o.warmup_steps = 30  # linear warm-up from 0 to lr
  o.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio at the last step
  o.b1 = 0.9  # AdamW first-moment decay
  o.b2 = 0.95  # AdamW second-moment decay
  o.eps = 1e-8  # AdamW epsilon
  o.weight_decay = 0.1  # decoupled weight decay on matrices (not norms)
  o.clip_norm = 1.0  # global gradient-norm clip; 0 disables
  o.shard = "none"  # none, zero1 (moments over dp, ep, cp), zero2 (+ gradients), fsdp (+ params)

  c.train = t = ml_collections.ConfigDict()
  t.steps = 300  # optimizer steps in the whole run
  t.seed = 0  # parameter initialisation seed
  t.log_every = 10  # steps between metric writes (and the non-finite check)
  t.eval_every = 100  # steps between evaluations; 0 disables
  t.eval_batches = 4  # batches per evaluation
  # CPU devices: keep freed host memory in the heap (glibc), as device allocators pool theirs, so
  # no step maps and faults its temporaries in again (python -m jaxpipe.train)
  t.pool_host_memory = True
  # the GEMMs of the model's projections and output head (`ops.matmul`): xla, onednn (CPU,
  # float32 or bfloat16, its gradients oneDNN products too) or auto (onednn where it builds)
  t.matmul = "xla"

  c.checkpoint = k = ml_collections.ConfigDict()
  k.every = 100  # steps between checkpoints; 0 saves only at the end and on SIGTERM
  k.keep = 3  # checkpoints kept (the newest)
  k.async_save = True  # write in a background thread while training continues

  c.lock()
  return c


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
  """The model section as the model's own dataclass.

  Args:
    config: the run's config.

  Returns:
    `TransformerConfig(**config.model)`.
  """
  return TransformerConfig(**config.model.to_dict())


def mesh_shape(mesh: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Axis sizes with an unset `dp` filled from the device count.

  Args:
    mesh: the config's `mesh` section, one size per axis of MESH_AXES (dp may be None).
    num_devices: the devices the run has.

  Returns:
    The size of every axis of MESH_AXES.

  Raises:
    ConfigError: the sizes cannot fit: a size that is not a positive integer, or a product that
      is not (or, dp unset, does not divide) the device count.
  """
  for axis in MESH_AXES:
    size = mesh[axis]
    if axis == "dp" and size is None:
      continue
    if not isinstance(size, int) or size < 1:
      raise ConfigError(
          f"mesh.{axis}={size!r} must be a positive integer; set --config.mesh.{axis}=1 "
          "to leave the axis unused"
      )
  others = [a for a in MESH_AXES if a != "dp"]
  rest = 1
  for a in others:
    rest *= mesh[a]
  sizes = {a: mesh[a] for a in MESH_AXES}
  if mesh.dp is None:
    if num_devices % rest:
      raise ConfigError(
          f"mesh {' x '.join(f'{a}={mesh[a]}' for a in others)} = {rest} devices does not divide "
          f"the {num_devices} available, so no data-parallel size fits; choose axis sizes whose "
          f"product divides {num_devices}"
      )
    sizes["dp"] = num_devices // rest
  product = rest * sizes["dp"]
  if product != num_devices:
    shape = " x ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
    raise ConfigError(
        f"mesh {shape} = {product} devices, but {num_devices} are available; the product must "
        f"equal the device count (leave mesh.dp unset to fill the remaining devices with data "
        f"parallelism)"
    )
  return sizes


def mesh_order(mesh: ml_collections.ConfigDict) -> tuple[str, ...]:
  """mesh.order as a tuple of every axis, outermost first.

  The axes it lists lead, the others follow in MESH_AXES order.

  Args:
    mesh: the config's `mesh` section; `order` is a comma list of axes.

  Returns:
    Every axis of MESH_AXES, outermost first.

  Raises:
    ConfigError: names an unknown or repeated axis.
  """
  listed = [a.strip() for a in str(mesh.order).split(",") if a.strip()]
  bad = [a for a in listed if a not in MESH_AXES]
  if bad or len(set(listed)) != len(listed):
    what = f"unknown axis {bad[0]!r}" if bad else "an axis twice"
    raise ConfigError(
        f"mesh.order={mesh.order!r} names {what}; list mesh axes "
        f"({', '.join(MESH_AXES)}) outermost first, e.g. --config.mesh.order=dp,pp "
        "to put data parallelism across processes and the pipeline within each"
    )
  return tuple(listed) + tuple(a for a in MESH_AXES if a not in listed)


def _positive(section: str, cfg: ml_collections.ConfigDict, names: Iterable[str]) -> None:
  for name in names:
    value = cfg[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"{section}.{name}={value!r} must be a positive integer")


def _non_negative(section: str, cfg: ml_collections.ConfigDict, names: Iterable[str]) -> None:
  for name in names:
    value = cfg[name]
    if not value >= 0:
      raise ConfigError(f"{section}.{name}={value!r} must be >= 0")


def validate(
    config: ml_collections.ConfigDict, num_devices: int, platform: str | None = None
) -> dict[str, int]:
  """Checks every value the run depends on, before any device work.

  Args:
    config: the run's config.
    num_devices: the devices the run has.
    platform: the backend the run will use ('cpu', 'gpu', 'tpu'), for the dtypes it cannot run.

  Returns:
    The mesh shape (`mesh_shape`).

  Raises:
    ConfigError: the first value that cannot run; the message names the field and the fix.
  """
  m, p, d, o, t, k = (
      config.model,
      config.pipeline,
      config.data,
      config.optimizer,
      config.train,
      config.checkpoint,
  )
  _positive(
      "model", m, ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")
  )
  _positive("pipeline", p, ("microbatches", "chunks"))
  _positive("data", d, ("seq_len", "batch"))
  _positive("train", t, ("steps", "log_every", "eval_batches"))
  _positive("checkpoint", k, ("keep",))
  _non_negative("train", t, ("eval_every",))
  _non_negative("checkpoint", k, ("every",))
  _non_negative(
      "optimizer", o, ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm", "eps")
  )
  for name in ("b1", "b2"):
    if not 0 <= o[name] < 1:
      raise ConfigError(f"optimizer.{name}={o[name]!r} must lie in [0, 1)")
  if t.matmul not in matmul_lib.BACKENDS:
    raise ConfigError(
        f"train.matmul={t.matmul!r} is unknown; use one of {', '.join(matmul_lib.BACKENDS)}"
    )
  if o.shard not in zero.MODES:
    raise ConfigError(f"optimizer.shard={o.shard!r} is unknown; use one of {', '.join(zero.MODES)}")
  if m.head_dim % 2:
    raise ConfigError(
        f"model.head_dim={m.head_dim} must be even: rotary embeddings rotate pairs of channels"
    )
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads="
        f"{m.n_kv_heads}; grouped-query attention shares each KV head among an equal "
        "number of query heads, so pick n_kv_heads among the divisors of n_heads"
    )
  if m.remat not in REMAT:
    raise ConfigError(
        f"model.remat={m.remat!r} is unknown; use False (keep activations), True (recompute "
        "each layer in the backward) or 'selective' (recompute the attention core only)"
    )
  if not isinstance(m.cp_overlap, bool):
    raise ConfigError(f"model.cp_overlap={m.cp_overlap!r} must be True or False")
  if (
      isinstance(m.unroll_layers, bool)
      or not isinstance(m.unroll_layers, int)
      or m.unroll_layers < 0
  ):
    raise ConfigError(
        f"model.unroll_layers={m.unroll_layers!r} must be an integer >= 0: stacks of at most "
        "that many layers run unrolled, longer ones as a lax.scan loop (0: always the loop)"
    )
  if m.rope_theta <= 0:
    raise ConfigError(f"model.rope_theta={m.rope_theta!r} must be > 0")
  if m.dtype not in DTYPES:
    raise ConfigError(f"model.dtype={m.dtype!r} is unknown; use one of {DTYPES}")
  why = UNSUPPORTED_DTYPES.get(platform, {}).get(m.dtype)
  if why:
    runs = [d for d in DTYPES if d not in UNSUPPORTED_DTYPES[platform]]
    raise ConfigError(
        f"model.dtype={m.dtype!r} does not run on {platform}: {why}; use one of {runs} there"
    )
  check_fp8(m)
  if d.get("tokenizer", "bytes") not in TOKENIZERS:
    raise ConfigError(
        f"data.tokenizer={d.tokenizer!r} is unknown; use 'bytes' (UTF-8, jaxpipe's byte-level "
        "models) or 'hf' (the workdir's hf/ tokenizer, as python -m jaxpipe.convert writes it)"
    )
  tokens_dir = data_source.store_dir(d.source) if isinstance(d.source, str) else None
  if d.source not in SOURCES and tokens_dir is None:
    raise ConfigError(
        f"data.source={d.source!r} is unknown; use one of {SOURCES} or "
        f"'{data_source.PREFIX}DIR' (a token store: python -m jaxpipe.data prepare)"
    )
  if d.source == "stdlib" and m.vocab < 256:
    raise ConfigError(
        f"model.vocab={m.vocab} cannot hold the byte-level stdlib corpus; set "
        "--config.model.vocab=256 (or more)"
    )
  if not 0 < d.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction!r} must lie strictly between 0 and 1")
  if tokens_dir is not None:
    try:
      data_source.check(d.source, m.vocab, d.eval_fraction, need_eval=t.eval_every > 0)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  schedule = p.schedule
  if not isinstance(schedule, str) or not (
      schedule in SCHEDULE_NAMES + (AUTO,) or schedule.endswith(".csv")
  ):
    raise ConfigError(
        f"pipeline.schedule={schedule!r} is unknown; use one of "
        f"{', '.join(SCHEDULE_NAMES)} "
        f"or {AUTO!r}, or the path of a torch.distributed.pipelining schedule CSV "
        "(ending in .csv)"
    )
  if schedule.endswith(".csv") and not os.path.isfile(schedule):
    raise ConfigError(f"pipeline.schedule={schedule!r}: no such file")

  shape = mesh_shape(config.mesh, num_devices)
  mesh_order(config.mesh)
  every = 1
  if m.moe is not None:
    every = m.moe.every
    if not isinstance(every, int) or every < 1:
      raise ConfigError(
          f"model.moe.every={every!r} must be a positive integer (1: every layer MoE)"
      )
    first = m.get("first_dense", 0)
    if (m.n_layers - first) % every:
      after = f" after model.first_dense={first}" if first else ""
      raise ConfigError(
          f"model.n_layers={m.n_layers}{after} is not a multiple of model.moe.every={every}; "
          "layers come in groups of moe.every (the last of each is MoE), so use a "
          f"multiple of {every} layers" + (" plus first_dense" if first else "")
      )
    try:  # the MoE layer's own checks: at construction, then against the expert axis
      model_config(config).moe.validate(shape["ep"])
    except (TypeError, ValueError) as e:
      raise ConfigError(f"model.moe: {e}") from e
  try:  # the model's own checks: rotary variants, windows and layer kinds, activations, ...
    model_config(config)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model: {e}") from e
  if schedule == AUTO:
    _check_auto(config, shape)
  elif shape["pp"] > 1 or schedule.endswith(".csv"):
    _check_stages(m.n_layers, every, pipeline_schedule(p, shape["pp"]), m.get("first_dense", 0))
  cp = shape["cp"]
  if m.mla is not None and (cp > 1 or shape["tp"] > 1):
    raise ConfigError(
        f"model.mla (latent attention) with mesh.cp={cp} and mesh.tp={shape['tp']}: neither "
        "context nor tensor parallelism splits it yet; use mesh.cp=1 and mesh.tp=1 (pipeline, "
        "data and expert parallelism do)"
    )
  for name in ("n_heads", "n_kv_heads"):
    if m[name] % cp:
      raise ConfigError(
          f"model.{name}={m[name]} is not divisible by mesh.cp={cp}; context "
          "parallelism gives each context rank an equal share of the heads, so use "
          f"a cp that divides {m[name]}"
      )
  if d.seq_len % cp:
    raise ConfigError(f"data.seq_len={d.seq_len} is not divisible by mesh.cp={cp}")
  _check_tensor_parallel(m, d, shape)
  if o.shard != "none":
    try:
      zero.check(config, shape)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  shard_map_path = cp > 1 or shape["tp"] > 1 or o.shard == "fsdp"
  if m.fp8 == "delayed" and m.attention == "pallas" and shard_map_path and shape["pp"] == 1:
    raise ConfigError(
        "model.fp8='delayed' with model.attention='pallas' on the shard_map path (pp = 1 "
        "with mesh.cp > 1, mesh.tp > 1 or optimizer.shard='fsdp'): the amaxes are "
        "max-reduced over the shards only where the shard_map tracks varying axes, which "
        "interpreted Pallas kernels switch off; set --config.model.attention=xla (or cudnn), "
        "or use mesh.pp > 1"
    )
  replicas = shape["dp"] * shape["ep"]
  if schedule != AUTO and d.batch % (replicas * p.microbatches):
    raise ConfigError(
        f"data.batch={d.batch} is not divisible by data-parallel ranks (mesh.dp x mesh.ep = "
        f"{shape['dp']} x {shape['ep']}) x pipeline.microbatches={p.microbatches} = "
        f"{replicas * p.microbatches}; use a batch that is a multiple of "
        f"{replicas * p.microbatches}"
    )
  return shape


def _check_tensor_parallel(
    m: ml_collections.ConfigDict, d: ml_collections.ConfigDict, shape: dict[str, int]
) -> None:
  """mesh.tp against the model: what splits over it, and what cannot run with it yet."""
  tp = shape["tp"]
  if not isinstance(m.sequence_parallel, bool):
    raise ConfigError(f"model.sequence_parallel={m.sequence_parallel!r} must be True or False")
  try:
    tp_lib.check(
        tp=tp,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        d_ff=m.d_ff,
        vocab=m.vocab,
        seq_len=d.seq_len // shape["cp"],
        sequence_parallel=m.sequence_parallel,
        cp=shape["cp"],
    )
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if tp == 1:
    return
  if m.fp8 == "block":
    _check_block_tiles(m, tp)
  if (
      m.fp8 != "none"
      and not tp_lib.kv_split(m.n_kv_heads, tp)
      and (m.sequence_parallel or shape["pp"] > 1)
  ):
    # the K/V projections' outputs are then varying over tp (or, in the executor, every value
    # is): each rank's gradient is a partial sum, quantised before the sum (measured: 14% off)
    where = "with sequence parallelism" if m.sequence_parallel else "inside the pipeline"
    raise ConfigError(
        f"model.fp8={m.fp8!r} with model.n_kv_heads={m.n_kv_heads} whole on every rank of "
        f"mesh.tp={tp}, {where}: each rank's K/V gradient would be quantised as a partial "
        "sum; use a mesh.tp that "
        f"divides {m.n_kv_heads}"
        + (", or model.sequence_parallel=False" if shape["pp"] == 1 else "")
    )
  unsupported = (
      (
          # experts are whole over tp: inside the executor their gradient's amax would come
          # from a per-rank partial of the replicated stream's cotangent
          m.fp8 != "none" and m.moe is not None and shape["pp"] > 1 and not m.sequence_parallel,
          "model.fp8 and MoE inside the pipeline without sequence parallelism",
          "model.sequence_parallel=True",
      ),
  )
  for bad, what, fix in unsupported:
    if bad:
      raise ConfigError(f"mesh.tp={tp} does not run with {what} yet; set {fix}, or mesh.tp=1")


def check_fp8(m: ml_collections.ConfigDict) -> None:
  """Checks model.fp8 and its delayed-scaling fields.

  Block scaling's 1x128 tiles need the contracted widths to be multiples of 128.

  Args:
    m: the config's `model` section.

  Raises:
    ConfigError: an unknown recipe or amax algorithm, a bad history length or margin, FP8 with
      cp_overlap, or under 'block' a contracted width that is not a multiple of the block.
  """
  if m.fp8 not in fp8_lib.RECIPES:
    raise ConfigError(f"model.fp8={m.fp8!r} is unknown; use one of {fp8_lib.RECIPES}")
  _positive("model", m, ("fp8_history",))
  if not isinstance(m.fp8_margin, int) or isinstance(m.fp8_margin, bool) or m.fp8_margin < 0:
    raise ConfigError(
        f"model.fp8_margin={m.fp8_margin!r} must be an integer >= 0 (the scale is "
        "fp8_max / amax / 2^margin)"
    )
  if m.fp8_amax not in fp8_lib.AMAX_ALGOS:
    raise ConfigError(f"model.fp8_amax={m.fp8_amax!r} is unknown; use one of {fp8_lib.AMAX_ALGOS}")
  if m.fp8 != "none" and m.cp_overlap:
    raise ConfigError(
        f"model.fp8={m.fp8!r} with model.cp_overlap=True: the projections fused "
        "with Ulysses' all-to-alls run in the compute dtype only; set "
        "--config.model.cp_overlap=False"
    )
  if m.fp8 != "block":
    return
  widths = {"d_model": m.d_model, "d_ff": m.d_ff, "n_heads * head_dim": m.n_heads * m.head_dim}
  if m.moe is not None:
    widths["moe.d_ff"] = m.moe.d_ff
    if m.moe.num_shared_experts:
      widths["moe.num_shared_experts * moe.d_ff"] = m.moe.num_shared_experts * m.moe.d_ff
  for name, width in widths.items():
    if width % fp8_lib.BLOCK:
      raise ConfigError(
          f"model.fp8='block' quantises activations in 1x{fp8_lib.BLOCK} tiles along "
          f"the width a GEMM contracts, but model.{name}={width} is not a multiple "
          f"of {fp8_lib.BLOCK}; use a multiple of {fp8_lib.BLOCK} or another recipe"
      )


def _check_block_tiles(m: ml_collections.ConfigDict, tp: int) -> None:
  """model.fp8='block' under mesh.tp: every width split over tp must leave each rank whole
  128-wide tiles, so that a rank's tiles (and their scales) are exactly the one-device model's
  over its slice (the column-parallel outputs are what the input gradient contracts); and the
  KV heads must split, since a whole K/V projection's gradient would be quantised per rank's
  partial cotangent."""
  if not tp_lib.kv_split(m.n_kv_heads, tp):
    raise ConfigError(
        f"model.fp8='block' under mesh.tp={tp} with model.n_kv_heads={m.n_kv_heads} whole on "
        "every rank: each rank's K/V gradient is a partial sum, and its tiles would be scaled "
        f"before the sum rather than after; use a mesh.tp that divides {m.n_kv_heads}, or "
        "model.fp8='current'"
    )
  widths = {
      "n_heads * head_dim": m.n_heads * m.head_dim,
      "n_kv_heads * head_dim": m.n_kv_heads * m.head_dim,
      "d_ff": m.d_ff,
  }
  for name, width in widths.items():
    if (width // tp) % fp8_lib.BLOCK:
      raise ConfigError(
          f"model.fp8='block' under mesh.tp={tp} splits model.{name}={width} into "
          f"{width // tp}-wide slices, which cut its 1x{fp8_lib.BLOCK} scaling tiles; use a "
          f"width that is a multiple of {tp} x {fp8_lib.BLOCK} = {tp * fp8_lib.BLOCK}, "
          "another mesh.tp, or model.fp8='current'"
      )


def pipeline_schedule(pipeline: ml_collections.ConfigDict, pp: int) -> Schedule:
  """The validated schedule `pipeline` names for `pp` ranks, from the IR (no JAX).

  Args:
    pipeline: the config's `pipeline` section: schedule (a generator name or a CSV path),
      microbatches and chunks (1: the generator's own count, or the file's).
    pp: pipeline ranks.

  Returns:
    The validated `Schedule`.

  Raises:
    ConfigError: the schedule cannot be built, or a CSV disagrees with `pp`, the micro-batch
      count or the chunk count.
  """
  name = pipeline.schedule
  if name.endswith(".csv"):
    try:
      schedule = Schedule.from_csv(name)
    except (ValueError, OSError) as e:
      raise ConfigError(f"pipeline.schedule={name!r} is not a valid schedule: {e}") from e
    if schedule.num_ranks != pp:
      raise ConfigError(
          f"pipeline.schedule={name!r} has {schedule.num_ranks} ranks but mesh.pp="
          f"{pp}; set --config.mesh.pp={schedule.num_ranks} or write the schedule "
          f"for {pp} ranks"
      )
    if schedule.num_microbatches != pipeline.microbatches:
      raise ConfigError(
          f"pipeline.schedule={name!r} runs {schedule.num_microbatches} micro-batches "
          f"but pipeline.microbatches={pipeline.microbatches}; set "
          f"--config.pipeline.microbatches={schedule.num_microbatches}"
      )
    chunks = schedule.placement.chunks_per_rank
    if pipeline.chunks not in (1, chunks):
      raise ConfigError(
          f"pipeline.schedule={name!r} places {chunks} chunk"
          f"{'s' if chunks > 1 else ''} on each rank but "
          f"pipeline.chunks={pipeline.chunks}; leave pipeline.chunks at 1 (the "
          "file decides) or set it to the file's count"
      )
    return schedule
  # chunks = 1 is the default: the generator's own choice (2 for interleaved and V schedules).
  chunks = None if pipeline.chunks == 1 else pipeline.chunks
  try:
    return make_schedule(name, pp=pp, microbatches=pipeline.microbatches, chunks=chunks)
  except ValueError as e:
    raise ConfigError(
        f"pipeline.schedule={name!r} cannot run mesh.pp={pp} with "
        f"pipeline.microbatches={pipeline.microbatches}"
        + (f", pipeline.chunks={chunks}" if chunks else "")
        + f": {e}"
    ) from e


def _check_auto(config: ml_collections.ConfigDict, shape: dict[str, int]) -> None:
  """pipeline.schedule = 'auto': its fields, and at least one candidate the IR can build."""
  from jaxpipe.planning import auto as auto_lib
  from jaxpipe.planning import costs as costs_lib

  p = config.pipeline
  if not isinstance(p.auto_layout, bool):
    raise ConfigError(f"pipeline.auto_layout={p.auto_layout!r} must be True or False")
  if p.auto_layout and not p.memory_limit_gb > 0:
    raise ConfigError(
        f"pipeline.auto_layout=True searches layouts under pipeline.memory_limit_gb, which is "
        f"{p.memory_limit_gb!r}; set it to the bytes per device to fit, in GB (e.g. 80)"
    )
  if shape["pp"] == 1 and not p.auto_layout:
    raise ConfigError(
        "pipeline.schedule='auto' chooses among pipeline schedules; set "
        "--config.mesh.pp to 2 or more, or name a schedule (or pipeline.auto_layout=True "
        "to choose the mesh too)"
    )
  if not p.memory_limit_gb >= 0:
    raise ConfigError(f"pipeline.memory_limit_gb={p.memory_limit_gb!r} must be >= 0 (0: no limit)")
  per_replica = config.data.batch // (shape["dp"] * shape["ep"])
  for mb in p.auto_microbatches:
    if not isinstance(mb, int) or mb < 1 or config.data.batch % (shape["dp"] * shape["ep"] * mb):
      raise ConfigError(
          f"pipeline.auto_microbatches entry {mb!r} does not split the batch: "
          f"data.batch={config.data.batch} over {shape['dp'] * shape['ep']} data "
          f"ranks leaves {per_replica} sequences each; use divisors of {per_replica}"
      )
  bad = [n for n in p.auto_schedules if n not in SCHEDULE_NAMES]
  if bad:
    raise ConfigError(
        f"pipeline.auto_schedules has {bad}; choose among {', '.join(SCHEDULE_NAMES)}"
    )
  if p.costs:
    try:
      costs_lib.load(p.costs)
    except costs_lib.CostFileError as e:
      raise ConfigError(f"pipeline.costs={p.costs!r}: {e}") from e
  if p.auto_layout:  # the layout planner chooses (jaxpipe.training.plan), not measured costs
    return
  try:
    auto_pairs(config, shape)
  except auto_lib.AutoError as e:
    raise ConfigError(f"pipeline.schedule='auto': {e}") from e


def auto_microbatches(config: ml_collections.ConfigDict, mesh_shape: dict) -> list[int]:
  """The micro-batch counts auto may choose.

  Args:
    config: the run's config.
    mesh_shape: axis sizes (dp and ep make the data-parallel replicas).

  Returns:
    pipeline.auto_microbatches (sorted, without repeats), else every count the per-replica
    batch splits into.
  """
  if config.pipeline.auto_microbatches:
    return sorted(set(config.pipeline.auto_microbatches))
  per_replica = config.data.batch // (mesh_shape["dp"] * mesh_shape["ep"])
  return [m for m in range(1, per_replica + 1) if per_replica % m == 0]


def auto_pairs(config: ml_collections.ConfigDict, mesh_shape: dict) -> list[tuple[int, int]]:
  """(micro-batches, stages) pairs the runnable auto candidates need costs for.

  Args:
    config: the run's config.
    mesh_shape: axis sizes.

  Returns:
    The sorted pairs.

  Raises:
    AutoError: no candidate can run.
  """
  from jaxpipe.planning import auto as auto_lib

  cands = auto_lib.candidates(
      mesh_shape["pp"],
      auto_microbatches(config, mesh_shape),
      auto_names(config),
      layers=layer_units(config),
  )
  auto_lib.require_runnable(cands, mesh_shape["pp"])
  return sorted({(c.microbatches, c.stages) for c in cands if not c.dropped})


def auto_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The schedules auto may choose.

  Args:
    config: the run's config.

  Returns:
    pipeline.auto_schedules, else every generator (SCHEDULE_NAMES).
  """
  return tuple(config.pipeline.auto_schedules) or SCHEDULE_NAMES


def layer_units(config: ml_collections.ConfigDict) -> int:
  """Entries of the layer stack stages split: layers, or groups of moe.every layers.

  Args:
    config: the run's config.

  Returns:
    model.n_layers less model.first_dense (those run with the embedding), over moe.every for
    a MoE model.
  """
  m = config.model
  return (m.n_layers - m.get("first_dense", 0)) // (m.moe.every if m.moe is not None else 1)


def _check_stages(n_layers: int, every: int, schedule: Schedule, first: int = 0) -> None:
  """Every model stage of `schedule` must get the same whole number of layers (MoE: groups),
  the `first` dense ones apart (they run with the embedding)."""
  pl = schedule.placement
  stages, pp = schedule.num_stages, schedule.num_ranks
  units = (n_layers - first) // every
  if units % stages == 0:
    return
  if pl.copies > 1:
    how = f"one per rank on mesh.pp={pp} ranks, each stage held twice, once per direction"
  elif pl == Placement.vshape(pp):
    how = (
        f"2 per rank on mesh.pp={pp} ranks, in a V: each rank's layers split into two equal "
        "chunks, so each rank needs an even number of them"
    )
  elif pl.chunks_per_rank > 1:
    how = f"mesh.pp={pp} ranks x {pl.chunks_per_rank} chunks per rank"
  else:
    how = f"one per rank on mesh.pp={pp} ranks"
  what = f" ({units} groups of model.moe.every={every} layers)" if every > 1 else ""
  plus = f" plus model.first_dense={first}" if first else ""
  raise ConfigError(
      f"model.n_layers={n_layers}{what} does not split into the {stages} model "
      f"stages of schedule {schedule.name!r} ({how}); every stage holds the same "
      f"number of layers, so use a multiple of {stages * every} layers{plus} or change "
      "mesh.pp, pipeline.chunks or the schedule"
  )


def define_runner_flags(flag_values) -> None:
  """Defines the `--config`, `--gin_file` and `--gin_param` flags of a runner.

  `--config` is an ml_collections file (required); `--gin_file` and `--gin_param` repeat.

  Args:
    flag_values: the runner's FlagValues (`jaxpipe.runtime.cli.flag_values`).
  """
  from absl import flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file(
      "config",
      None,
      "ml_collections config file (get_config).",
      lock_config=True,
      flag_values=flag_values,
  )
  flags.DEFINE_multi_string(
      "gin_file", [], "Gin files binding config fields.", flag_values=flag_values
  )
  flags.DEFINE_multi_string(
      "gin_param", [], "Gin bindings, e.g. 'optimizer.lr = 1e-3'.", flag_values=flag_values
  )
  flags.mark_flag_as_required("config", flag_values=flag_values)


def runner_config(argv: list[str], flag_values) -> ml_collections.ConfigDict:
  """The config those flags name, overrides and gin bindings applied.

  Args:
    argv: the program name and any positional arguments (there should be none).
    flag_values: the runner's FlagValues (`define_runner_flags`).

  Returns:
    The config.

  Raises:
    SystemExit: exits on stray arguments.
    ConfigError: a gin file or binding that cannot be applied (`apply_gin`).
  """
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  f = flag_values
  return apply_gin(f.config, f.gin_file, f.gin_param)


_GIN_CONFIGURABLES: dict = {}


def _section_configurable(section: str):
  """A gin configurable named after the section that returns whatever was bound to it."""
  import gin
  # gin keeps one global registry, so each section is registered once per process.
  if section not in _GIN_CONFIGURABLES:

    def bindings(**kwargs):
      return kwargs

    _GIN_CONFIGURABLES[section] = gin.external_configurable(
        bindings, name=section, module="jaxpipe.training.config"
    )
  return _GIN_CONFIGURABLES[section]


def apply_gin(
    config: ml_collections.ConfigDict, files: Iterable[str] = (), bindings: Iterable[str] = ()
) -> ml_collections.ConfigDict:
  """Applies gin bindings such as `model.d_model = 256` (files, then single bindings) onto `config`.

  Args:
    config: the config to change, in place.
    files: gin files.
    bindings: single bindings.

  Returns:
    `config`, changed.

  Raises:
    ConfigError: a file that does not exist, a binding gin cannot parse, or one that names no
      field of its section or a value the field does not take.
  """
  import gin

  files, bindings = list(files), list(bindings)
  if not files and not bindings:
    return config
  for f in files:  # gin would log its own error before raising
    if not os.path.isfile(f):
      raise ConfigError(f"--gin_file {f}: no such file (relative paths start at {os.getcwd()})")
  fns = {s: _section_configurable(s) for s in GIN_SECTIONS}
  gin.clear_config()
  try:
    try:
      gin.parse_config_files_and_bindings(files, bindings)
    except (ValueError, OSError) as e:
      raise ConfigError(
          f"gin: {e}; bind fields of the sections {GIN_SECTIONS}, e.g. 'model.d_model = 256'"
      ) from e
    bound = {section: fn() for section, fn in fns.items()}
  finally:
    gin.clear_config()
  for section, values in bound.items():
    for key, value in values.items():
      if key not in config[section]:
        close = difflib.get_close_matches(key, list(config[section].keys()), n=1)
        hint = (
            f"did you mean {section}.{close[0]}?" if close else f"fields: {list(config[section])}"
        )
        raise ConfigError(f"gin binding {section}.{key}: no such field; {hint}")
      try:
        config[section][key] = value
      except TypeError as e:
        raise ConfigError(f"gin binding {section}.{key} = {value!r}: {e}") from e
  return config
