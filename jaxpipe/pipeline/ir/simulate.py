"""Simulators: asynchronous (event-driven) and lock-step (SPMD ticks) execution of a schedule.

Views and units of every figure (anchors.md):
- time is in the units of `costs` (default F = I = W = 1, B = I + W = 2: one chunk's forward
  is one unit);
- `bubble[r]` is the single-step view: makespan minus rank r's busy time;
- `steady_bubble[r]` is the steady-state view: rank r's idle time between the start of its
  first op and the end of its last; the papers' steady-state figure is the max over ranks;
- `bubble_rate` is the mean single-step bubble over ranks divided by the makespan,
  1 - sum(busy) / (p * makespan), the "% of the makespan" of anchors.md;
- `peak_activations[r]` counts micro-batch-stages (one virtual stage's activations for one
  micro-batch) held at once on rank r: taken by F, released by B, or by W when the backward
  is split (I keeps them for W); inside an overlapped F&B the forward takes its slot before
  the backward frees one. `peak_activations_rank[r]` is the same in whole-rank units: one unit
  is one micro-batch's activations for 1/p of the model (what a plain pipeline's rank holds
  per micro-batch), i.e. count * p / num_stages; /chunks for VPP and V placements.
  Peaks depend only on each rank's order, so both simulators report the same ones.

Lock-step: tick t runs, on every rank, at most that rank's next op, and only if its inputs
were produced in an earlier tick; a tick lasts as long as its slowest op (plus `latency`, for
the collective permute that ends every tick). Which tick an op lands in is the asynchronous
start time under unit costs, so `lockstep_ticks` is what a tick-table lowering starts from.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Mapping

from jaxpipe.pipeline.ir.deps import list_schedule, unit_timeline
from jaxpipe.pipeline.ir.schedule import Op, Schedule

COST_KEYS = ("F", "B", "I", "W", "F&B")


def resolve_costs(costs: Mapping[str, float] | None = None) -> dict[str, float | None]:
  """Fills defaults: F = I = W = 1, B = I + W, F&B = None (sum of the pair's parts).

  Args:
    costs: per-kind costs (COST_KEYS); None: all defaults.

  Returns:
    Every kind of COST_KEYS as a float, F&B None unless given.

  Raises:
    ValueError: an unknown kind, or a cost that is not a non-negative number.
  """
  costs = dict(costs or {})
  bad = sorted(set(costs) - set(COST_KEYS))
  if bad:
    raise ValueError(f"unknown cost kinds {bad}; costs are given for {', '.join(COST_KEYS)}")
  for k, v in costs.items():
    if not isinstance(v, numbers.Real) or v < 0:
      raise ValueError(f"cost {k}={v!r} must be a non-negative number")
  out: dict[str, float | None] = {k: float(costs.get(k, 1.0)) for k in ("F", "I", "W")}
  out["B"] = float(costs.get("B", out["I"] + out["W"]))
  out["F&B"] = float(costs["F&B"]) if "F&B" in costs else None
  return out


def op_cost(op: Op, costs: Mapping[str, float | None]) -> float:
  """Time one op takes; an overlapped pair costs `F&B` if set, else the sum of its parts.

  Args:
    op: an Action or an Overlap.
    costs: resolved per-kind costs (`resolve_costs`).

  Returns:
    The time.
  """
  parts = op.parts()
  if len(parts) > 1 and costs["F&B"] is not None:
    return costs["F&B"]
  return sum(costs[a.kind] for a in parts)


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What one simulated step of a schedule costs; see the module docstring for views and units."""

  name: str  # schedule name
  lockstep: bool  # True: SPMD ticks; False: asynchronous execution
  costs: dict  # resolved per-kind costs
  timelines: tuple  # [rank] -> ((start, end, op), ...) in the rank's order
  makespan: float  # end of the last op
  busy: tuple[float, ...]  # [rank] total op time
  bubble: tuple[float, ...]  # [rank] single-step view: makespan - busy
  steady_bubble: tuple[float, ...]  # [rank] steady-state view: idle between first and last op
  peak_activations: tuple[int, ...]  # [rank] micro-batch-stages held at once
  peak_activations_rank: tuple[float, ...]  # [rank] same, whole-rank units
  param_copies: int  # copies of each model stage's parameters across the pipeline
  chunks: int  # virtual stages per rank
  ticks: int | None  # lock-step: number of ticks; None for asynchronous

  @property
  def num_ranks(self) -> int:
    return len(self.busy)

  @property
  def max_bubble(self) -> float:
    """Single-step view, worst rank."""
    return max(self.bubble)

  @property
  def max_steady_bubble(self) -> float:
    """Steady-state view (max over ranks), as the Zero Bubble paper counts it."""
    return max(self.steady_bubble)

  @property
  def bubble_rate(self) -> float:
    """Mean single-step bubble over ranks, as a fraction of the makespan."""
    if self.makespan == 0:
      return 0.0
    return 1.0 - sum(self.busy) / (self.num_ranks * self.makespan)

  def summary(self) -> str:
    mode = f"lock-step ({self.ticks} ticks)" if self.lockstep else "async"
    return (
        f"{self.name} {mode}: makespan {self.makespan:g}, bubble {self.max_bubble:g} "
        f"(single step, max over ranks), {self.max_steady_bubble:g} (steady state), "
        f"rate {100 * self.bubble_rate:.1f}%, peak activations {max(self.peak_activations)} "
        f"micro-batch-stages = {max(self.peak_activations_rank):g} whole-rank units"
    )


def lockstep_ticks(schedule: Schedule) -> list[list[int]]:
  """[rank][position] -> the tick the op runs in under lock-step execution.

  Args:
    schedule: the schedule.

  Returns:
    The ticks: each op's asynchronous start time under unit costs.
  """
  timeline = _timeline(schedule, None, 0.0)
  return [[int(t) for t in row] for row in timeline.start]


def _timeline(schedule: Schedule, durations, latency: float):
  """list_schedule, raising the validator's error for schedules that cannot run."""
  try:
    timeline = (
        unit_timeline(schedule)
        if durations is None and not latency
        else list_schedule(schedule, None, latency, durations)
    )
  except (KeyError, IndexError):  # an action off its route or out of range
    schedule.validate()
    raise
  if timeline.blocked:
    schedule.validate()  # raises with the deadlocked cells marked
  return timeline


def peak_activations(schedule: Schedule) -> list[int]:
  """[rank] -> most micro-batch-stages whose F ran and whose B (or W) has not yet run.

  Args:
    schedule: the schedule; only each rank's order counts.

  Returns:
    One peak per rank.
  """
  peaks = []
  for ops in schedule.ranks:
    held = peak = 0
    for op in ops:
      for a in op.parts():  # an overlap lists its forward first
        if a.kind == "F":
          held += 1
          peak = max(peak, held)
        elif a.kind in ("B", "W"):
          held -= 1
    peaks.append(peak)
  return peaks


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | None = None,
    lockstep: bool = False,
    latency: float = 0.0,
) -> SimResult:
  """Runs `schedule` in simulation (module docstring for the views and units).

  Args:
    schedule: the schedule.
    costs: per-kind costs (`resolve_costs`); None: the defaults.
    lockstep: SPMD ticks instead of asynchronous execution.
    latency: delays cross-rank inputs (async) or ends each tick (lock-step).

  Returns:
    The `SimResult`.

  Raises:
    ValueError: costs `resolve_costs` refuses, or a negative latency.
  """
  c = resolve_costs(costs)
  if not isinstance(latency, numbers.Real) or latency < 0:
    raise ValueError(f"latency={latency!r} must be a non-negative number")
  single = {k: c[k] for k in ("F", "B", "I", "W")}
  dur = [
      [single[op.kind] if op.kind in single else op_cost(op, c) for op in ops]
      for ops in schedule.ranks
  ]
  ticks = None
  if lockstep:
    tick_of = lockstep_ticks(schedule)
    ticks = 1 + max((t for row in tick_of for t in row), default=-1)
    length = [0.0] * ticks
    for row, d_row in zip(tick_of, dur):
      for t, d in zip(row, d_row):
        if d > length[t]:
          length[t] = d
    begin = [0.0] * (ticks + 1)
    for t in range(ticks):
      begin[t + 1] = begin[t] + length[t] + latency
    starts = [[begin[t] for t in row] for row in tick_of]
    ends = [[s + d for s, d in zip(row, d_row)] for row, d_row in zip(starts, dur)]
    makespan = begin[ticks] - (latency if ticks else 0.0)
  else:
    timeline = _timeline(schedule, dur, latency)
    starts, ends = timeline.start, timeline.end
    makespan = max((row[-1] for row in ends if row), default=0.0)
  timelines, busy, steady = [], [], []
  for ops, s_row, e_row in zip(schedule.ranks, starts, ends):
    timelines.append(tuple(zip(s_row, e_row, ops)))
    work = sum(map(operator.sub, e_row, s_row))
    busy.append(work)
    steady.append(e_row[-1] - s_row[0] - work if ops else 0.0)
  peaks = peak_activations(schedule)
  pl = schedule.placement
  return SimResult(
      name=schedule.name,
      lockstep=lockstep,
      costs=c,
      timelines=tuple(timelines),
      makespan=makespan,
      busy=tuple(busy),
      bubble=tuple(makespan - b for b in busy),
      steady_bubble=tuple(steady),
      peak_activations=tuple(peaks),
      peak_activations_rank=tuple(k * pl.num_ranks / pl.num_stages for k in peaks),
      param_copies=pl.copies,
      chunks=pl.chunks_per_rank,
      ticks=ticks,
  )
