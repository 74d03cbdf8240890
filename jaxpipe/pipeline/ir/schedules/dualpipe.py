"""DualPipe and DualPipeV: DeepSeek's bidirectional and V-shaped schedules, in the reference order.

Follows deepseek-ai/DualPipe: `DualPipe.step` in `dualpipe/dualpipe.py` and `DualPipeV.step`
in `dualpipe/dualpipev.py`. Both run the same eight steps on every rank; `_eight_steps` below
is that loop, step for step, with the reference's calls mapped onto the IR:

  `_forward_chunk(phase)`                     F of the phase's stage, next micro-batch
  `_backward_chunk(phase)`                    B (full backward)
  `_backward_chunk(phase, enable_zb=True)`    I, its weight gradient queued (`WeightGradStore`)
  `_weight_chunk()`                           W of the oldest queued I (the store is a FIFO)
  `_forward_backward_chunk(p0, p1)`           Overlap(F of p0, B of p1): the reference's
                                              overlapped backward never defers its W

Step 4's first iteration on the middle ranks (DualPipe) or the last rank (DualPipeV) runs
F and B apart, as the reference does ("we don't overlap these two chunks to further reduce
bubble size"). Sends that the reference postpones to batch them with later ones are a
communication detail the IR leaves to the executor: a result here may be used as soon as
it is computed.

Each rank has two phases. DualPipe (`Placement.bidirectional`): rank r holds virtual stage r
of the down route (model stage r) and virtual stage 2p-1-r of the up route (model stage
p-1-r); micro-batches 0..m/2-1 go down, m/2..m-1 go up; on the first half of the ranks
phase 0 is the down route, on the second half it is the up route (`phase ^=
is_in_second_half`), and `half_rank = min(r, p-1-r)` plays the rank's part. DualPipeV
(`Placement.vshape`): rank r holds stage r (phase 0) and stage 2p-1-r (phase 1) of a 2p-stage
V, and every micro-batch passes both.

Requirements are the reference's asserts: an even p and an even m >= 2p for DualPipe,
m >= 2p for DualPipeV (the step counts stay non-negative down to m = 2p-2 and 2p-1, but
the reference does not run those, so neither do we).

Bubble, as the README's table states it (PP stages; makespan minus busy time): with
F = I >= W and F&B = F + B every rank idles exactly (PP/2-1)(F&B + B - 3W); with a cheaper
overlapped pair, 2F <= F&B < F + B, that is the worst rank's idle time. Outside those
ranges (I > F, W > F, F&B < 2F) the formula is not what this order gives.
"""

from __future__ import annotations

import collections

from jaxpipe.pipeline.ir.schedule import Action, Op, Overlap, Placement, Schedule


def _eight_steps(
    half_ranks: int,
    half_rank: int,
    chunks: int,
    unoverlapped_first: bool,
    stages: tuple[int, int],
    microbatches: tuple[list[int], list[int]],
) -> list[Op]:
  """One rank's ops, following the eight steps of `DualPipe.step` / `DualPipeV.step`.

  `stages[phase]` is the rank's virtual stage for the phase, `microbatches[phase]` the
  micro-batches that pass it in order; `chunks` is how many each phase runs.
  """
  n, k, c = half_ranks, half_rank, chunks
  ops: list[Op] = []
  next_f, next_b = [0, 0], [0, 0]
  queued_w: collections.deque[Action] = collections.deque()  # WeightGradStore's FIFO

  def forward(phase: int) -> Action:
    mb = microbatches[phase][next_f[phase]]
    next_f[phase] += 1
    return Action("F", stages[phase], mb)

  def backward(phase: int, zero_bubble: bool = False) -> Action:
    mb = microbatches[phase][next_b[phase]]
    next_b[phase] += 1
    if zero_bubble:
      queued_w.append(Action("W", stages[phase], mb))
      return Action("I", stages[phase], mb)
    return Action("B", stages[phase], mb)

  def weight() -> Action:
    return queued_w.popleft()

  # Step 1: nF0
  for _ in range((n - k - 1) * 2):
    ops.append(forward(0))
  # Step 2: nF0F1
  for _ in range(k + 1):
    ops.append(forward(0))
    ops.append(forward(1))
  # Step 3: nB1W1F1 (zero bubble)
  for _ in range(n - k - 1):
    ops.append(backward(1, zero_bubble=True))
    ops.append(weight())
    ops.append(forward(1))
  # Step 4 (main step): nF0B1F1B0
  for i in range(c - 2 * n + k + 1):
    if i == 0 and unoverlapped_first:
      ops.append(forward(0))
      ops.append(backward(1))
    else:
      ops.append(Overlap(forward(0), backward(1)))
    ops.append(Overlap(forward(1), backward(0)))
  # Step 5: nB1F1B0
  for _ in range(n - k - 1):
    ops.append(backward(1))
    ops.append(Overlap(forward(1), backward(0)))
  # Step 6: nB1B0, the second half with zero bubble
  steps_6 = k + 1
  zero_bubble = False
  for i in range(steps_6):
    if i == steps_6 // 2 and k % 2 == 1:
      zero_bubble = True
    ops.append(backward(1, zero_bubble))
    if i == steps_6 // 2 and k % 2 == 0:
      zero_bubble = True
    ops.append(backward(0, zero_bubble))
  # Step 7: nWB0 (zero bubble)
  for _ in range(n - k - 1):
    ops.append(weight())
    ops.append(backward(0, zero_bubble=True))
  # Step 8: nW
  for _ in range(k + 1):
    ops.append(weight())
  assert not queued_w and next_f == [c, c] and next_b == [c, c], (next_f, next_b, queued_w)
  return ops


def _check_args(name: str, pp: int, microbatches: int, chunks: int | None, options: dict) -> None:
  if options:
    raise ValueError(f"{name} takes no options, got {sorted(options)}; remove them")
  if chunks not in (None, 2):
    raise ValueError(
        f"{name} runs exactly 2 chunks per rank, got chunks={chunks}; pass chunks=None or 2"
    )
  for arg, value in (("pp", pp), ("microbatches", microbatches)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}: {arg}={value!r} must be a positive integer")


def dualpipe(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """DualPipe on `pp` ranks: two copies of `pp` model stages, half the micro-batches each way.

  Args:
    pp: ranks, p; even.
    microbatches: m, even and at least 2p.
    chunks: 2 (one per direction) or None.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.bidirectional`.

  Raises:
    ValueError: an option, chunks other than 2, a count that is not a positive integer, an odd
      p, or m odd or below 2p.
  """
  _check_args("dualpipe", pp, microbatches, chunks, options)
  p, m = pp, microbatches
  if p % 2:
    raise ValueError(f"dualpipe needs an even number of ranks, got pp={p}; use pp={p + 1}")
  if m % 2 or m < 2 * p:
    raise ValueError(
        f"dualpipe needs an even number of micro-batches of at least 2*pp = "
        f"{2 * p}, got microbatches={m}; use microbatches={max(2 * p, m + m % 2)}"
    )
  half = m // 2
  down, up = list(range(half)), list(range(half, m))
  ranks = []
  for r in range(p):
    second_half = r >= p // 2
    half_rank = min(r, p - 1 - r)
    by_direction = ((r, down), (2 * p - 1 - r, up))  # (virtual stage, micro-batches)
    phase0, phase1 = by_direction[second_half], by_direction[not second_half]
    ranks.append(
        _eight_steps(
            p // 2,
            half_rank,
            half,
            half_rank == p // 2 - 1,
            (phase0[0], phase1[0]),
            (phase0[1], phase1[1]),
        )
    )
  return Schedule(
      "dualpipe",
      Placement.bidirectional(p),
      m,
      ranks,
      microbatch_route=(0,) * half + (1,) * half,
      options={"pp": p},
  )


def dualpipev(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """DualPipeV on `pp` ranks: 2*pp model stages in a V, every micro-batch down and back up.

  Args:
    pp: ranks, p.
    microbatches: m, at least 2p.
    chunks: 2 (the V's two arms) or None.
    **options: none.

  Returns:
    The `Schedule`, on `Placement.vshape`.

  Raises:
    ValueError: an option, chunks other than 2, a count that is not a positive integer, or m
      below 2p.
  """
  _check_args("dualpipev", pp, microbatches, chunks, options)
  p, m = pp, microbatches
  if m < 2 * p:
    raise ValueError(
        f"dualpipev needs at least 2*pp = {2 * p} micro-batches, got "
        f"microbatches={m}; use microbatches={2 * p} or more"
    )
  every = list(range(m))
  ranks = [_eight_steps(p, r, m, r == p - 1, (r, 2 * p - 1 - r), (every, every)) for r in range(p)]
  return Schedule("dualpipev", Placement.vshape(p), m, ranks, options={"pp": p})
