"""Data dependencies between actions, and the list-scheduling core every simulator shares."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpipe.pipeline.ir import Action, Op, Schedule

# Keys for what an action produces: ("F", s, mb) the stage's output activation,
# ("G", s, mb) the gradient of the stage's input (from B or I), ("W", s, mb) its weight grad.
Key = tuple[str, int, int]


def produces(schedule: Schedule, a: Action) -> Key:
  return ("F" if a.kind == "F" else "G" if a.kind in ("B", "I") else "W", a.stage, a.microbatch)


def requires(schedule: Schedule, a: Action) -> list[Key]:
  """What `a` waits for: the previous stage's output, the next stage's input gradient, its own F/I."""
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


def list_schedule(schedule: Schedule, cost: Callable[[Op], float],
                  latency: float = 0.0) -> Timeline:
  """Runs each rank's ops in order, each as soon as its rank is free and its inputs arrived.

  Cross-rank inputs arrive `latency` after they are produced. Ops that wait forever are
  reported in `blocked` rather than raised, so the validator can draw them.
  """
  rank_of = schedule.placement.stage_rank
  ready: dict[Key, tuple[float, int]] = {}  # key -> (time produced, rank)
  waiting: dict[Key, list[int]] = {}
  ptr = [0] * schedule.num_ranks
  free = [0.0] * schedule.num_ranks
  start = [[0.0] * len(ops) for ops in schedule.ranks]
  end = [[0.0] * len(ops) for ops in schedule.ranks]
  needs = [[[k for a in op.parts() for k in requires(schedule, a)] for op in ops]
           for ops in schedule.ranks]
  stack = list(range(schedule.num_ranks))[::-1]
  while stack:
    r = stack.pop()
    ops = schedule.ranks[r]
    while ptr[r] < len(ops):
      i = ptr[r]
      t = free[r]
      missing = None
      for k in needs[r][i]:
        got = ready.get(k)
        if got is None:
          missing = k
          break
        t = max(t, got[0] + (latency if got[1] != r else 0.0))
      if missing is not None:
        waiting.setdefault(missing, []).append(r)
        break
      op = ops[i]
      start[r][i] = t
      end[r][i] = free[r] = t + cost(op)
      ptr[r] = i + 1
      for a in op.parts():
        k = produces(schedule, a)
        ready[k] = (free[r], rank_of[a.stage])
        stack.extend(waiting.pop(k, ()))
  blocked = [(r, ptr[r]) for r in range(schedule.num_ranks) if ptr[r] < len(schedule.ranks[r])]
  return Timeline(start, end, blocked)
