"""Measure a model's stage costs on the real devices and write the cost file the simulators read.

  python -m jaxpipe.measure --config configs/quickstart.py --config.mesh.pp=4 \
      --config.model.n_layers=8 --config.data.batch=32 --microbatches 8,16 --stages 4,8 \
      --out costs.json
  python -m jaxpipe.schedule auto --pp 4 --microbatches 8 --costs costs.json

For each micro-batch count and stage count: one virtual stage of the config's model (its first
n_layers/stages layers) on one micro-batch of this mesh's per-device shape, its parts built by
the executor's own `stage_ops` (F keeps the `jax.vjp` residuals, I and W are the two halves of
that vjp, B both). Every device of the mesh runs the part at once, as in a tick where every rank
works, inside a `lax.scan` of `--inner` iterations whose inputs are tied to the loop (so XLA
cannot hoist the work out), and the median over `--repeats` calls, after one that compiles and
warms up, divided by `--inner` is the part's time. The same for one ppermute of an activation to
the next pipeline rank, the embedding (first stage) and the head and loss (last stage), and the
optimizer update on the real train state. Bytes come from the shapes: exact.
"""
from __future__ import annotations

from jaxpipe import runtime

if __name__ == "__main__":
  runtime.use_host_devices()

import functools  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpipe import config as config_lib  # noqa: E402
from jaxpipe.mesh import BATCH_AXES, make_mesh  # noqa: E402
from jaxpipe.models import transformer  # noqa: E402
from jaxpipe.pipeline import auto as auto_lib  # noqa: E402
from jaxpipe.pipeline import costs as costs_lib  # noqa: E402
from jaxpipe.pipeline.executor import stage_ops  # noqa: E402
from jaxpipe.pipeline.lm import CONTEXT_AXIS, lm_model, stage_param_specs  # noqa: E402
from jaxpipe.trainer import TrainState, make_optimizer, state_shardings  # noqa: E402


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


# The parts one compiled program runs, chosen by an argument; "" runs nothing (the baseline).
KINDS = costs_lib.SECONDS + ("",)


def time_call(fn: Callable, args: tuple, repeats: int) -> float:
  """Median seconds of `fn(*args)` over `repeats` calls, after one call that compiles and warms."""
  return time_kinds(lambda _, *a: fn(*a), [None], args, repeats)[0]


def time_kinds(fn: Callable, kinds: list, args: tuple, repeats: int) -> list[float]:
  """Median seconds of `fn(kind, *args)` for each kind over `repeats` rounds, after one warm-up
  round; each round times every kind once, so load that drifts during the run hits all alike."""
  for k in kinds:
    jax.block_until_ready(fn(k, *args))
  times = [[] for _ in kinds]
  for _ in range(repeats):
    for i, k in enumerate(kinds):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(k, *args))
      times[i].append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


def _tied(tree, carry):
  """`tree` as a value of this loop iteration (via `carry`), so XLA cannot hoist work on it."""
  return lax.optimization_barrier((tree, carry))[0]


def _acc(acc, d):
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d)


def _f32_zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), tree)


def microbatch_shape(config: ml_collections.ConfigDict, mesh_shape: dict, microbatches: int
                     ) -> tuple[int, int]:
  """Sequences and tokens one device holds of one micro-batch: [batch / (dp ep m), seq / cp]."""
  replicas = mesh_shape["dp"] * mesh_shape["ep"]
  if config.data.batch % (replicas * microbatches):
    raise config_lib.ConfigError(
        f"data.batch={config.data.batch} does not split into {replicas} data ranks x "
        f"{microbatches} micro-batches; measure a micro-batch count that divides "
        f"{config.data.batch // replicas}")
  return config.data.batch // (replicas * microbatches), config.data.seq_len // mesh_shape["cp"]


def stage_entry(cfg: transformer.TransformerConfig, mesh: jax.sharding.Mesh, microbatches: int,
                stages: int, shape: tuple[int, int], repeats: int, inner: int) -> dict:
  """Seconds and bytes of one virtual stage (n_layers/stages layers) on a [b, L] micro-batch."""
  every = cfg.moe.every if cfg.moe is not None else 1
  units = cfg.n_layers // every
  if units % stages:
    raise config_lib.ConfigError(f"model.n_layers={cfg.n_layers} does not split into {stages} "
                                 "stages; measure a stage count that divides the layers")
  seq_axes = (CONTEXT_AXIS,) if mesh.shape[CONTEXT_AXIS] > 1 else ()
  model = lm_model(cfg, seq_axes[0] if seq_axes else None)
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  stage = jax.tree.map(lambda a: a[:units // stages], params["layers"])
  head = {k: v for k, v in params.items() if k != "layers"}
  embed = {"embed": params["embed"]}
  b, seq = shape
  data = [a for a in BATCH_AXES if a in mesh.axis_names]
  replicas = math.prod(mesh.shape[a] for a in data)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab, (b * replicas, seq * mesh.shape[CONTEXT_AXIS]), np.int32)
  targets = np.roll(tokens, -1, axis=1)
  mask = np.ones(tokens.shape, np.float32)
  io = P(tuple(data), *seq_axes)
  devices = P(tuple(mesh.axis_names))  # a leading axis over every device: per-device values
  ep_axis = "ep" if cfg.moe is not None and "ep" in mesh.axis_names else None
  leading = jax.tree.map(lambda a: a[None], stage)
  stage_spec = stage_param_specs(leading, ep_axis)  # over one stage's own dims
  in_specs = (stage_spec, P(), P(), io, io, io)
  args = (stage, head, embed, tokens, targets, mask)
  perm = [(i, (i + 1) % mesh.shape["pp"]) for i in range(mesh.shape["pp"])]

  def make_ops(stage, x):
    return stage_ops(model, stage, jax.ShapeDtypeStruct(x.shape, x.dtype))

  def prepare(stage, head, embed, tokens, targets, mask):
    """-> what every part starts from on this device: x, y, stored residuals, dy, g."""
    x = model.embed_fn(embed, tokens)
    ops = make_ops(stage, x)
    found["bytes"] = {"activation": _nbytes(x), "residual": _nbytes(ops.stored),
                      "wg": _nbytes(ops.g)}
    y, stored, _ = ops.forward(stage, x)
    dy = jnp.ones_like(y) / y.size
    _, g = ops.input_grad(stage, list(stored), dy, jnp.bool_(True))
    return jax.tree.map(lambda a: a[None], (x, y, list(stored), dy, g))

  def program(kind, stage, head, embed, tokens, targets, mask, values):
    """`inner` iterations of part KINDS[kind] in a scan, each reading what the last wrote."""
    x, y, stored, dy, g = jax.tree.map(lambda a: a[0], values)
    ops = make_ops(stage, x)
    yes = jnp.bool_(True)
    target = (targets, mask)

    def forward(c):
      y, st, _ = ops.forward(stage, c["x"])
      return {**c, "x": y, "stored": list(st)}

    def input_grad(c):
      dx, gg = ops.input_grad(stage, stored, c["dy"], yes)
      return {**c, "dy": dx, "g": gg}

    def weight_grad(c):
      p, st, gg = _tied((stage, stored, g), c["grads"])
      return {**c, "grads": _acc(c["grads"], ops.weight_grad(p, st, gg))}

    def full_grad(c):
      dx, dp = ops.full_grad(stage, stored, c["dy"], yes)
      return {**c, "dy": dx, "grads": _acc(c["grads"], dp)}

    def embed_part(c):
      e, t, d = _tied((embed, tokens, x), c["embed"])
      _, vjp = jax.vjp(lambda e: model.embed_fn(e, t), e)
      return {**c, "embed": _acc(c["embed"], vjp(d)[0])}

    def head_part(c):
      h, yy = _tied((head, y), c["head"])
      _, (dh, dyy) = jax.value_and_grad(model.loss_fn, argnums=(0, 1))(h, yy, target)
      return {**c, "head": _acc(c["head"], dh), "dy": dyy}

    parts = {"F": forward, "B": full_grad, "I": input_grad, "W": weight_grad,
             "F&B": lambda c: full_grad(forward(c)),
             "ppermute": lambda c: {**c, "x": lax.ppermute(c["x"], "pp", perm)},
             "embed": embed_part, "head": head_part, "": lambda c: c}
    branches = [parts[k] for k in KINDS]
    init = {"x": x, "stored": stored, "dy": dy, "g": g, "grads": _f32_zeros(stage),
            "embed": _f32_zeros(embed), "head": _f32_zeros(head)}
    out = lax.scan(lambda c, _: (lax.switch(kind, branches, c), None), init, None,
                   length=inner)[0]
    return jnp.stack([jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(out)])[None]

  shard = lambda fn, specs: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                                                  out_specs=devices, check_vma=False))
  found: dict = {}
  values = shard(prepare, in_specs)(*args)
  run = shard(program, (P(),) + in_specs + (devices,))
  kinds = [k for k in KINDS if k != "ppermute" or mesh.shape["pp"] > 1]
  times = time_kinds(run, [np.int32(KINDS.index(k)) for k in kinds], args + (values,), repeats)
  empty = times[kinds.index("")]  # what a call costs around the loop: dispatch, arguments
  seconds = {k: max(t - empty, 0.0) / inner for k, t in zip(kinds, times) if k}
  seconds.setdefault("ppermute", 0.0)
  return {"microbatches": microbatches, "stages": stages, "microbatch": [b, seq],
          "layers_per_stage": units // stages * every, "seconds": seconds,
          "bytes": found["bytes"]}


def step_section(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                 repeats: int) -> dict:
  """The optimizer update's seconds on the real train state (layers split over pp, one copy)
  and the state's and gradients' bytes per device, the layer stack's share apart."""
  cfg = config_lib.model_config(config)
  optimizer = make_optimizer(config.optimizer, config.train.steps)
  init = lambda: TrainState(jnp.zeros((), jnp.int32), *(lambda p: (p, optimizer.init(p)))(
      transformer.init_params(cfg, jax.random.key(0))))
  shapes = jax.eval_shape(init)
  shardings = state_shardings(shapes, mesh)
  state = jax.jit(init, out_shardings=shardings)()

  def update(state):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)

  run = jax.jit(update, in_shardings=(shardings,), out_shardings=shardings)
  update_s = time_call(run, (state,), repeats)
  per_device = lambda s, sh: math.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
  in_layers = lambda path: "layers" in [getattr(k, "key", None) for k in path]
  state_b = {True: 0, False: 0}
  grad_b = {True: 0, False: 0}
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  for (path, s), sh in zip(leaves, jax.tree.leaves(shardings)):
    state_b[in_layers(path)] += per_device(s, sh)
  for (path, s), sh in zip(jax.tree_util.tree_flatten_with_path(shapes.params)[0],
                           jax.tree.leaves(shardings.params)):
    grad_b[in_layers(path)] += per_device(s, sh)
  return {"update_s": update_s, "layer_state_bytes": state_b[True],
          "shared_state_bytes": state_b[False], "layer_grad_bytes": grad_b[True],
          "shared_grad_bytes": grad_b[False]}


def load_average() -> str:
  try:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def measure(config: ml_collections.ConfigDict, pairs: Sequence[tuple[int, int]],
            repeats: int = 5, inner: int = 8, log: Callable[[str], None] | None = None) -> dict:
  """The cost file's contents for the config's model and mesh at each (micro-batches, stages)."""
  mesh_shape = config_lib.mesh_shape(config.mesh, jax.device_count())
  mesh = make_mesh(config.mesh)
  cfg = config_lib.model_config(config)
  load_before = load_average()
  entries = []
  for m, s in sorted(set(pairs)):
    shape = microbatch_shape(config, mesh_shape, m)
    t0 = time.perf_counter()
    entries.append(stage_entry(cfg, mesh, m, s, shape, repeats, inner))
    if log:
      sec = entries[-1]["seconds"]
      log(f"measured m={m} over {s} stages (micro-batch {list(shape)} per device) in "
          f"{time.perf_counter() - t0:.1f} s: " + ", ".join(f"{k} {1e3 * v:.3f} ms"
                                                           for k, v in sec.items()))
  step = step_section(config, mesh, repeats)
  d = jax.devices()[0]
  setup = {"model": config.model.to_dict(), "mesh": mesh_shape,
           "batch": [config.data.batch, config.data.seq_len],
           "devices": f"{jax.device_count()} x {d.platform} ({d.device_kind})",
           "repeats": repeats, "inner": inner, "jax": jax.__version__,
           "load_average": f"{load_before} before, {load_average()} after (1, 5, 15 min)"}
  out = {"format": costs_lib.FORMAT, "setup": setup, "step": step, "entries": entries}
  costs_lib.parse(out)
  return out


# --- pipeline.schedule = auto ----------------------------------------------------------------

def auto_microbatches(config: ml_collections.ConfigDict, mesh_shape: dict) -> list[int]:
  """The micro-batch counts auto may choose: pipeline.auto_microbatches, else every count the
  per-replica batch splits into."""
  if config.pipeline.auto_microbatches:
    return sorted(set(config.pipeline.auto_microbatches))
  per_replica = config.data.batch // (mesh_shape["dp"] * mesh_shape["ep"])
  return [m for m in range(1, per_replica + 1) if per_replica % m == 0]


def auto_pairs(config: ml_collections.ConfigDict, mesh_shape: dict) -> list[tuple[int, int]]:
  """(micro-batches, stages) pairs the runnable auto candidates need costs for."""
  cands = auto_lib.candidates(mesh_shape["pp"], auto_microbatches(config, mesh_shape),
                              auto_names(config), layers=layer_units(config))
  auto_lib.require_runnable(cands, mesh_shape["pp"])
  return sorted({(c.microbatches, c.stages) for c in cands if not c.dropped})


def auto_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  return tuple(config.pipeline.auto_schedules) or auto_lib.SCHEDULE_NAMES


def layer_units(config: ml_collections.ConfigDict) -> int:
  """Entries of the layer stack stages split: layers, or groups of moe.every layers."""
  m = config.model
  return m.n_layers // (m.moe.every if m.moe is not None else 1)


def choose(config: ml_collections.ConfigDict, mesh_shape: dict,
           log: Callable[[str], None] | None = None) -> tuple[auto_lib.Ranking, dict | None]:
  """Ranks the auto candidates with pipeline.costs, or with costs measured now (returned, to be
  saved); the config's pipeline.schedule must be 'auto'."""
  p = config.pipeline
  measured = None
  if p.costs:
    costs = costs_lib.load(p.costs)
  else:
    pairs = auto_pairs(config, mesh_shape)
    if log:
      log(f"auto: measuring stage costs for (micro-batches, stages) {pairs}")
    measured = measure(config, pairs, log=log)
    costs = costs_lib.parse(measured, "<measured>")
  limit = p.memory_limit_gb * auto_lib.GB if p.memory_limit_gb else None
  ranking = auto_lib.rank(mesh_shape["pp"], auto_microbatches(config, mesh_shape), costs, limit,
                          layer_units(config), auto_names(config))
  return ranking, measured


def main(argv: list[str]) -> None:
  from absl import flags
  if len(argv) > 1:
    sys.exit(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  config = config_lib.apply_gin(f.config, f.gin_file, f.gin_param)
  try:
    mesh_shape = config_lib.mesh_shape(config.mesh, jax.device_count())
    if f.microbatches or f.stages:
      ms = [int(x) for x in f.microbatches.split(",")] if f.microbatches else \
          [config.pipeline.microbatches]
      if f.stages:
        ss = [int(x) for x in f.stages.split(",")]
      else:
        ss = [config_lib.pipeline_schedule(config.pipeline, mesh_shape["pp"]).num_stages]
      pairs = [(m, s) for m in ms for s in ss]
    elif config.pipeline.schedule == "auto":
      pairs = auto_pairs(config, mesh_shape)
    else:
      config_lib.validate(config, jax.device_count())
      sched = config_lib.pipeline_schedule(config.pipeline, mesh_shape["pp"])
      pairs = [(sched.num_microbatches, sched.num_stages)]
    out = measure(config, pairs, f.repeats, f.inner, log=print)
  except (config_lib.ConfigError, ValueError) as e:
    sys.exit(f"error: {e}")
  costs_lib.dump(out, f.out)
  print(f"wrote {f.out}: {len(out['entries'])} entries, update "
        f"{1e3 * out['step']['update_s']:.2f} ms; load {out['setup']['load_average']}")


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "ml_collections config file (get_config).",
                                  lock_config=True)
  flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields.")
  flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'model.d_model = 256'.")
  flags.DEFINE_string("out", "costs.json", "Cost file to write.")
  flags.DEFINE_string("microbatches", "", "Micro-batch counts, e.g. 8,16 (default: the config's).")
  flags.DEFINE_string("stages", "", "Model stage counts, e.g. 4,8 (default: the config "
                      "schedule's).")
  flags.DEFINE_integer("repeats", 5, "Timed calls per part; the median is kept.")
  flags.DEFINE_integer("inner", 8, "Iterations of the part inside one timed call.")
  flags.mark_flag_as_required("config")
  app.run(main)
