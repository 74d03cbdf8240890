"""Data dependencies between actions, and the list-scheduling core every simulator shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpipe.pipeline.ir.schedule import Action, Op, Schedule

# Keys for what an action produces: ("F", s, mb) the stage's output activation,
# ("G", s, mb) the gradient of the stage's input (from B or I), ("W", s, mb) its weight grad.
Key = tuple[str, int, int]


def produces(schedule: Schedule, a: Action) -> Key:
  """The key of what an action produces.

  Args:
    schedule: the schedule.
    a: the action.

  Returns:
    ("F", stage, mb) for a forward (the stage's output), ("G", stage, mb) for B or I (the
    gradient of the stage's input), ("W", stage, mb) for W (its weight gradient).
  """
  return ("F" if a.kind == "F" else "G" if a.kind in ("B", "I") else "W", a.stage, a.microbatch)


def requires(schedule: Schedule, a: Action) -> list[Key]:
  """What `a` waits for: the previous stage's output, the next stage's input gradient, its own F/I.

  Args:
    schedule: the schedule, whose routes order the stages of `a`'s micro-batch.
    a: the action.

  Returns:
    The keys (`produces`) it needs: F the previous stage's ("F", ...), none on the route's first
    stage; B and I its own ("F", ...) and the next stage's ("G", ...), not on the last; W its
    own ("G", ...).
  """
  which = schedule.microbatch_route[a.microbatch]
  route = schedule.placement.routes[which]
  i = schedule.placement.route_positions[which][a.stage]
  if a.kind == "F":
    return [("F", route[i - 1], a.microbatch)] if i > 0 else []
  if a.kind == "W":
    return [("G", a.stage, a.microbatch)]
  deps = [("F", a.stage, a.microbatch)]
  if i + 1 < len(route):
    deps.append(("G", route[i + 1], a.microbatch))
  return deps


@dataclasses.dataclass
class Timeline:
  """Result of list-scheduling a schedule: when each op of each rank starts and ends."""

  start: list[list[float]]  # [rank][position]
  end: list[list[float]]  # [rank][position]
  blocked: list[tuple[int, int]]  # (rank, position) of ops that could never start (deadlock)


def _dependency_table(schedule: Schedule):
  """[rank][position] -> (keys the op needs, keys it makes), keys as ints for fast hashing.

  Key (what, stage, mb) -> (what * S + stage) * M + mb with what 0: F output, 1: input grad.
  """
  pl = schedule.placement
  n_s, m = pl.num_virtual_stages, schedule.num_microbatches
  grad = n_s * m
  routes, positions, which = pl.routes, pl.route_positions, schedule.microbatch_route
  needs, makes = [], []
  for ops in schedule.ranks:
    need_r, make_r = [], []
    for op in ops:
      need, make = [], []
      for a in op.parts():
        s, mb, kind = a.stage, a.microbatch, a.kind
        w = which[mb]
        route, i = routes[w], positions[w][s]
        if kind == "F":
          if i:
            need.append(route[i - 1] * m + mb)
          make.append(s * m + mb)
        elif kind == "W":
          need.append(grad + s * m + mb)
        else:
          need.append(s * m + mb)
          if i + 1 < len(route):
            need.append(grad + route[i + 1] * m + mb)
          make.append(grad + s * m + mb)
      need_r.append(need)
      make_r.append(make)
    needs.append(need_r)
    makes.append(make_r)
  return needs, makes


def list_schedule(
    schedule: Schedule,
    cost: Callable[[Op], float] | None = None,
    latency: float = 0.0,
    durations: list[list[float]] | None = None,
) -> Timeline:
  """Runs each rank's ops in order, each as soon as its rank is free and its inputs arrived.

  Ops that wait forever are reported in `blocked` rather than raised, so the validator can draw
  them. Linear in the number of ops: a rank waiting on an input is parked under that input's key
  and resumed once, when it is produced.

  Args:
    schedule: the schedule.
    cost: op -> its duration; None gives every op one unit (the lock-step tick grid).
    latency: cross-rank inputs arrive `latency` after they are produced.
    durations: [rank][position] durations; if given, replaces `cost`.

  Returns:
    The `Timeline`: [rank][position] start and end times, and the blocked ops.
  """
  needs, makes = _cached(schedule, "_dependency_table", _dependency_table)
  p = schedule.num_ranks
  n_s, m = schedule.placement.num_virtual_stages, schedule.num_microbatches
  rank_of = schedule.placement.stage_rank
  ready: dict[int, float] = {}  # key -> time produced
  waiting: dict[int, list[int]] = {}
  ptr = [0] * p
  free = [0.0] * p
  dur = durations or [
      [1.0] * len(ops) if cost is None else [float(cost(op)) for op in ops]
      for ops in schedule.ranks
  ]
  start = [[0.0] * len(ops) for ops in schedule.ranks]
  end = [[0.0] * len(ops) for ops in schedule.ranks]
  stack = list(range(p))[::-1]
  while stack:
    r = stack.pop()
    need_r, make_r, dur_r, start_r, end_r = needs[r], makes[r], dur[r], start[r], end[r]
    i, n, t_free = ptr[r], len(need_r), free[r]
    while i < n:
      t = t_free
      missing = None
      for k in need_r[i]:
        got = ready.get(k)
        if got is None:
          missing = k
          break
        if latency and rank_of[(k // m) % n_s] != r:
          got += latency
        if got > t:
          t = got
      if missing is not None:
        waiting.setdefault(missing, []).append(r)
        break
      start_r[i] = t
      t_free = end_r[i] = t + dur_r[i]
      for k in make_r[i]:
        ready[k] = t_free
        woken = waiting.pop(k, None)
        if woken:
          stack.extend(woken)
      i += 1
    ptr[r], free[r] = i, t_free
  blocked = [(r, ptr[r]) for r in range(p) if ptr[r] < len(schedule.ranks[r])]
  return Timeline(start, end, blocked)


def _cached(schedule: Schedule, name: str, build):
  """`build(schedule)`, remembered on the schedule until its ops, placement or routes change."""
  key = (schedule.ranks, schedule.placement, schedule.microbatch_route)
  cached = schedule.__dict__.get(name)
  if cached is not None and all(a is b for a, b in zip(cached[0], key)):
    return cached[1]
  value = build(schedule)
  schedule.__dict__[name] = (key, value)
  return value


def unit_timeline(schedule: Schedule) -> Timeline:
  """list_schedule with unit costs (validator's deadlock check, lock-step ticks), cached.

  The result is remembered on the schedule until its ops, placement or routes change.

  Args:
    schedule: the schedule.

  Returns:
    The `Timeline`.
  """
  return _cached(schedule, "_unit_timeline", list_schedule)
