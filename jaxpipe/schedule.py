"""Build, check, measure and draw a pipeline schedule from the command line (no JAX).

  python -m jaxpipe.schedule 1f1b --pp 4 --microbatches 8 --format stats
  python -m jaxpipe.schedule interleaved-1f1b --pp 4 --microbatches 8 --chunks 2 --format grid
  python -m jaxpipe.schedule my_schedule.csv --format stats   # torch CSV: load, validate, measure
  python -m jaxpipe.schedule zb-v --pp 4 --microbatches 8 --costs costs.json --format stats
  python -m jaxpipe.schedule auto --pp 4 --microbatches 8,16 --costs costs.json --memory_limit 2

`--costs` takes per-kind costs (F=1,I=1,W=1) or a cost file from `python -m jaxpipe.measure`
(seconds; the entry for the schedule's micro-batch and stage counts, one ppermute as the
latency). `auto` ranks every schedule the cost file can price by its predicted step time.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable

from absl import app, flags

from jaxpipe.pipeline import SCHEDULE_NAMES, Schedule, make_schedule
from jaxpipe.pipeline.ir.export import text_grid, to_csv, to_perfetto, to_png
from jaxpipe.pipeline.ir.formulas import anchor
from jaxpipe.pipeline.ir.simulate import resolve_costs, simulate
from jaxpipe.planning import auto as auto_lib
from jaxpipe.planning import costs as costs_lib
from jaxpipe.runtime import cli

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("pp", None, "Pipeline ranks.", flag_values=FLAGS)
flags.DEFINE_string(
    "microbatches",
    None,
    "Micro-batches per step (auto: a comma list, e.g. 8,16).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("chunks", None, "Model chunks per rank (interleaved-1f1b).", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "option",
    [],
    "Generator option NAME=VALUE, e.g. group=4 for interleaved-1f1b; repeatable.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "costs",
    "",
    "Per-kind costs, e.g. F=1,I=1,W=1 (B=I+W), or a cost file (python -m jaxpipe.measure).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "memory_limit",
    0.0,
    "auto: GB per device; schedules predicted to need more are dropped.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "layers", None, "auto: layers every stage count must divide.", flag_values=FLAGS
)
flags.DEFINE_string(
    "schedules", "", "auto: generators to rank, comma-separated (default all).", flag_values=FLAGS
)
flags.DEFINE_float("latency", 0.0, "Cross-rank latency.", flag_values=FLAGS)
flags.DEFINE_bool(
    "lockstep",
    False,
    "perfetto/png: draw the lock-step timeline instead of the asynchronous one.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "format", "grid", "Output: grid, csv, perfetto, png, stats or ticks.", flag_values=FLAGS
)
flags.DEFINE_string("out", None, "Write here instead of stdout.", flag_values=FLAGS)


def is_cost_file(text: str | None) -> bool:
  """Whether a --costs value names a cost file rather than per-kind costs.

  Args:
    text: the --costs value, or None.

  Returns:
    True if it ends with .json or is an existing file.
  """
  return bool(text) and (text.endswith(".json") or os.path.isfile(text))


def parse_costs(text: str | None) -> dict[str, float]:
  """Per-kind costs from their text: 'F=1,I=1,W=1' -> {'F': 1.0, ...}.

  Args:
    text: comma-separated KIND=VALUE items, KIND one of F, B, I, W, F&B; None or '' gives {}.

  Returns:
    The costs by kind, as floats.

  Raises:
    ValueError: an item not of the form KIND=number, an unknown kind or a negative value.
  """
  out = {}
  for item in filter(None, (text or "").split(",")):
    key, sep, value = item.partition("=")
    try:
      out[key.strip()] = float(value)
    except ValueError:
      raise ValueError(
          f"--costs item {item!r} must look like F=1 (kinds F, B, I, W, F&B)"
      ) from None
    if not sep:
      raise ValueError(f"--costs item {item!r} must look like F=1 (kinds F, B, I, W, F&B)")
  resolve_costs(out)  # rejects unknown kinds and negative values
  return out


def parse_ints(flag: str, text: str | None) -> list[int] | None:
  """A comma list of counts: '8,16' -> [8, 16]; None stays None.

  Args:
    flag: the flag's name, for the error message.
    text: the flag's value, or None.

  Returns:
    The counts, or None for None.

  Raises:
    ValueError: an item that is not a whole number, no item, or one below 1.
  """
  if text is None:
    return None
  try:
    out = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(
        f"{flag} {text!r} must be a whole number (auto: a comma list like 8,16)"
    ) from None
  if not out or min(out) < 1:
    raise ValueError(f"{flag} {text!r} must be positive whole numbers")
  return out


def parse_options(items: list[str]) -> dict:
  """Generator options from --option: ['group=4'] -> {'group': 4}.

  Args:
    items: NAME=VALUE strings; a VALUE becomes an int, a float, a bool (true/false, any case)
      or else stays a string.

  Returns:
    The options by name.

  Raises:
    ValueError: an item without `=` or without a name.
  """
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--option {item!r} must look like name=value, e.g. group=4")
    low = value.lower()
    if low in ("true", "false"):
      out[key] = low == "true"
      continue
    for kind in (int, float):
      try:
        out[key] = kind(value)
        break
      except ValueError:
        pass
    else:
      out[key] = value
  return out


def stats(schedule: Schedule, args) -> str:
  """Async and lock-step bubble, rate, peak activations, beside the anchors.md figures.

  Args:
    schedule: the schedule to simulate.
    args: the command's values; reads `costs` (resolved per-kind costs) and `latency`.

  Returns:
    The report, one figure per line.
  """
  a = simulate(schedule, args.costs, latency=args.latency)
  ls = simulate(schedule, args.costs, lockstep=True, latency=args.latency)
  pl = schedule.placement
  c = a.costs
  fb = "F+B" if c["F&B"] is None else f"{c['F&B']:g}"
  top = max(range(schedule.num_ranks), key=lambda r: a.peak_activations[r])
  lines = [
      f"schedule {schedule.name}: p={schedule.num_ranks}, m={schedule.num_microbatches}, "
      f"chunks per rank {pl.chunks_per_rank}, model stages {pl.num_stages}, "
      f"parameter copies {pl.copies}",
      f"costs F={c['F']:g} B={c['B']:g} I={c['I']:g} W={c['W']:g} F&B={fb}"
      + (f", latency {args.latency:g}" if args.latency else ""),
      f"{'':34}{'async':>12}{'lock-step':>12}",
      f"{'makespan':34}{a.makespan:>12g}{ls.makespan:>12g}",
      f"{'bubble, single step (max rank)':34}{a.max_bubble:>12g}{ls.max_bubble:>12g}",
      f"{'bubble, steady state (max rank)':34}{a.max_steady_bubble:>12g}"
      f"{ls.max_steady_bubble:>12g}",
      f"{'bubble rate (mean rank/makespan)':34}{100 * a.bubble_rate:>11.1f}%"
      f"{100 * ls.bubble_rate:>11.1f}%",
      f"lock-step ticks {ls.ticks}; lock-step / async makespan {ls.makespan / a.makespan:.3f}"
      if a.makespan
      else f"lock-step ticks {ls.ticks}",
      f"peak activations {a.peak_activations[top]} micro-batch-stages on rank {top} = "
      f"{a.peak_activations_rank[top]:g} whole-rank units",
      f"per rank: bubble (async, single step) {[round(x, 6) for x in a.bubble]}",
      f"per rank: peak activations {list(a.peak_activations)}",
  ]
  name = schedule.name
  if name in SCHEDULE_NAMES:
    try:
      f = anchor(
          name,
          schedule.num_ranks,
          schedule.num_microbatches,
          pl.chunks_per_rank,
          args.costs,
          schedule.options.get("group"),
      )
    except ValueError as e:
      lines.append(f"anchors.md: {e}")
    else:
      bubble = (
          f"bubble {f.bubble_text()} ({f.bubble_view}, units {f.bubble_units})"
          if f.bubble is not None
          else f"bubble {f.bubble_text()}"
      )
      lines.append(
          f"anchors.md: {bubble}; activations {f.activations_text()} "
          f"({f.activations_units}); {f.source}"
          + ("" if f.exact else "; * = bound or approximation")
      )
  return "\n".join(lines)


def _png(schedule: Schedule, args) -> None:
  if not args.out:
    raise ValueError("--format png writes a file: pass --out FILE.png")
  to_png(schedule, args.out, costs=args.costs, lockstep=args.lockstep)


# Output formats: name -> writer(schedule, args) returning text for stdout/--out, or None when it
# wrote --out itself. Other layers register theirs here (a tick-table printer adds "ticks");
# import anything heavy inside the writer so that this CLI stays free of JAX.
FORMATS: dict[str, Callable[[Schedule, types.SimpleNamespace], str | None]] = {
    "grid": lambda s, args: text_grid(s),
    "csv": lambda s, args: to_csv(s),
    "perfetto": lambda s, args: to_perfetto(s, costs=args.costs, lockstep=args.lockstep),
    "png": _png,
    "stats": stats,
    "ticks": lambda s, args: _ticks(s, args),
}


def _ticks(schedule: Schedule, args) -> str:
  """The executor's lowered tick table (one cell per tick, packed parts joined by ';')."""
  from jaxpipe.pipeline.ir.lower import Costs, lower

  lowered = lower(schedule, Costs(**{k: v for k, v in args.costs.items() if k in "FIW"}))
  print(lowered.summary(), file=sys.stderr)
  return lowered.to_csv()


def use_cost_file(schedule: Schedule, args) -> None:
  """--costs FILE: the schedule's entry as per-kind costs, one ppermute as the latency.

  Args:
    schedule: its micro-batch and stage counts pick the cost file's entry.
    args: the command's values; `cost_file` is read, `costs` set, and `latency` set where it is
      0.0 (not given).

  Raises:
    CostFileError: the cost file has no entry for the schedule's counts.
  """
  entry = args.cost_file.entry(schedule.num_microbatches, schedule.num_stages)
  args.costs = entry.kinds()
  if args.latency == 0.0:
    args.latency = entry.seconds["ppermute"]


def auto(args) -> str:
  """Ranks every generator at --microbatches (comma list) by predicted step time.

  Args:
    args: the command's values; reads `cost_file`, `pp`, `microbatches_list`, `schedules`
      (comma list, empty: every generator), `memory_limit` (GB per device, 0: none) and
      `layers`.

  Returns:
    The ranking's report.

  Raises:
    ValueError: --pp, --microbatches or a cost file is missing.
    AutoError: no candidate can run (`jaxpipe.planning.auto.rank`).
  """
  if args.cost_file is None or args.pp is None or args.microbatches_list is None:
    raise ValueError(
        "auto needs --pp, --microbatches and --costs FILE (from python -m jaxpipe.measure)"
    )
  names = tuple(filter(None, args.schedules.split(","))) or SCHEDULE_NAMES
  limit = args.memory_limit * auto_lib.GB if args.memory_limit else None
  ranking = auto_lib.rank(
      args.pp, args.microbatches_list, args.cost_file, limit, args.layers, names
  )
  return ranking.report()


def load(args) -> Schedule:
  """The schedule named by args.schedule (a generator name or a CSV path), validated.

  Args:
    args: the command's values; reads `schedule`, `pp`, `microbatches`, `chunks` and `options`
      (the generator's options).

  Returns:
    The validated `Schedule`.

  Raises:
    FileNotFoundError: a .csv path that does not exist.
    ValueError: for a CSV, --pp, --microbatches or --chunks disagrees with the file; for a
      generator, --pp or --microbatches is missing, or `make_schedule` refuses it.
  """
  if args.schedule.endswith(".csv") or os.path.isfile(args.schedule):
    if not os.path.isfile(args.schedule):
      raise FileNotFoundError(f"no such schedule file {args.schedule!r}")
    schedule = Schedule.from_csv(args.schedule)
    for flag, want, got in (
        ("--pp", args.pp, schedule.num_ranks),
        ("--microbatches", args.microbatches, schedule.num_microbatches),
        ("--chunks", args.chunks, schedule.placement.chunks_per_rank),
    ):
      if want is not None and want != got:
        raise ValueError(
            f"{flag} {want} disagrees with {args.schedule}, which has {got}; "
            f"drop {flag} or fix the file"
        )
    return schedule
  if args.pp is None or args.microbatches is None:
    raise ValueError(f"schedule {args.schedule!r} needs --pp and --microbatches")
  return make_schedule(
      args.schedule, pp=args.pp, microbatches=args.microbatches, chunks=args.chunks, **args.options
  )


def main(argv: list[str]) -> int:
  """Runs the command (module docstring).

  Args:
    argv: the program name and the schedule; the rest are flags.

  Returns:
    The exit status: 0, 2 for a schedule or flag that cannot work, 1 if --out fails.

  Raises:
    app.UsageError: not exactly one schedule is given.
  """
  if len(argv) != 2:
    raise app.UsageError(
        f"give one schedule: one of {', '.join(SCHEDULE_NAMES)}, a torch CSV "
        "path, or auto (rank them all with --costs FILE)"
        + (f"; got {argv[1:]}" if len(argv) > 2 else "")
    )
  args = cli.values(FLAGS)
  args.schedule = argv[1]
  if args.format not in FORMATS:
    print(
        f"error: --format={args.format!r}: choose from {', '.join(sorted(FORMATS))}",
        file=sys.stderr,
    )
    return 2
  try:
    args.cost_file = costs_lib.load(args.costs) if is_cost_file(args.costs) else None
    args.costs = {} if args.cost_file else parse_costs(args.costs)
    args.microbatches_list = parse_ints("--microbatches", args.microbatches)
    args.options = parse_options(args.option)
    if args.schedule == "auto":
      text = auto(args)
    else:
      if args.microbatches_list is not None and len(args.microbatches_list) > 1:
        raise ValueError("--microbatches takes one count, except for auto")
      args.microbatches = args.microbatches_list[0] if args.microbatches_list else None
      schedule = load(args)
      if args.cost_file:
        use_cost_file(schedule, args)
      text = FORMATS[args.format](schedule, args)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if text is not None and not args.out:
    print(text)
    return 0
  if text is not None:
    try:
      with open(args.out, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    except OSError as e:
      print(f"error: --out {args.out}: {e.strerror}", file=sys.stderr)
      return 1
  print(f"wrote {args.format} to {args.out}")
  return 0


if __name__ == "__main__":
  cli.run(main)
