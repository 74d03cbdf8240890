"""Chimera (Li & Hoefler, SC21): a down and an up pipeline over two replicas of the model.

Rank r holds model stage r of the down pipeline and model stage p-1-r of the up pipeline
(`Placement.bidirectional`: virtual stage r and 2p-1-r). Backwards are full (B); Chimera does
not split them.

Basic unit (the paper's construction, and its authors' generator `AutoGeneratePipelineRank` in
Shigangli/Chimera `chimera_pipeline_rank.py`): p micro-batches, the first p/2 sent down and the
next p/2 up; each pipeline runs its half as 1F1B does in equal time slots (forward and backward
one slot each, as the paper draws them), and the two are merged rank by rank. Micro-batch j of
a unit enters its pipeline at slot 2j, so it never waits: the forward on its i-th stage falls in
slot 2j+i, the backward in slot 2j+2p-1-i. For an even p the merged slots never collide. In
slots every rank is busy 2m of 2m+p-2: the paper's bubble rate (D-2)/(2N+D-2), N the
micro-batches, D the stages, which counts equal slots (B = F).

More micro-batches than p, two ways (`concat=`):

- "direct": the paper's direct concatenation, which the authors' generator implements: unit u
  starts 2p slots after unit u-1, its first forwards filling the slots unit u-1 leaves idle
  while draining; a last unit of fewer than p micro-batches (still an even number) uses the
  first slots of a full unit. Exact in slots, but a backward costs about two forwards, and then
  each unit boundary leaves intermediate bubbles (p-2 F more per unit concatenated at B = 2F):
  the gaps the paper fills with forward doubling (two micro-batches per forward slot, twice
  the activations) or backward halving.
- "merged" (the default, from m = 2p-2 on; "direct" below that): the units are merged instead,
  each pipeline running one 1F1B over all of its m/2 micro-batches, so there is no unit boundary
  to leave a gap. Rank r, at distance k = min(r, p-1-r) from its nearer end, calls "near" the
  pipeline that enters there (down for r < p/2) and "far" the other; with n = p/2 and
  c = m/2 micro-batches per pipeline it runs
    2(n-k-1) near forwards, then k+1 pairs (near F, far F)      warm-up
    n-k-1 times (far B, far F)
    c-2n+k+1 times (far B, near F, near B, far F)               steady state
    n-k-1 times (far B, near B, far F)
    k+1 times (far B, near B), then n-k-1 near B's               cool-down
  This is the phase structure of DeepSeek's DualPipe (`DualPipe.step`) with its overlapped
  pairs run apart, backward first, and its split backwards left whole: DualPipe is this
  bidirectional pipeline with Chimera's placement. Every rank then idles exactly
  (p-2)·max(F, B) in both bubble views, for every m: at B = F the paper's (p-2)/(2m+p-2),
  at B = 2F one unit's bubble however many micro-batches follow (p = 8: 12 F, where direct
  concatenation at m = 32 idles 30 F and 1F1B 21 F), with at most p micro-batch-stages
  in flight on every rank (the unit's peak), none of forward doubling's extra activations.

Activations (micro-batch-stages whose forward ran and whose backward has not): the unit and
direct concatenation hold between p/2+1 (end ranks) and p (middle ranks), the paper's range;
the merged order holds p on every rank.
"""

from __future__ import annotations

from jaxpipe.pipeline.ir.schedule import Action, Placement, Schedule

CONCAT = ("merged", "direct")


def chimera(
    pp: int, microbatches: int, chunks: int | None = None, concat: str = "merged", **options
) -> Schedule:
  """Chimera on `pp` ranks: bidirectional 1F1B units, merged (default) or concatenated.

  The merged order runs from m = 2p-2 on; below that, and with concat='direct', the units are
  concatenated (module docstring).

  Args:
    pp: ranks, p; even.
    microbatches: m, even (ideally a multiple of p); half go down, half up.
    chunks: 2 (one per pipeline) or None.
    concat: 'merged' or 'direct' (CONCAT).
    **options: none other.

  Returns:
    The `Schedule`, on `Placement.bidirectional`.

  Raises:
    ValueError: another option, an unknown concat, chunks other than 2, or an odd p or m (or
      one below 2).
  """
  if options:
    raise ValueError(
        f"chimera takes only the option concat={CONCAT}, got {sorted(options)}; remove them"
    )
  if concat not in CONCAT:
    raise ValueError(f"chimera: concat={concat!r} is not one of {CONCAT}")
  if chunks not in (None, 2):
    raise ValueError(
        f"chimera runs exactly 2 chunks per rank (one per pipeline), got "
        f"chunks={chunks}; pass chunks=None or 2"
    )
  p, m = pp, microbatches
  if not isinstance(p, int) or p < 2 or p % 2:
    raise ValueError(
        f"chimera needs an even number of ranks (its two pipelines collide on an "
        f"odd one), got pp={p}; use pp={max(2, p + 1)}"
    )
  if not isinstance(m, int) or m < 2 or m % 2:
    raise ValueError(
        f"chimera splits micro-batches evenly between its down and up pipelines, "
        f"got microbatches={m}; use an even number, ideally a multiple of pp={p} "
        f"such as {max(p, p * round(m / p))}"
    )
  if concat == "merged" and m >= 2 * p - 2:
    return _merged(p, m)
  return _concatenated(p, m)


def _concatenated(p: int, m: int) -> Schedule:
  """Units of p micro-batches in the paper's slots, each 2p slots after the previous one."""
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
  return Schedule(
      "chimera",
      Placement.bidirectional(p),
      m,
      ranks,
      microbatch_route=route,
      options={"pp": p, "concat": "direct"},
  )


def _merged(p: int, m: int) -> Schedule:
  """One 1F1B per pipeline over all its micro-batches, merged rank by rank (module docstring)."""
  n, c = p // 2, m // 2
  ranks = []
  for r in range(p):
    k = min(r, p - 1 - r)
    down = (r, range(c))  # (virtual stage on this rank, its micro-batches in order)
    up = (2 * p - 1 - r, range(c, m))
    near, far = (down, up) if r < n else (up, down)
    done = {"F": {0: 0, 1: 0}, "B": {0: 0, 1: 0}}  # kind -> pipeline (0 near, 1 far) -> count
    ops: list[Action] = []

    def run(*steps: str) -> None:
      for step in steps:  # "F0": forward of the near pipeline's next micro-batch, etc.
        kind, pipe = step[0], int(step[1])
        stage, mbs = (near, far)[pipe]
        ops.append(Action(kind, stage, mbs[done[kind][pipe]]))
        done[kind][pipe] += 1

    for _ in range(2 * (n - k - 1)):
      run("F0")
    for _ in range(k + 1):
      run("F0", "F1")
    for _ in range(n - k - 1):
      run("B1", "F1")
    for _ in range(c - 2 * n + k + 1):
      run("B1", "F0", "B0", "F1")
    for _ in range(n - k - 1):
      run("B1", "B0", "F1")
    for _ in range(k + 1):
      run("B1", "B0")
    for _ in range(n - k - 1):
      run("B0")
    assert done == {"F": {0: c, 1: c}, "B": {0: c, 1: c}}, (r, done)
    ranks.append(ops)
  return Schedule(
      "chimera",
      Placement.bidirectional(p),
      m,
      ranks,
      microbatch_route=(0,) * c + (1,) * c,
      options={"pp": p, "concat": "merged"},
  )
