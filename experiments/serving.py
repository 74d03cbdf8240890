"""What the serving benches share: a finished request's times, the engine driven request by
request, the real-time driver, the length flags.

`experiments.serve_bench` (in-process systems and deployments) and `experiments.serve_client`
(the same workload over HTTP, `serve_bench --url`) both import this module and neither imports
the other back; it defines no flags, so any runner may import it.
"""

from __future__ import annotations

import dataclasses
import time

from jaxpipe.serve import slo
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.workload import Lengths, Work


@dataclasses.dataclass
class Done:
  arrival: float
  token_times: list[float]

  @property
  def ttft(self) -> float:
    return slo.ttft(self.arrival, self.token_times[0])

  @property
  def tpot(self) -> float | None:
    return slo.tpot(self.token_times[0], self.token_times[-1], len(self.token_times))


class Paged:
  """The engine, driven request by request."""

  def __init__(self, engine: Engine):
    self.engine, self.done, self.usage = engine, [], []

  def add(self, w: Work, t0: float) -> None:
    rid = self.engine.add_request(w.prompt, w.max_tokens, eos_id=None)
    self.engine.requests[rid].arrival = t0 + w.arrival

  def busy(self) -> bool:
    return self.engine.has_work()

  def step(self) -> None:
    self.engine.step()
    u = self.engine.kv_usage()
    self.usage.append((u["tokens"], u["slots"]))
    for r in self.engine.finished():
      self.done.append(Done(r.arrival, r.token_times))


def serve(system, work: list[Work]) -> float:
  """Runs the workload in real time; returns the makespan (first arrival to last token)."""
  pending, t0 = list(work), time.perf_counter()
  while pending or system.busy():
    now = time.perf_counter() - t0
    while pending and pending[0].arrival <= now:
      system.add(pending.pop(0), t0)
    if system.busy():
      system.step()
    elif pending:
      time.sleep(max(0.0, pending[0].arrival - now))
  return time.perf_counter() - t0 - work[0].arrival


def parse_lengths(args) -> tuple[Lengths, Lengths]:
  """--prompt and --output of `args` (a runner's flag values) as Lengths; one line if bad."""
  try:
    return Lengths.parse(args.prompt), Lengths.parse(args.output)
  except ValueError as e:
    raise SystemExit(f"--prompt/--output: {e}") from None
