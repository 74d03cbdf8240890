"""ZB-H1, ZB-H2 and ZB-V: validity, bubbles and activations against the published figures.

Figures are at F = I = W = 1, B = 2 (anchors.md). Bubbles come from list-scheduling the
per-rank orders (jaxpipe.pipeline.deps); activations are counted here from each rank's order.
Expected values are the formulas, never the generator's output:
- ZB-H1: (p - 1)(F + B - 2W) per rank (single step; rank 0 also idles that long between its
  first and last op), at most p micro-batches in flight (1F1B's rank 0: Megatron's p - 1 warm-up
  forwards plus one).
- ZB-H2: steady-state bubble 0, at most 2p - 1 in flight.
- ZB-V: steady-state bubble 0, at most 2p stage activations per rank (two chunks of half a
  rank's layers: p in whole-rank units, as 1F1B), twice 1F1B's pipeline communication.
Lower bounds derived below (the generators must attain them): no single-chunk or V schedule
can be bubble-free in the steady state with m < 2p - 1, and no schedule ends before the last
rank, whose first input arrives after (p - 1) forwards, has done its 3m (or 6m) units.
"""
import pytest

from jaxpipe.pipeline import make_schedule
from jaxpipe.pipeline.deps import list_schedule
from jaxpipe.pipeline.schedules.zero_bubble import zb_h1, zb_h2, zb_v

F, I, W = 1, 1, 1
B = I + W
COST = {"F": F, "I": I, "W": W, "B": B}
PS = range(1, 9)  # odd and even p, p = 1 included


def edge_ms(p):
  """m = 1, p - 1, p, p + 1, 2p - 2, 2p - 1, 2p, 3p + 1 and a large m."""
  return sorted({m for m in (1, p - 1, p, p + 1, 2 * p - 2, 2 * p - 1, 2 * p, 3 * p + 1, 8 * p)
                 if m >= 1})


def measure(schedule):
  """(single-step bubble per rank, steady-state bubble per rank, peak in flight per rank)."""
  t = list_schedule(schedule, cost=lambda op: sum(COST[a.kind] for a in op.parts()))
  assert not t.blocked
  makespan = max(max(ends) for ends in t.end if ends)
  single, steady, peak = [], [], []
  for r, ops in enumerate(schedule.ranks):
    busy = sum(COST[op.kind] for op in ops)
    single.append(makespan - busy)
    steady.append(max(t.end[r]) - min(t.start[r]) - busy)
    held = most = 0
    for op in ops:  # F takes an activation; W (or a full B) releases it, I keeps it for W
      held += 1 if op.kind == "F" else -1 if op.kind in ("W", "B") else 0
      most = max(most, held)
    peak.append(most)
  return single, steady, peak


@pytest.mark.parametrize("p", PS)
def test_zb_h1_bubble_and_memory(p):
  for m in edge_ms(p):
    s = zb_h1(p, m).validate()
    assert (s.num_stages, s.placement.chunks_per_rank) == (p, 1)
    single, steady, peak = measure(s)
    assert max(peak) <= min(p, m), (p, m, peak)  # never more than 1F1B's rank 0
    if m >= p:
      assert single == [(p - 1) * (F + B - 2 * W)] * p, (p, m, single)
      assert max(steady) == (p - 1) * (F + B - 2 * W), (p, m, steady)
      assert peak[0] == p


@pytest.mark.parametrize("p", PS)
def test_zb_h2_bubble_free_with_at_most_2p_minus_1_in_flight(p):
  for m in edge_ms(p):
    s = zb_h2(p, m).validate()
    assert (s.num_stages, s.placement.chunks_per_rank) == (p, 1)
    single, steady, peak = measure(s)
    assert max(peak) <= min(2 * p - 1, m), (p, m, peak)
    # Rank 0's first I needs F of micro-batch 0 to go down p stages and its I to come back up
    # p - 1: 2p - 1 units after its first F, filled only by its m forwards.
    assert max(steady) >= 2 * p - 1 - m
    if m >= 2 * p - 1:
      assert max(steady) == 0, (p, m, steady)
      assert peak[0] == 2 * p - 1
      assert single == [(p - 1) * F] * p, (p, m, single)  # the parallelogram's slant only
    else:
      assert max(steady) == 2 * p - 1 - m, (p, m, steady)  # the bound, attained


@pytest.mark.parametrize("p", PS)
def test_zb_v_bubble_free_within_1f1b_memory(p):
  for m in edge_ms(p):
    s = zb_v(p, m).validate()
    assert (s.num_stages, s.placement.chunks_per_rank) == (2 * p, 2)
    assert all(s.placement.stage_rank[k] == s.placement.stage_rank[2 * p - 1 - k]
               for k in range(p))  # the V: stages k and 2p-1-k share a rank
    single, steady, peak = measure(s)
    assert max(peak) <= 2 * p, (p, m, peak)  # <= p whole-rank units: 1F1B's rank 0
    # Rank 0 runs nothing but chunk-0 forwards until micro-batch 0 has passed all 2p - 1
    # stages before its last: an idle of at least 2p - 1 - m.
    assert max(steady) >= 2 * p - 1 - m
    if m >= 2 * p - 1:
      assert max(steady) == 0, (p, m, steady)
      assert peak[0] == 2 * p
      assert single == [(p - 1) * F] * p, (p, m, single)


@pytest.mark.parametrize("p", [2, 3, 8])
def test_zb_v_doubles_pipeline_communication(p):
  m = 2 * p
  s = zb_v(p, m)
  sends = 0
  for r, ops in enumerate(s.ranks):  # an F sends forward, an I backward, unless the peer is r
    for op in ops:
      route = s.route(op.microbatch)
      k = route.index(op.stage)
      peer = {"F": k + 1, "I": k - 1}.get(op.kind)
      if peer is not None and 0 <= peer < len(route):
        sends += s.placement.stage_rank[route[peer]] != r
  assert sends == 2 * (2 * m * (p - 1))  # 1F1B: m micro-batches, p - 1 hops, both ways


def test_large_pipelines_keep_the_formulas():
  p, m = 64, 512
  single, steady, peak = measure(zb_h1(p, m).validate())
  assert single == [(p - 1) * (F + B - 2 * W)] * p and peak[0] == p
  p, m = 16, 64
  _, steady, peak = measure(zb_h2(p, m).validate())
  assert max(steady) == 0 and max(peak) == 2 * p - 1
  _, steady, peak = measure(zb_v(p, m).validate())
  assert max(steady) == 0 and max(peak) == 2 * p


def test_registry_names_build_the_same_orders():
  for name, fn, chunks in (("zb-h1", zb_h1, None), ("zb-h2", zb_h2, 1), ("zb-v", zb_v, 2)):
    s = make_schedule(name, pp=4, microbatches=8, chunks=chunks)
    direct = fn(4, 8)
    assert s.name == name and (s.placement, s.ranks) == (direct.placement, direct.ranks)


@pytest.mark.parametrize("fn, kwargs, match", [
    (zb_h1, dict(pp=4, microbatches=8, chunks=2), r"chunks=2 .*one chunk per rank.*zb-v"),
    (zb_h2, dict(pp=4, microbatches=8, chunks=3), r"chunks=3 .*one chunk per rank"),
    (zb_v, dict(pp=4, microbatches=8, chunks=1), r"chunks=1 .*two chunks per rank.*chunks=2"),
    (zb_v, dict(pp=4, microbatches=8, chunks=4), r"chunks=4"),
    (zb_h1, dict(pp=0, microbatches=8), r"pp=0 must be a positive integer"),
    (zb_h2, dict(pp=4, microbatches=0), r"microbatches=0 must be a positive integer"),
    (zb_v, dict(pp=4.0, microbatches=8), r"pp=4.0 must be a positive integer"),
    (zb_h1, dict(pp=True, microbatches=8), r"pp=True"),
    (zb_h2, dict(pp=4, microbatches=8, memory="2p"), r"zb-h2 takes no options.*memory"),
])
def test_bad_requests_say_what_and_how_to_fix(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(**kwargs)
