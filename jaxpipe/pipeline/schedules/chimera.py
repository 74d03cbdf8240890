"""Chimera (Li & Hoefler, SC21): a down and an up pipeline over two replicas of the model.

Follows the paper's construction. Rank r holds model stage r of the down pipeline and model
stage p-1-r of the up pipeline (`Placement.bidirectional`: virtual stage r and 2p-1-r). A
basic unit is p micro-batches, the first p/2 sent down and the next p/2 up; each pipeline
runs its half as 1F1B does in equal time slots (forward and backward one slot each, as the
paper draws them), and the two are merged rank by rank. Micro-batch j of a unit enters its
pipeline at slot 2j, so it never waits: the forward on its i-th stage falls in slot 2j+i,
the backward in slot 2j+2p-1-i. For an even p the merged slots never collide.

More micro-batches than p: units are concatenated directly (the paper's "direct
concatenation"), unit u starting 2p slots after unit u-1, so its first forwards fill the
slots that unit u-1 leaves idle while draining. A last unit with fewer than p micro-batches
(still an even number) uses the first slots of a full unit, as the reference runtime
(Shigangli/Chimera, `chimera_pipeline_rank.py`) does.

Bubble: in slot units every rank is busy 2m slots of a makespan of 2m+p-2, so the bubble
rate is (p-2)/(2m+p-2) when m is a multiple of p: the paper's (D-2)/(2N+D-2), N the
micro-batches per iteration, D the stages. That formula counts equal slots, i.e. assumes a
backward costs what a forward does. Read in time as (p/2-1)(F+B) idle per rank against
m(F+B) busy it would hold for any B/F, but with B = 2F this order, run asynchronously, idles
more, and more with every unit concatenated (p-2 F per extra unit): the intermediate bubbles
the paper removes with forward doubling or backward halving, which change the micro-batch
shapes and are not generated here.

Order per rank: actions sorted by slot. Backwards are full (B); Chimera does not split them.
"""
from __future__ import annotations

from jaxpipe.pipeline.ir import Action, Placement, Schedule


def chimera(pp: int, microbatches: int, chunks: int | None = None, **options) -> Schedule:
  """Chimera on `pp` ranks: bidirectional pipelines, units of `pp` micro-batches concatenated."""
  if options:
    raise ValueError(f"chimera takes no options, got {sorted(options)}; remove them")
  if chunks not in (None, 2):
    raise ValueError(f"chimera runs exactly 2 chunks per rank (one per pipeline), got "
                     f"chunks={chunks}; pass chunks=None or 2")
  p, m = pp, microbatches
  if not isinstance(p, int) or p < 2 or p % 2:
    raise ValueError(f"chimera needs an even number of ranks (its two pipelines collide on an "
                     f"odd one), got pp={p}; use pp={max(2, p + 1)}")
  if not isinstance(m, int) or m < 2 or m % 2:
    raise ValueError(f"chimera splits micro-batches evenly between its down and up pipelines, "
                     f"got microbatches={m}; use an even number, ideally a multiple of pp={p} "
                     f"such as {max(p, p * round(m / p))}")
  slots: list[dict[int, Action]] = [{} for _ in range(p)]  # rank -> slot -> action
  route = [0] * m

  def place(rank: int, slot: int, action: Action) -> None:
    assert slot not in slots[rank], (rank, slot, slots[rank][slot], action)  # p even: never
    slots[rank][slot] = action

  for u, first in enumerate(range(0, m, p)):
    per_pipe = min(p, m - first) // 2
    for j in range(per_pipe):
      t = 2 * p * u + 2 * j
      down, up = first + j, first + per_pipe + j
      route[up] = 1
      for i in range(p):  # i-th stage along the route
        place(i, t + i, Action("F", i, down))
        place(i, t + 2 * p - 1 - i, Action("B", i, down))
        place(p - 1 - i, t + i, Action("F", p + i, up))
        place(p - 1 - i, t + 2 * p - 1 - i, Action("B", p + i, up))
  ranks = [[slots[r][t] for t in sorted(slots[r])] for r in range(p)]
  return Schedule("chimera", Placement.bidirectional(p), m, ranks, microbatch_route=route,
                  options={"pp": p})
