"""Zero Bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Every backward is split into I (input gradient, on the critical path) and W (weight gradient,
free to move), and the W's fill the bubbles. Figures below are at F = I = W (B = I + W = 2F),
the paper's assumption; "steady-state bubble" is a rank's idle time between its first and last
op, what throughput pays when steps run back to back (the paper's parallelogram).

- `zb_h1` (ZB-H1, the paper's ZB1P) follows torch.distributed.pipelining's
  `ScheduleInterleavedZeroBubble` with one chunk per rank, which is also the order of sail-sg's
  zbpp_light `auto_schedule` (there W's are popped newest first; here, as in torch, oldest
  first): Megatron's 1F1B warm-up of min(p - r - 1, m) forwards, then F, I pairs, with rank r
  holding back its first r W's so that I's run up the pipeline without waiting, the held W's
  filling the tail. Bubble (p - 1)(F + B - 2W) = p - 1 per rank, a third of 1F1B's; at most p
  micro-batches in flight on every rank, as 1F1B's rank 0.
- `zb_h2` (ZB-H2, ZB2P) is the paper's handcrafted ZB-H2 (its Figure 3): rank r runs
  2(p - r) - 1 warm-up forwards so its first I finds no bubble, W's are reordered so that every
  rank runs 3m units without idling (rank r from r to r + 3m). Neither sail-sg's repository
  (which gets ZB2P from its auto-scheduler with a memory limit of 2p) nor torch ships it, so the
  order is derived here: start from the unbounded-memory order the sail-sg auto-scheduler's
  `manual_order` draws (warm-up, I/F alternation, I/W alternation, W's), then pull one W ahead
  of each forward along a diagonal wave (rank r, r slots later than rank 0). A wave shifts every
  later op on every rank by one slot, which keeps every cross-rank dependency and takes its W
  from the rank's final run of W's, so no idle appears; m - 2p + 1 waves keep rank 0 at 2p - 1
  micro-batches in flight and every rank at most 2p - 1.
- `zb_v` (ZB-V), from m = 2p - 1 on, follows sail-sg's handcrafted_zb_v.py (tag
  zero-bubble-v0.1.0), which torch's `ScheduleZBVZeroBubble` also implements: two chunks per rank
  on `Placement.vshape(p)` (stage r and stage 2p - 1 - r on rank r), 2(p - r) - 1 chunk-0 warm-up
  forwards, chunk 1 started as soon as the V turns. At most 2p stage activations per rank (p in
  whole-rank units, as 1F1B), twice 1F1B's pipeline communication. The model needs an even number
  of layers per rank so each rank's layers split into two equal chunks; that check belongs to the
  model, not to the order.
  Below m = 2p - 1 (`fewer="generator"`, the default) it follows the authors' V generator, the
  one their Megatron runs for ZB-V (sail-sg `megatron/core/pipeline_parallel/zerobubble/
  scheduler/zbv.py`, `PipelineGraph.try_v_schedule` with its default memory limit of 2p stage
  activations), at F = I = W and no communication cost: simulate the ranks and place, in order,
  one chunk-0 forward per rank; more chunk-0 forwards on ranks 0..r while rank r waits for its
  first chunk-1 forward (memory permitting); chunk-0 and chunk-1 forwards alternately until
  every rank has run at least as many as its predecessor; then 2m rounds of one I per rank
  (chunk 1's when its gradient has arrived, else chunk 0's) followed by one forward per rank
  that has an input, queued W's filling any wait for an input (and, with `fill_b`/`fill_f`,
  a wait longer than the idle the worst rank already has); W's last. Each of the four fill
  settings is retried with the first pass's per-rank idle as a budget and the least idle
  result is kept. Its orders equal the generator's, op for op (tested against orders it
  printed). It idles 2p - 1 - m in the steady-state view, the lower bound below, and p - 1 in
  a single step from m = p on; `fewer="drop"` builds the handcrafted order for 2p - 1
  micro-batches and drops the extra ones, torch's rule, which keeps every dependency but idles
  2(2p - 1 - m).
"""

from __future__ import annotations

import collections

from jaxpipe.pipeline.ir.schedule import Action, Op, Placement, Schedule

FEWER = ("generator", "drop")  # how zb_v runs fewer than 2p - 1 micro-batches


def _check(
    name: str, pp: int, microbatches: int, chunks: int | None, want_chunks: int, options: dict
) -> None:
  for arg, value in (("pp", pp), ("microbatches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}: {arg}={value!r} must be a positive integer")
  if chunks not in (None, want_chunks):
    fix = (
        "it places two chunks per rank in a V"
        if want_chunks == 2
        else "it runs one chunk per rank; use 'zb-v' for two chunks per rank"
    )
    raise ValueError(
        f"{name}: chunks={chunks!r} is not supported, {fix}; pass "
        f"chunks={want_chunks} or leave it out"
    )
  if options:
    raise ValueError(f"{name} takes no options, got {sorted(options)}")


def zb_h1(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """ZB-H1: 1F1B with split backwards, rank r deferring its first r W's to fill the tail.

  Args:
    pp: ranks, p.
    microbatches: micro-batches per step, m.
    chunks: 1 or None.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.interleaved(pp)`.

  Raises:
    ValueError: a count that is not a positive integer, chunks other than 1, or an option.
  """
  _check("zb-h1", pp, microbatches, chunks, 1, options)
  m = microbatches
  ranks = []
  for r in range(pp):
    warmup = min(pp - r - 1, m)
    ops: list[Op] = [Action("F", r, i) for i in range(warmup)]
    next_w = 0
    for k in range(m):  # the k-th I; a forward before it while forwards remain
      if k + warmup < m:
        ops.append(Action("F", r, k + warmup))
      ops.append(Action("I", r, k))
      if k >= r:  # rank r holds back r W's: its I's then never wait for a W
        ops.append(Action("W", r, next_w))
        next_w += 1
    ops += [Action("W", r, k) for k in range(next_w, m)]
    ranks.append(ops)
  return Schedule("zb-h1", Placement.interleaved(pp), m, ranks)


def _zb_h2_rank(p: int, m: int, r: int) -> list[Op]:
  """Rank r's ZB-H2 order for m >= 2p - 1 micro-batches (see the module docstring)."""
  warmup = 2 * (p - r) - 1
  ops: list[Op] = [Action("F", r, i) for i in range(warmup)]
  w = 0
  for j in range(m - warmup):  # I/F alternation; waves put a W between them on rank r's
    ops.append(Action("I", r, j))  # forwards r .. r + m - 2p (every rank gets m - 2p + 1)
    if r <= j <= r + m - 2 * p:
      ops.append(Action("W", r, w))
      w += 1
    ops.append(Action("F", r, warmup + j))
  for j in range(m - warmup, m):  # I/W alternation once the forwards are done
    ops.append(Action("I", r, j))
    if j < m - 1:
      ops.append(Action("W", r, w))
      w += 1
  ops += [Action("W", r, k) for k in range(w, m)]
  return ops


def _drop_microbatches(ops: list[Op], m: int) -> list[Op]:
  return [op for op in ops if op.microbatch < m]


def zb_h2(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """ZB-H2: 2(p-r)-1 warm-up forwards and W's moved to make a bubble-free parallelogram.

  With fewer than 2p - 1 micro-batches the full order is built and the extra ones dropped.

  Args:
    pp: ranks, p.
    microbatches: micro-batches per step, m.
    chunks: 1 or None.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.interleaved(pp)`.

  Raises:
    ValueError: a count that is not a positive integer, chunks other than 1, or an option.
  """
  _check("zb-h2", pp, microbatches, chunks, 1, options)
  m = microbatches
  full = max(m, 2 * pp - 1)  # fewer micro-batches: build the full order, drop the extra ones
  ranks = [_drop_microbatches(_zb_h2_rank(pp, full, r), m) for r in range(pp)]
  return Schedule("zb-h2", Placement.interleaved(pp), m, ranks)


def _zb_v_rank(p: int, m: int, r: int) -> list[Op]:
  """Rank r's ZB-V order for m >= 2p - 1 micro-batches (sail-sg's handcrafted_zb_v)."""
  down, up = r, 2 * p - 1 - r  # chunk 0 (going down the V) and chunk 1 (coming back up)
  f = {down: 0, up: 0}  # next micro-batch per stage for F, I and W
  i = {down: 0, up: 0}
  w = {down: 0, up: 0}
  ops: list[Op] = []

  def put(kind: str, stage: int) -> None:
    count = {"F": f, "I": i, "W": w}[kind]
    ops.append(Action(kind, stage, count[stage]))
    count[stage] += 1

  for _ in range(2 * (p - r) - 1):  # fill the V's descent
    put("F", down)
  for _ in range(r):  # chunk 1's first forwards arrive: alternate the two chunks
    put("F", up)
    put("F", down)
  for _ in range(p - r):  # chunk 1's first gradients come straight back from rank 0's F
    put("F", up)
    put("I", up)
    put("W", up)
  while f[up] < f[down] or f[down] < m:  # steady: F, I, W of each chunk in turn
    if f[down] < m:
      put("F", down)
    put("I", down)
    put("W", down)
    put("F", up)
    put("I", up)
    put("W", up)
  for _ in range(r):  # cool-down: I's first, W's fill the wait for the next I
    put("I", down)
    put("I", up)
  for _ in range(p - r):
    put("I", down)
    put("W", down)
  while w[up] < m:
    put("W", up)
  while w[down] < m:
    put("W", down)
  return ops


def _zb_v_generated(
    p: int, m: int, fill_f: bool, fill_b: bool, approved: list[int] | None = None
) -> tuple[list[list[Op]], list[int]]:
  """One pass of the authors' V generator at unit costs (module docstring) -> (ranks, idle)."""
  down, up = 0, 1  # the V's legs: chunk 0 (stage r) and chunk 1 (stage 2p - 1 - r)
  cap = 2 * p  # stage activations a rank may hold (F takes one, W frees it)
  end: dict[tuple, int] = {}  # (kind, leg, rank, micro-batch) -> end time
  count = [collections.Counter() for _ in range(p)]  # [rank][kind, leg] -> ops placed
  clock, held, idle = [0] * p, [0] * p, [0] * p
  queued_w = [collections.deque() for _ in range(p)]  # legs of the I's whose W is pending
  ranks: list[list[Op]] = [[] for _ in range(p)]
  approved = approved or [-1] * p

  def budget(r: int) -> int:  # idle rank r may add without exceeding the worst rank's (or plan)
    return max(max(idle), max(approved) - approved[r]) - idle[r]

  def upstream(kind: str, leg: int, r: int) -> tuple | None:
    """The op on the neighbouring rank that kind/leg's next op on rank r waits for."""
    peer = r - 1 if (kind == "F") == (leg == down) else r + 1  # F down, I up: from r - 1
    return (kind, leg, peer, count[r][kind, leg]) if 0 <= peer < p else None

  def ran(key: tuple | None) -> bool:
    return key is not None and key in end

  def put(kind: str, leg: int, r: int) -> None:
    mb = count[r][kind, leg]
    t = clock[r] + 1
    dep = upstream(kind, leg, r) if kind != "W" else None
    if dep is not None:
      assert dep in end, (kind, leg, r, mb)  # the generator's invariant
      t = max(t, end[dep] + 1)
    if count[r]["F", down]:
      idle[r] += t - clock[r] - 1
    end[kind, leg, r, mb] = clock[r] = t
    held[r] += {"F": 1, "I": 0, "W": -1}[kind]
    assert held[r] <= cap, (r, held[r])
    ranks[r].append(Action(kind, r if leg == down else 2 * p - 1 - r, mb))
    if kind == "I":
      queued_w[r].append(leg)
    count[r][kind, leg] += 1

  def put_w(r: int) -> None:
    put("W", queued_w[r].popleft(), r)

  def fill(r: int, dep: tuple | None, beyond_budget: bool) -> None:
    """W's into the wait for `dep`; one more if the wait exceeds rank r's idle budget."""
    while queued_w[r] and ran(dep) and end[dep] >= clock[r] + 1:
      put_w(r)
    if queued_w[r] and ran(dep) and end[dep] - clock[r] > budget(r) and beyond_budget:
      put_w(r)

  for r in range(p):
    put("F", down, r)
  for r in reversed(range(p)):  # more chunk-0 forwards upstream while rank r waits for chunk 1
    if r < p - 1:
      arrives = end["F", up, r + 1, count[r]["F", up]]
      while held[r] + 2 + 2 * r <= cap and clock[r] + 1 <= arrives and count[r]["F", down] < m:
        for j in range(r + 1):
          put("F", down, j)
    put("F", up, r)
  leg = down
  for r in range(1, p):  # both chunks' forwards until rank r has run as many as rank r - 1
    c, prev = count[r], count[r - 1]
    while (
        c["F", down] + c["F", up] < prev["F", down] + prev["F", up]
        or c["F", up] <= prev["F", up] < m
    ):
      for j in reversed(range(r, p)):
        if count[j]["F", leg] < m:
          put("F", leg, j)
      leg = 1 - leg
  for _ in range(2 * m):
    i_down, i_up = [], []  # which leg's I each rank runs next
    for r in range(p):
      c = count[r]
      if c["I", down] < c["I", up] and (
          r == p - 1 or ran(("I", down, r + 1, c["I", down])) or c["I", up] >= m
      ):
        i_down.append(r)
      else:
        i_up.append(r)
    for r, leg in [(r, down) for r in reversed(i_down)] + [(r, up) for r in i_up]:
      fill(r, upstream("I", leg, r), leg == down or fill_b)
      put("I", leg, r)
    for r in range(p):
      c = count[r]
      if c["F", up] >= m:
        continue
      if c["F", up] >= c["F", down]:
        leg = down
      elif r == p - 1 or ran(("F", up, r + 1, c["F", up])):
        leg = up
      elif c["F", down] < m and (r == 0 or ran(("F", down, r - 1, c["F", down]))):
        leg = down
      else:
        continue  # no input yet
      while held[r] + 1 > cap:
        put_w(r)
      fill(r, upstream("F", leg, r), fill_f)
      put("F", leg, r)
  for r in range(p):
    while queued_w[r]:
      put_w(r)
  if max(approved) < 0 or max(idle) < max(approved):  # retry with this pass's idle as the plan
    again = _zb_v_generated(p, m, fill_f, fill_b, idle)
    if max(again[1]) < max(idle):
      return again
  return ranks, idle


def zb_v(
    pp: int, microbatches: int, chunks: int | None = None, fewer: str = "generator", **options
) -> Schedule:
  """ZB-V: two chunks per rank in a V (stages r and 2p-1-r), bubble-free at F = I = W.

  Args:
    pp: ranks, p.
    microbatches: micro-batches per step, m.
    chunks: 2 or None.
    fewer: how fewer than 2p - 1 micro-batches run (FEWER): 'generator' builds the order for m
      (the least idle of its variants), 'drop' builds it for 2p - 1 and drops the extra ones
      (torch's rule).
    **options: none.

  Returns:
    The `Schedule`, on `Placement.vshape(pp)`.

  Raises:
    ValueError: a count that is not a positive integer, chunks other than 2, an option, or an
      unknown `fewer`.
  """
  _check("zb-v", pp, microbatches, chunks, 2, options)
  if fewer not in FEWER:
    raise ValueError(f"zb-v: fewer={fewer!r} is not one of {FEWER}")
  p, m = pp, microbatches
  if m >= 2 * p - 1 or fewer == "drop":
    full = max(m, 2 * p - 1)  # torch's rule: build for 2p - 1, drop the extra micro-batches
    ranks = [_drop_microbatches(_zb_v_rank(p, full, r), m) for r in range(p)]
    return Schedule(
        "zb-v", Placement.vshape(p), m, ranks, options={"fewer": "drop"} if m < 2 * p - 1 else {}
    )
  best = None
  for fill_b in (True, False):
    for fill_f in (True, False):
      ranks, idle = _zb_v_generated(p, m, fill_f, fill_b)
      if best is None or max(idle) < max(best[1]):
        best = ranks, idle
  return Schedule("zb-v", Placement.vshape(p), m, best[0], options={"fewer": "generator"})
