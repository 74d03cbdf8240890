"""Checks a schedule: placement, completeness, dependency order, and freedom from deadlock."""

from __future__ import annotations

import collections

from jaxpipe.pipeline.ir.deps import unit_timeline
from jaxpipe.pipeline.ir.schedule import Schedule


class ScheduleError(ValueError):
  """An invalid schedule; the message ends with the step x rank grid, bad cells marked >like<."""


def _fail(schedule: Schedule, why: str, cells) -> None:
  raise ScheduleError(f"schedule {schedule.name!r}: {why}\n{schedule.to_grid(mark=cells)}")


def validate(schedule: Schedule) -> None:
  """Checks a schedule: placement, completeness, dependency order, and freedom from deadlock.

  Args:
    schedule: the schedule.

  Raises:
    ScheduleError: naming the first problem, with the offending cells marked in the grid: an
      action outside the micro-batches or stages, on another rank than its stage, off its
      micro-batch's route, or repeated; a missing forward or backward, or both a full and a
      split backward; a forward overlapped with its own backward; a backward before its forward
      (W before its I) on a rank; or a deadlock.
  """
  pl = schedule.placement
  m = schedule.num_microbatches
  n_s = pl.num_virtual_stages
  positions, which = pl.route_positions, schedule.microbatch_route
  seen = collections.defaultdict(list)  # (kind, stage, mb) -> [(rank, position)]
  for r, ops in enumerate(schedule.ranks):
    for i, op in enumerate(ops):
      for a in op.parts():
        s, mb = a.stage, a.microbatch
        if not 0 <= mb < m:
          _fail(schedule, f"{a} names micro-batch {mb}, outside [0, {m})", [(r, i)])
        if not 0 <= s < n_s:
          _fail(schedule, f"{a} names stage {s}, outside [0, {n_s})", [(r, i)])
        if pl.stage_rank[s] != r:
          _fail(
              schedule,
              f"{a} is on rank {r} but stage {s} is placed on rank {pl.stage_rank[s]}",
              [(r, i)],
          )
        if s not in positions[which[mb]]:
          _fail(
              schedule,
              f"{a}: micro-batch {mb} follows route {schedule.route(mb)}, which "
              f"does not pass stage {s}",
              [(r, i)],
          )
        seen[(a.kind, s, mb)].append((r, i))
  for key, cells in seen.items():
    if len(cells) > 1:
      _fail(schedule, f"{key[1]}{key[0]}{key[2]} appears {len(cells)} times", cells)
  for mb in range(m):
    for s in schedule.route(mb):
      name = f"stage {s}, micro-batch {mb}"
      if ("F", s, mb) not in seen:
        _fail(schedule, f"{name} has no forward ({s}F{mb})", [])
      has_b = ("B", s, mb) in seen
      has_i, has_w = ("I", s, mb) in seen, ("W", s, mb) in seen
      if has_b and (has_i or has_w):
        _fail(
            schedule,
            f"{name} has both a full backward and a split one",
            seen.get(("B", s, mb), []) + seen.get(("I", s, mb), []) + seen.get(("W", s, mb), []),
        )
      if not has_b and not (has_i and has_w):
        missing = "B, or I and W" if not (has_i or has_w) else ("W" if has_i else "I")
        _fail(
            schedule,
            f"{name} lacks its backward ({missing})",
            seen.get(("I", s, mb), []) + seen.get(("W", s, mb), []),
        )
  for r, ops in enumerate(schedule.ranks):
    for i, op in enumerate(ops):
      if (
          len(op.parts()) == 2
          and op.parts()[0].microbatch == op.parts()[1].microbatch
          and op.parts()[0].stage == op.parts()[1].stage
      ):
        _fail(schedule, f"{op} overlaps a forward with its own backward", [(r, i)])
  for (kind, s, mb), cells in seen.items():  # same stage, same rank: order is visible directly
    before = {"B": "F", "I": "F", "W": "I"}.get(kind)
    if before and cells[0][1] <= seen[(before, s, mb)][0][1]:
      _fail(
          schedule,
          f"{s}{kind}{mb} runs before {s}{before}{mb} on rank {cells[0][0]}, which "
          f"it needs ({'W needs its I' if kind == 'W' else 'a backward needs its forward'})",
          [cells[0], seen[(before, s, mb)][0]],
      )
  timeline = unit_timeline(schedule)
  if timeline.blocked:
    _fail(
        schedule,
        "deadlock: the marked ops wait on each other (or on an op ordered after "
        "them on the same rank) and can never run",
        timeline.blocked,
    )
