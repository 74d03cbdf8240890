"""DualPipe and DualPipeV against DeepSeek's README: its figures, its bubble and memory table.

Units: F, I, W, B = I + W are the times of one stage (one chunk) on one micro-batch, F&B the
time of an overlapped pair. The README's bubble (PP/2-1)(F&B + B - 3W) is in the single-step
view: makespan minus a rank's busy time, which here is the same on every rank. Activations
are counted in (stage, micro-batch) pairs whose forward ran and whose backward has not freed
them (B, or W when the backward is split).
"""

import pytest

from jaxpipe.pipeline import ScheduleError, make_schedule
from jaxpipe.pipeline.ir.deps import list_schedule
from jaxpipe.pipeline.ir.schedules.dualpipe import dualpipe, dualpipev


def _costs(f=1.0, i=1.0, w=1.0, fb=None):
  """Cost of an op: F, I, W as given, B = I + W, an overlapped pair `fb` (default F + B)."""
  fb = f + i + w if fb is None else fb
  per_kind = {"F": f, "I": i, "W": w, "B": i + w}
  return lambda op: fb if len(op.parts()) == 2 else per_kind[op.kind]


def _bubbles(schedule, cost):
  """(single-step bubble per rank, steady-state bubble per rank) of the async execution."""
  timeline = list_schedule(schedule, cost)
  assert not timeline.blocked
  makespan = max(ends[-1] for ends in timeline.end)
  busy = [sum(cost(op) for op in ops) for ops in schedule.ranks]
  single = [makespan - b for b in busy]
  steady = [timeline.end[r][-1] - timeline.start[r][0] - busy[r] for r in range(len(busy))]
  return single, steady


def _peak_activations(schedule, forward_first: bool = False):
  """Peak live (stage, micro-batch) activations per rank.

  With `forward_first`, an overlapped pair's forward counts before its backward frees.
  """
  peaks = []
  for ops in schedule.ranks:
    live = peak = 0
    for op in ops:
      made = sum(a.kind == "F" for a in op.parts())
      freed = sum(a.kind in ("B", "W") for a in op.parts())
      peak = max(peak, live + made if forward_first else live + made - freed)
      live += made - freed
    assert live == 0
    peaks.append(peak)
  return peaks


def _readme_formula(pp_stages, f, i, w, fb):
  return (pp_stages / 2 - 1) * (fb + (i + w) - 3 * w)


DUALPIPE_SIZES = [
    (2, 4),
    (2, 6),
    (4, 8),
    (4, 10),
    (4, 12),
    (6, 12),
    (6, 16),
    (8, 16),
    (8, 20),
    (8, 32),
    (16, 32),
]
DUALPIPEV_SIZES = [
    (1, 2),
    (1, 3),
    (2, 4),
    (2, 5),
    (3, 6),
    (3, 7),
    (4, 8),
    (4, 9),
    (4, 10),
    (6, 13),
    (8, 16),
    (8, 32),
]


@pytest.mark.parametrize("p,m", DUALPIPE_SIZES)
def test_dualpipe_validates(p, m):
  s = dualpipe(p, m).validate()
  assert s.num_stages == p and s.placement.copies == 2 and s.placement.chunks_per_rank == 2
  assert s.microbatch_route == (0,) * (m // 2) + (1,) * (m // 2)
  for r in range(p):  # each rank: a forward and a backward per micro-batch of each direction
    assert sum(a.kind == "F" for rank, _, a in s.actions() if rank == r) == m


@pytest.mark.parametrize("p,m", DUALPIPEV_SIZES)
def test_dualpipev_validates(p, m):
  s = dualpipev(p, m).validate()
  assert s.num_stages == 2 * p and s.placement.copies == 1 and s.placement.chunks_per_rank == 2
  assert s.placement.stage_rank == tuple(range(p)) + tuple(reversed(range(p)))


def test_registry_builds_both():
  assert make_schedule("dualpipe", pp=4, microbatches=8).name == "dualpipe"
  assert make_schedule("dualpipev", pp=4, microbatches=8, chunks=2).name == "dualpipev"


def _tokens(schedule, rank, label):
  return " ".join("&".join(label(a) for a in op.parts()) for op in schedule.ranks[rank])


def test_dualpipe_matches_readme_figure():
  """README figure, 8 ranks, 20 micro-batches; it numbers only the down direction's."""
  s = dualpipe(8, 20)
  label = lambda a: a.kind + (str(a.microbatch) if a.microbatch < 10 else "")
  assert _tokens(s, 0, label) == (
      "F0 F1 F2 F3 F4 F5 F6 F I W F I W F I W F F7&B F&B0 F8&B F&B1 F9&B F&B2 B F&B3 B F&B4 "
      "B F&B5 B I6 W6 I7 W7 I8 W8 I9 W9"
  )
  assert _tokens(s, 7, label) == (
      "F F F F F F F F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 F&B3 F4&B F&B4 F5&B F&B5 F6&B B6 F7&B B7 "
      "F8&B B8 F9&B B9 I W I W I W I W"
  )


def test_dualpipev_matches_readme_figure():
  """README figure, 4 ranks (8 stages), 10 micro-batches; ' marks the way back up."""
  s = dualpipev(4, 10)
  label = lambda a: f"{a.kind}{a.microbatch}" + ("'" if a.stage >= 4 else "")
  assert _tokens(s, 0, label) == (
      "F0 F1 F2 F3 F4 F5 F6 F0' I0' W0' F1' I1' W1' F2' I2' W2' F3' F7&B3' F4'&B0 F8&B4' "
      "F5'&B1 F9&B5' F6'&B2 B6' F7'&B3 B7' F8'&B4 B8' F9'&B5 B9' I6 W6 I7 W7 I8 W8 I9 W9"
  )
  # the last rank runs its first step-4 pair apart (F4, then B0'), as the reference does
  assert _tokens(s, 3, label) == (
      "F0 F0' F1 F1' F2 F2' F3 F3' F4 B0' F4'&B0 F5&B1' F5'&B1 F6&B2' F6'&B2 F7&B3' F7'&B3 "
      "F8&B4' F8'&B4 F9&B5' F9'&B5 B6' B6 B7' B7 I8' I8 I9' I9 W8' W8 W9' W9"
  )


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 32)])
def test_dualpipe_bubble_single_step_view(p, m):
  """F = I = W = 1, F&B = F + B = 3 (no overlap credit): (p/2-1)(3 + 2 - 3) on every rank."""
  single, _ = _bubbles(dualpipe(p, m), _costs())
  expected = _readme_formula(p, 1, 1, 1, 3)
  assert single == [expected] * p
  assert expected == {4: 2, 8: 6}.get(p, expected)  # the anchors' worked numbers


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_bubble_single_step_view(p, m):
  """PP = 2p stages on p ranks: (PP/2-1)(F&B + B - 3W) on every rank."""
  single, _ = _bubbles(dualpipev(p, m), _costs())
  assert single == [_readme_formula(2 * p, 1, 1, 1, 3)] * p


@pytest.mark.parametrize("f,i,w", [(2, 2, 1), (1, 1, 0.5), (3, 3, 1), (1, 1, 0.25)])
def test_bubble_formula_other_costs(f, i, w):
  """The formula is exact for F = I >= W with F&B = F + B, on every rank."""
  cost = _costs(f, i, w)
  single, _ = _bubbles(dualpipe(8, 20), cost)
  assert single == [_readme_formula(8, f, i, w, f + i + w)] * 8
  single, _ = _bubbles(dualpipev(4, 10), cost)
  assert single == [_readme_formula(8, f, i, w, f + i + w)] * 4


@pytest.mark.parametrize("fb", [2.0, 2.5])
def test_bubble_formula_with_overlap_credit(fb):
  """A cheaper overlapped pair (2F <= F&B <= F + B): the formula is the worst rank's bubble."""
  for s, stages in ((dualpipe(8, 20), 8), (dualpipev(4, 10), 8), (dualpipe(16, 40), 16)):
    single, _ = _bubbles(s, _costs(fb=fb))
    assert max(single) == _readme_formula(stages, 1, 1, 1, fb)


@pytest.mark.parametrize(
    "gen,p,m,stages",
    [(dualpipe, 4, 8, 4), (dualpipe, 8, 20, 8), (dualpipev, 4, 10, 8), (dualpipev, 8, 16, 16)],
)
def test_bubble_steady_state_view(gen, p, m, stages):
  """Idle between a rank's first and last op: the formula on rank 0, which bounds the rest."""
  _, steady = _bubbles(gen(p, m), _costs())
  assert steady[0] == max(steady) == _readme_formula(stages, 1, 1, 1, 3)
  assert min(steady) < max(steady)  # middle ranks start late and end early


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (6, 12), (8, 16), (8, 32)])
def test_dualpipe_activations(p, m):
  """README: PP+1 per device (the worst rank, in one stage's activations per micro-batch)."""
  s = dualpipe(p, m)
  assert max(_peak_activations(s)) == p + 1
  assert _peak_activations(s, forward_first=True) == [p + 1] * p


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (4, 8), (4, 13), (8, 16)])
def test_dualpipev_activations(p, m):
  """README: PP+1 with PP = 2p stages."""
  s = dualpipev(p, m)
  assert max(_peak_activations(s)) == 2 * p + 1
  assert _peak_activations(s, forward_first=True) == [2 * p + 1] * p


def test_dualpipe_at_scale():
  s = dualpipe(64, 512).validate()
  assert sum(a.kind == "F" for _, _, a in s.actions()) == 64 * 512


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pp=3, microbatches=12), r"even number of ranks, got pp=3; use pp=4"),
        (dict(pp=4, microbatches=9), r"microbatches=9; use microbatches=10"),
        (dict(pp=4, microbatches=6), r"at least 2\*pp = 8, got microbatches=6; use microbatches=8"),
        (dict(pp=4, microbatches=8, chunks=3), r"chunks=3"),
        (dict(pp=4, microbatches=8, zero_bubble=False), r"no options.*zero_bubble"),
    ],
)
def test_dualpipe_rejects(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dualpipe(**kwargs)
  with pytest.raises(ValueError, match=match):
    make_schedule("dualpipe", **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pp=4, microbatches=7), r"at least 2\*pp = 8 .*microbatches=7; use microbatches=8"),
        (dict(pp=4, microbatches=8, chunks=1), r"chunks=1"),
    ],
)
def test_dualpipev_rejects(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dualpipev(**kwargs)


def test_validator_catches_a_broken_dualpipe():
  """Swapping two dependent ops of rank 0 must be caught (the tests above rely on validate)."""
  s = dualpipe(4, 8)
  ops = list(s.ranks[0])
  first_i = next(i for i, op in enumerate(ops) if op.parts()[0].kind == "I")
  ops[first_i], ops[first_i + 1] = ops[first_i + 1], ops[first_i]  # W before its I
  s.ranks = (tuple(ops),) + s.ranks[1:]
  with pytest.raises(ScheduleError):
    s.validate()
