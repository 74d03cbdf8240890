"""`pipeline.schedule=auto`: every schedule the run allows, priced with measured costs, ranked.
No JAX.

Candidates are every generator at every micro-batch count asked for, interleaved 1F1B at every
chunk count whose stages the layers (or, without layers, the cost file) allow. Each is lowered
to the tick tables the executor runs (`lower` with its default costs, as `api.lowered_for`
does) and priced by `costs.predict`; those whose predicted per-device memory passes the limit
are dropped, the rest ranked by predicted step time (then memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxpipe.pipeline.ir.lower import Lowered, lower
from jaxpipe.pipeline.ir.schedule import Schedule
from jaxpipe.pipeline.ir.schedules import SCHEDULE_NAMES, make_schedule
from jaxpipe.planning.costs import CostFile, Prediction

GB = 2**30


class AutoError(ValueError):
  """No candidate can run; the message says why and what to change."""


@dataclasses.dataclass
class Candidate:
  """One (schedule, chunks, micro-batches) choice, priced or with the reason it was dropped."""

  name: str
  chunks: int | None  # None: the generator's own count
  microbatches: int
  schedule: Schedule | None = None
  lowered: Lowered | None = None
  prediction: Prediction | None = None
  dropped: str = ""  # why it cannot run or was ruled out; empty if it may run

  @property
  def label(self) -> str:
    v = f" v={self.chunks}" if self.chunks else ""
    return f"{self.name}{v} m={self.microbatches}"

  @property
  def stages(self) -> int | None:
    return self.schedule.num_stages if self.schedule else None


@dataclasses.dataclass
class Ranking:
  """Candidates, runnable ones first by predicted step time; `best` is the choice."""

  candidates: list[Candidate]
  memory_limit: float | None  # bytes per device; None: no limit

  @property
  def ranked(self) -> list[Candidate]:
    return [c for c in self.candidates if not c.dropped]

  @property
  def best(self) -> Candidate:
    return self.ranked[0]

  def table(self) -> str:
    """One line per candidate: predicted step, its parts, bubble, memory, or why it was dropped."""
    head = (
        f"{'rank':>4}  {'candidate':<24}{'step ms':>9}{'lock-step':>10}{'CPU ms':>9}"
        f"{'ticks':>6}{'bubble':>8}{'memory MB':>10}  note"
    )
    lines = [head]
    for i, c in enumerate(self.candidates):
      pos = f"{i + 1:>4}" if not c.dropped else f"{'-':>4}"
      pr = c.prediction
      if pr is None:
        lines.append(
            f"{pos}  {c.label:<24}{'':>9}{'':>10}{'':>9}{'':>6}{'':>8}{'':>10}  {c.dropped}"
        )
        continue
      cpu = f"{1e3 * pr.cpu_s:>9.2f}" if pr.cpu_s is not None else f"{'':>9}"
      lines.append(
          f"{pos}  {c.label:<24}{1e3 * pr.step_s:>9.2f}{1e3 * pr.lockstep_s:>10.2f}"
          f"{cpu}{c.lowered.num_ticks:>6}{100 * pr.bubble:>7.1f}%"
          f"{pr.memory_bytes / 2**20:>10.2f}  {c.dropped}"
      )
    return "\n".join(lines)

  def model_text(self) -> str:
    b = self.best.prediction
    if b.model == "shared cores":
      return (
          "step ms: the devices share the host's cores, so a tick costs its ranks' CPU "
          "seconds together (CPU ms) over the cores; lock-step: what parallel devices "
          "would take (each tick its slowest rank)"
      )
    return "step ms: lock-step, each tick as long as its slowest rank, plus its ppermutes"

  def reason(self) -> str:
    """Why the best candidate won, against the runner-up."""
    best = self.best
    b = best.prediction
    limit = f", within the {self.memory_limit / GB:g} GB limit" if self.memory_limit else ""
    text = (
        f"auto chose {best.label}: predicted {1e3 * b.step_s:.2f} ms per step ({b.model}; "
        f"{best.lowered.num_ticks} ticks at {100 * b.bubble:.1f}% lock-step bubble), "
        f"{b.memory_bytes / 2**20:.2f} MB per device{limit}"
    )
    over = [c for c in self.candidates if c.dropped.startswith("over")]
    if over:
      text += f"; {len(over)} ruled out by memory ({', '.join(c.label for c in over)})"
    if len(self.ranked) > 1:
      r = self.ranked[1]
      q = r.prediction
      gap = 100 * (q.step_s / b.step_s - 1) if b.step_s else 0.0
      if abs(q.step_s - b.step_s) <= 1e-12:
        text += (
            f". {r.label} ties with it; it ranks first on memory "
            f"({b.memory_bytes / 2**20:.2f} vs {q.memory_bytes / 2**20:.2f} MB), then on "
            "the generators' order"
        )
      else:
        why = [
            f"{best.lowered.num_ticks} vs {r.lowered.num_ticks} ticks",
            f"lock-step bubble {100 * b.bubble:.1f}% vs {100 * q.bubble:.1f}%",
        ]
        if b.cpu_s is not None and q.cpu_s is not None:
          why.append(f"{1e3 * b.cpu_s:.2f} vs {1e3 * q.cpu_s:.2f} ms of CPU")
        if abs(b.overhead_s - q.overhead_s) > 1e-12:
          why.append(
              f"{1e3 * abs(q.overhead_s - b.overhead_s):.2f} ms "
              f"{'less' if b.overhead_s < q.overhead_s else 'more'} in per-tick overhead"
          )
        text += (
            f". Runner-up {r.label} at {1e3 * q.step_s:.2f} ms ({gap:.1f}% slower): "
            + ", ".join(why)
        )
    return text

  def report(self) -> str:
    return f"{self.table()}\n{self.model_text()}\n{self.reason()}"


def chunk_choices(
    name: str, pp: int, layers: int | None, stage_counts: Sequence[int] = ()
) -> list[int | None]:
  """Chunk counts to try for one generator.

  The generator's own count, or for interleaved 1F1B every v >= 2 whose pp*v stages split the
  layers (without layers: whose stage count is in `stage_counts`).

  Args:
    name: the generator's name (one of SCHEDULE_NAMES).
    pp: pipeline ranks.
    layers: layer units every stage count must divide, or None.
    stage_counts: stage counts the cost file has, used when `layers` is None.

  Returns:
    [None] (the generator's own count) for any generator but interleaved 1F1B; for it the
    counts v in increasing order, possibly none.
  """
  if name != "interleaved-1f1b":
    return [None]
  if layers is not None:
    return [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
  return sorted({s // pp for s in stage_counts if s % pp == 0 and s > pp})


def candidates(
    pp: int,
    microbatches: Sequence[int],
    names: Sequence[str] = SCHEDULE_NAMES,
    layers: int | None = None,
    stage_counts: Sequence[int] = (),
) -> list[Candidate]:
  """Every (generator, chunks, micro-batches) built from the IR.

  Those the generator refuses, that have no chunk count, or whose stages do not split `layers`
  come back with the reason in `dropped`.

  Args:
    pp: pipeline ranks.
    microbatches: micro-batch counts to try.
    names: generators to try (SCHEDULE_NAMES).
    layers: layer units every stage count must divide, or None.
    stage_counts: the cost file's stage counts (`chunk_choices` without `layers`).

  Returns:
    The candidates, by micro-batch count, then generator, then chunk count.

  Raises:
    AutoError: no micro-batch count, no name, or a name that is not a generator.
  """
  if not microbatches:
    raise AutoError("no micro-batch counts to choose from; give at least one")
  unknown = [n for n in names if n not in SCHEDULE_NAMES]
  if unknown or not names:
    raise AutoError(f"auto chooses among {', '.join(SCHEDULE_NAMES)}; got {list(names)}")
  out = []
  for m in microbatches:
    for name in names:
      choices = chunk_choices(name, pp, layers, stage_counts)
      if not choices:
        out.append(
            Candidate(
                name,
                None,
                m,
                dropped=(
                    f"no chunk count v >= 2 splits {layers} layers into pp*v stages"
                    if layers
                    else "the cost file has no stage count for two or more chunks per rank"
                ),
            )
        )
      for v in choices:
        c = Candidate(name, v, m)
        out.append(c)
        try:
          c.schedule = make_schedule(name, pp=pp, microbatches=m, chunks=v)
        except ValueError as e:
          c.dropped = f"cannot run: {e}"
          continue
        if layers is not None and layers % c.stages:
          c.dropped = f"{layers} layers do not split into its {c.stages} stages"
  return out


def rank(
    pp: int,
    microbatches: Sequence[int],
    costs: CostFile,
    memory_limit: float | None = None,
    layers: int | None = None,
    names: Sequence[str] = SCHEDULE_NAMES,
) -> Ranking:
  """Prices every candidate with the cost file and ranks them.

  Args:
    pp: pipeline ranks.
    microbatches: micro-batch counts to try.
    costs: the measured cost file; candidates it has no entry for are dropped.
    memory_limit: bytes per device; candidates predicted to need more are dropped. None: no
      limit.
    layers: layer units each stage count must divide (None: any the cost file has).
    names: generators to try.

  Returns:
    The `Ranking`: runnable candidates first by predicted step time (then memory), then the
    dropped ones.

  Raises:
    AutoError: none can run; naming the smallest memory need when the limit is what rules them
      all out.
  """
  cands = candidates(pp, microbatches, names, layers, [e.stages for e in costs.entries])
  for c in cands:
    if c.dropped:
      continue
    m, s = c.microbatches, c.stages
    if not costs.has(m, s):
      c.dropped = f"no measured costs for m={m} over {s} stages in {costs.path}"
      continue
    c.lowered = lower(c.schedule)
    c.prediction = costs.predict(c.lowered)
    need = c.prediction.memory_bytes
    if memory_limit is not None and need > memory_limit:
      c.dropped = f"over the memory limit: needs {need / GB:.3g} GB > {memory_limit / GB:g} GB"
  key = lambda c: (
      bool(c.dropped),
      c.prediction is None,
      (c.prediction.step_s, c.prediction.memory_bytes) if c.prediction else (0, 0),
  )
  ranking = Ranking(sorted(cands, key=key), memory_limit)
  over = [c for c in cands if c.dropped.startswith("over")]
  if not ranking.ranked and over:
    low = min(over, key=lambda c: c.prediction.memory_bytes)
    raise AutoError(
        f"memory limit {memory_limit / GB:g} GB per device rules out every schedule;"
        f" the smallest need is {low.prediction.memory_bytes / GB:.3g} GB "
        f"({low.label}); raise the limit to at least that"
    )
  require_runnable(cands, pp)
  return ranking


def require_runnable(cands: Sequence[Candidate], pp: int) -> None:
  """Checks that some candidate is left.

  Args:
    cands: the candidates, each priced or dropped.
    pp: pipeline ranks, for the message.

  Raises:
    AutoError: every candidate was dropped; the message says why.
  """
  if any(not c.dropped for c in cands):
    return
  ms = sorted({c.microbatches for c in cands})
  split = [c for c in cands if "do not split" in c.dropped]
  rest = [c for c in cands if c not in split]
  why = []
  if split:
    counts = sorted({c.stages for c in split})
    why.append(
        f"the layers split into none of the stage counts {counts} ({len(split)} "
        f"candidates; e.g. {split[0].label}: {split[0].dropped})"
    )
  if rest:
    why.append(f"{len(rest)} others dropped (e.g. {rest[0].label}: {rest[0].dropped})")
  raise AutoError(f"no schedule can run on pp={pp} with micro-batches {ms}: " + "; ".join(why))


def choice_config(best: Candidate) -> Mapping[str, object]:
  """The `pipeline` fields that run the chosen candidate.

  Args:
    best: the chosen candidate.

  Returns:
    {'schedule': name, 'microbatches': m, 'chunks': v}, chunks 1 for the generator's own count.
  """
  return {"schedule": best.name, "microbatches": best.microbatches, "chunks": best.chunks or 1}
