"""The executor on every schedule: compile time, memory, lock-step bubble, CPU time vs unpipelined.

  python -m experiments.pipeline_bench [--pp 4] [--microbatches 16] [--reps 3]
      [--schedules 1f1b,zb-h2] [--recompute] [--profile out/pipeline_bench] [--breakdown]

One model for every schedule: `layers` residual tanh-dense layers of width D on micro-batches of
[mb, L, D], split into the schedule's model stages (pp for plain and bidirectional schedules,
2pp for interleaved with 2 chunks and V shapes). Columns:
- ticks, lock-step/async: the lowered tables' length and their lock-step time (F = I = W = 1,
  B = 2) over the schedule's asynchronous makespan; bubble: idle fraction of the lock-step time;
- compile s: lowering + XLA compile of the executor;
- temp MB: per-device temporaries from `compiled.memory_analysis()`; the ratio is against
  GPipe by autodiff (a scan over m + p - 1 forward ticks differentiated by `jax.grad`, as
  MaxText pipelines) on the same model;
- CPU ratio: process CPU time of one pipelined step over that of the unpipelined
  `jax.value_and_grad` (same micro-batches, one device), the two run back to back in each of
  `--reps` repeats: the median ratio and, in brackets, the lowest and highest; load: the
  highest 1-minute load average seen while the row ran (timings above ~1 per core are noisy).
  glibc maps every allocation over 32 MB afresh and unmaps it on free, so a program whose XLA
  temporaries pass that size (GPipe's m residual slots, the unpipelined baseline) page-faults
  through all of them on every step (~1.4 us per 4 KB page, ~0.1 s per step here) while a
  smaller one reuses warm heap. Device allocators pool their memory, so the bench keeps freed
  host memory in one heap (`mallopt`); `--system_malloc` measures with glibc's defaults.
First a table of the lowered lock-step time against the asynchronous makespan for all nine at
(p, m) = (4, 8) and (8, 32) (tables only, nothing runs). `--profile DIR` writes, per schedule, a
jax.profiler trace of one step next to the schedule's Perfetto trace (`<name>.perfetto.json`)
and its tick table (`<name>.ticks.csv`); the scan's tick n is row/column n of the tick table.
`--breakdown` then profiles `--reps` steps of every program and splits them by kind of op
(`experiments/op_breakdown.py`): time on the device threads, and the bytes that slot reads,
slot writes, copies and fills and ppermutes write, which do not depend on the machine's load.
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import os  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments import op_breakdown  # noqa: E402
from jaxpipe.pipeline import SCHEDULE_NAMES, make_schedule  # noqa: E402
from jaxpipe.pipeline.executor import ExecSpec, Model, from_local, layered, make_executor, to_local  # noqa: E402
from jaxpipe.pipeline.ir.lower import lower  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

CHUNKS = {"interleaved-1f1b": 2}

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("pp", 4, "Pipeline ranks.", flag_values=FLAGS)
flags.DEFINE_integer("microbatches", 16, "Micro-batches per step.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 8, "Model layers (divisible by 2 pp).", flag_values=FLAGS)
flags.DEFINE_integer("mb", 8, "Sequences per micro-batch.", flag_values=FLAGS)
flags.DEFINE_integer("seq", 64, "Tokens per sequence.", flag_values=FLAGS)
flags.DEFINE_integer("d", 256, "Layer width.", flag_values=FLAGS)
flags.DEFINE_integer(
    "reps", 3, "Repeats of each CPU-time comparison (and profiled steps).", flag_values=FLAGS
)
flags.DEFINE_list("schedules", list(SCHEDULE_NAMES), "Schedules to run.", flag_values=FLAGS)
flags.DEFINE_bool(
    "recompute", False, "Recompute stage forwards in the backward.", flag_values=FLAGS
)
flags.DEFINE_string(
    "profile", None, "Directory for profiler traces, Perfetto traces, tick CSVs.", flag_values=FLAGS
)
flags.DEFINE_bool(
    "breakdown",
    False,
    "Then profile steps of each program and split them by kind of op.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "system_malloc",
    False,
    "Keep glibc's default of unmapping freed allocations over 32 MB.",
    flag_values=FLAGS,
)


def layer(w_DxD, b_D, x_BxLxD):
  return x_BxLxD + jnp.tanh(x_BxLxD @ w_DxD + b_D)


def layer_fn(params, x_BxLxD):
  return layer(params["w"], params["b"], x_BxLxD)


# A stage is some layers in order (params leaves [layers_per_stage, ...]); `layered` lets the
# executor keep per-layer cotangents between a split backward's I and W.
stage_fn = layered(layer_fn)


def loss_fn(head_params, y_BxLxD, t_BxLxD):
  return jnp.sum((y_BxLxD - t_BxLxD) ** 2)


MODEL = Model(stage_fn, loss_fn)


def make_data(layers, m, mb, seq, d, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  params = {
      "w": f32(rng.normal(size=(layers, d, d)) / np.sqrt(d) / 4),
      "b": f32(0.1 * rng.normal(size=(layers, d))),
  }
  xs = f32(rng.normal(size=(m, mb, seq, d)))
  ts = f32(rng.normal(size=(m, mb, seq, d)))
  return params, xs, ts


def stacked(params, stages):
  return jax.tree.map(lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), params)


def unpipelined(params, xs, ts):
  """value_and_grad of the sequential model, micro-batch by micro-batch (same matmul shapes)."""

  def total(params):
    def body(acc, xt):
      return acc + loss_fn((), stage_fn(params, xt[0]), xt[1]), None

    return lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts))[0]

  return jax.value_and_grad(total)(params)


def gpipe_autodiff(mesh, p, m):
  """GPipe as MaxText runs it: m + p - 1 forward ticks of every stage, then jax.grad of all."""
  perm = [(i, (i + 1) % p) for i in range(p)]

  def local(params, xs, ts):
    params = jax.tree.map(lambda a: a[0], params)
    r = lax.axis_index("pp")

    def body(carry, t):
      state, loss = carry
      x = jnp.where(r == 0, xs[jnp.minimum(t, m - 1)], state)
      y = stage_fn(params, x)
      mb = t - (p - 1)
      here = (r == p - 1) & (mb >= 0)
      loss = loss + jnp.where(here, loss_fn((), y, ts[jnp.clip(mb, 0, m - 1)]), 0.0)
      return (lax.ppermute(y, "pp", perm), loss), None

    init = (jnp.zeros(xs.shape[1:], xs.dtype), jnp.zeros((), jnp.float32))
    (_, loss), _ = lax.scan(body, init, jnp.arange(m + p - 1))
    return loss[None]

  sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=P("pp"), check_vma=False
  )
  return jax.jit(jax.value_and_grad(lambda ps, xs, ts: jnp.sum(sharded(ps, xs, ts))))


def cpu_ratios(fn, args, base, base_args, reps):
  """Per repeat, CPU time of fn over that of base, the two run back to back so load drift hits
  both alike; -> (ratios, base CPU seconds per repeat).

  CPU time (all threads of this process), not wall time: the host devices share the cores.
  """
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(base(*base_args))
  ratios, t_base = [], []
  for _ in range(reps):
    t = []
    for f, a in ((fn, args), (base, base_args)):
      t0 = time.process_time()
      jax.block_until_ready(f(*a))
      t.append(time.process_time() - t0)
    ratios.append(t[0] / t[1])
    t_base.append(t[1])
  return ratios, t_base


def spread(ratios) -> str:
  """median (min-max) of the per-repeat ratios"""
  return f"{np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def load() -> float:
  """The machine's 1-minute load average."""
  return os.getloadavg()[0]


def rel_err(got, want):
  pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
  return max(
      float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / np.max(np.abs(np.asarray(w))))
      for g, w in pairs
  )


def lockstep_table(cases=((4, 8), (8, 32))):
  """Lowered lock-step time against the asynchronous makespan (F = I = W = 1, B = 2)."""
  print(
      f"{'p, m':<8}{'schedule':<17}{'ticks':>6}{'lock-step':>10}{'async':>7}{'over':>8}"
      f"{'bubble':>8}  lowering"
  )
  for p, m in cases:
    for name in SCHEDULE_NAMES:
      lo = lower(make_schedule(name, pp=p, microbatches=m, chunks=CHUNKS.get(name)))
      print(
          f"{f'{p}, {m}':<8}{name:<17}{lo.num_ticks:>6}{lo.lockstep_time:>10g}"
          f"{lo.async_makespan:>7g}{100 * lo.overhead:>+7.1f}%{100 * lo.bubble:>7.1f}%  "
          f"split={lo.options.split}{' pull_w' if lo.options.pull_w else ''}"
      )
  print()


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  pooled = not args.system_malloc and process.pool_host_memory()
  lockstep_table()
  p, m = args.pp, args.microbatches
  if len(jax.devices()) < p:
    raise SystemExit(f"--pp {p} needs {p} devices, have {len(jax.devices())}")
  mesh = jax.make_mesh(
      (p,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:p]
  )
  params, xs, ts = make_data(args.layers, m, args.mb, args.seq, args.d)
  print(
      f"p={p} m={m}: {args.layers} layers of width {args.d}, micro-batch "
      f"[{args.mb}, {args.seq}, {args.d}], {len(jax.devices())} {jax.devices()[0].platform} "
      f"devices, recompute={args.recompute}, host memory "
      f"{'pooled' if pooled else 'glibc default'}"
  )

  dev0 = jax.devices()[0]
  args1 = jax.device_put((params, xs, ts), dev0)
  base = jax.jit(unpipelined)
  want = base(*args1)

  gp = gpipe_autodiff(mesh, p, m)
  gp_params = stacked(params, p)
  t0 = time.perf_counter()
  gp_compiled = gp.lower(gp_params, xs, ts).compile()
  gp_compile = time.perf_counter() - t0
  gp_temp = gp_compiled.memory_analysis().temp_size_in_bytes
  gp_out = gp_compiled(gp_params, xs, ts)
  gp_err = max(
      rel_err(gp_out[0], want[0]),
      rel_err(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), gp_out[1]), want[1]),
  )
  load0 = load()
  gp_ratios, base_cpu = cpu_ratios(gp_compiled, (gp_params, xs, ts), base, args1, args.reps)

  header = (
      f"{'schedule':<17}{'ticks':>6}{'lock/async':>11}{'bubble':>8}{'compile s':>10}"
      f"{'temp MB':>9}{'vs GPipe-AD':>12}{'CPU ratio (range)':>19}{'load':>6}"
      f"{'rel err':>9}"
  )
  print(
      f"unpipelined value_and_grad: {1e3 * np.median(base_cpu):.0f} ms CPU per step (median of "
      f"{args.reps}, {1e3 * min(base_cpu):.0f}-{1e3 * max(base_cpu):.0f}); CPU ratio = median "
      f"over {args.reps} repeats of pipelined / unpipelined CPU time, run back to back; load = "
      f"highest 1-min load average during the row, on {os.cpu_count()} cores"
  )
  print(header)
  print("-" * len(header))
  print(
      f"{'gpipe-autodiff':<17}{'':>6}{'':>11}{'':>8}{gp_compile:>10.1f}{gp_temp / 2**20:>9.2f}"
      f"{1.0:>12.2f}{spread(gp_ratios):>19}{max(load0, load()):>6.1f}{gp_err:>9.1e}"
  )
  rows = {}
  programs = [("gpipe-autodiff", gp_compiled, (gp_params, xs, ts))]
  for name in args.schedules:
    load0 = load()
    sched = make_schedule(name, pp=p, microbatches=m, chunks=CHUNKS.get(name))
    t0 = time.perf_counter()
    lowered = lower(sched)
    spec = ExecSpec.covering([lowered], recompute=args.recompute)
    run = make_executor(MODEL, spec, mesh)
    layout = lowered.layout()
    local = to_local(stacked(params, sched.num_stages), layout)
    call = (lowered.table, local, xs, ts, (), ())
    compiled = run.lower(*call).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    loss, local_grads, _, _ = compiled(*call)
    grads = from_local(local_grads, layout, sched.num_stages)
    grads = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), grads)
    err = max(rel_err(loss, want[0]), rel_err(grads, want[1]))
    ratios, _ = cpu_ratios(compiled, call, base, args1, args.reps)
    rows[name] = temp
    programs.append((name, compiled, call))
    print(
        f"{name:<17}{lowered.num_ticks:>6}{lowered.lockstep_time / lowered.async_makespan:>11.3f}"
        f"{100 * lowered.bubble:>7.1f}%{compile_s:>10.1f}{temp / 2**20:>9.2f}"
        f"{temp / gp_temp:>12.2f}{spread(ratios):>19}{max(load0, load()):>6.1f}{err:>9.1e}",
        flush=True,
    )
    if args.profile:
      os.makedirs(args.profile, exist_ok=True)
      with open(os.path.join(args.profile, f"{name}.perfetto.json"), "w") as f:
        f.write(sched.to_perfetto())
      with open(os.path.join(args.profile, f"{name}.ticks.csv"), "w") as f:
        f.write(lowered.to_csv())
      with jax.profiler.trace(os.path.join(args.profile, f"{name}.jax_trace")):
        jax.block_until_ready(compiled(*call))
  if "1f1b" in rows and "zb-h2" in rows:
    print(f"zb-h2 / 1f1b temp memory: {rows['zb-h2'] / rows['1f1b']:.2f}")
  if args.breakdown:  # the baseline compiled as a program of its own only here
    print_breakdown([("unpipelined", base.lower(*args1).compile(), args1)] + programs, args.reps)


def print_breakdown(programs, reps):
  """Per program, ms per step by kind of op, and MB written per step by the data movers."""
  kinds = op_breakdown.KINDS
  print(
      f"\nper step, by kind of op (`experiments/op_breakdown.py`, mean of {reps} profiled "
      f"steps): ms of wall time on the device threads summed over devices | MB written"
  )
  header = (
      f"{'program':<17}"
      + "".join(f"{k:>11}" for k in kinds)
      + f"{'total':>8}  |"
      + "".join(f"{k:>11}" for k in op_breakdown.MOVES)
      + f"{'load':>6}"
  )
  print(header)
  print("-" * len(header))
  for name, compiled, call in programs:
    load0 = load()
    got = op_breakdown.breakdown(compiled, call, reps)
    print(
        f"{name:<17}"
        + "".join(f"{1e3 * got[k][0]:>11.1f}" for k in kinds)
        + f"{1e3 * sum(v[0] for v in got.values()):>8.1f}  |"
        + "".join(f"{got[k][1] / 2**20:>11.1f}" for k in op_breakdown.MOVES)
        + f"{max(load0, load()):>6.1f}",
        flush=True,
    )


if __name__ == "__main__":
  cli.run(main)
