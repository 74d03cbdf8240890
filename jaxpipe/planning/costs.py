"""Measured costs: the cost file the simulators read, and the step time and memory it predicts.
No JAX.

`python -m jaxpipe.measure` writes the file for one model, mesh and batch. Each entry is keyed by
the micro-batch count and the number of model stages (both change what one stage computes) and
holds, in seconds, one virtual stage's parts on one micro-batch as the executor runs them
(every device of the mesh running the part at once, as in a full tick): `F`, `B`, `I`, `W`,
`F&B`; `embed`, what a route's first forward adds (the token embedding); `head`, what its last
adds (norm, head, loss and its gradient); `tick`, an idle tick (the parts' gates, the slot writes,
the gradient accumulator); `ppermute`, each activation or cotangent sent to a neighbouring
pipeline rank; `call`, what the executor costs around its ticks (buffers, the gradients'
reduction). And, in bytes per device, what stays in flight: `activation` (one stage input, also
the size of an output cotangent), `residual` (what F keeps for the backward), `wg` (what I keeps
for its W), `work` (the executor's other temporaries: a running part's intermediates, the
gradient accumulators; its compiled temporaries less its slots). The `step` section holds what the
schedule changes only through the copies of the layer stack it keeps (two under Chimera and
DualPipe): the optimizer update's seconds and the train state's and gradients' bytes per device,
each split into this device's share of one copy of the layer stack and the rest.

    {"format": "jaxpipe-costs/1", "setup": {...}, "devices": {"platform": "cpu", "count": 8,
                                                              "cores": 2, "parallel": false},
     "step": {"update_s": .., "update_cpu_s": .., "layer_state_bytes": ..,
              "shared_state_bytes": .., "layer_grad_bytes": .., "shared_grad_bytes": ..},
     "entries": [{"microbatches": 8, "stages": 4, "seconds": {"F": .., ...},
                  "cpu_seconds": {"F": .., ...}, "bytes": {"activation": .., ...}}, ...]}

Where the devices share the host's cores (CPU host devices: 8 devices on 2 cores) wall time
says little: the devices do not run in parallel, and other processes take the cores. There the
file also holds `cpu_seconds` (the process's CPU time for the same calls, every device's work
summed) and `devices.parallel` is false.

`predict` turns a lowered schedule and an entry into a step time: the ticks as the executor runs
them, each with its overhead (`tick`, and `ppermute` for each channel something arrives on in
that tick: the executor runs only those), the
call and the update. With parallel devices (lock-step) each tick lasts as long as its slowest
rank's parts. With devices sharing cores a tick costs what all ranks' parts cost together: the
mean over ranks of the all-devices CPU seconds (an idle rank costs nothing), and the step's wall
time on an idle host is that CPU time over the cores. It also predicts a per-device memory:
state, gradients and the slot buffers.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Mapping

from jaxpipe.pipeline.ir.lower import BRANCHES, CHANNELS, COL, Lowered
from jaxpipe.pipeline.ir.schedule import Schedule
from jaxpipe.runtime import files

FORMAT = "jaxpipe-costs/1"
PARTS = ("F", "B", "I", "W", "F&B")  # one virtual stage on one micro-batch
SECONDS = PARTS + ("ppermute", "embed", "head", "tick", "call")
BYTES = ("activation", "residual", "wg", "work")
STEP = (
    "update_s",
    "layer_state_bytes",
    "shared_state_bytes",
    "layer_grad_bytes",
    "shared_grad_bytes",
)
STEP_CPU = "update_cpu_s"  # optional in `step`, with `cpu_seconds` in the entries
MEASURE = "python -m jaxpipe.measure"


class CostFileError(ValueError):
  """A cost file that cannot be used; the message names the file, the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Devices:
  """What the costs were measured on."""

  platform: str = "unknown"
  count: int = 1  # devices in the mesh
  cores: int = 1  # host cores, where the devices share them
  parallel: bool = True  # False: the devices share the host's cores (CPU host devices)


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """One entry: a virtual stage's parts for `microbatches` micro-batches and `stages` stages."""

  microbatches: int
  stages: int
  seconds: Mapping[str, float]  # SECONDS, wall time
  bytes: Mapping[str, int]  # BYTES, per device
  cpu_seconds: Mapping[str, float] | None = None  # SECONDS, process CPU time (shared cores)

  def kinds(self) -> dict[str, float]:
    """The per-kind costs the simulators take (`Schedule.simulate(costs=...)`)."""
    return {k: self.seconds[k] for k in PARTS}


@dataclasses.dataclass(frozen=True)
class CostFile:
  path: str
  setup: Mapping  # what was measured where: model, mesh, devices, load; for reports
  step: Mapping[str, float]  # STEP (and STEP_CPU)
  entries: tuple[StageCosts, ...]
  devices: Devices = Devices()

  def entry(self, microbatches: int, stages: int) -> StageCosts:
    """The entry measured for `microbatches` micro-batches over `stages` model stages.

    Args:
      microbatches: the schedule's micro-batch count.
      stages: its number of model stages.

    Returns:
      The matching `StageCosts`.

    Raises:
      CostFileError: the file has no such entry; the message names the keys it has and the
        command that measures the missing one.
    """
    for e in self.entries:
      if (e.microbatches, e.stages) == (microbatches, stages):
        return e
    raise CostFileError(
        f"{self.path} has no costs for microbatches={microbatches} over {stages} model stages "
        f"(it has {self.keys_text()}); measure them with `{MEASURE} --microbatches "
        f"{microbatches} --stages {stages}`"
    )

  def predict(self, lowered: Lowered) -> Prediction:
    """`predict` with this file's entry for the lowered schedule, its step and devices.

    Args:
      lowered: the tick tables the executor runs.

    Returns:
      The `Prediction`.

    Raises:
      CostFileError: the file has no entry for the schedule's micro-batch and stage counts.
    """
    s = lowered.schedule
    return predict(lowered, self.entry(s.num_microbatches, s.num_stages), self.step, self.devices)

  def has(self, microbatches: int, stages: int) -> bool:
    """Whether the file has an entry for these counts.

    Args:
      microbatches: micro-batch count.
      stages: number of model stages.

    Returns:
      True if `entry(microbatches, stages)` finds one.
    """
    return any((e.microbatches, e.stages) == (microbatches, stages) for e in self.entries)

  def keys_text(self) -> str:
    return ", ".join(f"m={e.microbatches}/{e.stages} stages" for e in self.entries) or "none"


def _number(path: str, where: str, value, integer: bool = False) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
  if not ok or (integer and value != int(value)):
    raise CostFileError(
        f"{path}: {where}={value!r} must be a non-negative {'integer' if integer else 'number'}"
    )
  return int(value) if integer else float(value)


def _section(path: str, where: str, got, keys: tuple[str, ...], integer: bool = False) -> dict:
  if not isinstance(got, Mapping):
    raise CostFileError(f"{path}: {where} must be an object with {', '.join(keys)}")
  missing = [k for k in keys if k not in got]
  if missing:
    raise CostFileError(
        f"{path}: {where} lacks {', '.join(missing)}; every part is needed "
        f"(`{MEASURE}` writes them all), so remeasure or add them"
    )
  unknown = sorted(set(got) - set(keys))
  if unknown:
    raise CostFileError(f"{path}: {where} has unknown keys {unknown}; known: {', '.join(keys)}")
  return {k: _number(path, f"{where}.{k}", got[k], integer) for k in keys}


def parse(data: Mapping, path: str = "<costs>") -> CostFile:
  """Checks a cost file's contents.

  Args:
    data: the file's JSON object (module docstring).
    path: the file's name, for the messages.

  Returns:
    The `CostFile`.

  Raises:
    CostFileError: names the first missing or bad value (a wrong format, a missing or unknown
      key, a negative number, a repeated entry, or shared-core devices without CPU seconds).
  """
  if not isinstance(data, Mapping) or data.get("format") != FORMAT:
    got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
    raise CostFileError(
        f"{path} is not a cost file (format {got!r}, expected {FORMAT!r}); "
        f"write one with `{MEASURE}`"
    )
  got_step = dict(data.get("step") or {}) if isinstance(data.get("step"), Mapping) else None
  cpu_update = got_step.pop(STEP_CPU, None) if got_step is not None else None
  step = _section(path, "step", got_step, STEP)
  if cpu_update is not None:
    step[STEP_CPU] = _number(path, f"step.{STEP_CPU}", cpu_update)
  dev = data.get("devices", {})
  if not isinstance(dev, Mapping) or not set(dev) <= {f.name for f in dataclasses.fields(Devices)}:
    raise CostFileError(
        f"{path}: devices must be an object with platform, count, cores, parallel; got {dev!r}"
    )
  devices = Devices(**dev)
  entries = data.get("entries")
  if not isinstance(entries, list) or not entries:
    raise CostFileError(
        f"{path}: entries must be a non-empty list; `{MEASURE}` writes one per "
        "micro-batch count and stage count"
    )
  out, seen = [], set()
  for i, e in enumerate(entries):
    if not isinstance(e, Mapping):
      raise CostFileError(f"{path}: entries[{i}] must be an object")
    m = e.get("microbatches")
    s = e.get("stages")
    for name, value in (("microbatches", m), ("stages", s)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CostFileError(f"{path}: entries[{i}].{name}={value!r} must be a positive integer")
    where = f"entries[{i}] (microbatches={m}, stages={s})"
    if (m, s) in seen:
      raise CostFileError(f"{path}: {where} appears twice; keep one")
    seen.add((m, s))
    cpu = e.get("cpu_seconds")
    if cpu is not None:
      cpu = _section(path, f"{where} cpu_seconds", cpu, SECONDS)
    if not devices.parallel and (cpu is None or STEP_CPU not in step):
      raise CostFileError(
          f"{path}: devices share cores (parallel: false) but {where} lacks "
          f"cpu_seconds or step lacks {STEP_CPU}; remeasure with `{MEASURE}`"
      )
    out.append(
        StageCosts(
            m,
            s,
            _section(path, f"{where} seconds", e.get("seconds"), SECONDS),
            _section(path, f"{where} bytes", e.get("bytes"), BYTES, True),
            cpu,
        )
    )
  return CostFile(path, dict(data.get("setup") or {}), step, tuple(out), devices)


def load(path: str | os.PathLike) -> CostFile:
  """Reads and checks a cost file.

  Args:
    path: the JSON file `python -m jaxpipe.measure` writes.

  Returns:
    The `CostFile`.

  Raises:
    CostFileError: no such file, not JSON, or contents that `parse` refuses.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise CostFileError(f"no such cost file {path!r}; write one with `{MEASURE}`")
  with open(path) as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise CostFileError(f"{path} is not JSON ({e}); write it with `{MEASURE}`") from e
  return parse(data, path)


def dump(costs: Mapping, path: str | os.PathLike) -> None:
  """Writes a cost file's contents after checking them.

  Args:
    costs: the file's JSON object (module docstring).
    path: where to write it.

  Raises:
    CostFileError: contents that `parse` refuses; nothing is written.
  """
  parse(costs, os.fspath(path))
  files.write_json(path, costs, indent=1)


# --- prediction ------------------------------------------------------------------------------


def sends_per_tick(lowered: Lowered) -> tuple[int, ...]:
  """[tick] ppermutes the executor runs, as `executor.make_executor` issues them for these tables.

  One per used channel, except that activations and cotangents going the same way share one when
  no branch runs a forward beside a backward; each only on ticks where some rank receives over
  it.

  Args:
    lowered: the tick tables.

  Returns:
    [num_ticks] the count of ppermutes in each tick.
  """
  parts = [set(BRANCHES[c].split("+")) for c in lowered.branches]
  shared = not any("F" in p and p & {"I", "B"} for p in parts)
  links = []  # the table columns each ppermute delivers to
  for direction in ("down", "up"):
    on = [
        COL[f"recv_{kind}_{direction}"]
        for kind in ("act", "grad")
        if lowered.channels[CHANNELS.index(f"{kind}_{direction}")]
    ]
    links += [on] if shared and len(on) == 2 else [[c] for c in on]
  table = lowered.table
  return tuple(
      int(sum((table[t][:, cols] >= 0).any() for cols in links)) for t in range(lowered.num_ticks)
  )


def rank_tick_seconds(schedule: Schedule, parts, seconds: Mapping[str, float]) -> float:
  """Seconds one rank's parts take in one tick.

  A forward beside a full backward costs `F&B`, a route's first forward adds `embed`, its last
  forward `head`.

  Args:
    schedule: the schedule, whose routes say which forward is first or last.
    parts: the rank's actions in the tick.
    seconds: seconds by kind (SECONDS).

  Returns:
    The seconds.
  """
  kinds = [a.kind for a in parts]
  total = sum(seconds[k] for k in kinds)
  if "F" in kinds and "B" in kinds:
    total += seconds["F&B"] - seconds["F"] - seconds["B"]
  for a in parts:
    if a.kind == "F":
      route = schedule.route(a.microbatch)
      total += seconds["embed"] * (a.stage == route[0]) + seconds["head"] * (a.stage == route[-1])
  return total


@dataclasses.dataclass(frozen=True)
class Prediction:
  """What a lowered schedule is predicted to cost per step on the measured devices."""

  step_s: float  # wall seconds on these devices: lockstep_s, or cpu_s / cores if they share
  model: str  # "lock-step" (parallel devices) or "shared cores"
  lockstep_s: float  # ticks_s + overhead_s + call + update_s: devices in parallel, in lock-step
  ticks_s: float  # sum over ticks of the slowest rank's parts
  overhead_s: float  # over ticks, an idle tick + the tick's ppermutes: the executor per tick
  update_s: float  # optimizer update, outside the pipeline
  cpu_s: float | None  # shared cores: CPU seconds, each tick the mean of its ranks' parts
  rank_tick_s: tuple[tuple[float, ...], ...]  # [tick][rank] each rank's parts
  planned_tick_s: tuple[float, ...]  # [tick] wall seconds under `model`, its overhead included
  bubble: float  # idle fraction of rank-time within the lock-step ticks
  buffer_bytes: int  # per device: activation, residual, cotangent and wg slots, and `work`
  state_bytes: int  # per device: parameters and optimizer moments
  grad_bytes: int  # per device: the gradients the step produces

  @property
  def memory_bytes(self) -> int:
    return self.buffer_bytes + self.state_bytes + self.grad_bytes


def predict(
    lowered: Lowered, costs: StageCosts, step: Mapping[str, float], devices: Devices = Devices()
) -> Prediction:
  """Step time and per-device memory of `lowered` (the tables the executor runs) from costs.

  Args:
    lowered: the tick tables the executor runs.
    costs: the entry measured for the schedule's micro-batch and stage counts.
    step: the cost file's `step` section (STEP, and STEP_CPU for shared cores).
    devices: what the costs were measured on; with `parallel` False (and CPU seconds) the step
      time is the CPU time over the cores, else lock-step.

  Returns:
    The `Prediction`.

  Raises:
    CostFileError: `costs` was measured for other micro-batch or stage counts.
  """
  schedule = lowered.schedule
  pl = schedule.placement
  if (schedule.num_microbatches, schedule.num_stages) != (costs.microbatches, costs.stages):
    raise CostFileError(
        f"costs measured for microbatches={costs.microbatches} over "
        f"{costs.stages} stages cannot price {schedule.name!r} with "
        f"microbatches={schedule.num_microbatches} over {schedule.num_stages}"
    )
  price = lambda seconds: tuple(
      tuple(rank_tick_seconds(schedule, parts, seconds) for parts in tick) for tick in lowered.ticks
  )
  rank_tick = price(costs.seconds)
  tick_s = tuple(max(t) for t in rank_tick)
  ticks_s = sum(tick_s)
  busy = sum(map(sum, rank_tick))
  b = costs.bytes
  slots = lambda n: max(n, 1)  # the executor keeps at least one slot per buffer
  buffers = (
      (slots(lowered.act_slots) + slots(lowered.cot_slots)) * b["activation"]
      + slots(lowered.res_slots) * b["residual"]
      + lowered.wg_slots * b["wg"]  # none where no backward is split
      + b["work"]
  )
  copies = pl.copies  # resident copies of the layer stack (bidirectional placements: 2)
  state = step["shared_state_bytes"] + step["layer_state_bytes"] * copies
  grads = step["shared_grad_bytes"] + step["layer_grad_bytes"] * copies
  # the update is elementwise over the state: its time grows with the copies' share
  one_copy = step["shared_state_bytes"] + step["layer_state_bytes"]
  scale = state / one_copy if one_copy else 1.0
  # an idle tick runs no ppermute; each one the executor issues in a tick adds its own
  sends = sends_per_tick(lowered)
  overhead = lambda sec, t: sec["tick"] + sends[t] * sec["ppermute"]
  s = costs.seconds
  planned = tuple(x + overhead(s, t) for t, x in enumerate(tick_s))
  lockstep = sum(planned) + s["call"] + step["update_s"] * scale
  cpu = None
  if costs.cpu_seconds is not None and STEP_CPU in step:
    c = costs.cpu_seconds
    cpu_ticks = tuple(sum(x) / len(x) + overhead(c, t) for t, x in enumerate(price(c)))
    cpu = sum(cpu_ticks) + c["call"] + step[STEP_CPU] * scale
  shared = not devices.parallel and cpu is not None
  if shared:
    planned = tuple(t / devices.cores for t in cpu_ticks)
  return Prediction(
      step_s=cpu / devices.cores if shared else lockstep,
      model="shared cores" if shared else "lock-step",
      lockstep_s=lockstep,
      ticks_s=ticks_s,
      overhead_s=sum(overhead(s, t) for t in range(lowered.num_ticks)),
      update_s=step["update_s"] * scale,
      cpu_s=cpu,
      rank_tick_s=rank_tick,
      planned_tick_s=planned,
      bubble=1.0 - busy / (pl.num_ranks * ticks_s) if ticks_s else 0.0,
      buffer_bytes=int(buffers),
      state_bytes=int(state),
      grad_bytes=int(grads),
  )
