"""Config sweeps: every combination of --grid values trained by the real runner, measured
and predicted.

  python -m experiments.sweep --config configs/quickstart.py \
      --grid pipeline.schedule=1f1b,zb-h1,zb-v,dualpipev --grid pipeline.microbatches=4,8 \
      [--config.mesh.pp=4 ...] [--gin_file F.gin] [--gin_param 'optimizer.lr = 1e-3'] \
      --steps 20 --out DIR [--trace]

Each cell runs `python -m jaxpipe.train` in its own workdir DIR/<cell>/ (log.txt holds its
output) with the config file, the fixed --config.* overrides, gin, the cell's values and
--steps. A cell with a result.json is skipped (its prediction derived again from its cost
file), so rerunning the command resumes the sweep; a
cell that fails is recorded with the last line of its error and the sweep goes on (it runs
again next time). Per cell, from the runner: tokens/s and step time (median of its logged
windows, the compiling first step excluded), compile seconds and peak bytes per device from the
compiled step's `memory_analysis()` (compile.json), the final loss. Then `python -m
jaxpipe.measure --paired` measures the stage costs of the cell's model, mesh, micro-batch and
stage count (costs.json) in rounds that also time the cell's own train step, so the prediction
from those costs (step time, memory, lock-step bubble) meets a step measured under the same
load: the error column compares the two, in CPU time where the devices share the host's cores
(CPU host devices; `unit`), else in wall time; `lock-step ms` is what parallel devices would
take. The children share a JAX compilation cache
(DIR/jax-cache unless $JAX_COMPILATION_CACHE_DIR is set). `--trace` also writes
DIR/<cell>/ticks.perfetto.json (`python -m jaxpipe.tick_trace`: planned against measured
ticks). Results: DIR/sweep.csv, DIR/sweep.md, DIR/sweep.png; `load` is the 1-minute load
average when the cell started. Under the table, what `pipeline.schedule=auto` chooses from the
cells' own costs (merged into DIR/costs.json) and where that cell's measured step ranks.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import difflib
import importlib.util
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence

import ml_collections
from absl import flags

from jaxpipe.pipeline.ir.lower import lower
from jaxpipe.planning import auto as auto_lib
from jaxpipe.planning import costs as costs_lib
from jaxpipe.runtime import cli, files
from jaxpipe.training import config as config_lib
from jaxpipe.training.stage_timing import load_average

COLUMNS = (
    "cell",
    "status",
    "schedule",
    "microbatches",
    "chunks",
    "tokens_per_s",
    "step_ms",
    "unit",
    "paired_ms",
    "predicted_ms",
    "error_pct",
    "lockstep_ms",
    "compile_s",
    "peak_mb",
    "predicted_mb",
    "final_loss",
    "bubble_pct",
    "ticks",
    "load",
    "measure_load",
    "error",
)


FLAGS = cli.flag_values(__name__)
flags.DEFINE_string("config", None, "ml_collections config file[:arg].", flag_values=FLAGS)
flags.mark_flag_as_required("config", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "grid",
    [],
    "KEY=V1,V2: a config field and its values; repeatable, the cells are the product.",
    flag_values=FLAGS,
)
flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields.", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "gin_param", [], "Gin bindings, e.g. 'optimizer.lr = 1e-3'.", flag_values=FLAGS
)
flags.DEFINE_integer("steps", 20, "Train steps per cell.", flag_values=FLAGS)
flags.DEFINE_integer("log_every", 5, "Steps per timed window.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "Sweep directory (resumable).", flag_values=FLAGS)
flags.mark_flag_as_required("out", flag_values=FLAGS)
flags.DEFINE_bool(
    "trace",
    False,
    "Also write each cell's planned vs measured ticks (ticks.perfetto.json).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("repeats", 5, "Timed rounds of costs and step.", flag_values=FLAGS)
flags.DEFINE_float("timeout", 3600, "Seconds per cell process.", flag_values=FLAGS)


class SweepError(ValueError):
  """A sweep that cannot start; the message names the bad input and the fix."""


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`path/to/config.py[:arg]` -> its get_config(arg), as --config reads it."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SweepError(f"--config {path!r}: no such file")
  module = importlib.util.spec_from_file_location("sweep_config", path)
  mod = importlib.util.module_from_spec(module)
  module.loader.exec_module(mod)
  return mod.get_config(arg or None)


def field_paths(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every leaf field of the config tree, dotted."""
  out = []
  for key in config.keys():
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      out += field_paths(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def parse_value(config: ml_collections.ConfigDict, key: str, text: str):
  """`text` as the type of field `key` (as --config.key=text would set it)."""
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  kind = node.get_type(leaf)
  try:
    if kind is bool:
      if text.lower() not in ("true", "false"):
        raise ValueError
      return text.lower() == "true"
    if kind in (int, float, str):
      return kind(text)
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise SweepError(
        f"{key}={text!r} is not of type {kind.__name__}, the type of config field "
        f"{key}; give values of that type"
    ) from None


def check_key(config: ml_collections.ConfigDict, key: str, flag: str) -> None:
  paths = field_paths(config)
  if key not in paths:
    close = difflib.get_close_matches(key, paths, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; fields look like 'pipeline.schedule'"
    raise SweepError(f"{flag} key {key!r} is not a config field{hint}")


def parse_grid(config: ml_collections.ConfigDict, grid: Sequence[str]) -> dict[str, list[str]]:
  """['pipeline.schedule=1f1b,zb-h1', ...] -> {key: [values]}, each key a field, each value of
  its type; SweepError on an empty grid, an unknown key or a bad value."""
  if not grid:
    raise SweepError(
        "the grid is empty: give at least one --grid KEY=V1,V2 "
        "(e.g. --grid pipeline.schedule=1f1b,zb-h1)"
    )
  out: dict[str, list[str]] = {}
  for item in grid:
    key, sep, values = item.partition("=")
    key = key.strip()
    vals = [v.strip() for v in values.split(",") if v.strip()] if sep else []
    if not vals:
      raise SweepError(f"--grid {item!r} has no values; write KEY=V1,V2")
    check_key(config, key, "--grid")
    if key in out:
      raise SweepError(f"--grid key {key!r} is given twice; list all its values in one --grid")
    for v in vals:
      parse_value(config, key, v)
    out[key] = vals
  return out


def parse_overrides(config: ml_collections.ConfigDict, extra: Sequence[str]) -> list[str]:
  """Fixed `--config.key=value` arguments, checked and applied to `config`; others refused."""
  out = []
  for arg in extra:
    m = re.fullmatch(r"--config\.([\w.]+)=(.*)", arg)
    if not m:
      raise SweepError(f"unknown argument {arg!r}; fixed overrides look like --config.mesh.pp=4")
    check_key(config, m[1], "--config.")
    set_field(config, m[1], parse_value(config, m[1], m[2]))
    out.append(arg)
  return out


def set_field(config: ml_collections.ConfigDict, key: str, value) -> None:
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


def cell_dir(name: str) -> str:
  """A cell's workdir under the sweep directory, from its name."""
  return re.sub(r"[^\w.=,+-]", "_", name).replace(",", "__")


@dataclasses.dataclass
class Cell:
  values: dict[str, str]  # grid key -> value text

  @property
  def name(self) -> str:
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in self.values.items())

  @property
  def dirname(self) -> str:
    return cell_dir(self.name)

  def args(self) -> list[str]:
    return [f"--config.{k}={v}" for k, v in self.values.items()]


def run(cmd: list[str], log_path: str, timeout: float) -> tuple[int, str]:
  """Runs `cmd` with its output in `log_path`; -> (status, last line of stderr or stdout)."""
  with open(log_path, "w") as log:
    log.write(" ".join(cmd) + "\n")
    log.flush()
    try:
      proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, text=True)
      rc = proc.returncode
    except subprocess.TimeoutExpired:
      return 124, f"timed out after {timeout:g} s"
  with open(log_path) as f:
    lines = [l.strip() for l in f.read().replace("\r", "\n").splitlines() if l.strip()]
  return rc, (lines[-1] if lines else "")


def read_metrics(workdir: str) -> dict:
  """Step time (median of logged windows), tokens/s, final loss from metrics.jsonl."""
  rows = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
  losses = [r["loss"] for r in rows if "loss" in r]
  if not steps:
    raise SweepError(f"{workdir}/metrics.jsonl has no timed steps; run at least 3 steps")
  step = statistics.median(steps)
  return {"step_s": step, "windows": steps, "final_loss": losses[-1] if losses else None}


def resolved_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a cell's runner trained: its config.json, with auto's choice (auto.json)."""
  with open(os.path.join(workdir, "config.json")) as f:
    resolved = ml_collections.ConfigDict(json.load(f))
  if resolved.pipeline.schedule == config_lib.AUTO:
    with open(os.path.join(workdir, "auto.json")) as f:
      resolved.pipeline.update(json.load(f)["choice"])
  return resolved


def run_cell(cell: Cell, args, fixed: list[str], gin: list[str], out: str) -> dict:
  """Trains one cell, measures its costs beside its own step, predicts; -> its result row."""
  workdir = os.path.join(out, cell.dirname)
  os.makedirs(workdir, exist_ok=True)
  # The measurement below gets the same train settings: the learning-rate schedule (over
  # train.steps) is part of the step's program, so its step is the cell's own and is read from
  # the compilation cache the run just filled instead of compiled again.
  train = [
      f"--config.train.steps={args.steps}",
      f"--config.train.log_every={args.log_every}",
      "--config.train.eval_every=0",
      "--config.checkpoint.every=0",
  ]
  overrides = fixed + cell.args() + train
  row = {"cell": cell.name, "status": "failed", "load": load_average()}
  rc, last = run(
      [sys.executable, "-m", "jaxpipe.train", "--config", args.config, "--workdir", workdir]
      + overrides
      + gin,
      os.path.join(workdir, "log.txt"),
      args.timeout,
  )
  if rc != 0:
    row["error"] = f"train exited {rc}: {last}"
    return row
  resolved = resolved_config(workdir)
  p = resolved.pipeline
  row.update(schedule=p.schedule, microbatches=p.microbatches, chunks=p.chunks)
  metrics = read_metrics(workdir)
  with open(os.path.join(workdir, "compile.json")) as f:
    compiled = json.load(f)
  tokens = resolved.data.batch * resolved.data.seq_len
  row.update(
      status="ok",
      step_ms=1e3 * metrics["step_s"],
      tokens_per_s=tokens / metrics["step_s"],
      final_loss=metrics["final_loss"],
      compile_s=compiled["compile_s"],
      peak_mb=compiled["peak_bytes"] / 2**20 if "peak_bytes" in compiled else None,
  )
  if resolved.mesh.pp > 1:
    # what auto chose runs as a named schedule from here on
    chosen = [f"--config.pipeline.{k}={p[k]}" for k in ("schedule", "microbatches", "chunks")]
    predict_cell(row, resolved, fixed + cell.args() + chosen + train + gin, args, workdir)
  return row


def predict_cell(
    row: dict, resolved: ml_collections.ConfigDict, overrides: list[str], args, workdir: str
) -> None:
  """Adds the predicted step time, memory and bubble from costs measured in the same rounds as
  the cell's own train step (`python -m jaxpipe.measure --paired`), and that step's time."""
  schedule = config_lib.pipeline_schedule(resolved.pipeline, resolved.mesh.pp)
  m, s = schedule.num_microbatches, schedule.num_stages
  path = os.path.join(workdir, "costs.json")
  rc, last = run(
      [
          sys.executable,
          "-m",
          "jaxpipe.measure",
          "--config",
          args.config,
          "--out",
          path,
          f"--microbatches={m}",
          f"--stages={s}",
          "--paired",
          f"--repeats={args.repeats}",
      ]
      + overrides,
      os.path.join(workdir, "measure.log.txt"),
      args.timeout,
  )
  if rc != 0:
    row["error"] = f"measure exited {rc}: {last}"
    return
  add_prediction(row, resolved, path)
  if args.trace:
    rc, last = run(
        [
            sys.executable,
            "-m",
            "jaxpipe.tick_trace",
            "--config",
            args.config,
            "--costs",
            path,
            "--out",
            os.path.join(workdir, "ticks.perfetto.json"),
        ]
        + overrides,
        os.path.join(workdir, "trace.log.txt"),
        args.timeout,
    )
    if rc != 0:
      row["error"] = f"tick_trace exited {rc}: {last}"


def add_prediction(row: dict, resolved: ml_collections.ConfigDict, path: str) -> None:
  """The prediction columns from the cell's cost file `path` beside the step measured with it
  (also for a finished cell read back, so that the table follows the current cost model)."""
  schedule = config_lib.pipeline_schedule(resolved.pipeline, resolved.mesh.pp)
  costs = costs_lib.load(path)
  lowered = lower(schedule)  # the tables the executor runs (api.lowered_for)
  pred = costs.predict(lowered)
  paired = costs.setup["paired"]
  # devices sharing the host's cores: compare CPU seconds (every device's work, and little of
  # what other processes take); parallel devices: wall seconds of the lock-step ticks
  shared = pred.model == "shared cores"
  got, want = (paired["step_cpu_s"], pred.cpu_s) if shared else (paired["step_s"], pred.step_s)
  row.update(
      paired_ms=1e3 * got,
      predicted_ms=1e3 * want,
      unit="CPU" if shared else "wall",
      lockstep_ms=1e3 * pred.lockstep_s,
      predicted_mb=pred.memory_bytes / 2**20,
      bubble_pct=100 * pred.bubble,
      ticks=lowered.num_ticks,
      error_pct=100 * (want / got - 1),
      measure_load=costs.setup["load_average"],
  )


def auto_among(rows: list[dict], out: str) -> str | None:
  """What auto chooses from the cells' own costs (the first measured entry for each micro-batch
  and stage count, written to DIR/costs.json), and where that cell's step measured among the
  cells'."""
  ok = [r for r in rows if r["status"] == "ok" and r.get("paired_ms") is not None]
  if len(ok) < 2:
    return None
  entries, first = {}, None
  for r in ok:
    with open(os.path.join(out, cell_dir(r["cell"]), "costs.json")) as f:
      data = json.load(f)
    first = first or data
    for e in data["entries"]:
      entries.setdefault((e["microbatches"], e["stages"]), e)
  merged = {**first, "entries": list(entries.values())}
  path = os.path.join(out, "costs.json")  # for python -m jaxpipe.schedule auto --costs
  costs_lib.dump(merged, path)
  costs = costs_lib.parse(merged, path)
  model = first["setup"]["model"]
  layers = config_lib.layer_units(ml_collections.ConfigDict({"model": model}))
  ranking = auto_lib.rank(
      first["setup"]["mesh"]["pp"],
      sorted({int(r["microbatches"]) for r in ok}),
      costs,
      layers=layers,
      names=sorted({r["schedule"] for r in ok}),
  )
  best = ranking.best
  key = lambda r: float(r["paired_ms"])
  order = sorted(ok, key=key)
  mine = [
      r for r in ok if (r["schedule"], int(r["microbatches"])) == (best.name, best.microbatches)
  ]
  if not mine:
    return f"auto over the cells' costs chooses {best.label}, which is not a cell of this sweep"
  place = order.index(mine[0]) + 1
  unit = mine[0].get("unit", "")
  return (
      f"auto over the cells' costs chooses {best.label} (predicted "
      f"{1e3 * best.prediction.step_s:.1f} ms per step); that cell measured "
      f"{key(mine[0]):.1f} ms {unit}, #{place} of {len(order)}, "
      f"{100 * (key(mine[0]) / key(order[0]) - 1):.1f}% above the fastest "
      f"({order[0]['cell']}, {key(order[0]):.1f} ms)"
  )


def fmt(value, digits: int = 1) -> str:
  if value is None or value == "":
    return ""
  if isinstance(value, float):
    return f"{value:.{digits}f}"
  return str(value)


def markdown(rows: list[dict]) -> str:
  head = (
      "cell",
      "status",
      "tokens/s",
      "step ms",
      "paired ms",
      "predicted ms",
      "error",
      "lock-step ms",
      "compile s",
      "peak MB",
      "predicted MB",
      "final loss",
      "bubble",
      "ticks",
      "load",
  )
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    err = f"{r['error_pct']:+.0f}%" if r.get("error_pct") is not None else ""
    bub = f"{r['bubble_pct']:.1f}%" if r.get("bubble_pct") is not None else ""
    status = r["status"] if r["status"] == "ok" else f"failed: {r.get('error', '')}"
    lines.append(
        "| "
        + " | ".join(
            [
                r["cell"],
                status,
                fmt(r.get("tokens_per_s"), 0),
                fmt(r.get("step_ms")),
                f"{fmt(r.get('paired_ms'))} {r.get('unit', '')}".strip(),
                fmt(r.get("predicted_ms")),
                err,
                fmt(r.get("lockstep_ms")),
                fmt(r.get("compile_s")),
                fmt(r.get("peak_mb"), 2),
                fmt(r.get("predicted_mb"), 2),
                fmt(r.get("final_loss"), 4),
                bub,
                fmt(r.get("ticks")),
                r.get("load", "").split(" ")[0],
            ]
        )
        + " |"
    )
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
  """Step time per cell: the runner's, the one measured beside the costs, the predicted."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  ok = [r for r in rows if r["status"] == "ok"]
  fig = Figure(figsize=(max(6, 0.55 * len(rows) + 2), 4.5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  xs = range(len(ok))
  ax.bar(
      [x - 0.27 for x in xs],
      [r["step_ms"] for r in ok],
      0.27,
      label="runner (wall time, carries the load)",
      color="#4c8bd6",
  )
  unit = ok[0].get("unit", "wall") if ok else "wall"
  ax.bar(
      list(xs),
      [r.get("paired_ms") or 0 for r in ok],
      0.27,
      label=f"measured beside the costs ({unit} time)",
      color="#6aab5e",
  )
  ax.bar(
      [x + 0.27 for x in xs],
      [r.get("predicted_ms") or 0 for r in ok],
      0.27,
      label=f"predicted from those costs ({unit} time)",
      color="#e8a33d",
  )
  ax.set_xticks(list(xs), [r["cell"] for r in ok], rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("step time (ms)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
  """The sweep (module docstring): argv is the program name and the fixed --config.key=value
  overrides, which `cli.run(main, known_only=True)` leaves unparsed. -> 0 when every cell ran, 1
  when one failed, 2 for inputs that cannot start the sweep."""
  args, extra = cli.values(FLAGS), argv[1:]
  try:
    if args.steps < 3 or args.log_every < 1:
      raise SweepError(
          f"--steps {args.steps} --log_every {args.log_every}: need at least 3 "
          "steps (the first compiles and is not timed) and log_every >= 1"
      )
    base = load_config(args.config)
    fixed = parse_overrides(base, extra)
    grid = parse_grid(base, args.grid)
  except SweepError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  gin = [f"--gin_file={g}" for g in args.gin_file] + [f"--gin_param={g}" for g in args.gin_param]
  # the cell's runner, measurement and trace compile the same step: let them share it
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.out, "jax-cache"))
  cells = [Cell(dict(zip(grid, combo))) for combo in itertools.product(*grid.values())]
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for i, cell in enumerate(cells):
    result = os.path.join(args.out, cell.dirname, "result.json")
    if os.path.exists(result):
      with open(result) as f:
        row = json.load(f)
      costs = os.path.join(args.out, cell.dirname, "costs.json")
      if row.get("predicted_ms") is not None and os.path.exists(costs):
        add_prediction(row, resolved_config(os.path.dirname(costs)), costs)
      print(f"[{i + 1}/{len(cells)}] {cell.name}: done before, skipped", flush=True)
    else:
      print(f"[{i + 1}/{len(cells)}] {cell.name}: running", flush=True)
      try:
        row = run_cell(cell, args, fixed, gin, args.out)
      except Exception as e:  # a cell's outputs that cannot be read: record it, go on
        row = {"cell": cell.name, "status": "failed", "error": f"{type(e).__name__}: {e}"}
      if row["status"] == "ok":
        files.write_json(result, row, indent=1)
    rows.append(row)
    print(
        f"    {row['status']}: "
        + (
            f"{row['step_ms']:.1f} ms/step in the runner, "
            + (
                f"{row['paired_ms']:.1f} ms {row['unit']} beside the costs, "
                f"{row['predicted_ms']:.1f} predicted ({row['error_pct']:+.0f}%)"
                if row.get("predicted_ms") is not None
                else "no prediction"
            )
            if row["status"] == "ok"
            else row.get("error", "")
        ),
        flush=True,
    )
  with open(os.path.join(args.out, "sweep.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  table = markdown(rows)
  choice = auto_among(rows, args.out)
  if choice:
    table += f"\n{choice}\n"
  with open(os.path.join(args.out, "sweep.md"), "w") as f:
    f.write(table)
  plot(rows, os.path.join(args.out, "sweep.png"), f"{args.config} {' '.join(fixed)}")
  print(table)
  print(f"wrote {args.out}/sweep.csv, sweep.md, sweep.png")
  return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
  cli.run(main, known_only=True)
