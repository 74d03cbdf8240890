"""Seeded serving workloads: Poisson arrivals, prompt and output lengths, CSV traces in and out.

  from jaxpipe.serve import workload
  work = workload.generate(64, rate=8.0, prompt=workload.Lengths.parse("8:96"),
                           output=workload.Lengths.parse("lognormal:64:512"), vocab=256, seed=0)
  workload.write_csv("trace.csv", work)
  work = workload.read_csv("trace.csv", vocab=256, seed=0)   # the same requests back

Lengths: "64" (fixed), "8:96" (uniform, inclusive) or "lognormal:MEDIAN:MAX[:SIGMA]" (a
long-tailed, trace-like distribution: round(MEDIAN * exp(SIGMA * N(0, 1))) clipped to
[1, MAX], SIGMA 1 by default; chat traces such as ShareGPT's have roughly lognormal lengths).
A trace CSV has a header and the columns `arrival_s,prompt_len,output_len[,prompt]`: arrival in
seconds from the start (non-decreasing), lengths in tokens and, optionally, the prompt's token ids
separated by spaces (absent: drawn from the seed). `write_csv` writes all four.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os

import numpy as np

COLUMNS = ("arrival_s", "prompt_len", "output_len", "prompt")


@dataclasses.dataclass
class Work:
  """One request of a workload."""

  arrival: float  # seconds after the start
  prompt: list[int]
  max_tokens: int  # generated to exactly this length (no EOS)


@dataclasses.dataclass(frozen=True)
class Lengths:
  """A distribution of token counts (see the module docstring for the spec strings)."""

  kind: str  # 'fixed', 'uniform' or 'lognormal'
  low: int  # fixed: the length; uniform: the minimum; lognormal: the median
  high: int  # uniform and lognormal: the maximum
  sigma: float = 1.0  # lognormal: the standard deviation of log(length)

  @classmethod
  def parse(cls, spec: str) -> Lengths:
    """A distribution from its spec string (module docstring).

    Args:
      spec: "N" (fixed), "MIN:MAX" (uniform, inclusive) or "lognormal:MEDIAN:MAX[:SIGMA]".

    Returns:
      The `Lengths`.

    Raises:
      ValueError: a spec of another form, or one without 1 <= MIN (MEDIAN) <= MAX and SIGMA > 0.
    """
    parts = str(spec).split(":")
    try:
      if parts[0] == "lognormal" and len(parts) in (3, 4):
        out = cls(
            "lognormal", int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) == 4 else 1.0
        )
      elif len(parts) == 1:
        out = cls("fixed", int(parts[0]), int(parts[0]))
      elif len(parts) == 2:
        out = cls("uniform", int(parts[0]), int(parts[1]))
      else:
        raise ValueError
    except ValueError:
      raise ValueError(
          f"length spec {spec!r} is not N, MIN:MAX or lognormal:MEDIAN:MAX[:SIGMA] "
          "(positive integers)"
      ) from None
    if not 1 <= out.low <= out.high or not out.sigma > 0:
      low = "MEDIAN" if parts[0] == "lognormal" else "MIN"
      raise ValueError(f"length spec {spec!r} needs 1 <= {low} <= MAX and SIGMA > 0")
    return out

  def sample(self, rng: np.random.Generator) -> int:
    """One token count.

    Args:
      rng: the generator to draw from.

    Returns:
      The count, in [low, high] (lognormal: round(MEDIAN * exp(SIGMA * N(0, 1))) clipped to
      [1, MAX]).
    """
    if self.kind == "fixed":
      return self.low
    if self.kind == "uniform":
      return int(rng.integers(self.low, self.high + 1))
    length = round(self.low * math.exp(self.sigma * rng.standard_normal()))
    return int(min(max(length, 1), self.high))

  def __str__(self) -> str:
    if self.kind == "fixed":
      return str(self.low)
    if self.kind == "uniform":
      return f"U[{self.low}, {self.high}]"
    return f"lognormal(median {self.low}, sigma {self.sigma:g}, max {self.high})"


def generate(
    n: int, rate: float, prompt: Lengths, output: Lengths, vocab: int, seed: int
) -> list[Work]:
  """n requests, Poisson arrivals at `rate` per second (exponential gaps, mean 1/rate).

  The gaps are drawn first, so the same seed at another rate gives the same requests, their
  arrivals scaled by the ratio of the rates.

  Args:
    n: requests, >= 1.
    rate: requests per second, > 0.
    prompt: the prompts' lengths.
    output: the outputs' lengths.
    vocab: prompt tokens are drawn from [0, vocab).
    seed: the generator's seed.

  Returns:
    The requests, by arrival.

  Raises:
    ValueError: n below 1 or a rate not above 0.
  """
  if n < 1 or not rate > 0:
    raise ValueError(f"a workload needs n >= 1 requests (got {n}) and rate > 0 (got {rate})")
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
  work = []
  for a in arrivals:
    tokens = list(map(int, rng.integers(0, vocab, prompt.sample(rng))))
    work.append(Work(float(a), tokens, output.sample(rng)))
  return work


def at_rate(work: list[Work], rate: float) -> list[Work]:
  """The same requests (a trace's) with arrivals scaled so that requests / last arrival = rate.

  Args:
    work: the requests, by arrival.
    rate: requests per second, > 0.

  Returns:
    New requests, arrivals scaled.

  Raises:
    ValueError: a rate not above 0.
  """
  if not rate > 0:
    raise ValueError(f"rate={rate} must be > 0")
  scale = work[-1].arrival / len(work) * rate
  return [dataclasses.replace(w, arrival=w.arrival / scale) for w in work]


def write_csv(path: str | os.PathLike, work: list[Work]) -> None:
  """Writes a trace CSV: the header and all four columns (module docstring).

  Args:
    path: the file to write.
    work: the requests.
  """
  with open(path, "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(COLUMNS)
    for w in work:
      out.writerow((repr(w.arrival), len(w.prompt), w.max_tokens, " ".join(map(str, w.prompt))))


def read_csv(path: str | os.PathLike, vocab: int, seed: int = 0) -> list[Work]:
  """The requests of a trace CSV.

  Args:
    path: the trace (module docstring).
    vocab: the model's vocabulary: prompt tokens must lie in [0, vocab), and absent ones are
      drawn from it.
    seed: the generator's seed, for absent prompts.

  Returns:
    The requests, by arrival.

  Raises:
    ValueError: naming the file, line and value when malformed (a wrong header or field count,
      a bad or decreasing arrival, a length below 1, a prompt that does not match its length or
      the vocabulary), or when the trace holds no requests.
  """
  rng = np.random.default_rng(seed)
  work: list[Work] = []
  with open(path, newline="") as f:
    rows = csv.reader(f)
    header = next(rows, None)
    if (
        header is None
        or [h.strip() for h in header[:3]] != list(COLUMNS[:3])
        or len(header) > 4
        or (len(header) == 4 and header[3].strip() != COLUMNS[3])
    ):
      raise ValueError(f"{path}:1: header {header} must be {','.join(COLUMNS[:3])}[,prompt]")
    for line, row in enumerate(rows, start=2):
      if not row:
        continue
      where = f"{path}:{line}"
      if len(row) not in (3, len(header)) or len(row) > 4:
        raise ValueError(f"{where}: {len(row)} fields {row}; expected {','.join(header)}")
      try:
        arrival = float(row[0])
      except ValueError:
        raise ValueError(f"{where}: arrival_s={row[0]!r} is not a number") from None
      if not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"{where}: arrival_s={row[0]} must be a finite number >= 0")
      if work and arrival < work[-1].arrival:
        raise ValueError(
            f"{where}: arrival_s={row[0]} is before the previous row's "
            f"{work[-1].arrival}; sort the trace by arrival"
        )
      lengths = []
      for name, value in (("prompt_len", row[1]), ("output_len", row[2])):
        try:
          lengths.append(int(value))
        except ValueError:
          raise ValueError(f"{where}: {name}={value!r} is not an integer") from None
        if lengths[-1] < 1:
          raise ValueError(f"{where}: {name}={value} must be >= 1")
      if len(row) == 4 and row[3].strip():
        try:
          tokens = [int(t) for t in row[3].split()]
        except ValueError:
          raise ValueError(
              f"{where}: prompt {row[3]!r} is not token ids separated by spaces"
          ) from None
        if len(tokens) != lengths[0]:
          raise ValueError(
              f"{where}: prompt has {len(tokens)} tokens, prompt_len says {lengths[0]}"
          )
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
          raise ValueError(f"{where}: prompt token {bad[0]} is outside the vocabulary [0, {vocab})")
      else:
        tokens = list(map(int, rng.integers(0, vocab, lengths[0])))
      work.append(Work(arrival, tokens, lengths[1]))
  if not work:
    raise ValueError(f"{path}: the trace holds no requests")
  return work
