"""All nine schedules side by side, simulated, beside the anchors.md figures; traces and PNGs.

  python -m experiments.schedule_sweep [--out out/schedule_sweep] [--no_files]

Costs F = I = W = 1, B = 2, F&B = F + B (no overlap credit). Columns: bubble in time units,
single step (makespan - busy, max over ranks) and steady state (idle between a rank's first and
last op, max over ranks), asynchronous and lock-step (the published order tick by tick, and the
tick tables the executor really runs after lowering); rate = mean bubble / makespan; activations
as micro-batch-stages on the busiest rank and in whole-rank units (count * p / stages); the
formula columns are anchors.md's, `*` marking bounds and approximations, `w` whole-rank units.
A second table sets ZB-V below m = 2p - 1 from the Zero Bubble authors' V generator (the
default) beside torch's rule (the 2p - 1 order less its extra micro-batches).
"""

from __future__ import annotations

import importlib
import os

from absl import flags

from jaxpipe.pipeline import SCHEDULE_NAMES, make_schedule
from jaxpipe.pipeline.ir.export import to_perfetto, to_png
from jaxpipe.pipeline.ir.formulas import anchor
from jaxpipe.pipeline.ir.lower import lower
from jaxpipe.pipeline.ir.schedules import GENERATORS
from jaxpipe.runtime import cli

FLAGS = cli.flag_values(__name__)
flags.DEFINE_string("out", "out/schedule_sweep", "Traces and PNGs go here.", flag_values=FLAGS)
flags.DEFINE_bool("no_files", False, "Print the tables only.", flag_values=FLAGS)

CASES = ((4, 8), (8, 32))
CHUNKS = {"interleaved-1f1b": 2}
TOL = 1e-9


def generator_missing(name: str) -> bool:
  """True while the module or function behind `name` has not been written yet."""
  module, fn = GENERATORS[name].split(":")
  try:
    mod = importlib.import_module(f"jaxpipe.pipeline.ir.schedules.{module}")
  except ModuleNotFoundError as e:
    if e.name == f"jaxpipe.pipeline.ir.schedules.{module}":
      return True
    raise
  return not hasattr(mod, fn)


def check_bubble(f, a, s) -> str:
  """Simulated bubble against the formula, in the formula's view (and cost assumption)."""
  note = ""
  if f.assumes:  # e.g. Chimera's slots: the formula presumes B = F
    a = s.simulate(f.assumes)
    note = " at " + ",".join(f"{k}={v:g}" for k, v in f.assumes.items())
  if f.bubble is None:
    ok = abs(a.bubble_rate - f.rate) < 1e-9
    return ("ok" if ok else f"MISMATCH {100 * a.bubble_rate:.1f}%") + note
  got = a.max_bubble if f.bubble_view == "single step" else a.max_steady_bubble
  if f.exact:
    return ("ok" if abs(got - f.bubble) < TOL else "MISMATCH") + note
  if abs(got - f.bubble) < TOL:
    return "= bound" + note
  return ("< bound" if got < f.bubble else "ABOVE bound") + note


def check_activations(f, a) -> str:
  got = max(
      a.peak_activations if f.activations_units == "micro-batch-stages" else a.peak_activations_rank
  )
  if f.activations_bound == "=":
    return "ok" if abs(got - f.activations) < TOL else "MISMATCH"
  if f.activations_bound == "<=":
    return (
        "= bound"
        if abs(got - f.activations) < TOL
        else "< bound"
        if got < f.activations
        else "ABOVE bound"
    )
  if f.activations_bound == "between":
    return "in range" if f.activations - TOL <= got <= f.activations_hi + TOL else "OUTSIDE"
  return f"{got - f.activations:+g}"


HEADER = (
    "schedule",
    "p",
    "m",
    "v",
    "bubble async",
    "steady",
    "lock-step",
    "formula",
    "view",
    "check",
    "rate async",
    "rate lock",
    "formula rate",
    "act",
    "act w",
    "formula act",
    "check",
    "params",
    "lock/async",
    "lowered/async",
)


def row(name: str, p: int, m: int, out: str | None) -> tuple:
  v = CHUNKS.get(name)
  if generator_missing(name):
    return (name, p, m, v or "", "missing") + ("",) * (len(HEADER) - 5)
  try:
    s = make_schedule(name, pp=p, microbatches=m, chunks=v)
  except ValueError as e:
    return (name, p, m, v or "", f"error: {str(e).splitlines()[0]}") + ("",) * (len(HEADER) - 5)
  a = s.simulate()
  ls = s.simulate(lockstep=True)
  f = anchor(name, p, m, s.placement.chunks_per_rank, group=s.options.get("group"))
  if out:
    stem = os.path.join(out, f"{name}_p{p}_m{m}")
    with open(stem + ".json", "w") as fh:
      fh.write(to_perfetto(s))
    with open(stem + "_lockstep.json", "w") as fh:
      fh.write(to_perfetto(s, lockstep=True))
    to_png(s, stem + ".png")
  rate = "" if f.rate is None else f"{100 * f.rate:.1f}%"
  v = s.placement.chunks_per_rank
  # VPP's formula is per chunk; anchors.md quotes it in whole-rank units too (F = v chunks).
  whole = (
      (lambda x: f"{x:g} ({x / v:g}w)")
      if f.bubble_units.startswith("per-chunk")
      else (lambda x: f"{x:g}")
  )
  return (
      name,
      p,
      m,
      v,
      whole(a.max_bubble),
      f"{a.max_steady_bubble:g}",
      whole(ls.max_bubble),
      "" if f.bubble is None else whole(f.bubble) + ("" if f.exact else "*"),
      f.bubble_view if f.bubble is not None else "rate",
      check_bubble(f, a, s),
      f"{100 * a.bubble_rate:.1f}%",
      f"{100 * ls.bubble_rate:.1f}%",
      rate,
      max(a.peak_activations),
      f"{max(a.peak_activations_rank):g}",
      f.activations_text(),
      check_activations(f, a),
      s.placement.copies,
      f"{ls.makespan / a.makespan:.3f}",
      f"{lower(s).lockstep_time / a.makespan:.3f}",
  )


ZBV_CASES = ((4, (4, 5, 6, 7)), (8, (8, 10, 12, 14, 15)))
ZBV_HEADER = (
    "p",
    "m",
    "steady: generator",
    "steady: torch rule",
    "bound 2p-1-m",
    "single step: generator",
    "single step: torch rule",
    "act: generator",
    "act: torch rule",
)


def zbv_row(p: int, m: int) -> tuple:
  """ZB-V at p, m: the authors' generator (default) and torch's rule, F = I = W = 1."""
  gen = make_schedule("zb-v", pp=p, microbatches=m).simulate()
  drop = make_schedule("zb-v", pp=p, microbatches=m, fewer="drop").simulate()
  return (
      p,
      m,
      f"{gen.max_steady_bubble:g}",
      f"{drop.max_steady_bubble:g}",
      max(0, 2 * p - 1 - m),
      f"{gen.max_bubble:g}",
      f"{drop.max_bubble:g}",
      max(gen.peak_activations),
      max(drop.peak_activations),
  )


def table(rows: list[tuple], header: tuple = HEADER) -> str:
  cells = [tuple(str(c) for c in r) for r in [header] + rows]
  width = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, width)) + " |"
  return "\n".join(
      [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in width) + "|"]
      + [line(r) for r in cells[1:]]
  )


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  out = None if FLAGS.no_files else FLAGS.out
  if out:
    os.makedirs(out, exist_ok=True)
  rows = [row(name, p, m, out) for p, m in CASES for name in SCHEDULE_NAMES]
  print(table(rows))
  print(
      "\nbubble: time units (F = 1 per chunk; (..w) = VPP in whole-rank units), max over ranks; "
      "view of the formula in 'view'; rate = mean bubble / makespan; act = peak micro-batch-stages "
      "on the busiest rank, act w = whole-rank units; params = copies of each model stage; "
      "lock/async = lock-step makespan / asynchronous makespan running the published per-rank "
      "order tick by tick; lowered/async = the same for the tick tables the executor runs "
      "(jaxpipe.pipeline.ir.lower); * = bound or approximation"
  )
  print("\nZB-V below m = 2p-1 (steady state and single step in F, act in micro-batch-stages):")
  print(table([zbv_row(p, m) for p, ms in ZBV_CASES for m in ms], ZBV_HEADER))
  if out:
    print(f"traces (Perfetto: ui.perfetto.dev) and PNGs in {out}/")


if __name__ == "__main__":
  cli.run(main)
