"""Lowering: a validated schedule -> integer tables [tick, rank, field] the scan executor runs.
No JAX.

A tick runs, on every rank, at most one forward (F), one input-side backward (I, or a full
B) and one weight-gradient (W), then every rank takes part in the same ppermutes. A tick lasts
as long as its slowest rank, so the lowering list-schedules each rank's ops onto ticks: it may
split a B into I and W ticks, pack independent cheap parts of later ops into a tick that is
long anyway, and (optionally) pull a pending W forward into an idle tick. It tries a few such
variants and keeps the one with the shortest lock-step time (then the least memory).

Activations, residuals, output cotangents and, between a split backward's I and W, what W
needs from I (the output cotangents of the stage's layers) live in per-rank slot buffers; a slot
is taken when its value is written (end of a tick) and freed after its last read, so each buffer
holds exactly the peak number of values in flight at once on any rank.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

import numpy as np

from jaxpipe.pipeline.ir.deps import list_schedule, requires
from jaxpipe.pipeline.ir.schedule import Action, Overlap, Schedule

# Branch codes: which parts a rank runs in one tick. "B" is a full backward (input and
# weight cotangent of one micro-batch); "I+W" are the two halves of different micro-batches.
BRANCHES = ("idle", "F", "I", "B", "W", "F+I", "F+B", "F+W", "I+W", "F+I+W")
_BRANCH_OF = {name: i for i, name in enumerate(BRANCHES)}

# Columns of the table. mb/chunk/slot columns hold -1 when unused (the executor's buffers keep a
# spare last slot, so -1 indexes a scratch slot); flag columns hold 0/1.
FIELDS = (
    "branch",
    # forward part
    "f_mb",
    "f_chunk",
    "f_first",
    "f_last",
    "f_in",
    "f_res",
    "f_cot",
    "f_local",
    # input-side backward part (I or B)
    "b_mb",
    "b_chunk",
    "b_first",
    "b_res",
    "b_cot",
    "b_local",
    "b_wg",
    # weight-gradient part (reads what its I left in a wg slot)
    "w_mb",
    "w_chunk",
    "w_res",
    "w_wg",
    # chunk whose gradient receives this tick's weight cotangent (from B or W)
    "g_chunk",
    # where the values arriving over each ppermute land (-1: nothing for this rank)
    "recv_act_down",
    "recv_act_up",
    "recv_grad_down",
    "recv_grad_up",
)
COL = {name: i for i, name in enumerate(FIELDS)}
# ppermute channels: activations / input cotangents, "down" = rank r -> r+1, "up" = r -> r-1
# (both cyclic, so interleaved placements wrap from the last rank to the first).
CHANNELS = ("act_down", "act_up", "grad_down", "grad_up")


@dataclasses.dataclass(frozen=True)
class Costs:
  """Duration of each kind of part in one tick; a full B costs I + W, a packed tick the sum."""

  F: float = 1.0  # forward of one chunk on one micro-batch
  I: float = 1.0  # input cotangent
  W: float = 1.0  # weight cotangent

  def of(self, kind: str) -> float:
    """Duration of one part of a kind.

    Args:
      kind: 'F', 'I', 'W', or 'B' (a full backward, I + W).

    Returns:
      The duration.
    """
    return self.I + self.W if kind == "B" else getattr(self, kind)


@dataclasses.dataclass(frozen=True)
class LowerOptions:
  """One lowering variant; `lower` tries several and keeps the best."""

  split: str = "none"  # which full backwards become I + W: "none", "standalone" (not in F&B), "all"
  pack: bool = True  # fill a long tick with the next parts of the rank's order where they fit
  pull_w: bool = False  # run a later W whose I is done instead of idling


VARIANTS = tuple(
    LowerOptions(split, True, pull_w)
    for split in ("none", "standalone", "all")
    for pull_w in (False, True)
)


@dataclasses.dataclass
class Lowered:
  """The executor's tables and what they cost."""

  schedule: Schedule
  table: np.ndarray  # int32 [ticks, ranks, len(FIELDS)]
  ticks: list  # ticks[t][r] = tuple of Actions run by rank r in tick t (for reports and CSV)
  act_slots: int  # activation arrivals waiting for their forward, peak per rank
  res_slots: int  # stored forward residuals, peak per rank
  cot_slots: int  # output cotangents waiting for their backward, peak per rank
  wg_slots: int  # layer cotangents kept from an I for its W, peak per rank
  channels: tuple[bool, ...]  # which of CHANNELS the tables use
  durations: np.ndarray  # float [ticks]: each tick's length = its slowest rank
  async_makespan: float  # the schedule run asynchronously with the same costs
  costs: Costs
  options: LowerOptions

  @property
  def num_ticks(self) -> int:
    return self.table.shape[0]

  @property
  def lockstep_time(self) -> float:
    return float(self.durations.sum())

  @property
  def busy(self) -> float:
    """Work per rank (the same on every rank for the schedules here), averaged over ranks."""
    total = sum(self.costs.of(a.kind) for _, _, a in self.schedule.actions())
    return total / self.schedule.num_ranks

  @property
  def bubble(self) -> float:
    """Lock-step bubble: fraction of rank-time idle in the executed tables."""
    return 1.0 - self.busy / self.lockstep_time

  @property
  def async_bubble(self) -> float:
    return 1.0 - self.busy / self.async_makespan

  @property
  def overhead(self) -> float:
    """Lock-step time over the asynchronous makespan, minus one."""
    return self.lockstep_time / self.async_makespan - 1.0

  @property
  def branches(self) -> tuple[int, ...]:
    """Branch codes the tables use, sorted."""
    return tuple(sorted(set(int(b) for b in np.unique(self.table[..., COL["branch"]]))))

  def padded(self, num_ticks: int) -> np.ndarray:
    """The table with idle ticks appended, so schedules of different lengths share a program.

    Args:
      num_ticks: the ticks the padded table has, at least `self.num_ticks`.

    Returns:
      int32 [num_ticks, ranks, len(FIELDS)].

    Raises:
      ValueError: fewer ticks than the table has.
    """
    if num_ticks < self.num_ticks:
      raise ValueError(f"cannot pad {self.num_ticks} ticks down to {num_ticks}")
    pad = np.tile(idle_row(), (num_ticks - self.num_ticks, self.schedule.num_ranks, 1))
    return np.concatenate([self.table, pad], axis=0)

  def layout(self) -> np.ndarray:
    """int32 [ranks, chunks]: the model stage whose parameters each rank's local chunk holds."""
    pl = self.schedule.placement
    return np.array(
        [[pl.stage_model[s] for s in pl.rank_stages(r)] for r in range(pl.num_ranks)], np.int32
    )

  def to_csv(self) -> str:
    """One row per rank, one cell per tick, torch notation; packed parts joined by ';'."""
    rows = []
    for r in range(self.schedule.num_ranks):
      rows.append(",".join(";".join(str(a) for a in tick[r]) for tick in self.ticks))
    return "\n".join(rows) + "\n"

  def summary(self) -> str:
    return (
        f"{self.schedule.name}: {self.num_ticks} ticks, lock-step {self.lockstep_time:g} vs "
        f"async {self.async_makespan:g} ({100 * self.overhead:+.1f}%), bubble "
        f"{100 * self.bubble:.1f}%, slots act/res/cot/wg {self.act_slots}/{self.res_slots}/"
        f"{self.cot_slots}/{self.wg_slots}, split={self.options.split} "
        f"pull_w={self.options.pull_w}"
    )


def idle_row() -> np.ndarray:
  row = np.full(len(FIELDS), -1, np.int32)
  for flag in ("branch", "f_first", "f_last", "b_first"):
    row[COL[flag]] = 0
  return row


def op_cost(op, costs: Costs) -> float:
  """Duration of an op: the sum of its parts' (an overlapped pair costs both).

  Args:
    op: an Action or an Overlap.
    costs: durations by kind.

  Returns:
    The duration.
  """
  return sum(costs.of(a.kind) for a in op.parts())


def async_makespan(schedule: Schedule, costs: Costs = Costs()) -> float:
  """The makespan of the schedule run asynchronously (`list_schedule`) with these costs.

  Args:
    schedule: the schedule.
    costs: durations by kind.

  Returns:
    The last op's end time; 0 for no ops.
  """
  timeline = list_schedule(schedule, lambda op: op_cost(op, costs))
  return max([e for ends in timeline.end for e in ends] + [0.0])


def lower(
    schedule: Schedule, costs: Costs = Costs(), variants: Sequence[LowerOptions] = VARIANTS
) -> Lowered:
  """Lowers `schedule` with each variant and returns the shortest (then leanest) tables.

  The shortest lock-step time wins, then the fewest residual slots, then the fewest other slots,
  then the fewest ticks.

  Args:
    schedule: a validated schedule.
    costs: durations by kind, which the tick packing weighs.
    variants: the lowering variants to try.

  Returns:
    The best `Lowered`.
  """
  makespan = async_makespan(schedule, costs)
  best, best_key = None, None
  for opts in variants:
    lowered = _lower_one(schedule, costs, opts, makespan)
    key = (
        round(lowered.lockstep_time, 9),
        lowered.res_slots,
        lowered.wg_slots + lowered.cot_slots + lowered.act_slots,
        lowered.num_ticks,
    )
    if best_key is None or key < best_key:
      best, best_key = lowered, key
  return best


# --- tick assignment -------------------------------------------------------------------------


def _split(b: Action) -> tuple[Action, Action]:
  return Action("I", b.stage, b.microbatch), Action("W", b.stage, b.microbatch)


def _items(schedule: Schedule, split: str) -> list[list[tuple[Action, ...]]]:
  """Per rank, the units that must share a tick (an F&B pair) or stand alone, in order."""
  out = []
  for ops in schedule.ranks:
    items = []
    for op in ops:
      if isinstance(op, Overlap):
        f, b = op.forward, op.backward
        if b.kind == "B" and split == "all":
          i, w = _split(b)
          items += [(f, i), (w,)]
        else:
          items.append((f, b))
      elif op.kind == "B" and split in ("standalone", "all"):
        items += [(a,) for a in _split(op)]
      else:
        items.append((op,))
    out.append(items)
  return out


def _slots_of(parts: Iterable[Action]) -> tuple[int, int, int, bool]:
  f = sum(a.kind == "F" for a in parts)
  bi = sum(a.kind in ("B", "I") for a in parts)
  w = sum(a.kind == "W" for a in parts)
  has_b = any(a.kind == "B" for a in parts)
  return f, bi, w, has_b


def _fits(content: list[Action], item: Sequence[Action], budget: float, costs: Costs) -> bool:
  parts = list(content) + list(item)
  f, bi, w, has_b = _slots_of(parts)
  if f > 1 or bi > 1 or w > 1 or (has_b and w):
    return False
  return sum(costs.of(a.kind) for a in parts) <= budget + 1e-9


def _assign_ticks(schedule: Schedule, costs: Costs, opts: LowerOptions):
  """Greedy lock-step list scheduling; returns ticks[t][r] = list of Actions and durations."""
  items = _items(schedule, opts.split)
  p = schedule.num_ranks
  done: dict[tuple, int] = {}  # produced key -> tick
  deps = {}
  for r_items in items:
    for item in r_items:
      for a in item:
        deps[a] = requires(schedule, a)

  def ready(item, t, content):
    for a in item:
      for key in deps[a]:
        got = done.get(key)
        if got is not None and got < t:
          continue
        # A weight cotangent reads only the stored output cotangent, so it may share a tick
        # with its own input cotangent (the pair is then a full backward).
        if (
            a.kind == "W"
            and key == ("G", a.stage, a.microbatch)
            and any(
                c.kind == "I" and c.stage == a.stage and c.microbatch == a.microbatch
                for c in content
            )
        ):
          continue
        return False
    return True

  pending = [list(r_items) for r_items in items]  # items not yet run, in order
  ticks, durations = [], []
  t = 0
  while any(pending):
    content = [[] for _ in range(p)]
    for r in range(p):
      if pending[r] and ready(pending[r][0], t, content[r]):
        content[r].extend(pending[r].pop(0))
    dur = max(sum(costs.of(a.kind) for a in c) for c in content)
    if opts.pull_w:
      # An idle rank runs the first pending W whose input cotangent already ran.
      for r in range(p):
        if content[r]:
          continue
        for j, item in enumerate(pending[r]):
          if len(item) == 1 and item[0].kind == "W" and ready(item, t, content[r]):
            content[r].extend(pending[r].pop(j))
            break
      dur = max(dur, max(sum(costs.of(a.kind) for a in c) for c in content))
    if dur == 0:
      stuck = [(r, str(pending[r][0])) for r in range(p) if pending[r]]
      raise RuntimeError(
          f"schedule {schedule.name!r} cannot progress at tick {t}: {stuck}; validate() it first"
      )
    if opts.pack:
      for r in range(p):
        while (
            pending[r]
            and _fits(content[r], pending[r][0], dur, costs)
            and ready(pending[r][0], t, content[r])
        ):
          content[r].extend(pending[r].pop(0))
        if opts.pull_w:
          # Room left in a long tick: a later W whose I already ran fills it.
          for j, item in enumerate(pending[r]):
            if (
                len(item) == 1
                and item[0].kind == "W"
                and _fits(content[r], item, dur, costs)
                and ready(item, t, content[r])
            ):
              content[r].extend(pending[r].pop(j))
              break
    for r in range(p):
      for a in content[r]:
        key = (
            "F" if a.kind == "F" else "G" if a.kind in ("B", "I") else "W",
            a.stage,
            a.microbatch,
        )
        done[key] = t
        if a.kind == "B":
          done[("W", a.stage, a.microbatch)] = t
    ticks.append([_merge(c) for c in content])
    durations.append(dur)
    t += 1
  return ticks, np.array(durations, float)


def _merge(content: list[Action]) -> tuple[Action, ...]:
  """An I and a W of the same stage and micro-batch in one tick are a full B."""
  i = [a for a in content if a.kind == "I"]
  w = [a for a in content if a.kind == "W"]
  if i and w and (i[0].stage, i[0].microbatch) == (w[0].stage, w[0].microbatch):
    content = [a for a in content if a.kind not in ("I", "W")] + [
        Action("B", i[0].stage, i[0].microbatch)
    ]
  order = {"F": 0, "I": 1, "B": 1, "W": 2}
  return tuple(sorted(content, key=lambda a: order[a.kind]))


# --- slots and transfers ---------------------------------------------------------------------


class _Pool:
  """Interval slot allocation per rank: a slot written at the end of tick s and last read in
  tick e is busy in between; greedy by start uses exactly the peak number in flight."""

  def __init__(self, p: int):
    self.intervals = [[] for _ in range(p)]  # rank -> [(start, end, key)]

  def add(self, rank: int, start: int, end: int, key) -> None:
    assert end > start, (start, end, key)
    self.intervals[rank].append((start, end, key))

  def allocate(self) -> tuple[dict, int]:
    slot_of, peak = {}, 0
    for rank, ivs in enumerate(self.intervals):
      free: list[int] = []
      busy: list[tuple[int, int]] = []  # (end, slot)
      n = 0
      for start, end, key in sorted(ivs, key=lambda iv: (iv[0], iv[1])):
        while busy and busy[0][0] <= start:
          heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
          s = heapq.heappop(free)
        else:
          s, n = n, n + 1
        slot_of[(rank, key)] = s
        heapq.heappush(busy, (end, s))
      peak = max(peak, n)
    return slot_of, peak


def _direction(src: int, dst: int, p: int) -> str:
  if dst == (src + 1) % p:
    return "down"
  if dst == (src - 1) % p:
    return "up"
  raise ValueError(
      f"consecutive stages on ranks {src} and {dst}, which are not neighbours on a "
      f"ring of {p}; the executor sends only to adjacent ranks"
  )


def _lower_one(schedule: Schedule, costs: Costs, opts: LowerOptions, makespan: float) -> Lowered:
  pl = schedule.placement
  p = pl.num_ranks
  ticks, durations = _assign_ticks(schedule, costs, opts)
  when: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> tick; kind F, G (I/B), L (last)
  for t, tick in enumerate(ticks):
    for r in range(p):
      for a in tick[r]:
        if a.kind == "F":
          when[("F", a.stage, a.microbatch)] = t
        elif a.kind in ("B", "I"):
          when[("G", a.stage, a.microbatch)] = t
        if a.kind in ("B", "W"):
          when[("L", a.stage, a.microbatch)] = t  # last read of the residuals

  act, res, cot, wg = _Pool(p), _Pool(p), _Pool(p), _Pool(p)
  sends = []  # (tick, src rank, dst rank, channel kind "act"/"grad", key) for transfers
  for mb in range(schedule.num_microbatches):
    route = schedule.route(mb)
    for i, s in enumerate(route):
      r = pl.stage_rank[s]
      tf, tl = when[("F", s, mb)], when[("L", s, mb)]
      tg = when[("G", s, mb)]
      res.add(r, tf, tl, ("res", s, mb))
      if tl > tg:  # split backward: W reads what I kept
        wg.add(r, tg, tl, ("wg", s, mb))
      if i + 1 == len(route):
        cot.add(r, tf, tg, ("cot", s, mb))
      if i > 0:
        prev = route[i - 1]
        rp = pl.stage_rank[prev]
        tp = when[("F", prev, mb)]
        act.add(r, tp, tf, ("act", s, mb))
        sends.append((tp, rp, r, "act", ("act", s, mb)))
        # this stage's input cotangent goes back to `prev`, read by prev's I or B
        cot.add(rp, tg, when[("G", prev, mb)], ("cot", prev, mb))
        sends.append((tg, r, rp, "grad", ("cot", prev, mb)))
  act_slot, n_act = act.allocate()
  res_slot, n_res = res.allocate()
  cot_slot, n_cot = cot.allocate()
  wg_slot, n_wg = wg.allocate()

  table = np.tile(idle_row(), (len(ticks), p, 1))
  used = dict.fromkeys(CHANNELS, False)

  def put(t, r, field, value):
    table[t, r, COL[field]] = value

  for t, tick in enumerate(ticks):
    for r in range(p):
      parts = tick[r]
      names = []
      for a in parts:
        route = schedule.route(a.microbatch)
        i = route.index(a.stage)
        chunk = pl.local_chunk(a.stage)
        rs = res_slot[(r, ("res", a.stage, a.microbatch))]
        if a.kind == "F":
          names.append("F")
          put(t, r, "f_mb", a.microbatch)
          put(t, r, "f_chunk", chunk)
          put(t, r, "f_res", rs)
          if i == 0:
            put(t, r, "f_first", 1)
          else:
            put(t, r, "f_in", act_slot[(r, ("act", a.stage, a.microbatch))])
          if i + 1 == len(route):
            put(t, r, "f_last", 1)
            put(t, r, "f_cot", cot_slot[(r, ("cot", a.stage, a.microbatch))])
        else:
          if a.kind in ("B", "I"):
            names.append(a.kind)
            put(t, r, "b_mb", a.microbatch)
            put(t, r, "b_chunk", chunk)
            put(t, r, "b_res", rs)
            put(t, r, "b_cot", cot_slot[(r, ("cot", a.stage, a.microbatch))])
            put(t, r, "b_first", int(i == 0))
            if a.kind == "I":
              put(t, r, "b_wg", wg_slot[(r, ("wg", a.stage, a.microbatch))])
          else:
            names.append("W")
            put(t, r, "w_mb", a.microbatch)
            put(t, r, "w_chunk", chunk)
            put(t, r, "w_res", rs)
            put(t, r, "w_wg", wg_slot[(r, ("wg", a.stage, a.microbatch))])
          if a.kind in ("B", "W"):
            put(t, r, "g_chunk", chunk)
      put(t, r, "branch", _BRANCH_OF["+".join(names) if names else "idle"])

  for t, src, dst, kind, key in sends:
    if kind == "act":
      slot = act_slot[(dst, key)]
      if src == dst:
        put(t, src, "f_local", slot)
        continue
      field = f"recv_act_{_direction(src, dst, p)}"
    else:
      slot = cot_slot[(dst, key)]
      if src == dst:
        put(t, src, "b_local", slot)
        continue
      field = f"recv_grad_{_direction(src, dst, p)}"
    if table[t, dst, COL[field]] != -1:
      raise AssertionError(f"two arrivals on {field} at tick {t} rank {dst}")
    put(t, dst, field, slot)
    used[field[len("recv_") :]] = True

  return Lowered(
      schedule=schedule,
      table=table,
      ticks=[tuple(tuple(c) for c in tick) for tick in ticks],
      act_slots=n_act,
      res_slots=n_res,
      cot_slots=n_cot,
      wg_slots=n_wg,
      channels=tuple(used[c] for c in CHANNELS),
      durations=durations,
      async_makespan=makespan,
      costs=costs,
      options=opts,
  )
