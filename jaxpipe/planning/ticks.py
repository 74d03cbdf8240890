"""Planned against measured ticks: a profile of the compiled train step cut into the executor's
ticks, beside the ticks the cost file predicts, as one Perfetto trace
(`python -m jaxpipe.tick_trace`).

The planned ticks are the executor's tables priced with the cost file (`costs.predict`: each
tick as long as its slowest rank plus its ppermutes on parallel devices; on CPU host devices
sharing cores, the mean of its ranks' CPU seconds over the cores). The measured ones come from a
`jax.profiler` trace of one step after warm-up: every event that carries an `hlo_op` is matched,
through the compiled HLO's metadata, to its `op_name`. The executor runs each part of a tick,
and each ppermute, as a while loop of 0 or 1 trips under the name `tick/<part>` (`tick/F`,
`tick/I`, `tick/B`, `tick/W`, `tick/send_<direction>`), every tick and in the same order: the
k-th run of those loops on a device is its tick k, which starts with the first of them and ends
where tick k+1 starts. A part ran where ops of its loop's body ran after the loop started,
within the tick; the parts that ran name the tick's branch (`F+I`, `W`, `idle`, ...), and from
each one's loop start to the end of its body's last op (the CPU runtime may close a loop's own
event when it has dispatched the body) is the tick's work; the rest of the tick (the ppermutes
and waiting for the other devices at them, the slot moves) is its slack.

Per rank the file holds a `planned` track (parts and their priced length), a `measured` track
(the branch and its duration on the rank's first data shard) and a `slack` track (measured time
outside the parts), and the JSON's `otherData` the per-tick table. On CPU host devices the
events come from the XLA CPU runtime's thunk executor, which records each while loop as one
event. A device trace that shows kernels but not the loops themselves (as GPU traces may)
cannot be cut into ticks this way, and the error says so; so does a trace without `hlo_op`
stats.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import jax
import numpy as np

from jaxpipe.pipeline.executor import PARTS
from jaxpipe.pipeline.ir.lower import BRANCHES, COL, Lowered
from jaxpipe.planning.costs import Prediction

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\b([\w\-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LOOP = re.compile(r"/tick/(\w+)/while$")  # a part's (or a ppermute's) 0/1-trip loop


class TraceError(RuntimeError):
  """The profile cannot be read as ticks; the message says what the trace lacks."""


@dataclasses.dataclass(frozen=True)
class HloIndex:
  """What the trace's `hlo_op` names mean: op_name per instruction, the ticks' gated loops."""

  op_name: dict  # instruction name -> op_name metadata
  loops: dict  # while instruction -> what it runs: a part (F, I, B, W) or send_<direction>

  @classmethod
  def parse(cls, hlo_text: str) -> HloIndex:
    """Indexes a compiled program's HLO text.

    Args:
      hlo_text: the compiled step's HLO (`compiled.as_text()`).

    Returns:
      The `HloIndex`: op_name of every instruction that has one, and the while loops named
      `tick/<part>/while` with what each runs.
    """
    op_name, loops = {}, {}
    for line in hlo_text.splitlines():
      m = _INSTR.match(line)
      if not m or not (n := _OP_NAME.search(line)):
        continue
      op_name[m[1]] = n[1]
      if m[2] == "while" and (k := _LOOP.search(n[1])):
        loops[m[1]] = k[1]
    return cls(op_name, loops)

  def body_of(self, hlo_op: str) -> str | None:
    """The tick part whose loop body runs this instruction, or None.

    Args:
      hlo_op: an instruction's name, as a trace event's `hlo_op` stat gives it.

    Returns:
      The part (one of PARTS), or None for an instruction outside the parts' loop bodies.
    """
    name = self.op_name.get(hlo_op, "")
    for kind in PARTS:
      if f"/tick/{kind}/while/body/" in name:
        return kind
    return None


@dataclasses.dataclass(frozen=True)
class MeasuredTick:
  start_ns: float
  end_ns: float  # the next tick's start (the last: its last loop's end)
  work_ns: float  # the loops of the parts that ran
  branch: str


def events_by_device(xspace_path: str) -> dict[int, list[tuple[str, float, float]]]:
  """device ordinal -> [(hlo_op, start_ns, duration_ns)] from a profiler .xplane.pb.

  Events without an `hlo_op` stat, or without a device (a `device_ordinal` stat or a GPU
  plane), are left out.

  Args:
    xspace_path: the .xplane.pb file `jax.profiler.trace` wrote.

  Returns:
    Each device's events, in the file's order.
  """
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


def branch_name(parts: set[str]) -> str:
  """The BRANCHES entry running exactly `parts` ('idle' for none).

  Args:
    parts: the parts that ran, e.g. {'F', 'I'}.

  Returns:
    The branch's name, e.g. 'F+I'.
  """
  return next(b for b in BRANCHES if set(b.split("+")) - {"idle"} == parts)


def measured_ticks(
    events: list[tuple[str, float, float]], index: HloIndex, num_ticks: int
) -> list[MeasuredTick]:
  """One device's ticks: the k-th run of every tick loop is tick k (see the module docstring).

  Args:
    events: the device's (hlo_op, start_ns, duration_ns) events (`events_by_device`).
    index: the compiled step's `HloIndex`.
    num_ticks: ticks in the executor's tables.

  Returns:
    [num_ticks] the device's `MeasuredTick`s.

  Raises:
    TraceError: a tick loop ran other than once per tick (not a profile of exactly one step).
  """
  events = sorted(events, key=lambda e: (e[1], -e[2]))
  runs = {}  # loop -> its events, in order
  for e in events:
    if e[0] in index.loops:
      runs.setdefault(e[0], []).append(e)
  wrong = {op: len(r) for op, r in runs.items() if len(r) != num_ticks}
  if wrong:
    raise TraceError(
        f"tick loops ran {wrong} times, not once per tick of the {num_ticks} in the "
        "tables: is the profile of exactly one step?"
    )
  body = [(index.body_of(op), s, s + d) for op, s, d in events if index.body_of(op)]
  starts = [min(r[k][1] for r in runs.values()) for k in range(num_ticks)]
  last_end = max([s + d for r in runs.values() for _, s, d in r] + [e for _, _, e in body])
  ticks = []
  for k in range(num_ticks):
    end = starts[k + 1] if k + 1 < num_ticks else last_end
    ran, work = set(), 0.0
    for op, r in runs.items():
      kind, (_, s, d) = index.loops[op], r[k]
      # the runtime may end a loop's event once its body is dispatched: its work lasts until
      # the body's last op inside this tick ends
      ends = [e for b, t, e in body if b == kind and s <= t < end]
      if kind in PARTS and ends:
        ran.add(kind)
        work += max([s + d] + ends) - s
    ticks.append(MeasuredTick(starts[k], end, work, branch_name(ran)))
  return ticks


def rank_devices(mesh) -> list[int]:
  """[pp rank] -> the device id of its first data shard (every other mesh index 0).

  Args:
    mesh: the train step's mesh, with a 'pp' axis.

  Returns:
    One device id per pipeline rank.
  """
  devs = np.asarray(mesh.devices)
  pp = list(mesh.axis_names).index("pp")
  first = [0] * devs.ndim
  out = []
  for r in range(devs.shape[pp]):
    first[pp] = r
    out.append(int(devs[tuple(first)].id))
  return out


def read_profile(xspace_path: str, hlo_text: str, mesh, num_ticks: int) -> list[list[MeasuredTick]]:
  """[rank][tick] from a profile of exactly one step.

  Args:
    xspace_path: the .xplane.pb file of the profile.
    hlo_text: the compiled step's HLO text.
    mesh: the step's mesh; each pipeline rank is read on its first data shard.
    num_ticks: ticks in the executor's tables.

  Returns:
    [pp rank][num_ticks] `MeasuredTick`s.

  Raises:
    TraceError: says what the trace lacks: tick loops in the HLO (not the pipeline executor's
      step), events that name HLO instructions, events of the loops themselves on a rank's
      device, or one run of each loop per tick.
  """
  index = HloIndex.parse(hlo_text)
  if not any(kind in PARTS for kind in index.loops.values()):
    raise TraceError(
        "the compiled HLO has no tick/<part> loops: is this the pipeline "
        "executor's step (mesh.pp > 1)?"
    )
  events = events_by_device(xspace_path)
  if not events:
    raise TraceError(
        f"{xspace_path} has no events with hlo_op and device stats; this backend's "
        "trace does not name the HLO instructions it runs, so ticks cannot be "
        "recovered from it"
    )
  out = []
  for r, dev in enumerate(rank_devices(mesh)):
    mine = events.get(dev, [])
    if not any(op in index.loops for op, _, _ in mine):
      named = sum(index.body_of(op) is not None for op, _, _ in mine)
      raise TraceError(
          f"device {dev} (pp rank {r}) shows no event of the tick loops "
          f"{sorted(set(index.loops.values()))} (while instructions "
          f"{sorted(index.loops)[:4]}...), only {named} events of ops inside them: this "
          "backend's trace records kernels, not the loops, so ticks cannot be delimited"
      )
    out.append(measured_ticks(mine, index, num_ticks))
  return out


def branch_of_table(lowered: Lowered) -> list[list[str]]:
  """[rank][tick] the branch each rank's row names.

  Args:
    lowered: the executor's tables.

  Returns:
    [num_ranks][num_ticks] branch names (BRANCHES).
  """
  codes = lowered.table[..., COL["branch"]]
  return [
      [BRANCHES[int(codes[t, r])] for t in range(lowered.num_ticks)]
      for r in range(lowered.schedule.num_ranks)
  ]


def tick_table(
    lowered: Lowered, prediction: Prediction, measured: list[list[MeasuredTick]]
) -> list[dict]:
  """Per tick: planned and measured seconds (slowest rank) and each rank's measured slack.

  Args:
    lowered: the executor's tables.
    prediction: the cost file's prediction for them.
    measured: [rank][tick] measured ticks (`read_profile`).

  Returns:
    One dict per tick: tick, planned_s, measured_s, planned_work_s and measured_work_s (per
    rank), measured_slack_s (per rank) and branch (per rank, measured).
  """
  rows = []
  for t in range(lowered.num_ticks):
    per_rank = [m[t] for m in measured]
    rows.append(
        {
            "tick": t,
            "planned_s": prediction.planned_tick_s[t],
            "measured_s": max((m.end_ns - m.start_ns) for m in per_rank) * 1e-9,
            "planned_work_s": list(prediction.rank_tick_s[t]),
            "measured_work_s": [m.work_ns * 1e-9 for m in per_rank],
            "measured_slack_s": [(m.end_ns - m.start_ns - m.work_ns) * 1e-9 for m in per_rank],
            "branch": [m.branch for m in per_rank],
        }
    )
  return rows


def perfetto_trace(
    lowered: Lowered, prediction: Prediction, measured: list[list[MeasuredTick]]
) -> dict:
  """A Chrome trace (json.dump it): per rank a planned, a measured and a slack track.

  One time axis in us; otherData holds the totals and the per-tick table (`tick_table`).

  Args:
    lowered: the executor's tables.
    prediction: the cost file's prediction for them (the planned track).
    measured: [rank][tick] measured ticks (`read_profile`).

  Returns:
    The trace as a JSON object: traceEvents, displayTimeUnit and otherData.
  """
  p = lowered.schedule.num_ranks
  events = []
  tracks = ("planned", "measured", "measured slack (outside the parts)")
  for r in range(p):
    events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
    for tid, name in enumerate(tracks):
      events.append(
          {"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": name}}
      )
  t0 = min(m[0].start_ns for m in measured)
  plan_at = 0.0
  planned_branch = branch_of_table(lowered)
  for t in range(lowered.num_ticks):
    length = prediction.planned_tick_s[t]
    for r in range(p):
      parts = ";".join(str(a) for a in lowered.ticks[t][r]) or "idle"
      events.append(
          {
              "name": f"{t}: {parts}",
              "cat": planned_branch[r][t],
              "ph": "X",
              "pid": r,
              "tid": 0,
              "ts": plan_at * 1e6,
              "dur": length * 1e6,
              "args": {
                  "tick": t,
                  "parts": parts,
                  "model": prediction.model,
                  "lockstep_work_ms": 1e3 * prediction.rank_tick_s[t][r],
              },
          }
      )
      m = measured[r][t]
      start, work_end, end = (
          (m.start_ns - t0) / 1e3,
          (m.start_ns + m.work_ns - t0) / 1e3,
          (m.end_ns - t0) / 1e3,
      )
      events.append(
          {
              "name": f"{t}: {m.branch}",
              "cat": m.branch,
              "ph": "X",
              "pid": r,
              "tid": 1,
              "ts": start,
              "dur": end - start,
              "args": {
                  "tick": t,
                  "branch": m.branch,
                  "planned_parts": parts,
                  "work_ms": (work_end - start) / 1e3,
                  "planned_ms": 1e3 * length,
              },
          }
      )
      if end > work_end:
        events.append(
            {
                "name": f"{t}: slack",
                "cat": "slack",
                "ph": "X",
                "pid": r,
                "tid": 2,
                "ts": work_end,
                "dur": end - work_end,
                "args": {"tick": t, "slack_ms": (end - work_end) / 1e3},
            }
        )
    plan_at += length
  meta = {
      "schedule": lowered.schedule.name,
      "ticks": lowered.num_ticks,
      "model": prediction.model,
      "planned_s": plan_at,
      "measured_s": max(m[-1].end_ns for m in measured) * 1e-9 - t0 * 1e-9,
      "per_tick": tick_table(lowered, prediction, measured),
  }
  return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def profile_step(trainer, directory: str) -> tuple[str, str]:
  """Compiles, warms up and profiles one train step.

  Args:
    trainer: the `Trainer` whose step is profiled (two warm-up steps run first).
    directory: where `jax.profiler.trace` writes.

  Returns:
    (the .xplane.pb path, the HLO text of the compiled step).

  Raises:
    TraceError: the profiler wrote no .xplane.pb.
  """
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
