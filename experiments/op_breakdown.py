"""Where a compiled step's time goes: a profiler trace's per-instruction time, by kind of op.

Each HLO instruction the runtime executes leaves a trace event named after it; its exclusive
time (minus the events nested in it) is charged to the kind of op it is, read from the compiled
HLO: matmuls (a dot, a fusion around one, or the oneDNN kernel's custom call), the other
arithmetic, slot reads (dynamic-slice, slice), slot writes (dynamic-update-slice, select),
copies and zero fills, pipeline transfers (collective-permute, including the wait for the
neighbour), and control (while, conditional, call and their predicates). Times are wall time on
the devices' threads, summed over devices: where the devices share fewer cores, or the machine is
loaded, every figure grows. The bytes each kind writes (an in-place dynamic-update-slice writes
its update, any other op its output; times the runs counted in the trace) do not depend on the
machine.
"""

from __future__ import annotations

import collections
import pathlib
import re
import tempfile

import jax
import numpy as np

KINDS = ("matmul", "arithmetic", "slot read", "slot write", "copy/fill", "ppermute", "control")
MOVES = ("slot read", "slot write", "copy/fill", "ppermute")  # kinds whose bytes are counted
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
}


def _nbytes(shape: str) -> int:
  """Bytes of an array shape such as `f32[4,8]{1,0}` (0 for tuples and tokens)."""
  m = re.match(r"(\w+)\[([\d,]*)\]", shape)
  if not m or m[1] not in _BYTES:
    return 0
  return _BYTES[m[1]] * int(np.prod([int(d) for d in m[2].split(",") if d]))


def op_kinds(hlo: str) -> dict[str, tuple[str, int]]:
  """{instruction name: (one of KINDS, bytes it writes)} for every instruction in the compiled
  HLO text: an in-place dynamic-update-slice writes its update, any other op its output."""
  comps = dict(re.findall(r"^%([\w.\-]+) .*\{\n((?:  .*\n)*?)\}", hlo, re.M))
  with_dot = {name for name, body in comps.items() if " dot(" in body}

  def written(rest: str) -> int:
    shape = re.match(r"(\(.*?\)|\S+) ", rest)[1]
    calls = re.search(r"calls=%([\w.\-]+)", rest)
    body = comps.get(calls[1], "") if calls else ""
    root = re.search(r"ROOT %\S+ = \S+ dynamic-update-slice\(%[\w.\-]+, %([\w.\-]+)", body)
    if root:
      update = re.search(rf"%{re.escape(root[1])} = (\S+) ", body)
      return _nbytes(update[1]) if update else _nbytes(shape)
    return _nbytes(shape)

  kinds = {}
  for name, rest in re.findall(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$", hlo, re.M):
    opcode = re.match(r"(?:\(.*?\)|\S+) ([\w\-]+)\(", rest)
    opcode = opcode[1] if opcode else ""
    calls = re.search(r"calls=%([\w.\-]+)", rest)
    # the oneDNN kernel's GEMMs, over row-major or prepacked weights (all rows or the leading ones)
    gemm = r'custom_call_target="jaxpipe_matmul(_prepacked(_rows)?)?"'
    gemm_call = re.search(gemm, rest) is not None
    if opcode == "dot" or (calls and calls[1] in with_dot) or gemm_call:
      kind = "matmul"
    elif opcode.startswith("collective-permute"):
      kind = "ppermute"
    elif (
        opcode in ("while", "conditional", "call", "compare")
        or "compare" in name
        or "and_reduce" in name
    ):
      kind = "control"
    elif opcode in ("copy", "broadcast") or "copy" in name or "broadcast" in name:
      kind = "copy/fill"
    elif "dynamic-update-slice" in name or "select" in name or opcode == "dynamic-update-slice":
      kind = "slot write"
    elif "slice" in name or opcode in ("dynamic-slice", "slice"):
      kind = "slot read"
    else:
      kind = "arithmetic"
    kinds[name] = (kind, written(rest) if kind in MOVES else 0)
  return kinds


def exclusive_times(trace_file: str) -> tuple[collections.Counter, collections.Counter]:
  """({event name: seconds not spent in events nested inside it}, {event name: count}), over
  all threads."""
  data = jax.profiler.ProfileData.from_file(trace_file)
  out, runs = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      stack = []
      for start, end, name in sorted(
          ((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events),
          key=lambda e: (e[0], -e[1]),
      ):
        while stack and stack[-1][1] <= start:
          stack.pop()
        if stack:
          out[stack[-1][2]] -= (end - start) * 1e-9
        out[name] += (end - start) * 1e-9
        runs[name] += 1
        stack.append((start, end, name))
  return out, runs


def breakdown(compiled, args, reps: int = 3) -> dict[str, tuple[float, float]]:
  """{kind: (seconds, bytes written) per step} of `compiled(*args)`, over `reps` steps."""
  kinds = op_kinds(compiled.as_text())
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(reps):
        jax.block_until_ready(compiled(*args))
    (trace_file,) = pathlib.Path(d).glob("**/*.xplane.pb")
    times, runs = exclusive_times(str(trace_file))
  out = {k: [0.0, 0.0] for k in KINDS}
  for name, seconds in times.items():
    if name in kinds:
      kind, nbytes = kinds[name]
      out[kind][0] += seconds / reps
      out[kind][1] += runs[name] * nbytes / reps
  return {k: tuple(v) for k, v in out.items()}
