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
- `zb_v` (ZB-V) follows sail-sg's handcrafted_zb_v.py (tag zero-bubble-v0.1.0), which torch's
  `ScheduleZBVZeroBubble` also implements: two chunks per rank on `Placement.vshape(p)` (stage r
  and stage 2p - 1 - r on rank r), 2(p - r) - 1 chunk-0 warm-up forwards, chunk 1 started as soon
  as the V turns. At most 2p stage activations per rank (p in whole-rank units, as 1F1B), twice
  1F1B's pipeline communication. The model needs an even number of layers per rank so each
  rank's layers split into two equal chunks; that check belongs to the model, not to the order.

Zero bubble needs enough micro-batches to fill the warm-up: with one chunk, rank 0's first I
comes 2p - 1 units after its first F (p stages down, p - 1 back up) and only forwards can fill
that wait; in a V, rank 0 runs only chunk-0 forwards until micro-batch 0 has passed 2p - 1
stages. So no schedule of these placements is bubble-free in the steady state below m = 2p - 1,
and ZB-H2 and ZB-V are from m = 2p - 1 on. ZB-H1's bubble is exactly p - 1 from m = p on. In the
single-step view, at those m, every rank of all three idles (p - 1) F in total: the last rank's first input
arrives after p - 1 forwards. Fewer micro-batches still give valid schedules with bubbles:
ZB-H2 and ZB-V are built for max(m, 2p - 1) micro-batches and the extra ones dropped (torch's
rule for ZB-V), which keeps every dependency; ZB-H1 caps its warm-up at m, as Megatron does.
"""
from __future__ import annotations

from jaxpipe.pipeline.ir import Action, Op, Placement, Schedule


def _check(name: str, pp: int, microbatches: int, chunks: int | None, want_chunks: int,
           options: dict) -> None:
  for arg, value in (("pp", pp), ("microbatches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}: {arg}={value!r} must be a positive integer")
  if chunks not in (None, want_chunks):
    fix = ("it places two chunks per rank in a V" if want_chunks == 2 else
           "it runs one chunk per rank; use 'zb-v' for two chunks per rank")
    raise ValueError(f"{name}: chunks={chunks!r} is not supported, {fix}; pass "
                     f"chunks={want_chunks} or leave it out")
  if options:
    raise ValueError(f"{name} takes no options, got {sorted(options)}")


def zb_h1(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """ZB-H1: 1F1B with split backwards, rank r deferring its first r W's to fill the tail."""
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
  """ZB-H2: 2(p-r)-1 warm-up forwards and W's moved to make a bubble-free parallelogram."""
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


def zb_v(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """ZB-V: two chunks per rank in a V (stages r and 2p-1-r), bubble-free at F = I = W."""
  _check("zb-v", pp, microbatches, chunks, 2, options)
  m = microbatches
  full = max(m, 2 * pp - 1)  # torch's rule: build for 2p - 1, drop the extra micro-batches
  ranks = [_drop_microbatches(_zb_v_rank(pp, full, r), m) for r in range(pp)]
  return Schedule("zb-v", Placement.vshape(pp), m, ranks)
