"""Schedules out and in: text grid, torch.distributed.pipelining CSV, Chrome/Perfetto trace, PNG.

The CSV is torch's "compute_only" format: one row per rank, one cell per step, `2F0`, `3I1`,
`(0F2;1B3)OVERLAP_F_B`, an empty cell an idle step. We write it on the lock-step tick grid, so
the empty cells are the bubble; reading it back keeps only each rank's order, so export then
import gives the same schedule. torch puts each stage on one rank: a bidirectional schedule is
written as 2p stages, the second direction's stages p..2p-1 on ranks p-1..0, which is how
`Placement.bidirectional` numbers its virtual stages.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Mapping

from jaxpipe.pipeline.ir.schedule import Action, Op, Overlap, Placement, Schedule
from jaxpipe.pipeline.ir.simulate import lockstep_ticks, simulate

_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
# torch's communication and FSDP actions (compute_comms CSVs): no compute, derived from it.
_NON_COMPUTE = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")

# Chrome trace-viewer's reserved colour names, one per kind.
CNAMES = {
    "F": "thread_state_running",
    "B": "terrible",
    "I": "thread_state_iowait",
    "W": "rail_idle",
}
COLOURS = {"F": "#4c8bd6", "B": "#d65f4c", "I": "#e8a33d", "W": "#6aab5e"}


def tick_rows(schedule: Schedule, grid: str = "lockstep") -> list[list[Op | None]]:
  """[rank][column] -> op or None (idle), on the lock-step tick grid or in plain order.

  Args:
    schedule: the schedule.
    grid: 'lockstep' (idle cells show the bubble) or 'order' (each rank's ops, no idle cells).

  Returns:
    One row per rank.

  Raises:
    ValueError: another grid.
  """
  if grid == "order":
    return [list(ops) for ops in schedule.ranks]
  if grid != "lockstep":
    raise ValueError(f"grid={grid!r}: use 'lockstep' (idle cells show the bubble) or 'order'")
  rows = []
  for ops, ticks in zip(schedule.ranks, lockstep_ticks(schedule)):
    row: list[Op | None] = [None] * (ticks[-1] + 1 if ticks else 0)
    for op, t in zip(ops, ticks):
      row[t] = op
    rows.append(row)
  return rows


def text_grid(schedule: Schedule, idle: str = ".") -> str:
  """One row per rank, one column per lock-step tick; idle ticks shown as `idle`.

  Args:
    schedule: the schedule.
    idle: the text of an idle cell.

  Returns:
    The grid, a header line of tick numbers first.
  """
  rows = tick_rows(schedule)
  width = max([len(str(op)) for ops in schedule.ranks for op in ops] + [1]) + 1
  steps = max([len(r) for r in rows] + [0])
  lines = ["tick    " + "".join(f"{t:<{width}}" for t in range(steps)).rstrip()]
  for r, row in enumerate(rows):
    row = row + [None] * (steps - len(row))
    lines.append(
        f"rank {r:<3}"
        + "".join(f"{str(op) if op is not None else idle:<{width}}" for op in row).rstrip()
    )
  return "\n".join(lines)


def to_csv(schedule: Schedule, grid: str = "lockstep") -> str:
  """torch.distributed.pipelining CSV text (module docstring).

  Args:
    schedule: the schedule.
    grid: 'lockstep' (empty cells are the bubble) or 'order', which writes no idle cells.

  Returns:
    The CSV, one row per rank.

  Raises:
    ValueError: another grid.
  """
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  for row in tick_rows(schedule, grid):
    writer.writerow(["" if op is None else str(op) for op in row])
  return out.getvalue()


def _parse_cell(text: str, where: str) -> Op | None:
  text = text.strip()
  if not text or _NON_COMPUTE.fullmatch(text):
    return None
  if m := _ACTION.fullmatch(text):
    return Action(m[2], int(m[1]), int(m[3]))
  if m := _OVERLAP.fullmatch(text):
    parts = [_parse_cell(p, where) for p in m[1].split(";")]
    fwd = [a for a in parts if isinstance(a, Action) and a.kind == "F"]
    bwd = [a for a in parts if isinstance(a, Action) and a.kind in ("B", "I")]
    if len(parts) == 2 and len(fwd) == 1 and len(bwd) == 1:
      return Overlap(fwd[0], bwd[0])
    raise ValueError(
        f"{where}: overlapped cell {text!r} must pair one forward with one "
        "backward, e.g. (0F2;1B3)OVERLAP_F_B"
    )
  raise ValueError(
      f"{where}: cannot read cell {text!r}; cells are <stage><F|B|I|W><micro-batch> "
      "like 2F0, or (0F2;1B3)OVERLAP_F_B, or empty for an idle step"
  )


def _infer_placement(
    num_ranks: int, stage_rank: dict[int, int], mb_stages: dict[int, set[int]]
) -> tuple[Placement, list[int]]:
  """Placement and micro-batch routes from the stage->rank map and which stages each mb visits."""
  n = max(stage_rank) + 1
  missing = [s for s in range(n) if s not in stage_rank]
  if missing:
    raise ValueError(
        f"stages {missing} appear on no rank, but stage {n - 1} does; stages "
        "must be numbered 0..S-1"
    )
  ranks = tuple(stage_rank[s] for s in range(n))
  every = set(range(n))
  if all(seen == every for seen in mb_stages.values()):
    return Placement(num_ranks, ranks, tuple(range(n)), (tuple(range(n)),)), []
  h = n // 2
  low, high = set(range(h)), set(range(h, n))
  if n % 2 == 0 and all(seen in (low, high) for seen in mb_stages.values()):
    route = [0 if mb_stages[mb] == low else 1 for mb in range(len(mb_stages))]
    placement = Placement(
        num_ranks, ranks, tuple(range(h)) * 2, (tuple(range(h)), tuple(range(h, n)))
    )
    return placement, route
  rule = (
      f"every micro-batch must visit all {n} stages, or (bidirectional) every one exactly "
      f"stages 0..{h - 1} or {h}..{n - 1}"
  )
  odd = [mb for mb, seen in sorted(mb_stages.items()) if seen not in (every, low, high)]
  if odd:
    raise ValueError(f"micro-batch {odd[0]} visits stages {sorted(mb_stages[odd[0]])}: {rule}")
  full = [mb for mb, seen in sorted(mb_stages.items()) if seen == every]
  half = [mb for mb, seen in sorted(mb_stages.items()) if seen != every]
  raise ValueError(
      f"micro-batch {full[0]} visits all stages but micro-batch {half[0]} only "
      f"stages {sorted(mb_stages[half[0]])}: {rule}"
  )


def from_csv(
    text_or_path: str | os.PathLike, name: str | None = None, validate: bool = True
) -> Schedule:
  """Reads torch's CSV (text or a path); infers placement, routes and micro-batch count.

  Communication and FSDP cells (compute_comms CSVs) are skipped; each rank keeps only its order.

  Args:
    text_or_path: the CSV text, or the path of a file holding it.
    name: the schedule's name; None: the file's name without extension ('csv' for text).
    validate: validate the schedule.

  Returns:
    The `Schedule`.

  Raises:
    FileNotFoundError: a .csv path that does not exist.
    ValueError: a cell that cannot be read, no rows or actions, a stage on two ranks, stages or
      micro-batches numbered with gaps, routes that are neither all stages nor (bidirectional)
      one half each, or (with validate) an invalid schedule.
  """
  path = None
  if isinstance(text_or_path, os.PathLike) or (
      isinstance(text_or_path, str) and "\n" not in text_or_path and os.path.isfile(text_or_path)
  ):
    path = os.fspath(text_or_path)
    with open(path, newline="") as f:
      text = f.read()
  else:
    text = text_or_path
    if text.strip().endswith(".csv") and "," not in text and "\n" not in text.strip():
      raise FileNotFoundError(f"no such schedule file {text!r}")
  if name is None:
    name = os.path.splitext(os.path.basename(path))[0] if path else "csv"
  rows = list(csv.reader(io.StringIO(text)))
  while rows and not any(c.strip() for c in rows[-1]):
    rows.pop()
  if not rows:
    raise ValueError("the CSV has no rows; write one row per rank")
  ranks = [
      [
          op
          for c, cell in enumerate(row)
          if (op := _parse_cell(cell, f"rank {r}, step {c}")) is not None
      ]
      for r, row in enumerate(rows)
  ]
  stage_rank: dict[int, int] = {}
  mb_stages: dict[int, set[int]] = {}
  for r, ops in enumerate(ranks):
    for op in ops:
      for a in op.parts():
        if stage_rank.setdefault(a.stage, r) != r:
          raise ValueError(
              f"stage {a.stage} appears on rank {stage_rank[a.stage]} and on rank "
              f"{r} ({a}); torch's CSV places each stage on one rank"
          )
        mb_stages.setdefault(a.microbatch, set()).add(a.stage)
  if not stage_rank:
    raise ValueError("the CSV holds no actions")
  m = max(mb_stages) + 1
  absent = [mb for mb in range(m) if mb not in mb_stages]
  if absent:
    raise ValueError(f"micro-batches {absent} appear nowhere, but micro-batch {m - 1} does")
  placement, route = _infer_placement(len(ranks), stage_rank, mb_stages)
  schedule = Schedule(name, placement, m, ranks, tuple(route))
  return schedule.validate() if validate else schedule


def to_perfetto(
    schedule: Schedule,
    costs: Mapping[str, float] | None = None,
    lockstep: bool = False,
    unit_us: float = 1000.0,
) -> str:
  """Chrome trace JSON: a process per rank, a thread per chunk, one time unit = `unit_us` us.

  An overlapped F&B puts its backward on a thread of its own, so that no track overlaps.

  Args:
    schedule: the schedule.
    costs: per-kind costs (`simulate`); None: the defaults.
    lockstep: the lock-step timeline instead of the asynchronous one.
    unit_us: microseconds per time unit.

  Returns:
    The trace as JSON text, otherData holding the schedule, makespan and costs.
  """
  result = simulate(schedule, costs=costs, lockstep=lockstep)
  pl = schedule.placement
  events = []
  for r in range(pl.num_ranks):
    events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
    for c, s in enumerate(pl.rank_stages(r)):
      label = f"chunk {c}: stage {s}"
      if pl.copies > 1:
        label += f" (model stage {pl.stage_model[s]}, copy {pl.stage_copy(s)})"
      events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": c, "args": {"name": label}})
    events.append(
        {
            "ph": "M",
            "name": "thread_name",
            "pid": r,
            "tid": pl.chunks_per_rank,
            "args": {"name": "overlapped backward (same chunk)"},
        }
    )
  for r, spans in enumerate(result.timelines):
    for start, end, op in spans:
      parts = op.parts()
      used = set()
      for a in parts:
        tid = pl.local_chunk(a.stage)
        if tid in used:  # F&B of one chunk: keep the track free of overlaps
          tid = pl.chunks_per_rank
        used.add(tid)
        events.append(
            {
                "name": f"{a.kind}{a.microbatch}" + (" (F&B)" if len(parts) > 1 else ""),
                "cat": a.kind,
                "ph": "X",
                "pid": r,
                "tid": tid,
                "ts": start * unit_us,
                "dur": (end - start) * unit_us,
                "cname": CNAMES[a.kind],
                "args": {"op": str(op), "stage": a.stage, "microbatch": a.microbatch},
            }
        )
  meta = {
      "schedule": schedule.name,
      "lockstep": lockstep,
      "makespan": result.makespan,
      "costs": result.costs,
      "time_unit_us": unit_us,
  }
  return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta})


def to_png(
    schedule: Schedule,
    path: str | os.PathLike,
    costs: Mapping[str, float] | None = None,
    lockstep: bool = False,
    title: str | None = None,
) -> None:
  """Timeline PNG: a row per rank, a bar per op coloured by kind, micro-batch written inside.

  An overlapped F&B is drawn as two half-height bars, forward above backward; later chunks are
  lighter.

  Args:
    schedule: the schedule.
    path: the PNG file to write.
    costs: per-kind costs (`simulate`); None: the defaults.
    lockstep: the lock-step timeline instead of the asynchronous one.
    title: the plot's title; None: the schedule's name, counts, bubble and rate.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch

  result = simulate(schedule, costs=costs, lockstep=lockstep)
  p = schedule.num_ranks
  nops = sum(len(ops) for ops in schedule.ranks)
  fig = Figure(figsize=(min(4 + result.makespan * 0.25, 40), 1 + 0.45 * p))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  label = nops <= 1200
  chunks = schedule.placement.chunks_per_rank
  bars: dict[tuple, list] = {}  # (y, height, kind, chunk) -> [(start, width)], one call each
  for r, spans in enumerate(result.timelines):
    for start, end, op in spans:
      parts = op.parts()
      h = 0.8 / len(parts)
      for j, a in enumerate(parts):
        y = r - 0.4 + j * h
        chunk = schedule.placement.local_chunk(a.stage)
        bars.setdefault((y, h, a.kind, chunk), []).append((start, end - start))
        if label and end - start > 0:
          ax.text(
              start + (end - start) / 2,
              y + h / 2,
              str(a.microbatch),
              ha="center",
              va="center",
              fontsize=6,
          )
  for (y, h, kind, chunk), xs in bars.items():
    ax.broken_barh(
        xs,
        (y, h),
        facecolors=COLOURS[kind],
        edgecolors="white",
        linewidth=0.5,
        alpha=1.0 - 0.45 * chunk / max(chunks - 1, 1),
    )
  ax.set_ylim(p - 0.5, -0.5)
  ax.set_xlim(0, max(result.makespan, 1e-9))
  ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
  ax.set_xlabel("time (F = 1)" if not lockstep else f"time, lock-step ({result.ticks} ticks)")
  ax.set_title(
      title
      or f"{schedule.name}: p={p}, m={schedule.num_microbatches}, bubble "
      f"{result.max_bubble:g}, rate {100 * result.bubble_rate:.1f}%"
  )
  ax.legend(
      handles=[Patch(color=COLOURS[k], label=k) for k in ("F", "B", "I", "W")],
      loc="upper left",
      bbox_to_anchor=(1.0, 1.0),
      fontsize=7,
      title="later chunks lighter" if chunks > 1 else None,
      title_fontsize=7,
  )
  fig.tight_layout()
  fig.savefig(os.fspath(path), dpi=100)
