"""ZB-H1, ZB-H2 and ZB-V: validity, bubbles and activations against the published figures.

Figures are at F = I = W = 1, B = 2 (anchors.md). Bubbles come from list-scheduling the
per-rank orders (jaxpipe.pipeline.ir.deps); activations are counted here from each rank's order.
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
ZB-V below m = 2p - 1 is checked against per-rank orders printed by the Zero Bubble authors' V
generator (sail-sg zerobubble/scheduler/zbv.py, `PipelineGraph.try_v_schedule` at
f = b = w = 1, c = 0, default memory limit; its I is their B), and against torch's rule of
dropping micro-batches from the 2p - 1 order.
"""

import pytest

from jaxpipe.pipeline import make_schedule
from jaxpipe.pipeline.ir.deps import list_schedule
from jaxpipe.pipeline.ir.schedules.zero_bubble import zb_h1, zb_h2, zb_v

F, I, W = 1, 1, 1
B = I + W
COST = {"F": F, "I": I, "W": W, "B": B}
PS = range(1, 9)  # odd and even p, p = 1 included


def edge_ms(p):
  """m = 1, p - 1, p, p + 1, 2p - 2, 2p - 1, 2p, 3p + 1 and a large m."""
  return sorted(
      {m for m in (1, p - 1, p, p + 1, 2 * p - 2, 2 * p - 1, 2 * p, 3 * p + 1, 8 * p) if m >= 1}
  )


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
    assert all(
        s.placement.stage_rank[k] == s.placement.stage_rank[2 * p - 1 - k] for k in range(p)
    )  # the V: stages k and 2p-1-k share a rank
    single, steady, peak = measure(s)
    assert max(peak) <= 2 * p, (p, m, peak)  # <= p whole-rank units: 1F1B's rank 0
    # Rank 0 runs nothing but chunk-0 forwards until micro-batch 0 has passed all 2p - 1
    # stages before its last: an idle of at least 2p - 1 - m.
    assert max(steady) >= 2 * p - 1 - m
    if m >= 2 * p - 1:
      assert max(steady) == 0, (p, m, steady)
      assert peak[0] == 2 * p
      assert single == [(p - 1) * F] * p, (p, m, single)


# Orders printed by the authors' V generator (module docstring); F/I/W in torch's notation.
ZBV_GENERATOR_ORDERS = {
    (2, 2): [
        "0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1",
        "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1",
    ],
    (4, 5): [
        "0F0 0F1 0F2 0F3 0F4 7F0 7I0 7F1 7I1 7F2 7I2 7W0 7F3 7I3 7W1 0I0 7W2 7F4 7I4 0I1 7W3 0I2 "
        "0W0 0I3 7W4 0I4 0W1 0W2 0W3 0W4",
        "1F0 1F1 1F2 1F3 1F4 6F0 6F1 6I0 6F2 6I1 6W0 6F3 6I2 6W1 1I0 6W2 6F4 6I3 1I1 6I4 1I2 1W0 "
        "1I3 6W3 1I4 1W1 6W4 1W2 1W3 1W4",
        "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2I0 2W0 5F4 5I2 2I1 5I3 2I2 5I4 2I3 "
        "5W2 2I4 2W1 5W3 2W2 5W4 2W3 2W4",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 3I1 4I2 3I2 4I3 3I3 4I4 3I4 "
        "4W1 3W1 4W2 3W2 4W3 3W3 4W4 3W4",
    ],
    (8, 12): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0F8 0F9 0F10 0F11 15F0 15I0 15F1 15I1 15F2 15I2 15F3 15I3 "
        "15W0 15F4 15I4 15W1 15F5 15I5 15W2 15F6 15I6 15W3 15F7 15I7 15W4 0I0 15W5 15F8 15I8 15W6 "
        "0I1 15W7 15F9 15I9 0W0 0I2 15W8 15F10 15I10 0W1 0I3 15W9 15F11 15I11 0I4 0W2 0I5 15W10 "
        "0I6 0W3 0I7 15W11 0I8 0W4 0I9 0W5 0I10 0W6 0I11 0W7 0W8 0W9 0W10 0W11",
        "1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1F8 1F9 1F10 1F11 14F0 14F1 14I0 14F2 14I1 14F3 14I2 14W0 "
        "14F4 14I3 14W1 14F5 14I4 14W2 14F6 14I5 14W3 14F7 14I6 14W4 1I0 14W5 14F8 14I7 14W6 1I1 "
        "1W0 14F9 14I8 14W7 1I2 1W1 14F10 14I9 14W8 1I3 1W2 14F11 14I10 1I4 14I11 1I5 14W9 1I6 1W3 "
        "1I7 14W10 1I8 1W4 1I9 14W11 1I10 1W5 1I11 1W6 1W7 1W8 1W9 1W10 1W11",
        "2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 2F8 2F9 2F10 13F0 2F11 13F1 13F2 13I0 13F3 13I1 13W0 13F4 "
        "13I2 13W1 13F5 13I3 13W2 13F6 13I4 13W3 13F7 13I5 13W4 2I0 13W5 13F8 13I6 2W0 2I1 13W6 "
        "13F9 13I7 2W1 2I2 13W7 13F10 13I8 2W2 2I3 13W8 13F11 13I9 2I4 13I10 2I5 13I11 2I6 2W3 2I7 "
        "13W9 2I8 2W4 2I9 13W10 2I10 2W5 2I11 13W11 2W6 2W7 2W8 2W9 2W10 2W11",
        "3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3F8 12F0 3F9 12F1 3F10 12F2 3F11 12F3 12I0 12W0 12F4 12I1 "
        "12W1 12F5 12I2 12W2 12F6 12I3 12W3 12F7 12I4 12W4 3I0 3W0 12F8 12I5 12W5 3I1 3W1 12F9 "
        "12I6 12W6 3I2 3W2 12F10 12I7 12W7 3I3 3W3 12F11 12I8 3I4 12I9 3I5 12I10 3I6 12I11 3I7 "
        "12W8 3I8 3W4 3I9 12W9 3I10 3W5 3I11 12W10 3W6 12W11 3W7 3W8 3W9 3W10 3W11",
        "4F0 4F1 4F2 4F3 4F4 4F5 4F6 11F0 4F7 11F1 4F8 11F2 4F9 11F3 4F10 11F4 11I0 11W0 11F5 11I1 "
        "11W1 11F6 11I2 11W2 11F7 11I3 11W3 4F11 4I0 4W0 11F8 11I4 11W4 4I1 4W1 11F9 11I5 11W5 4I2 "
        "4W2 11F10 11I6 11W6 4I3 4W3 11F11 11I7 4I4 11I8 4I5 11I9 4I6 11I10 4I7 11I11 4I8 11W7 4I9 "
        "4W4 4I10 11W8 4I11 4W5 11W9 4W6 11W10 4W7 11W11 4W8 4W9 4W10 4W11",
        "5F0 5F1 5F2 5F3 5F4 10F0 5F5 10F1 5F6 10F2 5F7 10F3 5F8 10F4 5F9 10F5 10I0 10W0 10F6 10I1 "
        "10W1 10F7 10I2 10W2 5F10 5I0 5W0 10F8 10I3 10W3 5F11 5I1 5W1 10F9 10I4 10W4 5I2 5W2 10F10 "
        "10I5 10W5 5I3 5W3 10F11 10I6 5I4 10I7 5I5 10I8 5I6 10I9 5I7 10I10 5I8 10I11 5I9 10W6 5I10 "
        "5W4 5I11 10W7 5W5 10W8 5W6 10W9 5W7 10W10 5W8 10W11 5W9 5W10 5W11",
        "6F0 6F1 6F2 9F0 6F3 9F1 6F4 9F2 6F5 9F3 6F6 9F4 6F7 9F5 6F8 9F6 9I0 9W0 9F7 9I1 9W1 6F9 "
        "6I0 6W0 9F8 9I2 9W2 6F10 6I1 6W1 9F9 9I3 9W3 6F11 6I2 6W2 9F10 9I4 9W4 6I3 6W3 9F11 9I5 "
        "6I4 9I6 6I5 9I7 6I6 9I8 6I7 9I9 6I8 9I10 6I9 9I11 6I10 9W5 6I11 6W4 9W6 6W5 9W7 6W6 9W8 "
        "6W7 9W9 6W8 9W10 6W9 9W11 6W10 6W11",
        "7F0 8F0 7F1 8F1 7F2 8F2 7F3 8F3 7F4 8F4 7F5 8F5 7F6 8F6 7F7 8F7 8I0 8W0 7F8 7I0 7W0 8F8 "
        "8I1 8W1 7F9 7I1 7W1 8F9 8I2 8W2 7F10 7I2 7W2 8F10 8I3 8W3 7F11 7I3 7W3 8F11 8I4 7I4 8I5 "
        "7I5 8I6 7I6 8I7 7I7 8I8 7I8 8I9 7I9 8I10 7I10 8I11 7I11 8W4 7W4 8W5 7W5 8W6 7W6 8W7 7W7 "
        "8W8 7W8 8W9 7W9 8W10 7W10 8W11 7W11",
    ],
}


@pytest.mark.parametrize("p,m", sorted(ZBV_GENERATOR_ORDERS))
def test_zb_v_below_2p_minus_1_is_the_authors_generator(p, m):
  s = zb_v(p, m).validate()
  assert [" ".join(map(str, ops)) for ops in s.ranks] == ZBV_GENERATOR_ORDERS[(p, m)]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_from_p_to_3p_microbatches(p):
  """The authors' generator idles 2p - 1 - m in the steady state below m = 2p - 1 (the lower
  bound) and p - 1 in a single step; from 2p - 1 on both views match the handcrafted order's
  (0 and p - 1). Torch's rule, the 2p - 1 order less its extra micro-batches, idles twice the
  bound. Both hold at most 2p stage activations."""
  for m in range(p, 3 * p + 1):
    s = zb_v(p, m).validate()
    single, steady, peak = measure(s)
    assert max(steady) == max(0, 2 * p - 1 - m), (m, steady)
    assert max(single) == p - 1, (m, single)
    assert max(peak) <= 2 * p, (m, peak)
    torch_rule = zb_v(p, m, fewer="drop").validate()
    _, torch_steady, torch_peak = measure(torch_rule)
    assert max(torch_steady) == 2 * max(0, 2 * p - 1 - m), (m, torch_steady)
    assert max(torch_peak) <= 2 * p
    assert (s.ranks == torch_rule.ranks) == (m >= 2 * p - 1)


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


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (zb_h1, dict(pp=4, microbatches=8, chunks=2), r"chunks=2 .*one chunk per rank.*zb-v"),
        (zb_h2, dict(pp=4, microbatches=8, chunks=3), r"chunks=3 .*one chunk per rank"),
        (zb_v, dict(pp=4, microbatches=8, chunks=1), r"chunks=1 .*two chunks per rank.*chunks=2"),
        (zb_v, dict(pp=4, microbatches=8, chunks=4), r"chunks=4"),
        (zb_h1, dict(pp=0, microbatches=8), r"pp=0 must be a positive integer"),
        (zb_h2, dict(pp=4, microbatches=0), r"microbatches=0 must be a positive integer"),
        (zb_v, dict(pp=4.0, microbatches=8), r"pp=4.0 must be a positive integer"),
        (zb_h1, dict(pp=True, microbatches=8), r"pp=True"),
        (zb_h2, dict(pp=4, microbatches=8, memory="2p"), r"zb-h2 takes no options.*memory"),
        (zb_v, dict(pp=4, microbatches=3, fewer="pad"), r"fewer='pad' is not one of"),
    ],
)
def test_bad_requests_say_what_and_how_to_fix(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(**kwargs)
