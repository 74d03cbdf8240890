"""Where a serving step's time goes at a real model's size, against the matmul rate of this CPU.

  python -m experiments.step_profile [--shape smollm2-135m] [--dtypes float32,bfloat16]
      [--batch 64 --context 256 --prefill 1024 --steps 8]

First the limit, measured in this run: the model's GEMMs (q+k+v, attention output, gate+up,
down, the LM head: siblings fused as the engine's prepacked layers run them) at a decode step's
M (`--batch` rows) and a prefill step's (`--prefill` tokens), timed as one XLA program each,
through the oneDNN kernel the engine's steps run (`kernels_cpu.matmul`, `--matmul`), and, as a
second opinion, through torch's CPU matmul (its own oneDNN), in each dtype. Per dtype, the
fastest of these is the peak the steps are held to. Where packed products run on the kernel's own
tiles (`kernels_cpu.matmul.panels`: Intel CPUs with AVX-512; float32, and bfloat16 where it runs
as float32), those and oneDNN's matmul on the weights packed for each, over every layer's own
weights, alternated round by round (`--kernel_rounds`).

Then the engine's steps at that shape (random weights held in the dtype, pools for the batch):
- decode: `--batch` requests of `--context` prompt tokens, all running (their contexts grow by
  up to `--batch * --context / 256` tokens while the others' prompts are computed); each step
  computes one token of each. Its FLOPs: the GEMMs above for `--batch` tokens plus attention
  over their mean context (2 FLOPs a multiply-add, matmuls only, as `jaxpipe.models.flops`
  counts).
- prefill: one prompt of `--prefill` tokens, in one step (`forward_flops_per_sequence`, the
  output head on the last token alone: the engine computes only the rows it samples).
Per step: wall seconds (median of `--steps`), MFU against the dtype's peak, and against the
peak's GEMM timed again beside the steps (before each prefill step and after the last, before
and after the decode steps; the median: a shared machine's speed drifts from minute to minute,
and the first figure may hold a step to a peak timed in another minute), the engine's host
phases (`Engine.host_time`), and the device time of the step programs by kind of op
(`op_breakdown`: matmuls, other arithmetic, slot reads and writes, copies, control), from a
profiler trace of the timed steps.
"""

from __future__ import annotations

import functools
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import op_breakdown
from experiments.shapes import SHAPES, gemms
from jaxpipe.models import flops, transformer
from jaxpipe.runtime import cli
from jaxpipe.serve import __main__ as serve_main
from jaxpipe.serve.engine import HOST_PHASES, Engine
from kernels_cpu import matmul as onednn

FLAGS = cli.flag_values(__name__)
flags.DEFINE_enum("shape", "smollm2-135m", list(SHAPES), "The Llama's shape.", flag_values=FLAGS)
flags.DEFINE_list(
    "dtypes", ["float32", "bfloat16"], "Weights' and compute dtypes.", flag_values=FLAGS
)
flags.DEFINE_integer("batch", 64, "Decode: requests running at once.", flag_values=FLAGS)
flags.DEFINE_integer("context", 256, "Decode: each request's tokens so far.", flag_values=FLAGS)
flags.DEFINE_integer(
    "prefill", 1024, "Prefill: the prompt's tokens, in one step.", flag_values=FLAGS
)
flags.DEFINE_integer("steps", 8, "Timed steps of each kind.", flag_values=FLAGS)
flags.DEFINE_integer(
    "kernel_rounds",
    10,
    "Where the kernel's own tiles run packed products (Intel, AVX-512): rounds of every "
    "layer's GEMMs on them and on oneDNN's matmul, alternated (0: none).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "reps",
    50,
    "Timed runs of each GEMM, at most (a second's worth, 5 at least); the median counts.",
    flag_values=FLAGS,
)


def decode_flops(cfg: transformer.TransformerConfig, batch: int, context: int) -> int:
  """FLOPs of a decode step: `batch` tokens through the GEMMs, each attending `context` tokens.

  Args:
    cfg: the model's shape.
    batch: tokens in the step (one a request).
    context: tokens each attends (its own included).

  Returns:
    Matmul FLOPs, 2 a multiply-add.
  """
  shapes = gemms(cfg, batch)
  per_layer = sum(2 * m * kk * n for name, (m, kk, n) in shapes.items() if name != "lm head")
  head = 2 * np.prod(shapes["lm head"])
  attention = 2 * 2 * batch * context * cfg.n_heads * cfg.head_dim  # scores and values
  return int(cfg.n_layers * (per_layer + attention) + head)


def prefill_flops(cfg: transformer.TransformerConfig, tokens: int) -> int:
  """FLOPs of a prefill step: one prompt's forward pass, the head on its last token alone.

  The engine computes logits only for the rows it samples: a prompt's last.

  Args:
    cfg: the model's shape.
    tokens: the prompt's tokens, all in the step.

  Returns:
    Matmul FLOPs, 2 a multiply-add (causal attention counted half).
  """
  head = 2 * cfg.d_model * cfg.vocab
  return flops.forward_flops_per_sequence(cfg, tokens) - (tokens - 1) * head


def _median(fn, reps: int, budget_s: float = 1.0) -> float:
  """Median seconds of `fn` over `reps` runs, or fewer (5 at least) once they took `budget_s`.

  The median, not the fastest: on a shared machine a few runs' best says little (a 64-row bf16
  product's best of 5 once read 176 GFLOP/s, the median of 200 runs 390).
  """
  fn(), fn()  # compiled, warm
  times = []
  while len(times) < reps and (len(times) < 5 or sum(times) < budget_s):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def gemm_run(who: str, mm: int, kk: int, n: int, dtype: str, rng) -> Callable[[], object]:
  """One of the model's GEMMs as a contender runs it, on random operands.

  Args:
    who: "xla" (one XLA program), "onednn" (the kernel the engine's steps run), "prepacked" (the
      same on the weights prepacked, as an engine holds them) or "torch" (its CPU matmul).
    mm: rows; kk: the contraction; n: columns.
    dtype: float32 or bfloat16.
    rng: a NumPy generator for the operands.

  Returns:
    A call that computes the product once, to completion, and returns it (a [mm, n] array).
  """
  if who == "torch":
    import torch

    a = torch.from_numpy(rng.standard_normal((mm, kk), np.float32)).to(getattr(torch, dtype))
    b = torch.from_numpy(rng.standard_normal((kk, n), np.float32)).to(getattr(torch, dtype))
    return lambda: torch.matmul(a, b)
  a = jnp.asarray(rng.standard_normal((mm, kk)), dtype)
  b = jnp.asarray(rng.standard_normal((kk, n)), dtype)
  if who == "prepacked":
    f = jax.jit(functools.partial(onednn.matmul_prepacked, n=n))
    packed = jax.jit(onednn.prepack)(b)
    return lambda: f(a, packed).block_until_ready()
  f = jax.jit(onednn.matmul if who == "onednn" else lambda x, y: x @ y)
  return lambda: f(a, b).block_until_ready()


def gemm_rates(cfg, ms: list[int], dtype: str, reps: int) -> list[tuple[str, str, float]]:
  """(engine, GEMM, GFLOP/s) for each of the model's GEMMs at each m: XLA, oneDNN, torch.

  Args:
    cfg: the model's shape.
    ms: the tokens of the steps.
    dtype: float32 or bfloat16.
    reps: timed runs at most (`_median`).

  Returns:
    The rates, XLA's (each followed by the oneDNN kernel's, on row-major and on prepacked
    weights, where it builds), then torch's (left out if torch is not installed).
  """
  who = ["xla"] + (["onednn", "prepacked"] if onednn.unavailable() is None else [])
  out = []
  rng = np.random.default_rng(0)
  for m in ms:
    for name, (mm, kk, n) in gemms(cfg, m).items():
      for w in who:
        seconds = _median(gemm_run(w, mm, kk, n, dtype, rng), reps)
        out.append((w, f"{name} {mm}x{kk}x{n}", 2 * mm * kk * n / seconds / 1e9))
  try:
    import torch
  except ImportError:
    return out
  torch.set_num_threads(os.cpu_count() or 1)
  for m in ms:
    for name, (mm, kk, n) in gemms(cfg, m).items():
      seconds = _median(gemm_run("torch", mm, kk, n, dtype, rng), reps)
      out.append(("torch", f"{name} {mm}x{kk}x{n}", 2 * mm * kk * n / seconds / 1e9))
  return out


def peak_probe(who: str, gemm: str, dtype: str) -> Callable[[], float]:
  """The run's peak GEMM again, to time beside a step: a shared machine's speed can drift by a
  fifth from minute to minute, so a peak timed minutes before a step may not be the step's.

  Args:
    who: the contender that ran it fastest (`gemm_rates`' first field).
    gemm: its GEMM, as `gemm_rates` names it ("gate+up 1024x576x3072").
    dtype: float32 or bfloat16.

  Returns:
    A call that times it now (the median of its runs within a quarter second, 5 at least) and
    returns its GFLOP/s.
  """
  mm, kk, n = map(int, gemm.split()[-1].split("x"))
  run = gemm_run(who, mm, kk, n, dtype, np.random.default_rng(0))
  return lambda: 2 * mm * kk * n / _median(run, 50, budget_s=0.25) / 1e9


def packed_kernels(
    cfg, ms: list[int], rounds: int, dtype: str = "float32"
) -> list[tuple[str, float, float]]:
  """Packed products on the kernel's own tiles against oneDNN's matmul, alternated.

  Each GEMM runs over as many distinct weights as the model has layers (the head over one), as a
  step reads them: from memory, not from a cache that one weight's repeats would warm. Each
  kernel reads the weights as they are packed for it (bfloat16 ones, on a CPU without bfloat16
  dot products: as bfloat16 for the tiles, as float32 for oneDNN). Float32 row counts past
  `PANELS_ROWS`, where oneDNN runs either way, are left out.

  Args:
    cfg: the model's shape.
    ms: the tokens of the steps.
    rounds: timed rounds; each runs every layer's product on both kernels, in turn.
    dtype: the weights' and products' dtype.

  Returns:
    (GEMM, the tiles' median seconds over the layers, oneDNN's), the GEMMs of each m and then
    their sums ("all, M = m").
  """
  rng = np.random.default_rng(0)
  out = []
  for m in ms:
    if dtype == "float32" and m > onednn.PANELS_ROWS:
      continue
    total = [0.0, 0.0]
    for name, (mm, kk, n) in gemms(cfg, m).items():
      layers = 1 if name == "lm head" else cfg.n_layers
      x = jnp.asarray(rng.standard_normal((mm, kk)), dtype)
      weights = [jnp.asarray(rng.standard_normal((kk, n)), dtype) for _ in range(layers)]
      packed = []
      for tiles in (True, False):
        with onednn.panels_forced(tiles):  # packed before the setting changes back
          packed.append(jax.block_until_ready([onednn.prepack(w) for w in weights]))
      f = jax.jit(functools.partial(onednn.matmul_prepacked, n=n))
      times = ([], [])
      for r in range(rounds + 1):  # the first round compiles and warms
        for i, tiles in enumerate((True, False)):
          with onednn.panels_forced(tiles):
            start = time.perf_counter()
            jax.block_until_ready([f(x, p) for p in packed[i]])
            if r:
              times[i].append(time.perf_counter() - start)
      row = (statistics.median(times[0]), statistics.median(times[1]))
      out.append((f"{name} {mm}x{kk}x{n} x{layers}", *row))
      total = [total[0] + row[0], total[1] + row[1]]
    out.append((f"all, M = {m}", *total))
  return out


def _decode_tokens(args) -> int:
  """Tokens each decode request may generate: through the warm-up (the batch's prompts take a
  step of 256 tokens each, while the earlier ones decode) and the timed steps."""
  return -(-args.batch * args.context // 256) + args.steps + 16


def _engine(cfg, params, args, tokens: int) -> Engine:
  s = 16
  pages = -(-(args.context + _decode_tokens(args) + 2) // s)
  return Engine(
      cfg,
      params,
      page_size=s,
      num_pages=args.batch * pages + -(-(args.prefill + 2) // s) + 1,
      max_batch=args.batch,
      max_tokens_per_step=tokens,
      max_seq_len=max(pages * s, args.prefill + 2),
      token_buckets=(args.batch, tokens) if tokens > args.batch else (tokens,),
      prefix_caching=False,
      async_scheduling=False,  # each step's time is its own
  )


def timed_steps(engine: Engine, n: int) -> tuple[list[float], dict, dict]:
  """n steps, profiled: (wall seconds each, host seconds by phase, device seconds by kind)."""
  host0 = dict(engine.host_time)
  programs = [engine.step_program(t, p) for t, p in engine.programs]
  kinds = {}
  for compiled in programs:
    kinds.update(op_breakdown.op_kinds(compiled.as_text()))
  times = []
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(n):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    (trace,) = pathlib.Path(d).glob("**/*.xplane.pb")
    seconds, _ = op_breakdown.exclusive_times(str(trace))
  device = dict.fromkeys(op_breakdown.KINDS, 0.0)
  for name, s in seconds.items():
    if name in kinds:
      device[kinds[name][0]] += s / n
  host = {p: (engine.host_time[p] - host0.get(p, 0.0)) / n for p in HOST_PHASES}
  return times, host, device


def main(argv) -> None:
  """Prints the GEMM rates, then each step's time, MFU and breakdown (module docstring).

  Args:
    argv: the program name.
  """
  del argv
  args = FLAGS
  if args.reps < 1:
    raise app.UsageError(f"--reps={args.reps} must be 1 or more (timed runs of each GEMM)")
  base = SHAPES[args.shape]
  print(
      f"# step_profile {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load "
      f"{os.getloadavg()[0]:.2f}; {args.shape}, decode {args.batch} x {args.context} tokens, "
      f"prefill {args.prefill} tokens"
  )
  params32 = jax.jit(transformer.init_params, static_argnums=0)(base, jax.random.key(0))
  for dtype in args.dtypes:
    rates = gemm_rates(base, [args.batch, args.prefill], dtype, args.reps)
    fastest = max(rates, key=lambda r: r[2])
    peak = fastest[2]
    probe = peak_probe(fastest[0], fastest[1], dtype)
    print(
        f"\n## {dtype}\n\n| GEMM (M x K x N) | XLA GFLOP/s | oneDNN kernel GFLOP/s | prepacked "
        "GFLOP/s | torch GFLOP/s |\n|---|---|---|---|---|"
    )
    table = {}
    for who, name, r in rates:
      table.setdefault(name, {})[who] = r
    for name, by in table.items():
      cells = [f"{by[w]:,.1f}" if w in by else "—" for w in ("xla", "onednn", "prepacked", "torch")]
      print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\npeak (the fastest above: {fastest[0]}, {fastest[1]}): {peak:,.1f} GFLOP/s\n")
    tiles = onednn.unavailable() is None and onednn.panels(base.d_model, base.d_ff)
    if tiles and (dtype == "float32" or onednn.bf16_in_float32()) and args.kernel_rounds > 0:
      rows = packed_kernels(base, [args.batch, args.prefill], args.kernel_rounds, dtype)
      print(
          f"packed {dtype} products over each layer's own weights, {args.kernel_rounds} rounds "
          "alternated (median ms):\n\n| GEMM (M x K x N x weights) | own tiles | oneDNN | "
          "oneDNN / tiles |\n|---|---|---|---|"
      )
      for name, own, dnnl in rows:
        print(f"| {name} | {1e3 * own:,.1f} | {1e3 * dnnl:,.1f} | {dnnl / own:.2f} |")
      print()
    cfg, params = serve_main.in_dtype(base, params32, dtype)
    rows = []
    # decode: every request prefilled first (untimed), then steps of one token each
    e = _engine(cfg, params, args, max(args.batch, 256))
    e.precompile()
    rng = np.random.default_rng(1)
    for _ in range(args.batch):
      prompt = list(map(int, rng.integers(0, cfg.vocab, args.context)))
      e.add_request(prompt, _decode_tokens(args), eos_id=None)
    while len(e.running) < args.batch or any(r.computed < args.context for r in e.running):
      e.step()
    context = round(statistics.mean(r.length for r in e.running)) + args.steps // 2
    beside = [probe()]  # the peak GEMM just before the timed steps and just after
    times, host, device = timed_steps(e, args.steps)
    beside.append(probe())
    rows.append(("decode", times, decode_flops(cfg, args.batch, context), beside, host, device))
    # prefill: one prompt a step, its whole length
    e = _engine(cfg, params, args, args.prefill)
    e.precompile()
    times, hosts, devices, beside = [], [], [], []
    for _ in range(args.steps):
      rid = e.add_request(list(map(int, rng.integers(0, cfg.vocab, args.prefill))), 1, eos_id=None)
      beside.append(probe())  # the peak GEMM before each step, and after the last
      t, h, dv = timed_steps(e, 1)
      times += t
      hosts.append(h)
      devices.append(dv)
      e.cancel(rid)
      e.finished()
    mean = lambda ds: {k: statistics.mean(d[k] for d in ds) for k in ds[0]}
    fl = prefill_flops(cfg, args.prefill)
    beside.append(probe())
    rows.append(("prefill", times, fl, beside, mean(hosts), mean(devices)))
    print(
        "| step | wall ms (median) | GFLOP | GFLOP/s | MFU | peak beside, GFLOP/s | MFU beside "
        "| host ms: "
        + ", ".join(HOST_PHASES)
        + " | device ms: "
        + ", ".join(op_breakdown.KINDS[:5])
        + " |\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, ts, fl, near, host, device in rows:
      s = statistics.median(ts)
      near = statistics.median(near)
      print(
          f"| {name} | {1e3 * s:,.1f} | {fl / 1e9:,.1f} | {fl / s / 1e9:,.1f} | "
          f"{100 * fl / s / 1e9 / peak:.0f}% | {near:,.1f} | {100 * fl / s / 1e9 / near:.0f}% | "
          + " / ".join(f"{1e3 * host[p]:.1f}" for p in HOST_PHASES)
          + " | "
          + " / ".join(f"{1e3 * device[k]:.1f}" for k in op_breakdown.KINDS[:5])
          + " |",
          flush=True,
      )


if __name__ == "__main__":
  cli.run(main)
