"""Serving latency metrics and goodput under SLOs (the definitions DistServe uses).

Per request: TTFT = first token time - arrival; TPOT = (last token time - first token time) /
(output tokens - 1), the mean time per output token after the first (a one-token request has
none and meets any TPOT target); end-to-end latency = finish - arrival. A request meets the SLO
when it finished without error and both its TTFT and TPOT are within their targets. Goodput is
the highest request rate at which at least 90% (`SLO.attainment`) of requests meet it, found by a
search over rates (`search_goodput`): each probe is a whole run at that rate.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SLO:
  ttft: float  # seconds, time to first token
  tpot: float  # seconds, time per output token after the first
  attainment: float = 0.9  # the share of requests that must meet both

  def __post_init__(self):
    for name, value in (("ttft", self.ttft), ("tpot", self.tpot)):
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} SLO={value!r} must be a number of seconds > 0")
    if not 0 < self.attainment <= 1:
      raise ValueError(f"attainment={self.attainment} must lie in (0, 1]")

  def met(self, r) -> bool:
    """Whether a finished request (with .ttft, .tpot, .error) met both targets."""
    if getattr(r, "error", None) or r.ttft is None:
      return False
    return r.ttft <= self.ttft and (r.tpot is None or r.tpot <= self.tpot)

  def scaled(self, factor: float) -> "SLO":
    """Both targets times `factor` (DistServe's SLO scale)."""
    return SLO(self.ttft * factor, self.tpot * factor, self.attainment)


def attainment(requests: Sequence, slo: SLO) -> float:
  """The share of requests that met the SLO."""
  return sum(slo.met(r) for r in requests) / len(requests) if requests else 0.0


def e2e(r) -> float | None:
  """End-to-end latency of a finished request: arrival to its last token."""
  return None if r.finish_time is None else r.finish_time - r.arrival


def percentiles(values: Iterable[float | None], qs: Sequence[float] = (50, 90, 99)) -> list[float]:
  """The qs-th percentiles of the values that are not None (NaN when there are none)."""
  xs = [v for v in values if v is not None]
  return [float(np.percentile(xs, q)) if xs else math.nan for q in qs]


@dataclasses.dataclass
class Search:
  goodput: float  # the highest probed rate that met the SLO (0: none did)
  tried: dict[float, float]  # rate -> attainment, in probe order
  above: float | None  # the lowest probed rate above `goodput` that missed it (None: none did)


def search_goodput(attain_at: Callable[[float], float], rates: Sequence[float], target: float = 0.9,
                   rel_tol: float = 0.1, max_probes: int = 8) -> Search:
  """The highest rate whose attainment reaches `target`: probes `rates`, then doubles past the
  highest that passes or halves below the lowest that fails, then bisects (geometrically) until
  the bracket is within rel_tol or max_probes rates were probed."""
  if not rates or min(rates) <= 0:
    raise ValueError(f"rates={list(rates)} must be a non-empty list of positive rates")
  tried: dict[float, float] = {}
  queue = sorted(set(float(r) for r in rates))
  while True:
    for r in queue:
      if r not in tried and len(tried) < max_probes:
        tried[r] = attain_at(r)
    failing = [r for r, a in tried.items() if a < target]
    hi = min(failing) if failing else None
    passing = [r for r, a in tried.items() if a >= target and (hi is None or r < hi)]
    lo = max(passing) if passing else None
    if len(tried) >= max_probes:
      break
    if hi is None:
      queue = [2 * max(tried)]
    elif lo is None:
      queue = [min(tried) / 2]
    elif hi / lo <= 1 + rel_tol:
      break
    else:
      queue = [math.sqrt(lo * hi)]
  return Search(lo or 0.0, tried, hi)
