"""Cost files, step times and memory priced from them, and auto's ranking (no JAX)."""

import json

import pytest

from jaxpipe import schedule as schedule_cli
from jaxpipe.pipeline import SCHEDULE_NAMES, make_schedule
from jaxpipe.pipeline.ir.lower import BRANCHES, COL, lower
from jaxpipe.planning import auto as auto_lib
from jaxpipe.planning import costs as costs_lib
from jaxpipe.runtime import cli

SECONDS = dict(
    F=1.0,
    B=5.0,
    I=2.0,
    W=3.0,
    **{"F&B": 7.0},
    ppermute=0.125,
    embed=0.25,
    head=0.5,
    tick=0.375,
    call=0.03125,
)
STEP = dict(
    update_s=0.0625,
    layer_state_bytes=100,
    shared_state_bytes=100,
    layer_grad_bytes=10,
    shared_grad_bytes=10,
)
BYTES = dict(activation=1000, residual=10000, wg=100000, work=0)


def cost_data(entries, step=STEP):
  """entries: [(microbatches, stages, seconds, bytes)]"""
  return {
      "format": costs_lib.FORMAT,
      "setup": {},
      "step": dict(step),
      "entries": [
          {"microbatches": m, "stages": s, "seconds": dict(sec), "bytes": dict(b)}
          for m, s, sec, b in entries
      ],
  }


def schedule_main(args):
  """`python -m jaxpipe.schedule ARGS`, run in this process: -> its exit status."""
  return cli.call(schedule_cli.main, schedule_cli.FLAGS, args)


def write(tmp_path, data, name="costs.json"):
  path = tmp_path / name
  path.write_text(json.dumps(data))
  return str(path)


def test_cost_file_with_missing_parts_is_refused_before_anything_runs(tmp_path, capsys):
  seconds = {k: v for k, v in SECONDS.items() if k not in ("F&B", "head")}
  path = write(tmp_path, cost_data([(8, 4, seconds, BYTES)]))
  with pytest.raises(costs_lib.CostFileError) as e:
    costs_lib.load(path)
  assert "lacks F&B, head" in str(e.value) and "python -m jaxpipe.measure" in str(e.value)
  assert schedule_main(["1f1b", "--pp", "4", "--microbatches", "8", "--costs", path]) == 2
  assert "lacks F&B, head" in capsys.readouterr().err
  step = {k: v for k, v in STEP.items() if k != "update_s"}
  with pytest.raises(costs_lib.CostFileError, match="step lacks update_s"):
    costs_lib.parse(cost_data([(8, 4, SECONDS, BYTES)], step))
  with pytest.raises(costs_lib.CostFileError, match="not a cost file"):
    costs_lib.parse({"entries": []})
  # an entry the file lacks is named with what it has and how to measure it
  costs = costs_lib.parse(cost_data([(8, 4, SECONDS, BYTES)]), "c.json")
  with pytest.raises(
      costs_lib.CostFileError,
      match=r"no costs for microbatches=16 over 8 model stages \(it has m=8/4 "
      r"stages\); measure them with .*--microbatches 16 --stages 8",
  ):
    costs.entry(16, 8)


def table_price(lowered, s):
  """Oracle read from the executor's table alone: each tick lasts as long as its slowest row,
  a row costs its branch's parts (F with a full B: F&B) plus embed on a first, head on a last
  forward."""
  total = busy = 0.0
  for t in range(lowered.num_ticks):
    rows = []
    for r in range(lowered.schedule.num_ranks):
      row = lowered.table[t, r]
      parts = BRANCHES[row[COL["branch"]]].split("+")
      cost = (
          0.0
          if parts == ["idle"]
          else (
              s["F&B"] + sum(s[k] for k in parts if k not in ("F", "B"))
              if {"F", "B"} <= set(parts)
              else sum(s[k] for k in parts)
          )
      )
      cost += s["embed"] * row[COL["f_first"]] + s["head"] * row[COL["f_last"]]
      rows.append(cost)
    total += max(rows)
    busy += sum(rows)
  return total, busy


@pytest.mark.parametrize(
    "name,p,m",
    [
        ("gpipe", 2, 1),
        ("1f1b", 4, 8),
        ("dualpipe", 2, 4),
        ("zb-v", 2, 4),
        ("interleaved-1f1b", 2, 4),
        ("chimera", 4, 8),
    ],
)
def test_predicted_step_prices_each_tick_of_the_table_by_its_slowest_rank(name, p, m):
  lowered = lower(make_schedule(name, pp=p, microbatches=m))
  stages = lowered.schedule.num_stages
  entry = costs_lib.parse(cost_data([(m, stages, SECONDS, BYTES)])).entry(m, stages)
  pred = costs_lib.predict(lowered, entry, STEP)
  ticks_s, busy = table_price(lowered, SECONDS)
  # the executor's ppermutes per tick: one per direction something arrives from when sends never
  # share a tick with a forward beside a backward (always so without F&B), else one per channel
  fb = any({"F", "B"} <= set(BRANCHES[c].split("+")) for c in lowered.branches)
  links = [[f"recv_{k}_{d}" for k in ("act", "grad")] for d in ("down", "up")]
  if fb:
    links = [[c] for group in links for c in group]
  sends = [
      sum(any(lowered.table[t, r, COL[c]] >= 0 for r in range(p) for c in cols) for cols in links)
      for t in range(lowered.num_ticks)
  ]
  assert sum(sends) >= lowered.schedule.num_microbatches  # some ticks send, and
  assert 0 in sends  # some do not (the last backward)
  copies = 2 if name in ("chimera", "dualpipe") else 1
  update = STEP["update_s"] * (100 + 100 * copies) / 200
  assert pred.ticks_s == pytest.approx(ticks_s, rel=1e-12)
  # an idle tick runs no ppermute, each the tick runs adds its own
  overhead = lowered.num_ticks * SECONDS["tick"] + sum(sends) * SECONDS["ppermute"]
  assert pred.overhead_s == pytest.approx(overhead)
  assert pred.step_s == pytest.approx(ticks_s + overhead + SECONDS["call"] + update, rel=1e-12)
  assert pred.bubble == pytest.approx(1 - busy / (p * ticks_s), rel=1e-12)


def test_gpipe_two_ranks_one_microbatch_by_hand():
  # 0F0 (embed) | 1F0 (head) | 1I0 | 0I0 beside 1W0 | 0W0; ppermutes after 0F0 and 1I0 only
  lowered = lower(make_schedule("gpipe", pp=2, microbatches=1))
  work = dict(BYTES, work=12345)
  pred = costs_lib.predict(
      lowered,
      costs_lib.parse(cost_data([(1, 2, SECONDS, work)])).entry(1, 2),
      dict(STEP, layer_state_bytes=0, shared_state_bytes=0),
  )
  assert [[str(a) for a in t[r]] for t in lowered.ticks for r in range(2)] == [
      ["0F0"],
      [],
      [],
      ["1F0"],
      [],
      ["1I0"],
      ["0I0"],
      ["1W0"],
      ["0W0"],
      [],
  ]
  assert pred.ticks_s == 1.25 + 1.5 + 2 + 3 + 3
  assert pred.step_s == 10.75 + 5 * 0.375 + 2 * 0.125 + 0.03125 + 0.0625
  # one slot of each buffer (activation and cotangent: activation bytes) and the work bytes
  assert pred.buffer_bytes == 2 * 1000 + 10000 + 100000 + 12345


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_predicted_memory_holds_the_published_peak_activations(name):
  # residual bytes only: the buffers hold exactly the peak in-flight micro-batch-stages
  # (anchors.md: 1F1B p, GPipe m, ZB-H2 2p-1, ...), as the event simulator counts them
  schedule = make_schedule(name, pp=4, microbatches=8)
  s = schedule.num_stages
  only_res = dict(activation=0, residual=1 << 20, wg=0, work=0)
  pred = costs_lib.predict(
      lower(schedule), costs_lib.parse(cost_data([(8, s, SECONDS, only_res)])).entry(8, s), STEP
  )
  copies = schedule.placement.copies
  peak = max(schedule.simulate().peak_activations)
  assert pred.buffer_bytes == peak << 20
  assert pred.memory_bytes == (peak << 20) + 100 + 100 * copies + 10 + 10 * copies


def uniform_costs(m=8, ppermute=0.0, only_res=False):
  """F = I = W = 1 per whole-rank stage (half for the 8-stage placements), B = I + W."""
  entries = []
  for stages, scale in ((4, 1.0), (8, 0.5)):
    sec = {k: scale * v for k, v in dict(F=1, B=2, I=1, W=1, **{"F&B": 3}).items()}
    sec.update(ppermute=ppermute, embed=0.0, head=0.0, tick=ppermute, call=0.0)
    b = dict(activation=0, residual=1 << 30, wg=0, work=0) if only_res else BYTES
    entries.append((m, stages, sec, b))
  step = dict(
      STEP,
      update_s=0.0,
      layer_state_bytes=0,
      shared_state_bytes=0,
      layer_grad_bytes=0,
      shared_grad_bytes=0,
  )
  return costs_lib.parse(cost_data(entries, step), "uniform.json")


def test_auto_respects_a_memory_limit_and_reports_what_it_ruled_out():
  costs = uniform_costs(only_res=True)
  peak = {
      n: max(make_schedule(n, pp=4, microbatches=8).simulate().peak_activations)
      for n in SCHEDULE_NAMES
  }
  ranking = auto_lib.rank(4, [8], costs, memory_limit=4.5 * auto_lib.GB, layers=8)
  over = {c.name for c in ranking.candidates if c.dropped.startswith("over")}
  assert over == {n for n, k in peak.items() if k > 4.5} and "gpipe" in over
  assert all(peak[c.name] <= 4 for c in ranking.ranked)
  report = ranking.report()
  assert "over the memory limit: needs 8 GB > 4.5 GB" in report  # GPipe holds m = 8
  assert f"{len(over)} ruled out by memory" in report


def test_a_memory_limit_nothing_fits_names_the_smallest_need():
  costs = uniform_costs(only_res=True)
  least = min(
      max(make_schedule(n, pp=4, microbatches=8).simulate().peak_activations)
      for n in SCHEDULE_NAMES
  )
  with pytest.raises(
      auto_lib.AutoError,
      match=rf"rules out every schedule; the smallest need is "
      rf"{least:g} GB \(.*m=8\); raise the limit",
  ):
    auto_lib.rank(4, [8], costs, memory_limit=1.0 * auto_lib.GB, layers=8)


def test_auto_trades_interleaving_bubble_against_twice_the_ticks():
  # anchors.md: VPP's bubble is 1/v of 1F1B's, but it runs twice the ticks. Free ticks: the
  # interleaved schedule wins; a tick's overhead as long as a forward: 1F1B does.
  names = ("1f1b", "interleaved-1f1b")
  free = auto_lib.rank(4, [8], uniform_costs(ppermute=0.0), layers=8, names=names)
  assert free.best.name == "interleaved-1f1b" and free.best.chunks == 2
  assert free.best.lowered.num_ticks > 1.7 * free.ranked[1].lowered.num_ticks
  costly = auto_lib.rank(4, [8], uniform_costs(ppermute=1.0), layers=8, names=names)
  assert costly.best.name == "1f1b"
  assert "less in per-tick overhead" in costly.reason()


def test_schedule_cli_auto_prints_the_ranking_and_its_errors(tmp_path, capsys):
  path = write(tmp_path, cost_data([(8, 4, SECONDS, BYTES)]))
  assert (
      schedule_main(
          [
              "auto",
              "--pp",
              "4",
              "--microbatches",
              "8",
              "--costs",
              path,
              "--schedules",
              "1f1b,zb-h1,zb-v",
          ]
      )
      == 0
  )
  out = capsys.readouterr().out
  assert "auto chose" in out and "no measured costs for m=8 over 8 stages" in out
  assert (
      schedule_main(
          ["auto", "--pp", "4", "--microbatches", "8", "--costs", path, "--memory_limit", "1e-9"]
      )
      == 2
  )
  assert "the smallest need is" in capsys.readouterr().err
  assert schedule_main(["auto", "--pp", "4", "--microbatches", "8"]) == 2
  assert "auto needs --pp, --microbatches and --costs FILE" in capsys.readouterr().err
