"""The published bubble and activation figures (shared/anchors.md), as functions of p, m, v, costs.

Each figure names its view and units, so a simulated number is compared with the right one:
bubble views are "single step" (makespan - busy) or "steady state" (idle between a rank's first
and last op, max over ranks); activation units are "micro-batch-stages" (raw count on the
busiest rank) or "whole-rank" (count * p / num_stages). Figures marked inexact are the papers'
approximations or bounds ("about", "at most").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxpipe.pipeline.ir.simulate import resolve_costs


@dataclasses.dataclass(frozen=True)
class Anchor:
  """One schedule's published figures for given p, m, v and costs."""

  bubble: float | None  # per-rank bubble in time units (None: quoted only as a rate)
  bubble_view: str  # "single step" or "steady state"
  bubble_units: str  # what one time unit is
  rate: float | None  # bubble rate, where the source quotes one
  activations: float  # peak activations on the busiest rank (lower end of a range)
  activations_units: str  # "micro-batch-stages" or "whole-rank"
  activations_bound: str  # "=", "<=", "about", or "between" (activations..activations_hi)
  exact: bool  # True when the bubble formula is exact under these costs
  source: str
  activations_hi: float | None = None  # upper end when activations_bound is "between"
  assumes: dict | None = None  # costs the bubble formula presumes, where they differ from ours

  def bubble_text(self) -> str:
    if self.bubble is None:
      return f"rate {100 * self.rate:.1f}%"
    return f"{self.bubble:g}" + ("" if self.exact else "*")

  def activations_text(self) -> str:
    unit = "w" if self.activations_units == "whole-rank" else ""
    if self.activations_bound == "between":
      return f"{self.activations:g}..{self.activations_hi:g}{unit}"
    sign = {"=": "", "<=": "<=", "about": "~"}[self.activations_bound]
    return f"{sign}{self.activations:g}{unit}"


def anchor(
    name: str,
    pp: int,
    microbatches: int,
    chunks: int | None = None,
    costs: Mapping[str, float] | None = None,
    group: int | None = None,
) -> Anchor:
  """anchors.md's figures for `name` at `pp` ranks, `microbatches`, `chunks` per rank.

  Args:
    name: the schedule (a generator name).
    pp: pipeline ranks, p.
    microbatches: micro-batches per step, m.
    chunks: chunks per rank, v (interleaved 1F1B); None: 2.
    costs: per-kind costs (`resolve_costs`: F = I = W = 1, B = I + W by default).
    group: interleaved 1F1B's warm-up group; None: p.

  Returns:
    The `Anchor`: bubble and activation figures with their view, units and source.

  Raises:
    ValueError: a schedule without published figures, or costs `resolve_costs` refuses.
  """
  c = resolve_costs(costs)
  f, b, w = c["F"], c["B"], c["W"]
  fb = c["F&B"] if c["F&B"] is not None else f + b
  p, m = pp, microbatches
  if name == "gpipe":
    return Anchor(
        (p - 1) * (f + b),
        "single step",
        "F",
        None,
        m,
        "micro-batch-stages",
        "=",
        True,
        "GPipe paper; torch ScheduleGPipe",
    )
  if name == "1f1b":
    return Anchor(
        (p - 1) * (f + b),
        "single step",
        "F",
        None,
        min(p, m),
        "micro-batch-stages",
        "=",
        True,
        "DualPipe README; Megatron warm-up min(p-rank-1, m)",
    )
  if name == "interleaved-1f1b":
    v = chunks or 2
    g = group or p
    held = min((p - 1) * 2 + (v - 1) * g + 1, m * v)  # rank 0: warm-up forwards + one
    return Anchor(
        (p - 1) * (f + b),
        "single step",
        "per-chunk F (divide by v for whole-rank)",
        None,
        held / v,
        "whole-rank",
        "=",
        True,
        "Narayanan et al. 2021; Megatron warm-up (p-rank-1)*2+(v-1)*g, about p+(p-1)/v",
    )
  if name == "zb-h1":
    return Anchor(
        (p - 1) * (f + b - 2 * w),
        "single step",
        "F",
        None,
        min(p, m),
        "micro-batch-stages",
        "<=",
        True,
        "DualPipe README; Zero Bubble paper",
    )
  if name == "zb-h2":
    return Anchor(
        0.0,
        "steady state",
        "F",
        0.0,
        2 * p - 1,
        "micro-batch-stages",
        "about",
        f == c["I"] == w,
        "Zero Bubble paper; sail-sg README",
    )
  if name == "zb-v":
    return Anchor(
        0.0,
        "steady state",
        "F",
        0.0,
        p,
        "whole-rank",
        "<=",
        f == c["I"] == w,
        "sail-sg zero-bubble README",
    )
  if name == "chimera":
    # The paper counts equal time slots for forward and backward: exact at B = F only.
    return Anchor(
        None,
        "single step",
        "F",
        (p - 2) / (2 * m + p - 2),
        p / 2 + 1,
        "micro-batch-stages",
        "between",
        b == f,
        "Li & Hoefler SC21, (D-2)/(2N+D-2) in equal slots (B = F)",
        p,
        assumes=None if b == f else {"B": f},
    )
  if name == "dualpipe":
    return Anchor(
        (p / 2 - 1) * (fb + b - 3 * w),
        "single step",
        "F (F&B as F+B unless set)",
        None,
        p + 1,
        "micro-batch-stages",
        "=",
        False,
        "DualPipe README table",
    )
  if name == "dualpipev":
    stages = 2 * p  # DualPipe's PP counts stages: two per device, V placement
    return Anchor(
        (stages / 2 - 1) * (fb + b - 3 * w),
        "single step",
        "F (F&B as F+B unless set)",
        None,
        stages + 1,
        "micro-batch-stages",
        "=",
        False,
        "DualPipe README table, PP = 2 x devices",
    )
  raise ValueError(f"no published figures for schedule {name!r}")
