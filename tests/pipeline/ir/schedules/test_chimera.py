"""Chimera against its paper (Li & Hoefler, SC21) and its authors' reference schedule generator.

Units: the paper counts time in slots, one forward or one backward of one stage on one
micro-batch each, i.e. B = F; its bubble rate (D-2)/(2N+D-2) is in those units (D = p
stages, N = m micro-batches). The single-step view (makespan minus a rank's busy time) is
the one it states; the steady-state view is checked beside it. Activations are counted in
(stage, micro-batch) pairs whose forward ran and whose backward has not yet run.
Both ways of running more micro-batches than p are checked: the authors' direct concatenation
(`concat="direct"`) and the merged units (the default), against 1F1B's (p-1)(F+B) at B = 2F.
"""

import pytest

from jaxpipe.pipeline import make_schedule
from jaxpipe.pipeline.ir.deps import list_schedule
from jaxpipe.pipeline.ir.schedules.chimera import chimera

# Per-rank slot grids printed by Shigangli/Chimera's `AutoGeneratePipelineRank` (D stages,
# N micro-batches, two pipelines): d/u = down/up pipeline, the number is the micro-batch
# within its unit of p (the k-th time a label appears on a rank it belongs to unit k).
REFERENCE_GRIDS = {
    (4, 8): [
        "dF0 . dF1 uF2 uB2 uF3 uB3 dB0 dF0 dB1 dF1 uF2 uB2 uF3 uB3 dB0 . dB1",
        ". dF0 uF2 dF1 uF3 uB2 dB0 uB3 dB1 dF0 uF2 dF1 uF3 uB2 dB0 uB3 dB1",
        ". uF2 dF0 uF3 dF1 dB0 uB2 dB1 uB3 uF2 dF0 uF3 dF1 dB0 uB2 dB1 uB3",
        "uF2 . uF3 dF0 dB0 dF1 dB1 uB2 uF2 uB3 uF3 dF0 dB0 dF1 dB1 uB2 . uB3",
    ],
    (6, 12): [
        "dF0 . dF1 . dF2 uF3 uB3 uF4 uB4 uF5 uB5 dB0 dF0 dB1 dF1 dB2 dF2 uF3 uB3 uF4 uB4 uF5 "
        "uB5 dB0 . dB1 . dB2",
        ". dF0 . dF1 uF3 dF2 uF4 uB3 uF5 uB4 dB0 uB5 dB1 dF0 dB2 dF1 uF3 dF2 uF4 uB3 uF5 uB4 "
        "dB0 uB5 dB1 . dB2",
        ". . dF0 uF3 dF1 uF4 dF2 uF5 uB3 dB0 uB4 dB1 uB5 dB2 dF0 uF3 dF1 uF4 dF2 uF5 uB3 dB0 "
        "uB4 dB1 uB5 dB2",
        ". . uF3 dF0 uF4 dF1 uF5 dF2 dB0 uB3 dB1 uB4 dB2 uB5 uF3 dF0 uF4 dF1 uF5 dF2 dB0 uB3 "
        "dB1 uB4 dB2 uB5",
        ". uF3 . uF4 dF0 uF5 dF1 dB0 dF2 dB1 uB3 dB2 uB4 uF3 uB5 uF4 dF0 uF5 dF1 dB0 dF2 dB1 "
        "uB3 dB2 uB4 . uB5",
        "uF3 . uF4 . uF5 dF0 dB0 dF1 dB1 dF2 dB2 uB3 uF3 uB4 uF4 uB5 uF5 dF0 dB0 dF1 dB1 dF2 "
        "dB2 uB3 . uB4 . uB5",
    ],
    (8, 16): [
        "dF0 . dF1 . dF2 . dF3 uF4 uB4 uF5 uB5 uF6 uB6 uF7 uB7 dB0 dF0 dB1 dF1 dB2 dF2 dB3 "
        "dF3 uF4 uB4 uF5 uB5 uF6 uB6 uF7 uB7 dB0 . dB1 . dB2 . dB3",
        ". dF0 . dF1 . dF2 uF4 dF3 uF5 uB4 uF6 uB5 uF7 uB6 dB0 uB7 dB1 dF0 dB2 dF1 dB3 dF2 "
        "uF4 dF3 uF5 uB4 uF6 uB5 uF7 uB6 dB0 uB7 dB1 . dB2 . dB3",
        ". . dF0 . dF1 uF4 dF2 uF5 dF3 uF6 uB4 uF7 uB5 dB0 uB6 dB1 uB7 dB2 dF0 dB3 dF1 uF4 "
        "dF2 uF5 dF3 uF6 uB4 uF7 uB5 dB0 uB6 dB1 uB7 dB2 . dB3",
        ". . . dF0 uF4 dF1 uF5 dF2 uF6 dF3 uF7 uB4 dB0 uB5 dB1 uB6 dB2 uB7 dB3 dF0 uF4 dF1 "
        "uF5 dF2 uF6 dF3 uF7 uB4 dB0 uB5 dB1 uB6 dB2 uB7 dB3",
        ". . . uF4 dF0 uF5 dF1 uF6 dF2 uF7 dF3 dB0 uB4 dB1 uB5 dB2 uB6 dB3 uB7 uF4 dF0 uF5 "
        "dF1 uF6 dF2 uF7 dF3 dB0 uB4 dB1 uB5 dB2 uB6 dB3 uB7",
        ". . uF4 . uF5 dF0 uF6 dF1 uF7 dF2 dB0 dF3 dB1 uB4 dB2 uB5 dB3 uB6 uF4 uB7 uF5 dF0 "
        "uF6 dF1 uF7 dF2 dB0 dF3 dB1 uB4 dB2 uB5 dB3 uB6 . uB7",
        ". uF4 . uF5 . uF6 dF0 uF7 dF1 dB0 dF2 dB1 dF3 dB2 uB4 dB3 uB5 uF4 uB6 uF5 uB7 uF6 "
        "dF0 uF7 dF1 dB0 dF2 dB1 dF3 dB2 uB4 dB3 uB5 . uB6 . uB7",
        "uF4 . uF5 . uF6 . uF7 dF0 dB0 dF1 dB1 dF2 dB2 dF3 dB3 uB4 uF4 uB5 uF5 uB6 uF6 uB7 "
        "uF7 dF0 dB0 dF1 dB1 dF2 dB2 dF3 dB3 uB4 . uB5 . uB6 . uB7",
    ],
}


def _bubbles(schedule, f=1.0, b=1.0):
  """(single-step bubble per rank, steady-state bubble per rank, makespan), async execution."""
  cost = lambda op: f if op.kind == "F" else b
  timeline = list_schedule(schedule, cost)
  assert not timeline.blocked
  makespan = max(ends[-1] for ends in timeline.end)
  busy = [sum(cost(op) for op in ops) for ops in schedule.ranks]
  single = [makespan - x for x in busy]
  steady = [timeline.end[r][-1] - timeline.start[r][0] - busy[r] for r in range(len(busy))]
  return single, steady, makespan


def _peak_activations(schedule):
  peaks = []
  for ops in schedule.ranks:
    live = peak = 0
    for op in ops:
      live += 1 if op.kind == "F" else -1
      peak = max(peak, live)
    assert live == 0
    peaks.append(peak)
  return peaks


SIZES = [
    (2, 2),
    (2, 4),
    (2, 6),
    (4, 2),
    (4, 4),
    (4, 6),
    (4, 8),
    (4, 12),
    (6, 6),
    (6, 8),
    (6, 12),
    (8, 8),
    (8, 16),
    (8, 24),
    (8, 10),
    (10, 20),
]


@pytest.mark.parametrize("p,m", SIZES)
def test_validates(p, m):
  s = chimera(p, m).validate()
  assert s.num_stages == p and s.placement.copies == 2 and s.placement.chunks_per_rank == 2
  assert s.microbatch_route.count(0) == s.microbatch_route.count(1) == m // 2
  assert all(op.kind in ("F", "B") for ops in s.ranks for op in ops)  # Chimera never splits B


def test_registry_builds_it():
  assert make_schedule("chimera", pp=4, microbatches=8).name == "chimera"


@pytest.mark.parametrize("p,m", sorted(REFERENCE_GRIDS))
def test_matches_reference_generator(p, m):
  """Same per-rank order as the authors' generator, units concatenated 2p slots apart."""
  s = chimera(p, m, concat="direct")
  grid = REFERENCE_GRIDS[(p, m)]
  for r in range(p):
    seen = {}
    expected = []
    for cell in grid[r].split():
      if cell == ".":
        continue
      seen[cell] = seen.get(cell, -1) + 1
      direction, kind, j = cell[0], cell[1], int(cell[2:])
      expected.append((kind, p * seen[cell] + j, "du".index(direction)))
    got = [(a.kind, a.microbatch, s.microbatch_route[a.microbatch]) for a in s.ranks[r]]
    assert got == expected, f"rank {r}"
  # in slots (F = B = 1) the asynchronous run takes exactly the reference's grid length
  assert _bubbles(s)[2] == max(len(row.split()) for row in grid)


@pytest.mark.parametrize("concat", ["direct", "merged"])
@pytest.mark.parametrize(
    "p,m", [(2, 2), (4, 4), (4, 8), (4, 12), (6, 12), (8, 8), (8, 32), (10, 20)]
)
def test_bubble_rate_in_slots(p, m, concat):
  """Paper: (D-2)/(2N+D-2) with F = B; the single-step view, equal on every rank."""
  single, steady, makespan = _bubbles(chimera(p, m, concat=concat))
  assert single == [p - 2] * p
  assert makespan == 2 * m + p - 2
  assert single[0] / makespan == pytest.approx((p - 2) / (2 * m + p - 2), rel=1e-12)
  assert max(steady) == steady[0] == p - 2  # steady state: rank 0 starts first, ends last
  if (p, m) == (4, 8):
    assert single[0] / makespan == pytest.approx(0.111, abs=5e-4)  # the anchors' 11.1%
  if (p, m) == (8, 32):
    assert single[0] / makespan == pytest.approx(0.086, abs=5e-4)  # the anchors' 8.6%


@pytest.mark.parametrize("p", [4, 8])
def test_direct_concatenation_leaves_gaps_when_backward_is_longer(p):
  """With B = 2F the slot-derived order idles more than (p/2-1)(F+B) per rank, and more with
  every unit concatenated: the intermediate bubbles that the paper's forward doubling and
  backward halving exist to remove. The formula is a count of equal slots."""
  one_unit, _, _ = _bubbles(chimera(p, p, concat="direct"), b=2.0)
  two_units, _, _ = _bubbles(chimera(p, 2 * p, concat="direct"), b=2.0)
  assert max(two_units) > max(one_unit) >= (p / 2 - 1) * 3


@pytest.mark.parametrize("p,m", [(4, 6), (4, 16), (6, 10), (6, 24), (8, 14), (8, 32), (10, 40)])
def test_merged_units_leave_no_intermediate_bubble(p, m):
  """The merged order at B = 2F: below 1F1B's (p-1)(F+B) (at p = 8, m = 32: 21, where direct
  concatenation idles 30), and every rank idles (p-2)·B, one unit's bubble, for every m (single
  step; the steady-state view's worst rank the same); at F = 2B it is (p-2)·F. No rank holds
  more than p micro-batch-stages."""
  s = chimera(p, m)
  assert s.options["concat"] == "merged"
  for f, b in ((1.0, 2.0), (2.0, 3.0), (2.0, 1.0)):
    single, steady, _ = _bubbles(s, f, b)
    assert single == [(p - 2) * max(f, b)] * p, (f, b, single)
    assert max(steady) == (p - 2) * max(f, b), (f, b, steady)
    assert max(single) < (p - 1) * (f + b)  # 1F1B
  assert max(_peak_activations(s)) == p
  if (p, m) == (8, 32):
    direct, _, _ = _bubbles(chimera(p, m, concat="direct"), b=2.0)
    assert max(direct) == 30 > 21 > 12 == max(_bubbles(s, b=2.0)[0])


def test_merged_needs_2p_minus_2_microbatches_else_concatenates():
  for p, m in ((4, 4), (8, 8), (8, 12)):
    assert chimera(p, m).ranks == chimera(p, m, concat="direct").ranks
    assert chimera(p, m).options["concat"] == "direct"


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 12), (6, 12), (8, 16), (10, 20)])
def test_activations_between_half_and_full_depth(p, m):
  """Paper: activation memory between (D/2+1) and D micro-batches of one stage per worker."""
  peaks = _peak_activations(chimera(p, m, concat="direct"))
  assert min(peaks) == peaks[0] == peaks[-1] == p // 2 + 1
  assert max(peaks) == p


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pp=5, microbatches=10), r"even number of ranks.*pp=5; use pp=6"),
        (dict(pp=1, microbatches=2), r"even number of ranks.*pp=1; use pp=2"),
        (dict(pp=4, microbatches=7), r"microbatches=7; use an even number.*such as 8"),
        (dict(pp=4, microbatches=8, chunks=4), r"chunks=4"),
        (dict(pp=4, microbatches=8, doubling=True), r"only the option concat.*doubling"),
        (dict(pp=4, microbatches=8, concat="doubled"), r"concat='doubled' is not one of"),
    ],
)
def test_rejects(kwargs, match):
  with pytest.raises(ValueError, match=match):
    chimera(**kwargs)
  with pytest.raises(ValueError, match=match):
    make_schedule("chimera", **kwargs)
