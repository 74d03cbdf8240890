"""Simulators against timelines worked out by hand, and their figures' definitions."""

import pytest

from jaxpipe.pipeline import Action, Overlap, Placement, Schedule, make_schedule
from jaxpipe.pipeline.ir.schedules import SCHEDULE_NAMES
from jaxpipe.pipeline.ir.simulate import lockstep_ticks, resolve_costs

F = lambda s, mb: Action("F", s, mb)
B = lambda s, mb: Action("B", s, mb)
I = lambda s, mb: Action("I", s, mb)
W = lambda s, mb: Action("W", s, mb)


def one_f_one_b_2x2():
  return Schedule(
      "hand",
      Placement.interleaved(2),
      2,
      [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]],
  )


def test_async_by_hand():
  # rank 0: F0 [0,1] F1 [1,2]  B0 [4,6]  B1 [7,9]
  # rank 1: F0 [1,2] B0 [2,4]  F1 [4,5]  B1 [5,7]
  res = one_f_one_b_2x2().simulate()
  assert [(s, e) for s, e, _ in res.timelines[0]] == [(0, 1), (1, 2), (4, 6), (7, 9)]
  assert [(s, e) for s, e, _ in res.timelines[1]] == [(1, 2), (2, 4), (4, 5), (5, 7)]
  assert res.makespan == 9
  assert res.busy == (6, 6)
  assert res.bubble == (3, 3)  # single step: makespan - busy
  assert res.steady_bubble == (3, 0)  # rank 0 idles 2..4 and 6..7; rank 1 never in 1..7
  assert res.bubble_rate == pytest.approx(1 - 12 / 18, rel=1e-12)
  assert res.peak_activations == (2, 1)
  assert res.ticks is None


def test_async_latency_by_hand():
  # every cross-rank input arrives 0.5 late: rank 1's F0 at 1.5, rank 0's B0 at 4.5 + 0.5 ...
  res = one_f_one_b_2x2().simulate(latency=0.5)
  assert [(s, e) for s, e, _ in res.timelines[1]] == [
      (1.5, 2.5),
      (2.5, 4.5),
      (4.5, 5.5),
      (5.5, 7.5),
  ]
  assert [(s, e) for s, e, _ in res.timelines[0]] == [(0, 1), (1, 2), (5, 7), (8, 10)]
  assert res.makespan == 10


def test_lockstep_by_hand():
  # ticks: 0: r0 F0 | 1: r0 F1, r1 F0 | 2: r1 B0 | 3: r0 B0, r1 F1 | 4: r1 B1 | 5: r0 B1
  # lengths 1, 1, 2, 2, 2, 2 -> 10 (async: 9)
  s = one_f_one_b_2x2()
  assert lockstep_ticks(s) == [[0, 1, 3, 5], [1, 2, 3, 4]]
  res = s.simulate(lockstep=True)
  assert res.ticks == 6
  assert res.makespan == 10
  assert [(a, b) for a, b, _ in res.timelines[1]] == [(1, 2), (2, 4), (4, 5), (6, 8)]
  assert res.bubble == (4, 4)
  res = s.simulate(lockstep=True, latency=0.25)  # a permute ends every tick
  assert res.makespan == 10 + 5 * 0.25


def test_overlap_cost_and_activations():
  pl = Placement.interleaved(1)
  s = Schedule("hand", pl, 2, [[F(0, 0), Overlap(F(0, 1), B(0, 0)), B(0, 1)]]).validate()
  assert s.simulate().makespan == 1 + 3 + 2  # F&B defaults to F + B
  assert s.simulate({"F&B": 2}).makespan == 1 + 2 + 2
  assert s.simulate().peak_activations == (2,)  # the forward takes its slot first


@pytest.mark.parametrize(
    "order,peak",
    [
        ("F0 F1 I0 I1 W0 W1", 2),
        ("F0 I0 W0 F1 I1 W1", 1),
        ("F0 I0 F1 W0 I1 W1", 2),  # I keeps the activations until W
        ("F0 B0 F1 B1", 1),
    ],
)
def test_activations_released_by_b_or_w(order, peak):
  ops = [Action(t[0], 0, int(t[1])) for t in order.split()]
  s = Schedule("hand", Placement.interleaved(1), 2, [ops]).validate()
  assert s.simulate().peak_activations == (peak,)


def test_resolve_costs():
  assert resolve_costs(None) == {"F": 1, "I": 1, "W": 1, "B": 2, "F&B": None}
  assert resolve_costs({"I": 2, "W": 3})["B"] == 5
  assert resolve_costs({"B": 4, "I": 2})["B"] == 4
  with pytest.raises(ValueError, match="unknown cost kinds"):
    resolve_costs({"X": 1})
  with pytest.raises(ValueError, match="non-negative"):
    resolve_costs({"F": -1})


def test_whole_rank_units():
  """count * p / model stages: /v for VPP and V shapes, x1 for two copies of p stages."""
  vpp = make_schedule("interleaved-1f1b", pp=4, microbatches=8, chunks=2).simulate()
  assert vpp.peak_activations_rank == tuple(k / 2 for k in vpp.peak_activations)
  p = 2
  bi = (
      Schedule(
          "bi",
          Placement.bidirectional(p),
          2,
          [[F(0, 0), F(3, 1), B(3, 1), B(0, 0)], [F(1, 0), F(2, 1), B(1, 0), B(2, 1)]],
          microbatch_route=(0, 1),
      )
      .validate()
      .simulate()
  )
  assert bi.peak_activations_rank == tuple(float(k) for k in bi.peak_activations)
  assert bi.param_copies == 2 and bi.chunks == 2


def _available():
  names = []
  for name in SCHEDULE_NAMES:
    try:
      make_schedule(name, pp=4, microbatches=8)
    except (ImportError, AttributeError):
      continue
    names.append(name)
  return names


def test_lockstep_equals_async_under_unit_costs():
  """With every op costing 1, a tick is a time unit: both simulators agree exactly."""
  unit = {"F": 1, "B": 1, "I": 1, "W": 1, "F&B": 1}
  for name in _available():
    s = make_schedule(name, pp=4, microbatches=8)
    a, ls = s.simulate(unit), s.simulate(unit, lockstep=True)
    assert a.makespan == ls.makespan == ls.ticks, name
    assert [[t for t, _, _ in row] for row in a.timelines] == [
        [t for t, _, _ in row] for row in ls.timelines
    ], name
