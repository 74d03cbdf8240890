"""A model's stage costs measured on the real devices: the cost file the simulators read
(`python -m jaxpipe.measure` writes one), and `choose` for `pipeline.schedule = auto`.

For each micro-batch count and stage count: one virtual stage of the config's model (its first
n_layers/stages layers) on one micro-batch of this mesh's per-device shape, run by the executor
itself (`make_executor`) on tables in which every rank runs the same part on every tick (F, I,
B, W, F&B; a forward that embeds, one that ends in the head and loss), each tick reading what
the last wrote. A part's seconds are its table's less the idle table's, per tick; the idle
table at two lengths gives an idle tick (the parts' gates, slot writes, gradient accumulator;
no ppermute, as none is received) and the call around the ticks; a loop of ppermutes what each
ppermute a tick runs adds; the optimizer update is timed on the real train state, and a `step`
timer adds the config's own train step. After a warm-up, `repeats` rounds time every kind once
each (so load that drifts during the run hits all alike); medians are kept, in wall and process
CPU seconds. The activation, residual and weight-gradient bytes come from the shapes
(`executor.stage_ops`): exact; the working bytes are XLA's compiled temporaries less those
slots: an estimate.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.models import transformer
from jaxpipe.pipeline.executor import ExecSpec, make_executor, stage_ops
from jaxpipe.pipeline.ir.lower import BRANCHES, COL, idle_row
from jaxpipe.pipeline.sharding import PipelineSharding
from jaxpipe.planning import auto as auto_lib
from jaxpipe.planning import costs as costs_lib
from jaxpipe.training import config as config_lib
from jaxpipe.training.mesh import BATCH_AXES, make_mesh
from jaxpipe.training.pipeline_lm import CONTEXT_AXIS, io_params, lm_model, stage_param_specs
from jaxpipe.training.state import fresh_state, make_optimizer, state_shardings


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


TARGET_S = 0.05  # the ppermute loop runs this long per call, to dwarf dispatch
TICKS = 10  # rows of a measuring table: one that sets up, then the part on every rank


def seconds(fn: Callable, *args) -> tuple[float, float]:
  """The wall and process CPU seconds of one call, to its results' readiness.

  CPU time counts every device's work on the host and little of what other processes take from
  the cores.

  Args:
    fn: the function to call.
    *args: its arguments.

  Returns:
    `(wall, cpu)` seconds.
  """
  t0, c0 = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0, time.process_time() - c0


def microbatch_shape(
    config: ml_collections.ConfigDict, mesh_shape: dict, microbatches: int
) -> tuple[int, int]:
  """Sequences and tokens one device holds of one micro-batch: [batch / (dp ep m), seq / cp].

  Args:
    config: the run's config (its `data.batch` and `data.seq_len`).
    mesh_shape: axis sizes (dp, ep and cp are read).
    microbatches: m, micro-batches per step.

  Returns:
    `(sequences, tokens per sequence)` per device.

  Raises:
    ConfigError: `data.batch` does not split into the data ranks x `microbatches`.
  """
  replicas = mesh_shape["dp"] * mesh_shape["ep"]
  if config.data.batch % (replicas * microbatches):
    raise config_lib.ConfigError(
        f"data.batch={config.data.batch} does not split into {replicas} data ranks x "
        f"{microbatches} micro-batches; measure a micro-batch count that divides "
        f"{config.data.batch // replicas}"
    )
  return config.data.batch // (replicas * microbatches), config.data.seq_len // mesh_shape["cp"]


def part_table(kind: str, ticks: int, ranks: int) -> np.ndarray:
  """Executor rows where every rank runs `kind` on every tick after the first.

  The first tick runs a first-and-last forward (and for W then an I) to fill the slots the part
  reads; each part reads slot 0 and writes its output back there, so ticks chain.

  Args:
    kind: the part, one of `PARTS`: 'F', 'I', 'B', 'W', 'F&B', 'embed' (a forward that embeds),
      'head' (one that ends in the head and loss) or 'idle'.
    ticks: the table's rows.
    ranks: pipeline ranks.

  Returns:
    The table, int [ticks, ranks, FIELDS].

  Raises:
    ValueError: an unknown `kind`.
  """
  table = np.tile(idle_row(), (ticks, ranks, 1))

  def put(t, branch, **fields):
    table[t, :, COL["branch"]] = BRANCHES.index(branch)
    for k, v in fields.items():
      table[t, :, COL[k]] = v

  fwd = dict(f_mb=0, f_chunk=0, f_res=0, f_in=0, f_local=0)
  bwd = dict(b_mb=0, b_chunk=0, b_res=0, b_cot=0, b_local=0)
  put(0, "F", **fwd, f_first=1, f_last=1, f_cot=0)
  start = 1
  if kind == "W":
    put(1, "I", **bwd, b_wg=0)
    start = 2
  for t in range(start, ticks):
    if kind in ("F", "embed", "head"):
      put(
          t,
          "F",
          **fwd,
          f_first=int(kind == "embed"),
          f_last=int(kind == "head"),
          f_cot=0 if kind == "head" else -1,
      )
    elif kind == "I":
      put(t, "I", **bwd, b_wg=0)
    elif kind == "B":
      put(t, "B", **bwd, g_chunk=0)
    elif kind == "W":
      put(t, "W", w_mb=0, w_chunk=0, w_res=0, w_wg=0, g_chunk=0)
    elif kind == "F&B":
      put(t, "F+B", **fwd, **bwd, g_chunk=0)
    elif kind != "idle":
      raise ValueError(f"no table for part {kind!r}")
  return table


PARTS = ("F", "I", "B", "W", "F&B", "embed", "head", "idle")


class StageTimer:
  """One virtual stage (n_layers/stages layers) of the model on one [b, L] micro-batch per
  device, run by the executor itself (`make_executor`) on tables where every rank runs the same
  part every tick; a part's seconds are its table's less the idle table's, per tick. An idle
  tick (the parts' gates, the slot writes; nothing is received, so no ppermute runs) and what a
  call costs around its ticks come from the idle table at two lengths; a ppermute from a loop
  of them."""

  def __init__(
      self,
      cfg: transformer.TransformerConfig,
      mesh: jax.sharding.Mesh,
      microbatches: int,
      stages: int,
      shape: tuple[int, int],
      ticks: int = TICKS,
  ):
    every = cfg.moe.every if cfg.moe is not None else 1
    units = cfg.stack_units
    if units % stages:
      raise config_lib.ConfigError(
          f"model.n_layers={cfg.n_layers} does not split into {stages} "
          "stages; measure a stage count that divides the layers"
      )
    self.microbatches, self.stages, self.shape = microbatches, stages, shape
    self.layers = units // stages * every
    self.ticks = ticks
    p = mesh.shape["pp"]
    seq_axes = (CONTEXT_AXIS,) if mesh.shape[CONTEXT_AXIS] > 1 else ()
    model = lm_model(cfg, seq_axes[0] if seq_axes else None)
    params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
    stage = jax.tree.map(lambda a: a[: units // stages], params["layers"])
    head, embed = io_params(params)
    b, seq = shape
    data = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    replicas = math.prod(mesh.shape[a] for a in data)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (1, b * replicas, seq * mesh.shape[CONTEXT_AXIS]), np.int32)
    target = {"targets": np.roll(tokens, -1, axis=2), "mask": np.ones(tokens.shape, np.float32)}
    if cfg.mtp_depth:  # the prediction modules run with the head (`pipeline_lm.lm_model`)
      target["mtp_weights"] = np.ones(tokens.shape + (cfg.mtp_depth,), np.float32)
    if cfg.first_dense:  # the embedding stage's inputs (`pipeline_lm.lm_model`)
      tokens = {"tokens": tokens}
    ep_axis = "ep" if cfg.moe is not None and "ep" in mesh.axis_names else None
    stage_specs = stage_param_specs(jax.tree.map(lambda a: a[None], stage), ep_axis)
    local = jax.tree.map(lambda a: jnp.broadcast_to(a[None, None], (p, 1) + a.shape), stage)
    # every rank runs model stage 0's layers (and numbers them so, where layers differ)
    self._args = (local, tokens, target, head, embed, (), np.zeros((p, 1), np.int32))
    codes = tuple(sorted(BRANCHES.index(b) for b in ("idle", "F", "I", "B", "W", "F+B")))
    make = lambda n, branches: make_executor(
        model,
        ExecSpec(
            num_ranks=p,
            chunks=1,
            num_ticks=n,
            act_slots=1,
            res_slots=1,
            cot_slots=1,
            wg_slots=1,
            branches=branches,
            channels=(True, False, False, False),
            # one chunk per rank: no table moves a value within a rank, so the per-tick
            # same-rank steps are not compiled, as in a real non-V schedule's executor
            local_moves=(False, False),
        ),
        PipelineSharding(mesh, data_axes=data, seq_axes=seq_axes, param_specs=stage_specs),
    )
    self._run = make(ticks, codes)
    self._short = make(1, (0,))  # one idle tick: what a call costs around its ticks
    self._tables = {k: part_table(k, ticks, p) for k in PARTS}
    self._one_idle = part_table("idle", 1, p)
    self._temp = (
        self._run.lower(self._tables["idle"], *self._args)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
    )
    # a ppermute of one activation to the next rank, in a loop: what each extra channel adds
    perm = [(i, (i + 1) % p) for i in range(p)]
    io = P(data, *seq_axes)
    found: dict = {}

    def sizes(stage, embed, tokens):
      x = model.embed_fn(embed, jax.tree.map(lambda a: a[0], tokens))
      ops = stage_ops(model, stage, jax.ShapeDtypeStruct(x.shape, x.dtype))
      found["bytes"] = {
          "activation": _nbytes(x),
          "residual": _nbytes(ops.stored),
          "wg": _nbytes(ops.g),
      }
      found["x"] = jax.ShapeDtypeStruct(x.shape, x.dtype)
      return jnp.zeros(())

    jax.eval_shape(
        jax.shard_map(
            sizes,
            mesh=mesh,
            in_specs=(stage_specs, P(), P(None, *io)),
            out_specs=P(),
            check_vma=False,
        ),
        stage,
        embed,
        tokens,
    )
    self.bytes = found["bytes"]
    b = self.bytes  # this executor's own slots: one of each
    self.bytes["work"] = max(self._temp - 2 * b["activation"] - b["residual"] - b["wg"], 0)
    x_sd = found["x"]

    def hops(n, x):
      return lax.fori_loop(0, n, lambda _, x: lax.ppermute(x, "pp", perm), x[0])[None]

    all_axes = P(tuple(mesh.axis_names))
    self._hops = jax.jit(
        jax.shard_map(
            hops, mesh=mesh, in_specs=(P(), all_axes), out_specs=all_axes, check_vma=False
        )
    )
    self._x = jnp.zeros((mesh.size,) + x_sd.shape, x_sd.dtype)
    self.kinds = list(PARTS) + ["short", "hops"]
    self.hops = 1

  def call(self, kind: str) -> tuple[float, float]:
    """The wall and CPU seconds of one call: a part's table, the one-tick table, or the hop loop.

    Args:
      kind: a part of `PARTS`, 'short' (the one-tick idle table) or 'hops' (the ppermute loop);
        one of `self.kinds`.

    Returns:
      `(wall, cpu)` seconds (`seconds`).
    """
    if kind == "short":
      return seconds(self._short, self._one_idle, *self._args)
    if kind == "hops":
      return seconds(self._hops, np.int32(self.hops), self._x)
    return seconds(self._run, self._tables[kind], *self._args)

  def warm_up(self) -> None:
    """Compiles, then picks the hop count so that a call of them lasts ~TARGET_S."""
    for k in self.kinds:
      self.call(k)
    self.hops = 16
    once = max(self.call("hops")[0] / 16, 1e-6)
    self.hops = int(min(max(round(TARGET_S / once), 16), 4096))

  def entry(self, samples: dict[str, list[tuple[float, float]]]) -> dict:
    """The cost file entry from per-call (wall, CPU) samples of every kind, medians.

    Every table starts with a first-and-last forward (and W's with an I): a table's time is
    call + that start + its ticks' overheads + its parts, and the one-tick table's call + one.

    Args:
      samples: per kind of `self.kinds`, the `(wall, cpu)` seconds of its calls.

    Returns:
      The entry: micro-batches, stages, the micro-batch shape, layers per stage, bytes, and the
      per-part `seconds` and `cpu_seconds` (F, I, B, W, F&B, embed, head, tick, call,
      ppermute).
    """
    out = {}
    n = self.ticks - 1  # ticks running the part
    for i, name in ((0, "seconds"), (1, "cpu_seconds")):
      med = {k: statistics.median(x[i] for x in v) for k, v in samples.items()}
      part = lambda k, ticks=n: max(med[k] - med["idle"], 0.0) / ticks
      sec = {k: part(k) for k in ("F", "I", "B", "F&B")}
      sec["W"] = max(med["W"] - med["idle"] - sec["I"], 0.0) / (n - 1)
      sec["embed"] = max(med["embed"] - med["F"], 0.0) / n
      sec["head"] = max(med["head"] - med["F"], 0.0) / n
      start = sec["F"] + sec["embed"] + sec["head"]
      sec["tick"] = max(med["idle"] - med["short"] - start, 0.0) / n
      sec["call"] = max(med["short"] - sec["tick"], 0.0)
      sec["ppermute"] = med["hops"] / self.hops
      out[name] = sec
    return {
        "microbatches": self.microbatches,
        "stages": self.stages,
        "microbatch": list(self.shape),
        "layers_per_stage": self.layers,
        "bytes": self.bytes,
        **out,
    }


def time_rounds(
    timers: list, repeats: int, extra: dict[str, Callable[[], tuple]] | None = None
) -> tuple[list[dict], dict[str, list[tuple[float, float]]]]:
  """Times `repeats` rounds, each timing every part of every timer once (and each of `extra`).

  Load that drifts during the run thus hits all of them alike.

  Args:
    timers: the `StageTimer`s.
    repeats: the number of rounds.
    extra: further calls to time, by name, each returning `(wall, cpu)` seconds; None: none.

  Returns:
    `(samples, others)`: per timer, its kinds' `(wall, cpu)` samples; per name of `extra`, its
    samples.
  """
  extra = {} if extra is None else extra
  samples = [{k: [] for k in t.kinds} for t in timers]
  others = {name: [] for name in extra}
  for _ in range(repeats):
    for t, out in zip(timers, samples):
      for k in t.kinds:
        out[k].append(t.call(k))
    for name, fn in extra.items():
      others[name].append(fn())
  return samples, others


def load_average() -> str:
  try:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def update_timer(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[Callable[[], tuple[float, float]], dict]:
  """A call timing one optimizer update on the real train state, and its bytes per device.

  The state is stored as the trainer does (layers split over pp, one copy).

  Args:
    config: the run's config (model and optimizer).
    mesh: the device mesh.

  Returns:
    `(timer, sizes)`: `timer()` runs one update and returns its `(wall, cpu)` seconds; sizes:
    the state's and gradients' bytes per device, the layer stack's share apart
    (`layer_state_bytes`, `shared_state_bytes`, `layer_grad_bytes`, `shared_grad_bytes`).
  """
  cfg = config_lib.model_config(config)
  optimizer = make_optimizer(config.optimizer, config.train.steps)

  def init():  # the runner's state: model.fp8='delayed' histories included
    return fresh_state(cfg, optimizer, transformer.init_params(cfg, jax.random.key(0)))

  shapes = jax.eval_shape(init)
  shardings = state_shardings(shapes, mesh)
  state = jax.jit(init, out_shardings=shardings)()

  def update(state):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
    )

  run = jax.jit(update, in_shardings=(shardings,), out_shardings=shardings)
  per_device = lambda s, sh: math.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
  in_layers = lambda path: "layers" in [getattr(k, "key", None) for k in path]
  sizes = {"state": {True: 0, False: 0}, "grad": {True: 0, False: 0}}
  for what, tree, shard in (
      ("state", shapes, shardings),
      ("grad", shapes.params, shardings.params),
  ):
    for (path, s), sh in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(shard)):
      sizes[what][in_layers(path)] += per_device(s, sh)
  seconds(run, state)  # compiles
  return (
      lambda: seconds(run, state),
      {
          "layer_state_bytes": sizes["state"][True],
          "shared_state_bytes": sizes["state"][False],
          "layer_grad_bytes": sizes["grad"][True],
          "shared_grad_bytes": sizes["grad"][False],
      },
  )


def measure(
    config: ml_collections.ConfigDict,
    pairs: Sequence[tuple[int, int]],
    repeats: int = 5,
    log: Callable[[str], None] | None = None,
    step: Callable[[], tuple[float, float]] | None = None,
) -> dict:
  """The cost file's contents for the config's model and mesh at each (micro-batches, stages).

  Args:
    config: the run's config (model, mesh, data, optimizer, pipeline).
    pairs: the `(micro-batches, stages)` pairs to measure.
    repeats: the timing rounds; medians are kept.
    log: called with a line per measured pair, or None.
    step: a call timing the config's own train step (`jaxpipe.measure.step_timer`), timed in
      the same rounds (setup.paired.step_s), so a prediction from these costs meets a step
      measured under the same load; None: not timed.

  Returns:
    The cost file's JSON object (`format`, `setup`, `devices`, `step`, `entries`), checked by
    `costs.parse`.

  Raises:
    ConfigError: the batch does not split into a pair's micro-batches, or the layers into its
      stages.
  """
  mesh_shape = config_lib.mesh_shape(config.mesh, jax.device_count())
  mesh = make_mesh(config.mesh)
  cfg = config_lib.model_config(config)
  load_before = load_average()
  t0 = time.perf_counter()
  timers = [
      StageTimer(cfg, mesh, m, s, microbatch_shape(config, mesh_shape, m))
      for m, s in sorted(set(pairs))
  ]
  for t in timers:
    t.warm_up()
  update, step_bytes = update_timer(config, mesh)
  extra = {"update": update}
  if step is not None:
    extra["step"] = step
  compiled = time.perf_counter() - t0
  samples, others = time_rounds(timers, repeats, extra)
  entries = [t.entry(s) for t, s in zip(timers, samples)]
  if log:
    for e in entries:
      log(
          f"measured m={e['microbatches']} over {e['stages']} stages (micro-batch "
          f"{e['microbatch']} per device): "
          + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in e["seconds"].items())
      )
  d = jax.devices()[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  devices = {
      "platform": d.platform,
      "count": jax.device_count(),
      "cores": cores,
      "parallel": d.platform != "cpu" or jax.device_count() <= cores,
  }
  median = lambda xs, i: statistics.median(x[i] for x in xs)
  setup = {
      "model": config.model.to_dict(),
      "mesh": mesh_shape,
      "batch": [config.data.batch, config.data.seq_len],
      "devices": f"{jax.device_count()} x {d.platform} ({d.device_kind})",
      "repeats": repeats,
      "ticks_per_table": TICKS,
      "ppermutes_per_call": {f"m={t.microbatches}/{t.stages}": t.hops for t in timers},
      "jax": jax.__version__,
      "seconds": {"compile": compiled, "timing": time.perf_counter() - t0 - compiled},
      "load_average": f"{load_before} before, {load_average()} after (1, 5, 15 min)",
  }
  if step is not None:
    p = config.pipeline
    setup["paired"] = {
        "schedule": p.schedule,
        "microbatches": p.microbatches,
        "chunks": p.chunks,
        "step_s": median(others["step"], 0),
        "step_cpu_s": median(others["step"], 1),
        "samples": [list(x) for x in others["step"]],
    }
  step = {
      "update_s": median(others["update"], 0),
      costs_lib.STEP_CPU: median(others["update"], 1),
      **step_bytes,
  }
  out = {
      "format": costs_lib.FORMAT,
      "setup": setup,
      "devices": devices,
      "step": step,
      "entries": entries,
  }
  costs_lib.parse(out)
  return out


# --- pipeline.schedule = auto ----------------------------------------------------------------


def choose(
    config: ml_collections.ConfigDict, mesh_shape: dict, log: Callable[[str], None] | None = None
) -> tuple[auto_lib.Ranking, dict | None]:
  """Ranks the auto candidates with pipeline.costs, or with costs it measures on the devices.

  The config's pipeline.schedule must be 'auto'.

  Args:
    config: the run's config.
    mesh_shape: axis sizes.
    log: called with progress lines, or None.

  Returns:
    `(ranking, measured)`: the `auto.Ranking`, and the measured cost file's contents (to be
    saved), or None when pipeline.costs gave them.

  Raises:
    CostFileError: pipeline.costs names no readable cost file.
    AutoError: no candidate can run.
  """
  p = config.pipeline
  measured = None
  if p.costs:
    costs = costs_lib.load(p.costs)
  else:
    pairs = config_lib.auto_pairs(config, mesh_shape)
    if log:
      log(f"auto: measuring stage costs for (micro-batches, stages) {pairs}")
    measured = measure(config, pairs, log=log)
    costs = costs_lib.parse(measured, "<measured>")
  limit = p.memory_limit_gb * auto_lib.GB if p.memory_limit_gb else None
  ranking = auto_lib.rank(
      mesh_shape["pp"],
      config_lib.auto_microbatches(config, mesh_shape),
      costs,
      limit,
      config_lib.layer_units(config),
      config_lib.auto_names(config),
  )
  return ranking, measured
