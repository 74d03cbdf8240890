"""Serving latency metrics and goodput under SLOs (the definitions DistServe uses).

Per request: TTFT = first token time - arrival; TPOT = (last token time - first token time) /
(output tokens - 1), the mean time per output token after the first (a one-token request has
none and meets any TPOT target); end-to-end latency = finish - arrival. A request meets the SLO
when it finished without error and both its TTFT and TPOT are within their targets. Goodput is
the highest request rate at which at least 90% (`SLO.attainment`) of requests meet it, found by a
search over rates (`search_goodput`): each probe is a whole run at that rate. `ttft` and `tpot`
are the one implementation of the two that the engine's, the simulator's and the benchmarks'
requests and the HTTP server's histograms all use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

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
    """Whether a finished request met both targets.

    Args:
      r: a request with .ttft, .tpot and .error; one with an error or no first token misses, one
        without a TPOT (fewer than two tokens) meets any TPOT target.

    Returns:
      True if it met both.
    """
    if getattr(r, "error", None) or r.ttft is None:
      return False
    return r.ttft <= self.ttft and (r.tpot is None or r.tpot <= self.tpot)

  def scaled(self, factor: float) -> SLO:
    """Both targets times `factor` (DistServe's SLO scale).

    Args:
      factor: the scale, > 0.

    Returns:
      The scaled `SLO`, with the same attainment.
    """
    return SLO(self.ttft * factor, self.tpot * factor, self.attainment)

  def tightest_scale(self, requests: Sequence) -> float:
    """The smallest factor f for which `scaled(f)` is met by the `attainment` share of the requests.

    How tight an SLO they can meet.

    Args:
      requests: finished requests, with .ttft, .tpot and .error.

    Returns:
      The factor; inf if failed requests alone exceed the rest, or there are no requests.
    """
    need = [
        math.inf
        if getattr(r, "error", None) or r.ttft is None
        else max(r.ttft / self.ttft, (r.tpot or 0.0) / self.tpot)
        for r in requests
    ]
    k = math.ceil(self.attainment * len(need) - 1e-9)
    return sorted(need)[k - 1] if need else math.inf


def ttft(arrival: float, first_token: float | None) -> float | None:
  """Time to first token: arrival to the first token's time (None before there is one).

  Args:
    arrival: when the request arrived, seconds.
    first_token: when its first token came, or None.

  Returns:
    The seconds, or None.
  """
  return None if first_token is None else first_token - arrival


def tpot(first_token: float | None, last_token: float | None, tokens: int) -> float | None:
  """Time per output token after the first: (last - first) / (tokens - 1).

  The mean gap between a request's tokens.

  Args:
    first_token: when its first token came.
    last_token: when its last token came.
    tokens: its output tokens.

  Returns:
    The seconds; None with fewer than two tokens (it meets any TPOT target).
  """
  if tokens < 2:
    return None
  return (last_token - first_token) / (tokens - 1)


def attainment(requests: Sequence, slo: SLO) -> float:
  """The share of requests that met the SLO.

  Args:
    requests: finished requests.
    slo: the targets.

  Returns:
    The share in [0, 1]; 0 for no requests.
  """
  return sum(slo.met(r) for r in requests) / len(requests) if requests else 0.0


def e2e(r) -> float | None:
  """End-to-end latency of a finished request: arrival to its finish (the last token, or the
  cancellation or error that ended it).

  Args:
    r: a request with .arrival and .finish_time.

  Returns:
    finish_time - arrival, or None before it finished.
  """
  return None if r.finish_time is None else r.finish_time - r.arrival


def percentiles(values: Iterable[float | None], qs: Sequence[float] = (50, 90, 99)) -> list[float]:
  """The qs-th percentiles of the values that are not None.

  Args:
    values: the values, None for a missing one.
    qs: the percentiles, in [0, 100].

  Returns:
    One float per q; NaN when there are no values.
  """
  xs = [v for v in values if v is not None]
  return [float(np.percentile(xs, q)) if xs else math.nan for q in qs]


def summary(requests: Sequence, slo: SLO) -> dict[str, float]:
  """TTFT and TPOT p50 and p90 (seconds) and the share that met the SLO.

  Args:
    requests: finished requests, with .ttft and .tpot.
    slo: the targets.

  Returns:
    {"ttft50", "ttft90", "tpot50", "tpot90", "met"}.
  """
  (ttft50, ttft90), (tpot50, tpot90) = (
      percentiles((getattr(r, m) for r in requests), (50, 90)) for m in ("ttft", "tpot")
  )
  return {
      "ttft50": ttft50,
      "ttft90": ttft90,
      "tpot50": tpot50,
      "tpot90": tpot90,
      "met": attainment(requests, slo),
  }


@dataclasses.dataclass
class Search:
  goodput: float  # the highest probed rate that met the SLO (0: none did)
  tried: dict[float, float]  # rate -> attainment, in probe order
  above: float | None  # the lowest probed rate above `goodput` that missed it (None: none did)


class GoodputSearch:
  """The highest rate whose attainment reaches `target`, one probe at a time (so that searches of
  several systems can take turns on a noisy machine): probes `rates`, then doubles past the
  highest that passes or halves below the lowest that fails, then bisects (geometrically) until
  the bracket is within rel_tol or max_probes rates were probed."""

  def __init__(
      self, rates: Sequence[float], target: float = 0.9, rel_tol: float = 0.1, max_probes: int = 8
  ):
    if not rates or min(rates) <= 0:
      raise ValueError(f"rates={list(rates)} must be a non-empty list of positive rates")
    self.target, self.rel_tol, self.max_probes = target, rel_tol, max_probes
    self.tried: dict[float, float] = {}
    self._queue = sorted(set(float(r) for r in rates))

  def next_rate(self) -> float | None:
    """The next rate to probe, or None when the search is done."""
    self._queue = [r for r in self._queue if r not in self.tried]
    if len(self.tried) >= self.max_probes:
      return None
    if self._queue:
      return self._queue[0]
    lo, hi = self.bracket()
    if hi is None:
      return 2 * max(self.tried)
    if lo is None:
      return min(self.tried) / 2
    return None if hi / lo <= 1 + self.rel_tol else math.sqrt(lo * hi)

  def record(self, rate: float, attainment: float) -> None:
    """Records a probe's outcome.

    Args:
      rate: the probed rate.
      attainment: the share of its requests that met the SLO.
    """
    self.tried[rate] = attainment

  def bracket(self) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, lowest failing rate)."""
    failing = [r for r, a in self.tried.items() if a < self.target]
    hi = min(failing) if failing else None
    passing = [r for r, a in self.tried.items() if a >= self.target and (hi is None or r < hi)]
    return (max(passing) if passing else None), hi

  def result(self) -> Search:
    lo, hi = self.bracket()
    return Search(lo or 0.0, self.tried, hi)


def search_goodput(
    attain_at: Callable[[float], float],
    rates: Sequence[float],
    target: float = 0.9,
    rel_tol: float = 0.1,
    max_probes: int = 8,
) -> Search:
  """`GoodputSearch` run to the end with attain_at(rate) as the probe.

  Args:
    attain_at: rate -> attainment, one whole run at that rate.
    rates: the rates to probe first.
    target: the attainment a rate must reach.
    rel_tol: the bisection stops when the bracket is within this ratio.
    max_probes: the most rates probed.

  Returns:
    The `Search`: goodput, the rates tried and the lowest failing rate above it.

  Raises:
    ValueError: no rates, or one that is not positive.
  """
  search = GoodputSearch(rates, target, rel_tol, max_probes)
  while (rate := search.next_rate()) is not None:
    search.record(rate, attain_at(rate))
  return search.result()
