"""GPipe, 1F1B, interleaved 1F1B against Megatron's/torch's rules and anchors.md's formulas.

Oracles: the published formulas ((p-1)(F+B) bubble, Megatron's warm-up counts, the
activation counts they imply) and Megatron's documented schedule-table example; nothing here
is computed by the code under test.
"""

import pytest

from jaxpipe.pipeline import Placement, make_schedule
from jaxpipe.pipeline.ir.schedules.simple import schedule_table

# (p, m) with the edges m = p, m = 2p, m < p, odd and even p, p = 1.
PM = [
    (1, 1),
    (1, 3),
    (2, 2),
    (2, 4),
    (3, 3),
    (3, 6),
    (3, 7),
    (4, 4),
    (4, 8),
    (4, 9),
    (5, 5),
    (5, 10),
    (6, 2),
    (7, 14),
    (8, 8),
    (8, 32),
]


def leading_forwards(ops) -> int:
  n = 0
  while n < len(ops) and ops[n].kind == "F":
    n += 1
  return n


@pytest.mark.parametrize("p,m", PM)
def test_gpipe(p, m):
  s = make_schedule("gpipe", pp=p, microbatches=m)
  assert s.placement == Placement.interleaved(p)
  for r, ops in enumerate(s.ranks):
    assert [str(a) for a in ops] == [f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)]
  res = s.simulate()
  assert res.bubble == (3.0 * (p - 1),) * p  # (p-1)(F+B), F=1, B=2, every rank
  assert res.makespan == 3.0 * (m + p - 1)
  assert res.peak_activations == (m,) * p


@pytest.mark.parametrize("p,m", PM)
def test_one_f_one_b(p, m):
  s = make_schedule("1f1b", pp=p, microbatches=m)
  res = s.simulate()
  assert res.bubble == (3.0 * (p - 1),) * p
  assert res.max_steady_bubble == 3.0 * (p - 1)  # rank 0 idles the whole ramp
  for r, ops in enumerate(s.ranks):
    warmup = min(p - r - 1, m)  # Megatron: forwards before the steady 1F1B loop
    assert leading_forwards(ops) == warmup + (1 if m > warmup else 0)
    kinds = "".join(a.kind for a in ops[warmup:])
    steady = m - warmup
    assert kinds == "FB" * steady + "B" * warmup
    assert [a.microbatch for a in ops if a.kind == "B"] == list(range(m))
  # In flight: rank r holds min(p - r, m) micro-batches; p on the first rank.
  assert res.peak_activations == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("costs", [{"F": 1, "B": 3}, {"F": 2, "I": 1, "W": 2}])
def test_bubble_with_other_costs(costs):
  p, m = 5, 10
  f = costs["F"]
  b = costs.get("B", costs.get("I", 1) + costs.get("W", 1))
  for name in ("gpipe", "1f1b"):
    res = make_schedule(name, pp=p, microbatches=m).simulate(costs)
    assert res.bubble == ((p - 1) * (f + b),) * p


def test_anchor_worked_numbers():
  """anchors.md's table: 1F1B 9 units, 27.3% at (4, 8); 21 units, 17.9% at (8, 32)."""
  for (p, m), bubble, pct in (((4, 8), 9, 27.3), ((8, 32), 21, 17.9)):
    for name in ("gpipe", "1f1b"):
      res = make_schedule(name, pp=p, microbatches=m).simulate()
      assert res.max_bubble == bubble
      assert round(100 * res.bubble_rate, 1) == pct
    vpp = make_schedule("interleaved-1f1b", pp=p, microbatches=m, chunks=2).simulate()
    assert vpp.max_bubble == bubble  # per-chunk units
    assert vpp.max_bubble / 2 == {(4, 8): 4.5, (8, 32): 10.5}[(p, m)]  # whole-rank units
  assert make_schedule("1f1b", pp=4, microbatches=8).simulate().peak_activations[0] == 4


def test_megatron_schedule_table_example():
  # Megatron's comment: PP2 N3M5 VP2 -> micro-batch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1
  table = schedule_table(5, 2, 3)
  assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
  assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


VPP = [
    (p, m, v, g)
    for p, m in [
        (1, 2),
        (2, 2),
        (2, 4),
        (3, 3),
        (3, 6),
        (3, 7),
        (4, 4),
        (4, 8),
        (4, 10),
        (5, 10),
        (8, 16),
    ]
    for v in (2, 3, 4)
    for g in sorted({p, m, min(m, 2 * p)})
    if g >= p and (m % g == 0 or m % g >= p)
]


@pytest.mark.parametrize("p,m,v,g", VPP)
def test_interleaved(p, m, v, g):
  s = make_schedule("interleaved-1f1b", pp=p, microbatches=m, chunks=v, group=g)
  assert s.placement == Placement.interleaved(p, v)
  res = s.simulate()
  # (p-1)(F+B) in per-chunk units, every rank; 1/v of 1F1B's in whole-rank units.
  assert res.bubble == (3.0 * (p - 1),) * p
  for r, ops in enumerate(s.ranks):
    warmup = min((p - r - 1) * 2 + (v - 1) * g, m * v)  # Megatron's warm-up count
    first = leading_forwards(ops)
    assert first == min(warmup + 1, m * v)
    # chunk activations in flight: the warm-up plus the first steady forward
    assert res.peak_activations[r] == min(warmup + 1, m * v)
    assert res.peak_activations_rank[r] == min(warmup + 1, m * v) / v
    fwd_chunks = [s.placement.local_chunk(a.stage) for a in ops if a.kind == "F"]
    bwd_chunks = [s.placement.local_chunk(a.stage) for a in ops if a.kind == "B"]
    assert bwd_chunks == [v - 1 - c for c in fwd_chunks]  # backwards walk the chunks reversed


def test_interleaved_activations_formula():
  # anchors.md: about p + (p-1)/v whole-rank units on the first rank (m large enough)
  for p, v in ((4, 2), (8, 2), (4, 4)):
    res = make_schedule("interleaved-1f1b", pp=p, microbatches=4 * p, chunks=v).simulate()
    assert res.peak_activations_rank[0] == p + (p - 1) / v


def test_invalid_requests():
  with pytest.raises(ValueError, match=r"microbatches % group = 10 % 4 = 2.*0 or >= pp=4"):
    make_schedule("interleaved-1f1b", pp=4, microbatches=10, chunks=2)
  with pytest.raises(ValueError, match=r"group=3 .* must lie in \[pp, microbatches\] = \[4, 8\]"):
    make_schedule("interleaved-1f1b", pp=4, microbatches=8, chunks=2, group=3)
  with pytest.raises(ValueError, match=r"group=4 .* \[4, 3\]"):
    make_schedule("interleaved-1f1b", pp=4, microbatches=3, chunks=2)
  with pytest.raises(ValueError, match="chunks >= 2"):
    make_schedule("interleaved-1f1b", pp=4, microbatches=8, chunks=1)
  with pytest.raises(ValueError, match="use 'interleaved-1f1b'"):
    make_schedule("1f1b", pp=4, microbatches=8, chunks=2)
  with pytest.raises(ValueError, match="takes no options"):
    make_schedule("gpipe", pp=4, microbatches=8, group=4)
