"""Lowering: tables interpreted symbolically move every value where the schedule needs it.
No JAX."""

import pytest

from jaxpipe.pipeline import Action, Overlap, Placement, Schedule, make_schedule
from jaxpipe.pipeline.ir.lower import BRANCHES, COL, VARIANTS, LowerOptions, lower

NAMES = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "chimera",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "dualpipe",
    "dualpipev",
)
COST = {"F": 1, "I": 1, "W": 1, "B": 2}


def build(name, p, m):
  return make_schedule(name, pp=p, microbatches=m, chunks=2 if name == "interleaved-1f1b" else None)


def interpret(lowered):
  """Runs the tables on symbolic tokens; asserts every read finds the value the math needs.

  Returns (actions run, {buffer: peak values held per rank}, lock-step time from the table).
  """
  sched = lowered.schedule
  pl, p, table = sched.placement, sched.num_ranks, lowered.table
  act, res, cot, wg = ([{} for _ in range(p)] for _ in range(4))
  ran, time = [], 0
  peak = {"act": [0] * p, "res": [0] * p, "cot": [0] * p, "wg": [0] * p}
  for t in range(table.shape[0]):
    writes, sent = [], {}  # writes happen after every read of the tick
    tick_cost = 0
    for r in range(p):
      row = table[t, r]
      parts = [] if row[COL["branch"]] == 0 else BRANCHES[row[COL["branch"]]].split("+")
      tick_cost = max(tick_cost, sum(COST[k] for k in parts))
      sent[r] = {}
      for kind in parts:
        pre = {"F": "f", "I": "b", "B": "b", "W": "w"}[kind]
        mb, chunk = row[COL[f"{pre}_mb"]], row[COL[f"{pre}_chunk"]]
        stage = pl.rank_stages(r)[chunk]
        route = sched.route(mb)
        i = route.index(stage)
        ran.append(Action(kind, stage, mb))
        if kind == "F":
          assert row[COL["f_first"]] == (i == 0)
          if i > 0:
            assert act[r].pop(row[COL["f_in"]]) == ("y", route[i - 1], mb), (t, r, kind)
          writes.append((res[r], row[COL["f_res"]], ("res", stage, mb)))
          assert row[COL["f_last"]] == (i + 1 == len(route))
          if i + 1 == len(route):
            writes.append((cot[r], row[COL["f_cot"]], ("dy", stage, mb)))
          sent[r]["act"] = ("y", stage, mb) if i + 1 < len(route) else None
          if row[COL["f_local"]] >= 0:
            writes.append((act[r], row[COL["f_local"]], ("y", stage, mb)))
        else:
          assert res[r][row[COL[f"{pre}_res"]]] == ("res", stage, mb), (t, r, kind)
          if kind in ("B", "I"):
            assert cot[r].pop(row[COL["b_cot"]]) == ("dy", stage, mb), (t, r, kind)
          if kind == "I":  # what W needs from I waits in a wg slot
            writes.append((wg[r], row[COL["b_wg"]], ("g", stage, mb)))
          if kind == "B":
            assert row[COL["b_wg"]] == -1
          if kind == "W":
            assert wg[r].pop(row[COL["w_wg"]]) == ("g", stage, mb), (t, r, kind)
          if kind in ("B", "W"):
            assert row[COL["g_chunk"]] == chunk
            res[r].pop(row[COL[f"{pre}_res"]])
          if kind in ("B", "I"):
            assert row[COL["b_first"]] == (i == 0)
            sent[r]["grad"] = ("dy", route[i - 1], mb) if i > 0 else None
            if row[COL["b_local"]] >= 0:
              writes.append((cot[r], row[COL["b_local"]], ("dy", route[i - 1], mb)))
    for r in range(p):
      for ch, src in (("down", (r - 1) % p), ("up", (r + 1) % p)):
        for kind, buf in (("act", act[r]), ("grad", cot[r])):
          slot = table[t, r, COL[f"recv_{kind}_{ch}"]]
          if slot >= 0:
            token = sent[src].get(kind)
            assert token is not None, (t, r, kind, ch)
            writes.append((buf, slot, token))
    for buf, slot, token in writes:
      assert slot >= 0 and slot not in buf, ("slot taken", t, slot, token)
      buf[slot] = token
    for name, bufs in (("act", act), ("res", res), ("cot", cot), ("wg", wg)):
      for r in range(p):
        peak[name][r] = max(peak[name][r], len(bufs[r]))
    time += tick_cost
  assert all(not b for bufs in (act, res, cot, wg) for b in bufs), "values left in slots"
  return ran, peak, time


def expected_actions(sched):
  """Every (stage, micro-batch) forward, and its backward as B or as I and W."""
  out = set()
  for _, _, a in sched.actions():
    out.add(a)
  return out


def normalise(actions):
  """A B counts as its I and W, so splitting a backward does not change the work."""
  out = []
  for a in actions:
    out += (
        [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
        if a.kind == "B"
        else [a]
    )
  return sorted(out)


CASES = (
    [(n, p, m) for n in NAMES for p in (2, 4) for m in (p, 2 * p, 3 * p)]
    + [(n, 8, 32) for n in NAMES]
    + [("zb-v", 3, 6), ("1f1b", 3, 5), ("gpipe", 1, 3)]
)


@pytest.mark.parametrize("name,p,m", CASES)
def test_tables_move_every_value_where_it_is_needed(name, p, m):
  try:
    sched = build(name, p, m)
  except ValueError as e:
    if m == p:  # DualPipe-style schedules need m >= 2p
      pytest.skip(f"{name} forbids m={m} at p={p}: {e}")
    raise
  for opts in VARIANTS:
    lowered = lower(sched, variants=[opts])
    ran, peak, time = interpret(lowered)
    assert normalise(ran) == normalise(expected_actions(sched))
    for buf in ("act", "res", "cot", "wg"):  # slots are exactly the peak in flight
      assert getattr(lowered, f"{buf}_slots") == max(peak[buf]), buf
    assert time == lowered.lockstep_time
    # memory follows the schedule: no more residuals than its own order holds
    assert lowered.res_slots <= max(sched.simulate().peak_activations)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p,m", [(4, 8), (8, 32)])
def test_lockstep_time_within_5_percent_of_async_makespan(name, p, m):
  sched = build(name, p, m)
  lowered = lower(sched)
  async_makespan = sched.simulate(costs={"F": 1, "I": 1, "W": 1, "B": 2}).makespan
  _, _, time = interpret(lowered)
  assert time <= 1.05 * async_makespan, lowered.summary()


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_published_activation_memory(p, m):
  # GPipe holds all m micro-batches, 1F1B p (Megatron's warm-up), ZB-H2 at most 2p-1,
  # DualPipe p+1 (DualPipe README).
  assert lower(build("gpipe", p, m)).res_slots == m
  assert lower(build("1f1b", p, m)).res_slots == p
  assert lower(build("zb-h2", p, m)).res_slots <= 2 * p - 1
  assert lower(build("dualpipe", p, m)).res_slots <= p + 1


def test_csv_cells_in_torch_notation_with_packed_parts_joined():
  # One rank, one stage: F0, F1, then F2 overlapped with B0, then B1, B2.
  sched = Schedule(
      "hand",
      Placement.interleaved(1),
      3,
      [
          [
              Action("F", 0, 0),
              Action("F", 0, 1),
              Overlap(Action("F", 0, 2), Action("B", 0, 0)),
              Action("B", 0, 1),
              Action("B", 0, 2),
          ]
      ],
  ).validate()
  lowered = lower(sched, variants=[LowerOptions(split="none")])
  assert lowered.to_csv() == "0F0,0F1,0F2;0B0,0B1,0B2\n"


def test_csv_two_ranks_with_idle_cells():
  # GPipe by hand, p = 2, m = 2, full backwards: the long B ticks leave rank 0 idle.
  ranks = [
      [Action("F", r, 0), Action("F", r, 1), Action("B", r, 0), Action("B", r, 1)] for r in range(2)
  ]
  sched = Schedule("hand", Placement.interleaved(2), 2, ranks).validate()
  lowered = lower(sched, variants=[LowerOptions(split="none", pack=False)])
  assert lowered.to_csv() == "0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0,1B1,\n"
  assert lowered.lockstep_time == 1 + 1 + 1 + 2 + 2 + 2


def test_split_backward_runs_input_gradient_first():
  ranks = [
      [Action("F", r, 0), Action("F", r, 1), Action("B", r, 0), Action("B", r, 1)] for r in range(2)
  ]
  sched = Schedule("hand", Placement.interleaved(2), 2, ranks).validate()
  lowered = lower(sched, variants=[LowerOptions(split="standalone", pack=False)])
  # Rank 0 waits for 1I0 only, not 1W0: 8 unit ticks instead of 9 time units.
  assert lowered.to_csv() == "0F0,0F1,,,0I0,0W0,0I1,0W1\n,1F0,1F1,1I0,1W0,1I1,1W1,\n"
  assert lowered.lockstep_time == 8


def test_non_adjacent_stages_are_refused():
  pl = Placement(4, (0, 2, 1, 3), (0, 1, 2, 3), ((0, 1, 2, 3),))
  ranks = [[Action("F", s, 0), Action("B", s, 0)] for s in (0, 2, 1, 3)]
  sched = Schedule("far", pl, 1, ranks).validate()
  with pytest.raises(ValueError, match="not neighbours"):
    lower(sched)


def test_cli_prints_the_tick_table(capsys):
  import re

  from jaxpipe import schedule
  from jaxpipe.runtime import cli

  assert (
      cli.call(
          schedule.main,
          schedule.FLAGS,
          ["zb-h1", "--pp", "4", "--microbatches", "8", "--format", "ticks"],
      )
      == 0
  )
  rows = capsys.readouterr().out.strip().splitlines()
  assert len(rows) == 4
  cells = [row.split(",") for row in rows]
  assert len({len(c) for c in cells}) == 1  # one column per tick on every rank
  ran = []
  for r, row in enumerate(cells):
    for cell in row:
      for part in filter(None, cell.split(";")):
        stage, kind, mb = re.fullmatch(r"(\d+)([FIWB])(\d+)", part).groups()
        assert int(stage) == r  # plain placement: stage r on rank r
        ran.append(Action(kind, int(stage), int(mb)))
  assert normalise(ran) == normalise(expected_actions(build("zb-h1", 4, 8)))
