"""jaxpipe's training step against what a user would run instead: a plain `jax.jit` step, MaxText.

  python -m experiments.train_bench [--config configs/quickstart.py] [--batch 32] \
      [--pp 2,4] [--schedules 1f1b,zb-h1] [--microbatches 8[,4]] [--rounds 3] [--steps 3] \
      [--warmup 2] [--noplain_scan] [--unroll_layers 16] [--nopool_host_memory] \
      [--shape smollm2-135m] [--dtypes float32,bfloat16] [--matmuls xla,onednn] \
      [--peer_python PATH] \
      [--out train_bench.json] [--config.key=value]

Contenders, one model (the config's) and one global batch (`--batch`, 0 = the config's):
- plain: a hand-written JAX + optax train step of the config's model (`plain_loss`: RMSNorm,
  rotary, GQA through `jax.nn.dot_product_attention`, SwiGLU, tied embeddings; AdamW with the
  config's clipping and schedule), data-parallel over every device with `jax.jit` and a
  NamedSharding that splits the batch; written apart from jaxpipe's Trainer, it reads only the
  parameter layout (`transformer.init_params`, so both start from the same parameters). It is
  the floor every ratio is taken against. `plain jax.jit, scan` (`--plain_scan`, on by
  default) is the same step with its layers in a `lax.scan`, as jaxpipe runs them: what the
  loop over layers costs by itself.
- jaxpipe pp=1: the Trainer's compiled step at pp = 1 (dp = all devices, one micro-batch),
  with the config's `model.unroll_layers` (the quickstart's: 32);
  `--unroll_layers 16,...` adds it at each of those `model.unroll_layers` values (stacks of at
  most that many layers unrolled; 0: a `lax.scan` loop), named with its `unroll_layers=`.
- jaxpipe pp=1 DTYPE matmul=M: the same step with `model.dtype` at each of `--dtypes`
  (bfloat16: float32 master weights, bfloat16 compute) and `train.matmul` at each of
  `--matmuls` (onednn: the projections' GEMMs and their gradients by oneDNN, `ops.matmul`).
- jaxpipe pp=P SCHEDULE: the Trainer's pipelined step, for each `--pp` and `--schedules`, with
  `--microbatches` micro-batches (dp = devices / P); given several counts, one contender per
  count, named with its `m=`.
- maxtext (with `--peer_python`): MaxText's pre-training loop on the same shape, run by that
  interpreter as a subprocess each round (synthetic data, `hardware=cpu`) through
  `experiments/maxtext_run.py`; its per-step seconds come from its log (`parse_maxtext_log`),
  its CPU seconds and page faults per step and its parameter count from the lines that runner
  adds (`parse_maxtext_cpu`, `parse_maxtext_params`; the count is printed beside jaxpipe's);
  its first `MAXTEXT_MIN_WARMUP` steps are never timed. Tested with maxtext 0.2.5 (Python >=
  3.12, JAX 0.12). MaxText is never a dependency of jaxpipe.

Each contender is compiled and warmed up (`--warmup` steps), then `--rounds` rounds each run every
contender for `--steps` steps in turn, the order rotated by one per round, and the reference GEMMs
timed the same way as the steps: the model's weight GEMMs once each (q+k+v, attention out, gate+up,
down, the head) at a step's tokens a device (`--matmul_tokens`), in each dtype the steps compute in,
on XLA's dot and on each other matmul backend the contenders use (`ops.matmul`); a dtype's peak in a
round is the fastest of these. Per step: wall time, process CPU time (`time.process_time()` around a
blocked step; the 8 host devices share the machine's cores, so CPU time is the steadier measure) and
the process's minor page faults (`getrusage`): glibc returns a freed allocation over 32 MB to the
OS, so a program whose temporaries come in such allocations faults them in again on every step. By
default the bench keeps freed memory in the heap instead (`mallopt`, as a device allocator pools its
memory, and as `python -m jaxpipe.train` does on CPU: `train.pool_host_memory`), for every contender
in its process alike; `--nopool_host_memory` measures with glibc's defaults. A peer runs in its own
process as its users run it.
Columns: tokens/s (median over rounds of the round's tokens over its wall time); ms/step; CPU
s/step; MFU = model FLOPs per CPU second (`jaxpipe.models.flops`, matmuls only) over the peak FLOPs
per CPU second of the contender's dtype in the same round, median over rounds; wall and CPU ratio =
the contender's time per step over the plain step's in the same round, median (lowest-highest) over
rounds (below 1 = faster than plain); faults/step = minor page faults per step, median over rounds;
temp MB = per-device temporaries from `compiled.memory_analysis()`; HLO = instructions in the
compiled program's text. `--out FILE.json` keeps every raw sample and the load of each round.
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.shapes import SHAPES, gemms  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    "configs/quickstart.py",
    "Config file (its model, optimizer, data).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "batch",
    32,
    "Global batch in sequences for every contender (32: the smallest that pp = 2 x dp = 4 x 8"
    " micro-batches splits); 0 = the config's.",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "pp", ["2", "4"], "Pipeline sizes of jaxpipe's pipelined steps.", flag_values=FLAGS
)
flags.DEFINE_list(
    "schedules", ["1f1b", "zb-h1"], "Schedules of the pipelined steps.", flag_values=FLAGS
)
flags.DEFINE_list(
    "microbatches",
    ["8"],
    "Micro-batches of the pipelined steps (comma-separated).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "plain_scan",
    True,
    "Also time the plain step with its layers in a lax.scan (as jaxpipe runs them).",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "unroll_layers",
    [],
    "Also time jaxpipe pp=1 with model.unroll_layers at each value (0: the layer scan a loop).",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "dtypes",
    [],
    "Also time jaxpipe pp=1 with model.dtype at each value (bfloat16: float32 master weights,"
    " bfloat16 compute), with each of --matmuls.",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "matmuls",
    [],
    "Also time jaxpipe pp=1 with train.matmul at each value (xla, onednn, auto: ops.matmul), in"
    " each of --dtypes.",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "shape",
    None,
    list(SHAPES),
    "The model's shape (experiments/shapes.py) in place of the config's; its data, optimizer and"
    " settings kept.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "pool_host_memory",
    True,
    "Keep freed host memory in the heap (glibc mallopt: no mmap, no trim), as a device allocator"
    " pools its memory and as `python -m jaxpipe.train` runs (train.pool_host_memory);"
    " --nopool_host_memory: glibc's defaults.",
    flag_values=FLAGS,
)
flags.DEFINE_integer("rounds", 3, "Timed rounds; every contender runs in each.", flag_values=FLAGS)
flags.DEFINE_integer("steps", 3, "Timed steps of each contender per round.", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "Untimed steps of each contender first.", flag_values=FLAGS)
flags.DEFINE_integer(
    "matmul_tokens",
    0,
    "Rows a device of the reference GEMMs (the peak MFU is read against); 0: a step's tokens a"
    " device.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "peer_python",
    None,
    "Python interpreter with MaxText importable (its own venv); adds MaxText as a contender.",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "peer_overrides",
    [],
    "Extra MaxText key=value overrides, after the bench's own (comma-separated).",
    flag_values=FLAGS,
)
flags.DEFINE_float("peer_timeout", 1800, "Seconds per MaxText run.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "JSON file for every raw sample.", flag_values=FLAGS)

PLAIN = "plain jax.jit"
PLAIN_SCAN = "plain jax.jit, scan"
MATMUL = "matmul"
MAXTEXT = "maxtext"


# -- the plain step: the config's model written out in jnp, trained by optax -----------------------


def _rms(x_BxLxD, scale_D, eps):
  return x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD * x_BxLxD, -1, keepdims=True) + eps) * scale_D


def _rotary(x_BxLxHxK, theta):
  """Rotary positions 0..L-1, channel i paired with i + K/2 (the Llama/NeoX layout)."""
  seq, half = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1] // 2
  inv_freq_K2 = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angle_LxK2 = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq_K2
  cos_1xLx1xK2, sin_1xLx1xK2 = (
      jnp.cos(angle_LxK2)[None, :, None],
      jnp.sin(angle_LxK2)[None, :, None],
  )
  a, b = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
  return jnp.concatenate(
      [a * cos_1xLx1xK2 - b * sin_1xLx1xK2, b * cos_1xLx1xK2 + a * sin_1xLx1xK2], -1
  )


def plain_layer(cfg, p: dict, x_BxLxD: jax.Array) -> jax.Array:
  """One pre-norm decoder layer: GQA self-attention with rotary positions, then SwiGLU."""
  eps, attn, mlp = cfg.norm_eps, p["attn"], p["mlp"]
  h_BxLxD = _rms(x_BxLxD, p["attn_norm"]["scale"], eps)
  q_BxLxHxK = jnp.einsum("bld,dhk->blhk", h_BxLxD, attn["q"]["kernel"])
  k_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, attn["k"]["kernel"])
  v_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, attn["v"]["kernel"])
  q_BxLxHxK, k_BxLxGxK = _rotary(q_BxLxHxK, cfg.rope_theta), _rotary(k_BxLxGxK, cfg.rope_theta)
  o_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True)
  x_BxLxD = x_BxLxD + jnp.einsum("blhk,hkd->bld", o_BxLxHxK, attn["o"]["kernel"])
  h_BxLxD = _rms(x_BxLxD, p["mlp_norm"]["scale"], eps)
  gate_BxLxF = jax.nn.silu(h_BxLxD @ mlp["gate"]["kernel"])
  return x_BxLxD + (gate_BxLxF * (h_BxLxD @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]


def plain_loss(cfg, params: dict, batch: dict, scan: bool = False) -> jax.Array:
  """Mean next-token cross-entropy over the batch's valid tokens: the config's decoder in jnp,
  its layers a Python loop (XLA sees them unrolled) or, with `scan`, a `lax.scan` over them."""
  x_BxLxD = params["embed"][batch["tokens"]]
  if scan:
    x_BxLxD, _ = jax.lax.scan(
        lambda x, p: (plain_layer(cfg, p, x), None), x_BxLxD, params["layers"]
    )
  else:
    for i in range(cfg.n_layers):
      x_BxLxD = plain_layer(cfg, jax.tree.map(lambda a, i=i: a[i], params["layers"]), x_BxLxD)
  h_BxLxD = _rms(x_BxLxD, params["final_norm"]["scale"], cfg.norm_eps)
  head_DxV = params["embed"].T if cfg.tied_embeddings else params["head"]
  logp_BxLxV = jax.nn.log_softmax(h_BxLxD @ head_DxV)
  nll_BxL = -jnp.take_along_axis(logp_BxLxV, batch["targets"][..., None], -1)[..., 0]
  mask_BxL = batch["mask"]
  return jnp.sum(nll_BxL * mask_BxL) / jnp.maximum(jnp.sum(mask_BxL), 1.0)


def plain_optimizer(opt, steps: int) -> optax.GradientTransformation:
  """AdamW (no decay on norm scales) on a linear warm-up + cosine schedule, after global-norm
  clipping: the config's optimizer section, in optax's own pieces."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, opt.lr, opt.warmup_steps, max(steps, opt.warmup_steps + 1), opt.lr * opt.min_lr_ratio
  )
  decays = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key != "scale", params
  )
  adamw = optax.adamw(
      schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decays
  )
  return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adamw) if opt.clip_norm else adamw


def check_plain(cfg) -> None:
  """app.UsageError unless the plain step writes the config's model: dense, float32, no FP8,
  no QK norm, no rematerialisation."""
  wrong = {
      "moe": cfg.moe is not None,
      "dtype": cfg.dtype != "float32",
      "fp8": cfg.fp8 != "none",
      "qk_norm": cfg.qk_norm,
      "remat": cfg.remat,
  }
  bad = [k for k, v in wrong.items() if v]
  if bad:
    raise app.UsageError(
        f"the plain step writes a dense float32 model without fp8, qk_norm or remat; the config "
        f"sets model.{', model.'.join(bad)}"
    )


class PlainStep:
  """The plain data-parallel train step: params replicated, the batch split over every device.

  plain = PlainStep(config)               # same parameters as the Trainer's (train.seed)
  plain = PlainStep(config, scan=True)    # the same, its layers a lax.scan
  metrics = plain.step(batch)             # {'loss', 'grad_norm'}; plain.state: (params, opt)
  """

  def __init__(self, config, devices=None, scan: bool = False):
    from jaxpipe.models import transformer

    self.cfg = transformer.TransformerConfig(**config.model.to_dict())
    check_plain(self.cfg)
    devices = jax.devices() if devices is None else devices
    self.mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    self.batch_sharding = NamedSharding(self.mesh, P("dp"))
    replicated = NamedSharding(self.mesh, P())
    tx = plain_optimizer(config.optimizer, config.train.steps)
    params = jax.jit(transformer.init_params, static_argnums=0, out_shardings=replicated)(
        self.cfg, jax.random.key(config.train.seed)
    )
    self.state = (params, jax.jit(tx.init, out_shardings=replicated)(params))
    cfg = self.cfg

    def train_step(state, batch):
      params, opt_state = state
      loss, grads = jax.value_and_grad(plain_loss, argnums=1)(cfg, params, batch, scan)
      updates, opt_state = tx.update(grads, opt_state, params)
      metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
      return (optax.apply_updates(params, updates), opt_state), metrics

    self._step = jax.jit(
        train_step,
        in_shardings=(replicated, self.batch_sharding),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    self.compiled = None

  def put(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jax.device_put(v, self.batch_sharding) for k, v in host_batch.items()}

  def compile(self, batch: dict) -> jax.stages.Compiled:
    self.compiled = self._step.lower(self.state, batch).compile()
    return self.compiled

  def step(self, batch: dict) -> dict[str, jax.Array]:
    run = self.compiled or self._step
    self.state, metrics = run(self.state, batch)
    return metrics


# -- contenders and timing ----------------------------------------------------------------------


@dataclasses.dataclass
class Contender:
  """One thing timed: `run(steps)` -> [(wall s, CPU s or None, minor page faults or None)] per
  step."""

  name: str
  run: Callable[[int], list[tuple[float, float | None]]]
  flops: float  # per step
  tokens: int  # per step
  info: dict = dataclasses.field(default_factory=dict)  # compile s, temp bytes, HLO count


def minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(step: Callable[[], Any]) -> Callable[[int], list[tuple[float, float, int]]]:
  """-> run(steps): each step blocked on, its wall and process CPU seconds and minor faults."""

  def run(steps):
    out = []
    for _ in range(steps):
      f0, t0, c0 = minor_faults(), time.perf_counter(), time.process_time()
      jax.block_until_ready(step())
      t1, c1 = time.perf_counter(), time.process_time()
      out.append((t1 - t0, c1 - c0, minor_faults() - f0))
    return out

  return run


def compiled_info(compiled, compile_s: float) -> dict:
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  return {
      "compile_s": compile_s,
      "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
      "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, re.M)),
  }


def plain_contender(config, host_batches, flops, tokens, scan: bool = False) -> Contender:
  plain = PlainStep(config, scan=scan)
  batches = [plain.put(b) for b in host_batches]
  t0 = time.perf_counter()
  compiled = plain.compile(batches[0])
  info = {**compiled_info(compiled, time.perf_counter() - t0), "dtype": config.model.dtype}
  it = itertools.count()

  def step():
    metrics = plain.step(batches[next(it) % len(batches)])
    return metrics, plain.state

  return Contender(PLAIN_SCAN if scan else PLAIN, timed(step), flops, tokens, info)


SHAPE_FIELDS = (
    "vocab",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "norm_eps",
    "rope_theta",
    "tied_embeddings",
)


def with_shape(config, shape) -> None:
  """Sets the config's model to `shape`'s sizes (`experiments.shapes`), in place."""
  for name in SHAPE_FIELDS:
    config.model[name] = getattr(shape, name)


def jaxpipe_config(config, batch: int, pp: int = 1, schedule: str = "1f1b", microbatches: int = 1):
  c = config.copy_and_resolve_references()
  c.data.batch = batch
  c.mesh.pp, c.mesh.dp = pp, None
  c.pipeline.schedule, c.pipeline.microbatches = schedule, microbatches
  return c


def jaxpipe_contender(name, config, host_batches, flops, tokens) -> Contender:
  from jaxpipe.training.trainer import Trainer

  trainer = Trainer(config)
  trainer.init()
  batches = [trainer.shard_batch(b) for b in host_batches]
  compiled = trainer.compile()
  info = {
      **compiled_info(compiled, trainer.compile_stats["compile_s"]),
      "dtype": config.model.dtype,
  }
  it = itertools.count()

  def step():  # what Trainer.step runs, on the compiled program
    trainer.state, metrics = compiled(trainer.state, batches[next(it) % len(batches)])
    return metrics, trainer.state

  return Contender(name, timed(step), flops, tokens, info)


def matmul_contenders(model_cfg, tokens: int, dtypes, backends) -> list[Contender]:
  """The peak the steps are held to: the model's weight GEMMs once each (q+k+v, attention out,
  gate+up, down, the head) at `tokens` rows a device, rows split over every device as the batch
  is; one contender per dtype and matmul backend.

  Args:
    model_cfg: the model (`TransformerConfig`).
    tokens: rows of each product on each device (a step's tokens per device).
    dtypes: the steps' compute dtypes.
    backends: resolved `ops.matmul` backends ('xla', 'onednn').

  Returns:
    Contenders named `matmul DTYPE BACKEND`, info['reference'] set, info['dtype'] theirs.
  """
  from jaxpipe.ops import matmul as matmul_lib

  kn = [(kk, n) for _, kk, n in gemms(model_cfg, tokens).values()]
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
  rng = np.random.default_rng(0)
  flops = 2.0 * len(devices) * tokens * sum(kk * n for kk, n in kn)
  out = []
  for dtype in dtypes:
    put = lambda shape, spec, dtype=dtype: jax.device_put(
        jnp.asarray(rng.standard_normal(shape, np.float32), dtype), NamedSharding(mesh, spec)
    )
    xs = [put((len(devices) * tokens, kk), P("dp")) for kk, _ in kn]
    ws = [put((kk, n), P()) for kk, n in kn]
    for backend in backends:

      def products(xs, ws, backend=backend):
        with matmul_lib.backend(backend):
          return [matmul_lib.dot(x, w) for x, w in zip(xs, ws, strict=True)]

      program = jax.jit(
          jax.shard_map(products, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
      )
      compiled = program.lower(xs, ws).compile()
      info = {"reference": True, "dtype": dtype}
      step = lambda compiled=compiled, xs=xs, ws=ws: compiled(xs, ws)
      out.append(Contender(f"{MATMUL} {dtype} {backend}", timed(step), flops, 0, info))
  return out


# -- MaxText ------------------------------------------------------------------------------------

_PEER_PROBE = "import os, maxtext; print(os.path.dirname(maxtext.__file__))"


def check_peer(path: str) -> str:
  """The MaxText package directory of the interpreter `path`; app.UsageError (one line) unless
  `path` is an executable Python in which `import maxtext` works."""
  if not (os.path.isfile(path) and os.access(path, os.X_OK)):
    raise app.UsageError(f"--peer_python {path}: not an executable file")
  try:
    r = subprocess.run(
        [path, "-c", _PEER_PROBE], capture_output=True, text=True, timeout=300, check=False
    )
  except OSError as e:
    raise app.UsageError(f"--peer_python {path}: cannot run it ({e.strerror})") from None
  except subprocess.TimeoutExpired:
    raise app.UsageError(f"--peer_python {path}: `import maxtext` took over 300 s") from None
  lines = r.stdout.strip().splitlines()
  where = lines[-1] if lines else ""
  if r.returncode or not os.path.isfile(os.path.join(where, "configs", "base.yml")):
    errors = r.stderr.strip().splitlines()
    why = errors[-1] if errors else f"exit status {r.returncode}, no MaxText configs/base.yml"
    raise app.UsageError(
        f"--peer_python {path}: not a Python with MaxText importable ({why}); "
        "install it in its own venv: pip install 'maxtext[tpu]'"
    )
  return where


def maxtext_overrides(config, batch: int, steps: int, devices: int, outdir: str) -> list[str]:
  """MaxText key=value overrides for the config's model, optimizer and shape, data-parallel
  over `devices` CPU devices, synthetic data, no checkpoints."""
  m, o = config.model, config.optimizer
  if batch % devices:
    raise app.UsageError(f"--batch {batch} does not split over {devices} devices for MaxText")
  return [
      "run_name=train_bench",
      f"base_output_directory={outdir}",
      "hardware=cpu",
      "skip_jax_distributed_system=true",
      "dataset_type=synthetic",
      "enable_checkpointing=false",
      "enable_tensorboard=false",
      "enable_goodput_recording=false",
      "monitor_goodput=false",
      f"steps={steps}",
      f"per_device_batch_size={batch // devices}",
      f"max_target_length={config.data.seq_len}",
      "decoder_block=llama2",
      f"base_emb_dim={m.d_model}",
      f"base_num_query_heads={m.n_heads}",
      f"base_num_kv_heads={m.n_kv_heads}",
      f"head_dim={m.head_dim}",
      f"base_mlp_dim={m.d_ff}",
      f"base_num_decoder_layers={m.n_layers}",
      f"vocab_size={m.vocab}",
      f"logits_via_embedding={str(m.tied_embeddings).lower()}",
      "normalize_embedding_logits=false",  # MaxText divides tied logits by sqrt(d_model)
      f"normalization_layer_epsilon={m.norm_eps}",
      f"rope_max_timescale={int(m.rope_theta)}",
      "rope_interleave=false",  # channel i paired with i + K/2, as jaxpipe's rotary
      f"dtype={m.dtype}",
      "weight_dtype=float32",
      "attention=dot_product",
      "remat_policy=minimal_with_context",  # MaxText always wraps a layer in jax.checkpoint
      "enable_dropout=false",
      f"ici_data_parallelism={devices}",
      "ici_fsdp_parallelism=1",
      "opt_type=adamw",
      "adamw_mask=['scale']",  # no weight decay on the norm scales, as jaxpipe
      f"learning_rate={o.lr}",
      "lr_schedule_type=cosine",
      f"learning_rate_schedule_steps={config.train.steps}",
      f"warmup_steps_fraction={o.warmup_steps / config.train.steps}",
      f"learning_rate_final_fraction={o.min_lr_ratio}",
      f"adam_b1={o.b1}",
      f"adam_b2={o.b2}",
      f"adam_eps={o.eps}",
      f"adam_weight_decay={o.weight_decay}",
      f"gradient_clipping_threshold={o.clip_norm}",
  ]


MAXTEXT_MIN_WARMUP = 3
MAXTEXT_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext_run.py")


def maxtext_command(peer: str, package: str, overrides: list[str]) -> list[str]:
  """`maxtext.trainers.pre_train.train` as `python -m` runs it, through `maxtext_run.py`, which
  adds a CPU-time line after each step's and the exact parameter count."""
  base = os.path.join(package, "configs", "base.yml")
  return [peer, MAXTEXT_RUN, base, *overrides]


def parse_maxtext_log(text: str) -> list[dict[str, float]]:
  """MaxText's per-step lines (`metric_logger`: "completed step: 3, seconds: 0.319,
  TFLOP/s/device: ..., Tokens/s/device: ..., total_weights: ..., loss: ...", with or without a
  logging prefix and later fields) -> one dict per step: step, seconds, tflops_per_device,
  tokens_per_device, total_weights, loss. Rampup-phase and profiler-boundary lines, which carry
  no throughput, are left out."""
  names = {
      "completed step": "step",
      "seconds": "seconds",
      "TFLOP/s/device": "tflops_per_device",
      "Tokens/s/device": "tokens_per_device",
      "total_weights": "total_weights",
      "loss": "loss",
  }
  steps = []
  for line in text.splitlines():
    at = line.find("completed step: ")
    if at < 0:
      continue
    fields = {}
    for part in line[at:].split(", "):
      key, sep, value = part.partition(": ")
      if sep and key.strip() in names:
        try:
          fields[names[key.strip()]] = float(value.split()[0])
        except (ValueError, IndexError):
          pass
    if "seconds" in fields and "tokens_per_device" in fields:
      fields["step"] = int(fields["step"])
      steps.append(fields)
  return steps


_CPU_LINE = re.compile(
    r"^train_bench cpu: step (\d+), process_time: ([0-9.]+)(?:, minor_faults: (\d+))?\s*$", re.M
)
_PARAMS_LINE = re.compile(r"^train_bench parameters: (\d+)\s*$", re.M)


def parse_maxtext_cpu(text: str) -> dict[int, tuple[float, int | None]]:
  """`maxtext_run.py`'s lines -> {step: (CPU seconds, minor page faults or None) from the
  previous logged step to this one}; the first logged step has none."""
  marks = sorted(
      (int(m[1]), float(m[2]), None if m[3] is None else int(m[3]))
      for m in _CPU_LINE.finditer(text)
  )
  return {
      s: (t - t0, None if f is None or f0 is None else f - f0)
      for (_, t0, f0), (s, t, f) in zip(marks, marks[1:])
  }


def parse_maxtext_params(text: str) -> int | None:
  m = _PARAMS_LINE.search(text)
  return int(m[1]) if m else None


def maxtext_contender(config, batch, flops, tokens, args, package: str) -> Contender:
  devices = len(jax.devices())
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"

  # MaxText's `seconds` for a step run from one dispatch to the next, up to two steps in flight:
  # right after the compile two steps share one step's time (2.9 and 0.1 s for steps 1 and 2 of
  # the quickstart), so its first three steps are never timed.
  warmup = max(args.warmup, MAXTEXT_MIN_WARMUP)

  def run(steps):
    with tempfile.TemporaryDirectory(prefix="train_bench_maxtext") as outdir:
      overrides = maxtext_overrides(config, batch, warmup + steps, devices, outdir)
      cmd = maxtext_command(args.peer_python, package, overrides + list(args.peer_overrides))
      r = subprocess.run(
          cmd, capture_output=True, text=True, env=env, timeout=args.peer_timeout, check=False
      )
    text = r.stdout + "\n" + r.stderr
    logged = [s for s in parse_maxtext_log(text) if s["step"] >= warmup]
    if r.returncode or len(logged) < steps:
      tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
      raise RuntimeError(
          f"MaxText exited {r.returncode} with {len(logged)} of {steps} timed steps logged: "
          f"{tail[0]}\n  command: {' '.join(cmd)}"
      )
    cpu = parse_maxtext_cpu(text)
    info["parameters"] = parse_maxtext_params(text)
    return [(s["seconds"], *cpu.get(s["step"], (None, None))) for s in logged[-steps:]]

  info = {"dtype": config.model.dtype}
  return Contender(MAXTEXT, run, flops, tokens, info)


# -- the bench ----------------------------------------------------------------------------------


def rotated(items: list, r: int) -> list:
  k = r % len(items)
  return items[k:] + items[:k]


def measure(contenders: list[Contender], rounds: int, steps: int, warmup: int) -> dict:
  """Warms every contender, then times `rounds` rounds of `steps` steps each, the order rotated
  by one per round -> {'samples': {name: [[[wall, cpu], ...] per round]}, 'order', 'load'}."""
  for c in contenders:
    if c.name != MAXTEXT and warmup:
      c.run(warmup)
  samples = {c.name: [] for c in contenders}
  orders, loads = [], []
  for r in range(rounds):
    order = rotated(contenders, r)
    orders.append([c.name for c in order])
    load0 = os.getloadavg()[0]
    for c in order:
      samples[c.name].append([list(s) for s in c.run(steps)])
    loads.append([load0, os.getloadavg()[0]])
    print(f"round {r + 1}/{rounds}: load {load0:.1f} -> {loads[-1][1]:.1f}", flush=True)
  return {"samples": samples, "order": orders, "load": loads}


def per_round(rounds: list[list[list[float | None]]], i: int) -> list[float | None]:
  """Per step in each round (mean over the round's steps) of field i (0 wall s, 1 CPU s, 2 minor
  page faults)."""
  out = []
  for steps in rounds:
    values = [s[i] for s in steps]
    out.append(None if None in values else sum(values) / len(values))
  return out


def peaks(contenders: list[Contender], measured: dict) -> dict[str, list[float]]:
  """Each dtype's peak in each round: the fastest reference matmul's FLOPs per CPU second."""
  out = {}
  for c in contenders:
    if c.info.get("reference"):
      rates = [c.flops / x for x in per_round(measured["samples"][c.name], 1)]
      best = out.get(c.info["dtype"], [0.0] * len(rates))
      out[c.info["dtype"]] = [max(a, b) for a, b in zip(best, rates, strict=True)]
  return out


def summarise(contenders: list[Contender], measured: dict) -> list[dict]:
  """One row per contender (the reference matmuls left out): medians over rounds and per-round
  ratios; MFU against the contender's dtype's peak in each round (`peaks`)."""
  samples = measured["samples"]
  base_wall, base_cpu = per_round(samples[PLAIN], 0), per_round(samples[PLAIN], 1)
  peak = peaks(contenders, measured)
  rows = []
  for c in contenders:
    if c.info.get("reference"):
      continue
    wall, cpu = per_round(samples[c.name], 0), per_round(samples[c.name], 1)
    faults = per_round(samples[c.name], 2)
    has_cpu = None not in cpu
    mm_rate = peak.get(c.info.get("dtype"))
    rows.append(
        {
            "name": c.name,
            "tokens_per_s": statistics.median(c.tokens / w for w in wall),
            "ms_per_step": 1e3 * statistics.median(wall),
            "cpu_s_per_step": statistics.median(cpu) if has_cpu else None,
            "mfu_percent": (
                statistics.median(100 * c.flops / x / rate for x, rate in zip(cpu, mm_rate))
                if has_cpu and mm_rate
                else None
            ),
            "wall_ratio": [w / b for w, b in zip(wall, base_wall)],
            "cpu_ratio": [x / b for x, b in zip(cpu, base_cpu)] if has_cpu else None,
            "faults_per_step": statistics.median(faults) if None not in faults else None,
            **c.info,
        }
    )
  return rows


def parameter_count(config) -> int:
  """Parameters of the config's model (`transformer.init_params`, shapes only)."""
  from jaxpipe.models import transformer

  cfg = transformer.TransformerConfig(**config.model.to_dict())
  shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def contenders_by(contenders: list[Contender]) -> dict[str, Contender]:
  return {c.name: c for c in contenders}


def spread(ratios: list[float] | None) -> str:
  if not ratios:
    return "–"
  return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


COLUMNS = (
    "contender",
    "tokens/s",
    "ms/step",
    "CPU s/step",
    "MFU %",
    "wall ratio",
    "CPU ratio",
    "faults/step",
    "temp MB",
    "HLO",
    "compile s",
)


def table(rows: list[dict]) -> str:
  """The markdown table: one row per contender, COLUMNS."""

  def fmt(v, spec):
    return "–" if v is None else format(v, spec)

  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    temp = r.get("temp_bytes")
    cells = [
        r["name"],
        fmt(r["tokens_per_s"], ",.0f"),
        fmt(r["ms_per_step"], ".0f"),
        fmt(r["cpu_s_per_step"], ".3f"),
        fmt(r["mfu_percent"], ".1f"),
        spread(r["wall_ratio"]),
        spread(r["cpu_ratio"]),
        fmt(r.get("faults_per_step"), ",.0f"),
        fmt(None if temp is None else temp / 2**20, ".2f"),
        fmt(r.get("hlo_instructions"), "d"),
        fmt(r.get("compile_s"), ".1f"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def build(args, config) -> list[Contender]:
  """The contenders, compiled and ready: plain first, then jaxpipe's, MaxText, the reference
  GEMMs."""
  from jaxpipe.models import flops as flops_lib
  from jaxpipe.ops import matmul as matmul_lib
  from jaxpipe.training import batches as data_lib
  from jaxpipe.training import config as config_lib

  batch = args.batch or config.data.batch
  seq = config.data.seq_len
  model_cfg = config_lib.model_config(config)
  flops = flops_lib.training_flops_per_step(model_cfg, batch, seq)
  tokens = batch * seq
  devices = len(jax.devices())
  cells = [("jaxpipe pp=1", jaxpipe_config(config, batch))]
  for unroll in args.unroll_layers:
    c = jaxpipe_config(config, batch)
    c.model.unroll_layers = unroll
    cells.append((f"jaxpipe pp=1 unroll_layers={unroll}", c))
  for dtype in args.dtypes or [config.model.dtype]:
    for matmul in args.matmuls or [config.train.matmul]:
      if (dtype, matmul) != (config.model.dtype, config.train.matmul):
        c = jaxpipe_config(config, batch)
        c.model.dtype, c.train.matmul = dtype, matmul
        cells.append((f"jaxpipe pp=1 {dtype} matmul={matmul}", c))
  for pp in args.pp:
    for schedule in args.schedules:
      for m in args.microbatches:
        name = f"jaxpipe pp={pp} {schedule}" + (f" m={m}" if len(args.microbatches) > 1 else "")
        cells.append((name, jaxpipe_config(config, batch, pp, schedule, m)))
  for _, c in cells:  # every config refused before anything compiles
    try:
      config_lib.validate(c, devices, jax.default_backend())
    except config_lib.ConfigError as e:
      raise app.UsageError(str(e)) from None
  if batch % devices:
    raise app.UsageError(f"--batch {batch} does not split over the plain step's {devices} devices")
  check_plain(model_cfg)
  peer = None
  if args.peer_python:
    peer = maxtext_contender(config, batch, flops, tokens, args, args.peer_package)
  source = data_lib.make_source(config.data, model_cfg.vocab)
  host_batches = [source.batch("train", i, batch, seq) for i in range(4)]
  out = [plain_contender(config, host_batches, flops, tokens)]
  if args.plain_scan:
    out.append(plain_contender(config, host_batches, flops, tokens, scan=True))
  for name, c in cells:
    out.append(jaxpipe_contender(name, c, host_batches, flops, tokens))
    print(f"compiled {name}: {out[-1].info['compile_s']:.1f} s", flush=True)
  if peer is not None:
    out.append(peer)
  dtypes = sorted({c.model.dtype for _, c in cells})
  backends = sorted({"xla"} | {matmul_lib.resolve(c.train.matmul) for _, c in cells})
  per_device = args.matmul_tokens or tokens // devices
  out.extend(matmul_contenders(model_cfg, per_device, dtypes, backends))
  return out


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  for name in ("pp", "microbatches", "unroll_layers"):
    try:
      setattr(args, name, [int(v) for v in getattr(args, name)])
    except ValueError:
      raise app.UsageError(
          f"--{name} {','.join(getattr(args, name))}: integers, comma-separated"
      ) from None
  if args.matmul_tokens < 0:
    raise app.UsageError(f"--matmul_tokens={args.matmul_tokens} must be 0 (a step's) or more")
  for name in ("rounds", "steps"):
    if getattr(args, name) < 1:
      raise app.UsageError(f"--{name}={getattr(args, name)} must be at least 1")
  if min(args.microbatches, default=0) < 1:
    raise app.UsageError(f"--microbatches {args.microbatches}: each must be at least 1")
  config = _CONFIG.value
  if args.shape:
    with_shape(config, SHAPES[args.shape])
  if args.peer_python:
    args.peer_package = check_peer(args.peer_python)  # before any compile
  if args.pool_host_memory:
    cli.pool_host_memory()
  load0 = os.getloadavg()
  contenders = build(args, config)
  measured = measure(contenders, args.rounds, args.steps, args.warmup)
  rows = summarise(contenders, measured)
  batch = args.batch or config.data.batch
  m = config.model
  print(
      f"\n{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.n_kv_heads} KV), d_ff "
      f"{m.d_ff}, vocab {m.vocab}; batch {batch} x {config.data.seq_len} tokens; "
      f"{len(jax.devices())} {jax.devices()[0].platform} devices on {os.cpu_count()} cores; "
      f"{args.rounds} rounds x {args.steps} steps; host memory "
      f"{'pooled' if args.pool_host_memory else 'glibc default'}; "
      f"load average {load0[0]:.1f} at the start, "
      f"{min(min(x) for x in measured['load']):.1f}–{max(max(x) for x in measured['load']):.1f} "
      "during the rounds"
  )
  print(table(rows))
  for dtype, rates in peaks(contenders, measured).items():
    print(
        f"peak {dtype} (the reference GEMMs' fastest): "
        f"{statistics.median(rates) / 1e9:,.1f} GFLOP per CPU second (median over rounds)"
    )
  if args.peer_python:
    theirs = contenders_by(contenders)[MAXTEXT].info.get("parameters")
    ours = parameter_count(config)
    print(
        f"parameters: jaxpipe {ours:,}, MaxText {'?' if theirs is None else f'{theirs:,}'}"
        + ("" if theirs == ours else " (they differ)")
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
          {
              "argv": sys.argv,
              "flags": {k: v for k, v in vars(args).items() if k != "config"},
              "config": config.to_dict(),
              "devices": len(jax.devices()),
              "cpus": os.cpu_count(),
              "load_at_start": load0,
              "flops": {c.name: c.flops for c in contenders},
              "tokens": {c.name: c.tokens for c in contenders},
              **measured,
              "rows": rows,
          },
          f,
          indent=1,
      )


if __name__ == "__main__":
  cli.run(main)
