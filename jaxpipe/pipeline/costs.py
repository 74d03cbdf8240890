"""Measured costs: the cost file the simulators read, and the step time and memory it predicts. No JAX.

`python -m jaxpipe.measure` writes the file for one model, mesh and batch. Each entry is keyed by
the micro-batch count and the number of model stages (both change what one stage computes) and
holds, in seconds, one virtual stage's parts on one micro-batch as the executor compiles them
(every device of the mesh running the part at once, as in a full tick): `F`, `B`, `I`, `W`,
`F&B`; `ppermute`, one activation sent to the next pipeline rank; `embed`, the first stage's
token embedding (forward and backward); `head`, the last stage's norm, head and loss with their
gradient. And, in bytes per device, what stays in flight: `activation` (one stage input, also
the size of an output cotangent), `residual` (what F keeps for the backward), `wg` (what I keeps
for its W). The `step` section holds what the schedule changes only through the copies of the
layer stack it keeps (two under Chimera and DualPipe): the optimizer update's seconds and the
train state's and gradients' bytes per device, each split into this device's share of one copy
of the layer stack and the rest.

    {"format": "jaxpipe-costs/1", "setup": {...},
     "step": {"update_s": .., "layer_state_bytes": .., "shared_state_bytes": ..,
              "layer_grad_bytes": .., "shared_grad_bytes": ..},
     "entries": [{"microbatches": 8, "stages": 4, "seconds": {"F": .., ...},
                  "bytes": {"activation": .., ...}}, ...]}

`predict` turns a lowered schedule and an entry into a step time: the ticks as the executor runs
them (each tick as long as its slowest rank's parts), one ppermute per used link per tick, and
the update; and into a per-device memory: state, gradients and the slot buffers.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Mapping

from jaxpipe.pipeline.ir import Schedule
from jaxpipe.pipeline.lower import BRANCHES, CHANNELS, Lowered

FORMAT = "jaxpipe-costs/1"
PARTS = ("F", "B", "I", "W", "F&B")  # one virtual stage on one micro-batch
SECONDS = PARTS + ("ppermute", "embed", "head")
BYTES = ("activation", "residual", "wg")
STEP = ("update_s", "layer_state_bytes", "shared_state_bytes", "layer_grad_bytes",
        "shared_grad_bytes")
MEASURE = "python -m jaxpipe.measure"


class CostFileError(ValueError):
  """A cost file that cannot be used; the message names the file, the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """One entry: a virtual stage's parts for `microbatches` micro-batches and `stages` stages."""
  microbatches: int
  stages: int
  seconds: Mapping[str, float]  # SECONDS
  bytes: Mapping[str, int]  # BYTES, per device

  def kinds(self) -> dict[str, float]:
    """The per-kind costs the simulators take (`Schedule.simulate(costs=...)`)."""
    return {k: self.seconds[k] for k in PARTS}


@dataclasses.dataclass(frozen=True)
class CostFile:
  path: str
  setup: Mapping  # what was measured where: model, mesh, devices, load; for reports
  step: Mapping[str, float]  # STEP
  entries: tuple[StageCosts, ...]

  def entry(self, microbatches: int, stages: int) -> StageCosts:
    """The entry measured for `microbatches` micro-batches over `stages` model stages."""
    for e in self.entries:
      if (e.microbatches, e.stages) == (microbatches, stages):
        return e
    raise CostFileError(
        f"{self.path} has no costs for microbatches={microbatches} over {stages} model stages "
        f"(it has {self.keys_text()}); measure them with `{MEASURE} --microbatches "
        f"{microbatches} --stages {stages}`")

  def has(self, microbatches: int, stages: int) -> bool:
    return any((e.microbatches, e.stages) == (microbatches, stages) for e in self.entries)

  def keys_text(self) -> str:
    return ", ".join(f"m={e.microbatches}/{e.stages} stages" for e in self.entries) or "none"


def _number(path: str, where: str, value, integer: bool = False) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
  if not ok or (integer and value != int(value)):
    raise CostFileError(f"{path}: {where}={value!r} must be a non-negative "
                        f"{'integer' if integer else 'number'}")
  return int(value) if integer else float(value)


def _section(path: str, where: str, got, keys: tuple[str, ...], integer: bool = False) -> dict:
  if not isinstance(got, Mapping):
    raise CostFileError(f"{path}: {where} must be an object with {', '.join(keys)}")
  missing = [k for k in keys if k not in got]
  if missing:
    raise CostFileError(f"{path}: {where} lacks {', '.join(missing)}; every part is needed "
                        f"(`{MEASURE}` writes them all), so remeasure or add them")
  unknown = sorted(set(got) - set(keys))
  if unknown:
    raise CostFileError(f"{path}: {where} has unknown keys {unknown}; known: {', '.join(keys)}")
  return {k: _number(path, f"{where}.{k}", got[k], integer) for k in keys}


def parse(data: Mapping, path: str = "<costs>") -> CostFile:
  """Checks a cost file's contents; CostFileError names the first missing or bad value."""
  if not isinstance(data, Mapping) or data.get("format") != FORMAT:
    got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
    raise CostFileError(f"{path} is not a cost file (format {got!r}, expected {FORMAT!r}); "
                        f"write one with `{MEASURE}`")
  step = _section(path, "step", data.get("step"), STEP)
  entries = data.get("entries")
  if not isinstance(entries, list) or not entries:
    raise CostFileError(f"{path}: entries must be a non-empty list; `{MEASURE}` writes one per "
                        "micro-batch count and stage count")
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
    out.append(StageCosts(m, s, _section(path, f"{where} seconds", e.get("seconds"), SECONDS),
                          _section(path, f"{where} bytes", e.get("bytes"), BYTES, True)))
  return CostFile(path, dict(data.get("setup") or {}), step, tuple(out))


def load(path: str | os.PathLike) -> CostFile:
  """Reads and checks a cost file."""
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
  """Writes a cost file's contents after checking them."""
  parse(costs, os.fspath(path))
  with open(path, "w") as f:
    json.dump(costs, f, indent=1)
    f.write("\n")


# --- prediction ------------------------------------------------------------------------------

def ppermutes_per_tick(lowered: Lowered) -> int:
  """ppermutes every tick runs, as `executor.make_executor` issues them for these tables: one
  per used channel, except that activations and cotangents going the same way share one when
  no branch runs a forward beside a backward."""
  parts = [set(BRANCHES[c].split("+")) for c in lowered.branches]
  shared = not any("F" in p and p & {"I", "B"} for p in parts)
  n = 0
  for direction in ("down", "up"):
    on = sum(lowered.channels[CHANNELS.index(f"{kind}_{direction}")] for kind in ("act", "grad"))
    n += 1 if shared and on == 2 else on
  return n


def rank_tick_seconds(schedule: Schedule, parts, costs: StageCosts) -> float:
  """Seconds one rank's parts take in one tick: a forward beside a full backward costs `F&B`,
  a route's first forward adds `embed`, its last forward `head`."""
  s = costs.seconds
  kinds = [a.kind for a in parts]
  total = sum(s[k] for k in kinds)
  if "F" in kinds and "B" in kinds:
    total += s["F&B"] - s["F"] - s["B"]
  for a in parts:
    if a.kind == "F":
      route = schedule.route(a.microbatch)
      total += s["embed"] * (a.stage == route[0]) + s["head"] * (a.stage == route[-1])
  return total


@dataclasses.dataclass(frozen=True)
class Prediction:
  """What a lowered schedule is predicted to cost per step on the measured devices."""
  step_s: float  # ticks_s + send_s + update_s
  ticks_s: float  # sum over ticks of the slowest rank's parts
  send_s: float  # ticks x ppermutes per tick x one ppermute
  update_s: float  # optimizer update, outside the pipeline
  tick_s: tuple[float, ...]  # [tick] the slowest rank's parts
  rank_tick_s: tuple[tuple[float, ...], ...]  # [tick][rank] each rank's parts
  bubble: float  # idle fraction of rank-time within the ticks
  buffer_bytes: int  # per device: activation, residual, cotangent and wg slots
  state_bytes: int  # per device: parameters and optimizer moments
  grad_bytes: int  # per device: the gradients the step produces

  @property
  def memory_bytes(self) -> int:
    return self.buffer_bytes + self.state_bytes + self.grad_bytes


def predict(lowered: Lowered, costs: StageCosts, step: Mapping[str, float]) -> Prediction:
  """Step time and per-device memory of `lowered` (the tables the executor runs) from costs."""
  schedule = lowered.schedule
  pl = schedule.placement
  if (schedule.num_microbatches, schedule.num_stages) != (costs.microbatches, costs.stages):
    raise CostFileError(f"costs measured for microbatches={costs.microbatches} over "
                        f"{costs.stages} stages cannot price {schedule.name!r} with "
                        f"microbatches={schedule.num_microbatches} over {schedule.num_stages}")
  rank_tick = tuple(tuple(rank_tick_seconds(schedule, parts, costs) for parts in tick)
                    for tick in lowered.ticks)
  tick_s = tuple(max(t) for t in rank_tick)
  ticks_s = sum(tick_s)
  busy = sum(map(sum, rank_tick))
  send_s = lowered.num_ticks * ppermutes_per_tick(lowered) * costs.seconds["ppermute"]
  b = costs.bytes
  slots = lambda n: max(n, 1)  # the executor keeps at least one slot per buffer
  buffers = (slots(lowered.act_slots) + slots(lowered.cot_slots)) * b["activation"] + \
      slots(lowered.res_slots) * b["residual"] + slots(lowered.wg_slots) * b["wg"]
  copies = pl.copies  # resident copies of the layer stack (bidirectional placements: 2)
  state = step["shared_state_bytes"] + step["layer_state_bytes"] * copies
  grads = step["shared_grad_bytes"] + step["layer_grad_bytes"] * copies
  # the update is elementwise over the state: its time grows with the copies' share
  one_copy = step["shared_state_bytes"] + step["layer_state_bytes"]
  update = step["update_s"] * (state / one_copy if one_copy else 1.0)
  return Prediction(
      step_s=ticks_s + send_s + update, ticks_s=ticks_s, send_s=send_s,
      update_s=update, tick_s=tick_s, rank_tick_s=rank_tick,
      bubble=1.0 - busy / (pl.num_ranks * ticks_s) if ticks_s else 0.0,
      buffer_bytes=int(buffers), state_bytes=int(state), grad_bytes=int(grads))
