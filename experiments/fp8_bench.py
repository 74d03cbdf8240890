"""FP8 recipes against float32 and bf16.

  python -m experiments.fp8_bench [--steps 300] [--parts ...]

Parts (default: `curves,gemm` without a GPU, `gpu` with one):

  curves  the quickstart trained --steps steps in float32, in float32 from another initial seed
          (the yardstick: how far two float32 runs end apart), in bf16 and with each FP8 recipe
          (delayed, current, block), data-parallel and through the pipeline executor (pp = 2,
          ZB-H1, 4 micro-batches): final train loss, mean of the last 10 steps and eval loss,
          each against the float32 run's; the curves as a PNG in --out
  seeds   float32 and each --runs run trained from each initial seed of --seeds (the same
          batches), per path: each measure's mean over the seeds and its difference from
          float32's, and the spread of the seed-by-seed differences, so that a recipe's
          systematic offset is told from where one trajectory happens to end; each run is
          saved to --out/seeds.json as it ends and a rerun keeps the runs found there
  gemm    per recipe, every projection GEMM's relative error (Frobenius) of y = x w, dx and dw
          against float32 on that run's own trained weights and the activations and gradients
          of an eval batch, averaged over the layers (delayed: the run's own lagging scales)
  gpu     on one GPU: step time and TFLOP/s of a 0.5 B-parameter model (d_model 2048, 8 layers,
          batch 8 x 2048) in bf16 and with each recipe, and an 8192^3 GEMM alone, beside
          Transformer Engine's published H200 speedups over bf16 (5 B model: delayed 1.69x,
          current 1.57x, block 1.41x; the FP8 GEMM alone 1.92x), and the count of cuBLAS FP8
          GEMMs in the compiled step (whether XLA took the FP8 path)
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import quickstart  # noqa: E402
from experiments.timing import median_time  # noqa: E402
from jaxpipe.models import (
    flops,  # noqa: E402
    transformer,  # noqa: E402
)
from jaxpipe.ops import fp8
from jaxpipe.runtime import cli, files  # noqa: E402
from jaxpipe.training.trainer import Trainer  # noqa: E402

RECIPES = ("delayed", "current", "block")
# (label, model.fp8, model.dtype, train.seed); float32-seed1 is float32 from another initialisation
# (same batches): how far two float32 runs end apart, the yardstick for the others
RUNS = (
    ("float32", "none", "float32", 0),
    ("float32-seed1", "none", "float32", 1),
    ("bf16", "none", "bfloat16", 0),
    *((r, r, "float32", 0) for r in RECIPES),
)
TE_SPEEDUP = {"delayed": 1.69, "current": 1.57, "block": 1.41}  # H200, 5 B model, over bf16
TE_GEMM_SPEEDUP = 1.92
GEMMS = ("q", "k", "v", "o", "gate", "up", "down")
PARTS = ("curves", "gemm", "seeds", "gpu")
ONE_PATH = ("bf16", "float32-seed1")  # the dtype's and the seed's effects: data-parallel only
MEASURES = (
    ("final loss", lambda r: r["losses"][-1]),
    ("mean of last 10", lambda r: float(np.mean(r["losses"][-10:]))),
    ("eval loss", lambda r: r["eval_loss"]),
)

FLAGS = cli.flag_values(__name__)
flags.DEFINE_list(
    "parts",
    None,
    "Comma-separated: curves, gemm, seeds, gpu (default: curves,gemm on CPU, gpu on a GPU).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("steps", 300, "Training steps per run.", flag_values=FLAGS)
flags.DEFINE_list(
    "pp", ["1", "2"], "Pipeline sizes to train on (1 = data-parallel).", flag_values=FLAGS
)
flags.DEFINE_list(
    "runs",
    [run[0] for run in RUNS],
    "Labels of the runs to train (float32 always runs: the others are compared with it).",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "seeds", ["0", "1", "2", "3"], "seeds part: initial seeds (train.seed).", flag_values=FLAGS
)
flags.DEFINE_string(
    "out", "out/fp8_bench", "curves.json and fp8_loss.png go here.", flag_values=FLAGS
)
flags.DEFINE_integer("repeats", 10, "GPU: timed repetitions.", flag_values=FLAGS)
flags.DEFINE_integer("gemm_size", 8192, "GPU: the GEMM's M = N = K.", flag_values=FLAGS)


def _path(pp: int) -> str:
  return "dp" if pp == 1 else f"pp{pp}"


def _where(path: str) -> str:
  return "data-parallel" if path == "dp" else f"pp = {path[2:]}, ZB-H1"


def _pct(a: float, b: float) -> float:
  return 100 * (a / b - 1)


def quickstart_config(recipe: str, dtype: str, steps: int, pp: int, seed: int = 0):
  c = quickstart.get_config()
  c.model.fp8, c.model.dtype, c.train.steps, c.train.seed = recipe, dtype, steps, seed
  if pp > 1:
    c.mesh.pp, c.pipeline.schedule, c.pipeline.microbatches = pp, "zb-h1", 4
  return c


def train(recipe: str, dtype: str, steps: int, pp: int, seed: int = 0) -> tuple[dict, Trainer]:
  """Trains the quickstart; -> ({losses, eval_loss, seconds}, trainer)."""
  trainer = Trainer(quickstart_config(recipe, dtype, steps, pp, seed))
  trainer.init()
  t0 = time.perf_counter()
  losses = [trainer.step()["loss"] for _ in range(steps)]
  losses = [float(v) for v in jax.device_get(losses)]
  return {
      "losses": losses,
      "eval_loss": trainer.evaluate(),
      "seconds": time.perf_counter() - t0,
  }, trainer


def _rel(got, want) -> jax.Array:
  return jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel())


def gemm_inputs(cfg: transformer.TransformerConfig, params: dict, host: dict) -> dict:
  """{(layer, gemm): (x, w, g, fp8_scale or None)}: every projection's input, kernel and output
  cotangent on `host`'s batch, from the float32 model with `params` (layers run one by one)."""
  plain = dataclasses.replace(cfg, fp8="none", dtype="float32")
  n_layers = jax.tree.leaves(params["layers"])[0].shape[0]

  def loss(probes):
    seen, outs, where = {}, {}, {}

    def intercept(next_fun, args, kwargs, context):
      if not (isinstance(context.module, transformer.Dense) and context.method_name == "__call__"):
        return next_fun(*args, **kwargs)
      key = (where["layer"], context.module.name)
      seen[key] = args[0]
      outs[key] = y = next_fun(*args, **kwargs)
      return y + probes[key] if probes is not None else y

    x = transformer.embed(plain, params, host["tokens"])
    positions = jnp.arange(x.shape[1])
    with nn.intercept_methods(intercept):
      for i in range(n_layers):
        where["layer"] = i
        x = transformer.apply_unit(
            plain, jax.tree.map(lambda a: a[i], params["layers"]), x, positions
        )
    total, count = transformer.head_loss(plain, params, x, host["targets"], host["mask"])
    return total / count, (seen, outs)

  # a zero added to each output: its gradient is the output's cotangent
  probes = {
      k: jnp.zeros(y.shape, y.dtype) for k, y in jax.eval_shape(lambda: loss(None))[1][1].items()
  }
  cotangents, (xs, _) = jax.jit(jax.grad(loss, has_aux=True))(probes)
  out = {}
  for (layer, name), x in xs.items():
    sub = params["layers"]["attn" if name in ("q", "k", "v", "o") else "mlp"][name]
    w = sub["kernel"][layer]
    scale = sub["fp8_scale"][layer] if "fp8_scale" in sub else None
    out[(layer, name)] = (x, w, cotangents[(layer, name)], scale)
  return out


def gemm_errors(recipe: str, inputs: dict) -> dict[str, tuple[float, float, float]]:
  """Per projection: mean over layers of the relative error of (y, dx, dw) against float32."""

  @jax.jit
  def errors(x, w, g, scale):
    in_dims = x.ndim - 2
    run = lambda r, s: jax.vjp(lambda a, b: fp8.dot(a, b, in_dims, r, s, jnp.float32), x, w)
    y, vjp = run(recipe, scale if recipe == "delayed" else None)
    y32, vjp32 = run("none", None)
    return jnp.stack([_rel(y, y32), *(_rel(a, b) for a, b in zip(vjp(g), vjp32(g)))])

  per = {}
  for (_layer, name), (x, w, g, scale) in inputs.items():
    per.setdefault(name, []).append(np.asarray(errors(x, w, g, scale)))
  return {name: tuple(np.mean(per[name], axis=0)) for name in GEMMS}


def plot(results: dict, steps: int, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = sorted({p for p, _ in results}, key=lambda p: p != "dp")
  fig, axes = plt.subplots(2, len(paths), figsize=(6 * len(paths), 7), sharex=True, squeeze=False)
  smooth = lambda v: np.convolve(v, np.ones(10) / 10, mode="valid")
  colors = dict(
      zip(
          [run[0] for run in RUNS],
          ["k", "tab:purple", "tab:gray", "tab:blue", "tab:orange", "tab:green"],
      )
  )
  for col, p in enumerate(paths):
    base = np.asarray(results[(p, "float32")]["losses"])
    for label, *_ in RUNS:
      if (p, label) not in results:
        continue
      losses = np.asarray(results[(p, label)]["losses"])
      x = np.arange(10, steps + 1)
      style = dict(label=label, lw=1, color=colors[label])
      axes[0, col].plot(x, smooth(losses), **style)
      axes[1, col].plot(x, 100 * (smooth(losses) / smooth(base) - 1), **style)
    axes[0, col].set(
        title=f"quickstart, {_where(p)}", ylabel="train loss (10-step mean)", yscale="log"
    )
    axes[1, col].set(xlabel="step", ylabel="vs float32 (%)")
    axes[1, col].axhline(0, color="k", lw=0.5)
    axes[0, col].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def curves_and_gemms(args) -> None:
  results, gemm = {}, {}
  host = None
  for p in args.pp:
    for label, recipe, dtype, seed in RUNS:
      if label not in args.runs or (label in ONE_PATH and p > 1):
        continue
      r, trainer = train(recipe, dtype, args.steps, p, seed)
      key = (_path(p), label)
      results[key] = r
      print(
          f"{key[0]:>4} {label:>8}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
          f"eval {r['eval_loss']:.4f}, {r['seconds']:.0f} s",
          flush=True,
      )
      if p == 1 and recipe != "none" and "gemm" in args.parts:
        if host is None:
          host = trainer.source.batch(
              "eval", 0, trainer.config.data.batch, trainer.config.data.seq_len
          )
        inputs = gemm_inputs(trainer.model_cfg, jax.device_get(trainer.model_params()), host)
        gemm[label] = gemm_errors(recipe, inputs)
  os.makedirs(args.out, exist_ok=True)
  files.write_json(
      os.path.join(args.out, "curves.json"),
      {f"{p}/{label}": r for (p, label), r in results.items()},
  )
  print(
      f"\nquickstart, {args.steps} steps, 8 CPU host devices, load average "
      f"{os.getloadavg()[0]:.1f}; relative to the float32 run on the same path\n"
  )
  print(
      "| path | run | loss at step 1 | final loss | vs float32 | mean of last 10 | vs float32 "
      "| eval loss | vs float32 | wall s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for (path, label), r in results.items():
    base = results[(path, "float32")]
    cells = [f"{r['losses'][0]:.3f}"]
    for _, measure in MEASURES:
      cells += [f"{measure(r):.3f}", f"{_pct(measure(r), measure(base)):+.2f}%"]
    print(f"| {_where(path)} | {label} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
  path = os.path.join(args.out, "fp8_loss.png")
  plot(results, args.steps, path)
  print(f"\nloss curves: {path}")
  if gemm:
    print(
        "\nper-GEMM relative error against float32 (Frobenius norm, mean over the 4 layers; "
        "eval batch 0, each recipe's own trained weights):\n"
    )
    print("| GEMM | " + " | ".join(f"{r} y | {r} dx | {r} dw" for r in gemm) + " |")
    print("|---|" + "---|" * (3 * len(gemm)))
    for name in GEMMS:
      print(
          f"| {name} | "
          + " | ".join(" | ".join(f"{e:.4f}" for e in gemm[r][name]) for r in gemm)
          + " |"
      )


def seed_study(args) -> None:
  """Every run from each seed; the recipes' offsets from float32 as means over the seeds."""
  runs = [run for run in RUNS if run[0] in args.runs and run[0] != "float32-seed1"]
  # each run is saved as it ends, and a rerun with the same --steps and --out keeps those
  os.makedirs(args.out, exist_ok=True)
  saved_path = os.path.join(args.out, "seeds.json")
  saved = {}
  if os.path.exists(saved_path):
    with open(saved_path) as f:
      saved = json.load(f)
    if saved.get("steps") != args.steps:
      saved = {}
  done = saved.get("runs", {})
  results = {}
  for p in args.pp:
    path = _path(p)
    for seed in args.seeds:
      for label, recipe, dtype, _ in runs:
        if label in ONE_PATH and p > 1:
          continue
        key = f"{path}/{label}/{seed}"
        if key in done:
          r, kept = done[key], " (kept from an earlier run)"
        else:
          r, kept = train(recipe, dtype, args.steps, p, seed)[0], ""
          done[key] = r
          files.write_json(saved_path, {"steps": args.steps, "runs": done})
        results[(path, label, seed)] = r
        print(
            f"{path:>4} {label:>8} seed {seed}: loss {r['losses'][0]:.4f} -> "
            f"{r['losses'][-1]:.4f}, eval {r['eval_loss']:.4f}, {r['seconds']:.0f} s{kept}",
            flush=True,
        )
  seeds = ",".join(map(str, args.seeds))
  print(
      f"\nquickstart, {args.steps} steps from each of seeds {seeds} (the same batches), 8 CPU "
      f"host devices, load average {os.getloadavg()[0]:.1f}. Per measure: the mean over the "
      "seeds, the difference of that mean from float32's, and the smallest and largest of the "
      "seed-by-seed differences from float32 from the same seed (float32: the standard deviation "
      "of its own runs over the seeds)\n"
  )
  head = " | ".join(f"{m} | vs float32 | per seed" for m, _ in MEASURES)
  print(f"| path | run | {head} |")
  print("|---|---|" + "---|---|---|" * len(MEASURES))
  for path in dict.fromkeys(p for p, _, _ in results):
    for label in dict.fromkeys(l for q, l, _ in results if q == path):
      cells = []
      for _, measure in MEASURES:
        got = [measure(results[(path, label, s)]) for s in args.seeds]
        base = [measure(results[(path, "float32", s)]) for s in args.seeds]
        paired = [_pct(a, b) for a, b in zip(got, base)]
        spread = (
            f"sd over seeds {100 * np.std(got, ddof=1) / np.mean(got):.2f}%" if len(got) > 1 else ""
        )
        cells += (
            [f"{np.mean(got):.4f}", "", spread]
            if label == "float32"
            else [
                f"{np.mean(got):.4f}",
                f"{_pct(np.mean(got), np.mean(base)):+.2f}%",
                f"{min(paired):+.2f}% .. {max(paired):+.2f}%",
            ]
        )
      print(f"| {_where(path)} | {label} | " + " | ".join(cells) + " |", flush=True)


def _cublas_fp8_gemms(compiled_text: str) -> int:
  return compiled_text.count("__cublas$lt$matmul$f8")


def gpu_config():
  """The GPU step's model: 0.6 B parameters, bf16, one device."""
  c = quickstart.get_config()
  m = c.model
  m.vocab, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = (
      32768,
      2048,
      8,
      16,
      8,
      128,
      8192,
  )
  m.dtype, m.attention = "bfloat16", "auto"
  c.data.source, c.data.batch, c.data.seq_len = "synthetic", 8, 2048
  c.mesh.dp = 1
  return c


def gpu_part(args) -> None:
  if jax.default_backend() != "gpu":
    print(
        "GPU part skipped: no GPU here (backend "
        f"{jax.default_backend()}); bash experiments/gpu_check.sh runs it on one"
    )
    return
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; jax {jax.__version__}")
  n = args.gemm_size
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(k[0], (n, n), jnp.bfloat16)
  b = (jax.random.normal(k[1], (n, n), jnp.bfloat16) / 64).astype(jnp.bfloat16)
  scale = jnp.asarray([4.0 / 448, 0.1 / 448, 1.0], jnp.float32)
  aq, bq = fp8.quantize(a, fp8.E4M3, scale[0]), fp8.quantize(b, fp8.E4M3, scale[1])
  gemm_flops = 2 * n**3
  cases = {
      "bf16": (jax.jit(lambda a, b: jnp.dot(a, b)), (a, b)),
      "fp8 operands (E4M3 x E4M3, float32 out)": (
          jax.jit(
              lambda a, b: jax.lax.dot_general(
                  a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
              )
          ),
          (aq, bq),
      ),
      "fp8 delayed, with casts (bf16 in, bf16 out)": (
          jax.jit(lambda a, b: fp8.dot(a, b, 1, "delayed", scale, jnp.bfloat16)),
          (a, b),
      ),
  }
  base = None
  print(f"\nGEMM {n}^3 (median of {args.repeats}):")
  for name, (fn, operands) in cases.items():
    t = median_time(fn, *operands, repeats=args.repeats)
    base = base or t
    hlo = fn.lower(*operands).compile().as_text()
    print(
        f"  {name:45s} {1e3 * t:8.3f} ms  {gemm_flops / t / 1e12:7.1f} TFLOP/s  "
        f"{base / t:5.2f}x bf16  (cuBLAS FP8 GEMMs: {_cublas_fp8_gemms(hlo)})",
        flush=True,
    )
  print(f"  Transformer Engine, H200: FP8 GEMM {TE_GEMM_SPEEDUP}x bf16")

  c = gpu_config()
  m = c.model
  print(
      f"\nstep: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads}x{m.head_dim} heads "
      f"({m.n_kv_heads} KV), d_ff {m.d_ff}, vocab {m.vocab}, batch {c.data.batch} x "
      f"{c.data.seq_len}, bf16 compute, AdamW (median of {args.repeats} steps):"
  )
  base = None
  for recipe in ("none",) + RECIPES:
    m.fp8 = recipe
    trainer = Trainer(c)
    step = trainer.compile()  # initialises the state; compiled for batch 0's shapes
    batch = trainer.batch(0)
    if base is None:
      print(
          f"  parameters: {sum(x.size for x in jax.tree.leaves(trainer.state.params)) / 1e9:.2f} B"
      )
    step_flops = flops.training_flops_per_step(trainer.model_cfg, c.data.batch, c.data.seq_len)
    hlo = step.as_text()
    state = trainer.state
    times = []
    for _ in range(2 + args.repeats):  # two untimed
      t0 = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    times = times[2:]
    t = float(np.median(times))
    base = base or t
    te = f"(TE: {TE_SPEEDUP[recipe]}x)" if recipe in TE_SPEEDUP else ""
    print(
        f"  {'bf16' if recipe == 'none' else recipe:8s} {1e3 * t:8.1f} ms/step  "
        f"{step_flops / t / 1e12:6.1f} TFLOP/s  {base / t:5.2f}x bf16 {te:12s} "
        f"cuBLAS FP8 GEMMs in the step: {_cublas_fp8_gemms(hlo)}",
        flush=True,
    )
    del trainer, state


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  default = ["gpu"] if jax.default_backend() == "gpu" else ["curves", "gemm"]
  args.parts = set(args.parts or default)
  if args.parts - set(PARTS):
    raise app.UsageError(f"--parts: unknown {sorted(args.parts - set(PARTS))}; choose from {PARTS}")
  try:
    args.pp = [int(p) for p in args.pp]
    args.seeds = [int(v) for v in args.seeds]
  except ValueError as e:
    raise app.UsageError(f"--pp and --seeds take comma-separated integers: {e}") from None
  labels = [run[0] for run in RUNS]
  args.runs = set(args.runs) | {"float32"}
  if args.runs - set(labels):
    raise app.UsageError(f"--runs: unknown {sorted(args.runs - set(labels))}; choose from {labels}")
  print(
      f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices; "
      f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
  )
  if args.parts & {"curves", "gemm"}:
    curves_and_gemms(args)
  if "seeds" in args.parts:
    seed_study(args)
  if "gpu" in args.parts:
    gpu_part(args)


if __name__ == "__main__":
  cli.run(main)
