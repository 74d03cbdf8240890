"""Planned against measured ticks: one Perfetto file from a profile of the compiled train step.

  python -m jaxpipe.tick_trace --config configs/quickstart.py --config.mesh.pp=4 \
      --config.model.n_layers=8 --config.pipeline.schedule=zb-h1 --config.pipeline.microbatches=8 \
      --costs costs.json --out zb-h1.ticks.json      # open in ui.perfetto.dev

The planned ticks are the executor's tables priced with the cost file (`costs.predict`: each
tick as long as its slowest rank plus its ppermutes on parallel devices; on CPU host devices
sharing cores, the mean of its ranks' CPU seconds over the cores). The measured ones come from a
`jax.profiler` trace of one step after warm-up: every event that carries an `hlo_op` is matched,
through the compiled HLO's metadata, to its `op_name`, so the executor's per-tick `lax.switch`
(a conditional whose branches hold ops named `tick/<branch>/...`) marks where each tick starts
on each device and the ops inside it name the branch that ran. A tick lasts from the start of
its switch to the start of the next; up to the end of the branch's last op is its work, the rest
of the tick (the slot writes, the ppermutes and waiting for the slowest rank) its slack.

Per rank the file holds a `planned` track (parts and their priced length), a `measured` track
(the branch and its duration on the rank's first data shard) and a `slack` track (measured time
outside the branch), and the JSON's `otherData` the per-tick table. On CPU host devices the
events come from the XLA CPU runtime's thunk executor. Where a device's trace shows kernels but
not the conditional itself (as GPU traces may), ticks are closed by the scan body's ppermutes
instead, each tick running each of them once; a trace without `hlo_op` stats cannot be read,
and the error says what it lacks.
"""
from __future__ import annotations

from jaxpipe import runtime

if __name__ == "__main__":
  runtime.use_host_devices()

import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpipe import config as config_lib  # noqa: E402
from jaxpipe.pipeline.costs import Prediction  # noqa: E402
from jaxpipe.pipeline.lower import BRANCHES, COL, Lowered  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\b([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TICK = re.compile(r"/tick/([\w+]+)(?:/|$)")


class TraceError(RuntimeError):
  """The profile cannot be read as ticks; the message says what the trace lacks."""


@dataclasses.dataclass(frozen=True)
class HloIndex:
  """What the trace's `hlo_op` names mean: op_name per instruction, the tick switches."""
  op_name: dict  # instruction name -> op_name metadata
  switches: frozenset  # conditionals whose branches hold the executor's tick/<branch> ops
  body: tuple  # op_name prefixes of the scan bodies that hold them (what a tick runs)
  permutes: frozenset  # the collective-permutes that end every tick (its ppermutes)

  @classmethod
  def parse(cls, hlo_text: str) -> HloIndex:
    op_name, comp_of, branches_of, ticks_in, opcode = {}, {}, {}, {}, {}
    comp = None
    for line in hlo_text.splitlines():
      if (m := _COMP.match(line)) and "=" not in line.split("(")[0]:
        comp = m[1]
        continue
      m = _INSTR.match(line)
      if not m:
        continue
      name = m[1]
      comp_of[name] = comp
      opcode[name] = m[2]
      if n := _OP_NAME.search(line):
        op_name[name] = n[1]
        if _TICK.search(n[1]):
          ticks_in[comp] = True
      if m[2] == "conditional" and (b := _BRANCHES.search(line)):
        branches_of[name] = [x.strip().lstrip("%") for x in b[1].split(",")]
    switches = frozenset(
        name for name, comps in branches_of.items()
        if not _TICK.search(op_name.get(name, "")) and any(ticks_in.get(c) for c in comps))
    body = tuple(sorted({op_name.get(n, "").rsplit("/", 1)[0] + "/" for n in switches}))
    permutes = frozenset(n for n, code in opcode.items()
                         if code in ("collective-permute", "collective-permute-start")
                         and op_name.get(n, "").startswith(body or ("\0",)))
    return cls(op_name, switches, body, permutes)

  def in_body(self, hlo_op: str) -> bool:
    return self.op_name.get(hlo_op, "").startswith(self.body)

  def branch(self, hlo_op: str) -> str | None:
    """The tick branch an instruction belongs to (e.g. 'F+I'), or None."""
    m = _TICK.search(self.op_name.get(hlo_op, ""))
    return m[1] if m else None


@dataclasses.dataclass(frozen=True)
class MeasuredTick:
  start_ns: float
  end_ns: float  # the next tick's start (the last: its last event's end)
  work_ns: float  # from the switch's start to the end of the branch's last op
  branch: str


def events_by_device(xspace_path: str) -> dict[int, list[tuple[str, float, float]]]:
  """device ordinal -> [(hlo_op, start_ns, duration_ns)] from a profiler .xplane.pb."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xspace_path)
  out: dict[int, list] = {}
  for plane in data.planes:
    gpu = re.search(r"/device:GPU:(\d+)", plane.name)
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        op = stats.get("hlo_op")
        dev = stats.get("device_ordinal", int(gpu[1]) if gpu else None)
        if op is None or dev is None:
          continue
        out.setdefault(int(dev), []).append((str(op), float(e.start_ns), float(e.duration_ns)))
  return out


def measured_ticks(events: list[tuple[str, float, float]], index: HloIndex) -> list[MeasuredTick]:
  """One device's ticks: each switch event opens a tick; the ops named tick/<branch> inside it
  name the branch and, up to the end of the last of them, are its work (the CPU runtime's
  conditional event ends when the branch is dispatched, not when it is done)."""
  events = sorted(events, key=lambda e: (e[1], -e[2]))
  opens = [i for i, e in enumerate(events) if e[0] in index.switches]
  ticks = []
  for k, i in enumerate(opens):
    start, dur = events[i][1], events[i][2]
    last = opens[k + 1] if k + 1 < len(opens) else len(events)
    stop = events[last][1] if last < len(events) else max(
        s + d for o, s, d in events[i:] if index.in_body(o))
    ticks.append(_tick(events[i + 1:last], index, start, stop, start + dur))
  return ticks


def permute_ticks(events: list[tuple[str, float, float]], index: HloIndex) -> list[MeasuredTick]:
  """One device's ticks where the switch leaves no event of its own (device traces that show
  kernels, not control flow): every tick ends with the body's ppermutes, one event each."""
  events = sorted(events, key=lambda e: (e[1], -e[2]))
  per_tick = len(index.permutes)
  ends = [i for i, e in enumerate(events) if e[0] in index.permutes][per_tick - 1::per_tick]
  ticks, first = [], next((i for i, e in enumerate(events) if index.in_body(e[0])), 0)
  for i in ends:
    start = events[first][1]
    stop = events[i][1] + events[i][2]
    ticks.append(_tick(events[first:i + 1], index, start, stop, start))
    first = i + 1
  return ticks


def _tick(inside, index: HloIndex, start: float, stop: float, work_end: float) -> MeasuredTick:
  named = [(index.branch(o), s + d) for o, s, d in inside if index.branch(o)]
  work_end = max([work_end] + [end for _, end in named])
  return MeasuredTick(start, stop, work_end - start, named[0][0] if named else "idle")


def rank_devices(mesh) -> list[int]:
  """[pp rank] -> the device id of its first data shard (every other mesh index 0)."""
  devs = np.asarray(mesh.devices)
  pp = list(mesh.axis_names).index("pp")
  first = [0] * devs.ndim
  out = []
  for r in range(devs.shape[pp]):
    first[pp] = r
    out.append(int(devs[tuple(first)].id))
  return out


def read_profile(xspace_path: str, hlo_text: str, mesh, num_ticks: int,
                 by: str = "switch") -> list[list[MeasuredTick]]:
  """[rank][tick] from a profile of exactly one step, ticks opened by the switch's events (or,
  `by="ppermute"` or where the trace has none, closed by the ppermutes'); TraceError says what
  the trace lacks."""
  index = HloIndex.parse(hlo_text)
  if not index.switches:
    raise TraceError("the compiled HLO has no conditional with tick/<branch> ops: is this the "
                     "pipeline executor's step (mesh.pp > 1)?")
  events = events_by_device(xspace_path)
  if not events:
    raise TraceError(f"{xspace_path} has no events with hlo_op and device stats; this backend's "
                     "trace does not name the HLO instructions it runs, so ticks cannot be "
                     "recovered from it")
  out = []
  for r, dev in enumerate(rank_devices(mesh)):
    mine = events.get(dev, [])
    has_switch = any(op in index.switches for op, _, _ in mine)
    if by == "switch" and has_switch:
      ticks = measured_ticks(mine, index)
    elif index.permutes:
      ticks = permute_ticks(mine, index)
    else:
      raise TraceError(f"device {dev} (pp rank {r}) shows no event of the tick switch "
                       f"{sorted(index.switches)} and the step has no ppermute to close ticks")
    if len(ticks) != num_ticks:
      seen = {op for op, _, _ in mine}
      raise TraceError(
          f"device {dev} (pp rank {r}) shows {len(ticks)} ticks "
          + (f"(runs of the switch {sorted(index.switches)})" if by == "switch" and has_switch
             else f"(every {len(index.permutes)} of the ppermutes {sorted(index.permutes)})")
          + f", the tables have {num_ticks}; the trace names {len(seen)} HLO instructions on it")
    out.append(ticks)
  return out


def branch_of_table(lowered: Lowered) -> list[list[str]]:
  """[rank][tick] the branch each rank's row names."""
  codes = lowered.table[..., COL["branch"]]
  return [[BRANCHES[int(codes[t, r])] for t in range(lowered.num_ticks)]
          for r in range(lowered.schedule.num_ranks)]


def tick_table(lowered: Lowered, prediction: Prediction,
               measured: list[list[MeasuredTick]]) -> list[dict]:
  """Per tick: planned and measured seconds (slowest rank) and each rank's measured slack."""
  rows = []
  for t in range(lowered.num_ticks):
    per_rank = [m[t] for m in measured]
    rows.append({
        "tick": t, "planned_s": prediction.planned_tick_s[t],
        "measured_s": max((m.end_ns - m.start_ns) for m in per_rank) * 1e-9,
        "planned_work_s": list(prediction.rank_tick_s[t]),
        "measured_work_s": [m.work_ns * 1e-9 for m in per_rank],
        "measured_slack_s": [(m.end_ns - m.start_ns - m.work_ns) * 1e-9 for m in per_rank],
        "branch": [m.branch for m in per_rank]})
  return rows


def to_perfetto(lowered: Lowered, prediction: Prediction, measured: list[list[MeasuredTick]],
                extra: dict | None = None) -> str:
  """Chrome trace JSON: per rank a planned, a measured and a slack track, one time axis in us;
  `extra` joins the per-tick table in otherData."""
  p = lowered.schedule.num_ranks
  events = []
  tracks = ("planned", "measured", "measured slack (outside the branch)")
  for r in range(p):
    events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
    for tid, name in enumerate(tracks):
      events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                     "args": {"name": name}})
  t0 = min(m[0].start_ns for m in measured)
  plan_at = 0.0
  planned_branch = branch_of_table(lowered)
  for t in range(lowered.num_ticks):
    length = prediction.planned_tick_s[t]
    for r in range(p):
      parts = ";".join(str(a) for a in lowered.ticks[t][r]) or "idle"
      events.append({"name": f"{t}: {parts}", "cat": planned_branch[r][t], "ph": "X", "pid": r,
                     "tid": 0, "ts": plan_at * 1e6, "dur": length * 1e6,
                     "args": {"tick": t, "parts": parts, "model": prediction.model,
                              "lockstep_work_ms": 1e3 * prediction.rank_tick_s[t][r]}})
      m = measured[r][t]
      start, work_end, end = ((m.start_ns - t0) / 1e3, (m.start_ns + m.work_ns - t0) / 1e3,
                              (m.end_ns - t0) / 1e3)
      events.append({"name": f"{t}: {m.branch}", "cat": m.branch, "ph": "X", "pid": r, "tid": 1,
                     "ts": start, "dur": end - start,
                     "args": {"tick": t, "branch": m.branch, "planned_parts": parts,
                              "work_ms": (work_end - start) / 1e3,
                              "planned_ms": 1e3 * length}})
      if end > work_end:
        events.append({"name": f"{t}: slack", "cat": "slack", "ph": "X", "pid": r, "tid": 2,
                       "ts": work_end, "dur": end - work_end,
                       "args": {"tick": t, "slack_ms": (end - work_end) / 1e3}})
    plan_at += length
  meta = {"schedule": lowered.schedule.name, "ticks": lowered.num_ticks,
          "model": prediction.model, "planned_s": plan_at,
          "measured_s": max(m[-1].end_ns for m in measured) * 1e-9 - t0 * 1e-9,
          "per_tick": tick_table(lowered, prediction, measured), **(extra or {})}
  return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta})


def profile_step(trainer, directory: str) -> tuple[str, str]:
  """Compiles, warms up and profiles one train step; -> (the .xplane.pb path, the HLO text)."""
  compiled = trainer.compile()
  for _ in range(2):
    jax.block_until_ready(trainer.step())
  batch = trainer.batch(int(trainer.state.step))
  with jax.profiler.trace(directory):
    jax.block_until_ready(trainer.step(batch))
  found = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
  if not found:
    raise TraceError(f"jax.profiler.trace wrote no .xplane.pb under {directory}")
  return found[-1], compiled.as_text()


def main(argv: list[str]) -> None:
  from absl import flags

  from jaxpipe.measure import measure
  from jaxpipe.pipeline import costs as costs_lib
  from jaxpipe.pipeline.api import lowered_for
  from jaxpipe.pipeline.lm import lm_schedule
  from jaxpipe.trainer import Trainer
  f = flags.FLAGS
  config = config_lib.runner_config(argv)
  try:
    trainer = Trainer(config)
    config = trainer.config
    if trainer.mesh_shape["pp"] == 1:
      raise config_lib.ConfigError("there are no ticks without a pipeline: set "
                                   "--config.mesh.pp to 2 or more")
    schedule = lm_schedule(config.pipeline, trainer.mesh_shape["pp"])
    lowered = lowered_for(schedule)
    key = (schedule.num_microbatches, schedule.num_stages)
    costs = (costs_lib.load(f.costs) if f.costs else
             costs_lib.parse(measure(config, [key], log=print), "<measured>"))
    prediction = costs.predict(lowered)
    with tempfile.TemporaryDirectory() as tmp:
      xspace, hlo = profile_step(trainer, tmp)
      measured = read_profile(xspace, hlo, trainer.mesh, lowered.num_ticks)
      # the same ticks closed by their ppermutes instead, as traces without the switch are read
      by_permute = read_profile(xspace, hlo, trainer.mesh, lowered.num_ticks, by="ppermute")
  except (config_lib.ConfigError, costs_lib.CostFileError, TraceError) as e:
    sys.exit(f"error: {e}")
  text = to_perfetto(lowered, prediction, measured, {
      "branches_by_ppermute": [[t.branch for t in ticks] for ticks in by_permute]})
  with open(f.out, "w") as out:
    out.write(text)
  meta = json.loads(text)["otherData"]
  wrong = sum(m.branch != b for ticks, row in zip(measured, branch_of_table(lowered))
              for m, b in zip(ticks, row))
  print(f"{schedule.name}: {lowered.num_ticks} ticks, planned {1e3 * meta['planned_s']:.2f} ms, "
        f"measured {1e3 * meta['measured_s']:.2f} ms in the traced step; branches that differ "
        f"from the tables: {wrong}; wrote {f.out}")


if __name__ == "__main__":
  from absl import app, flags
  config_lib.define_runner_flags()
  flags.DEFINE_string("costs", "", "Cost file (python -m jaxpipe.measure); empty: measure now.")
  flags.DEFINE_string("out", "ticks.perfetto.json", "Perfetto file to write.")
  app.run(main)
