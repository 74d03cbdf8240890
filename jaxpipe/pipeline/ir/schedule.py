"""Schedule IR: per-rank ordered actions over a stage->rank placement. Pure Python, no JAX.

Stages in actions are *virtual* stages: positions along a micro-batch's route. A placement
maps each virtual stage to the rank that runs it and to the model stage (block of layers)
it computes, so interleaved (VPP), V-shaped and bidirectional (two copies of every model
stage, as in Chimera and DualPipe) layouts are all the same table.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping, Sequence

KINDS = ("F", "B", "I", "W")  # forward, full backward, input gradient, weight gradient


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One unit of work: `kind` of virtual stage `stage` on micro-batch `microbatch`."""

  kind: str  # one of KINDS
  stage: int  # virtual stage, 0 <= stage < placement.num_virtual_stages
  microbatch: int  # 0 <= microbatch < schedule.num_microbatches

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"action kind {self.kind!r} is not one of {KINDS}")

  def parts(self) -> tuple[Action, ...]:
    return (self,)

  def __str__(self) -> str:  # torch.distributed.pipelining notation, e.g. 2F0, 3I1
    return f"{self.stage}{self.kind}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Overlap:
  """A forward and a backward of different micro-batches run as one step (DualPipe's F&B)."""

  forward: Action  # kind F
  backward: Action  # kind B or I

  kind = "F&B"

  def __post_init__(self):
    if self.forward.kind != "F" or self.backward.kind not in ("B", "I"):
      raise ValueError(
          f"an overlapped pair is a forward and a backward (B or I), got "
          f"{self.forward} and {self.backward}"
      )

  def parts(self) -> tuple[Action, ...]:
    return (self.forward, self.backward)

  def __str__(self) -> str:
    return f"({self.forward};{self.backward})OVERLAP_F_B"


Op = Action | Overlap


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where each virtual stage runs, which model stage it computes, and the micro-batch routes."""

  num_ranks: int  # pipeline ranks (devices on the pipeline axis)
  stage_rank: tuple[int, ...]  # virtual stage -> rank
  stage_model: tuple[int, ...]  # virtual stage -> model stage (block of layers)
  routes: tuple[tuple[int, ...], ...]  # each: the virtual stages a micro-batch passes, in order

  def __post_init__(self):
    n = len(self.stage_rank)
    if len(self.stage_model) != n:
      raise ValueError(f"stage_rank has {n} entries but stage_model has {len(self.stage_model)}")
    if any(not 0 <= r < self.num_ranks for r in self.stage_rank):
      raise ValueError(f"stage_rank {self.stage_rank} names a rank outside [0, {self.num_ranks})")
    models = sorted(set(self.stage_model))
    if models != list(range(len(models))):
      raise ValueError(f"model stages {models} must be 0..{len(models) - 1} with none missing")
    for route in self.routes:
      if sorted(self.stage_model[s] for s in route) != models:
        raise ValueError(f"route {route} must pass every model stage once, in order")
      if [self.stage_model[s] for s in route] != models:
        raise ValueError(f"route {route} visits model stages out of order")
    counts = [self.stage_rank.count(r) for r in range(self.num_ranks)]
    if len(set(counts)) != 1:
      raise ValueError(
          f"ranks hold unequal numbers of stages {counts}; every rank must hold "
          "the same number of chunks"
      )

  @property
  def num_virtual_stages(self) -> int:
    return len(self.stage_rank)

  @property
  def num_stages(self) -> int:
    """Model stages (blocks of layers) the schedule expects."""
    return max(self.stage_model) + 1

  @property
  def chunks_per_rank(self) -> int:
    return self.num_virtual_stages // self.num_ranks

  @property
  def copies(self) -> int:
    """Parameter copies of each model stage (2 for bidirectional placements)."""
    return self.num_virtual_stages // self.num_stages

  @functools.cached_property
  def _rank_stages(self) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(s for s in range(self.num_virtual_stages) if self.stage_rank[s] == r)
        for r in range(self.num_ranks)
    )

  @functools.cached_property
  def route_positions(self) -> tuple[dict[int, int], ...]:
    """[route] -> {virtual stage: its position along the route}."""
    return tuple({s: i for i, s in enumerate(route)} for route in self.routes)

  def rank_stages(self, rank: int) -> tuple[int, ...]:
    """Virtual stages on `rank`, in ascending order; position = local chunk index.

    Args:
      rank: the rank.

    Returns:
      The stages.
    """
    return self._rank_stages[rank]

  def local_chunk(self, stage: int) -> int:
    """The local chunk index of a virtual stage on its rank.

    Args:
      stage: the virtual stage.

    Returns:
      Its position among `rank_stages` of its rank.
    """
    return self._rank_stages[self.stage_rank[stage]].index(stage)

  def stage_copy(self, stage: int) -> int:
    """Which copy of its model stage a virtual stage holds (0 or 1 in bidirectional layouts).

    Args:
      stage: the virtual stage.

    Returns:
      The number of earlier virtual stages with the same model stage.
    """
    return sum(1 for s in range(stage) if self.stage_model[s] == self.stage_model[stage])

  @classmethod
  def interleaved(cls, num_ranks: int, chunks: int = 1) -> Placement:
    """Stage s on rank s % p: plain for one chunk, Megatron's interleaved (VPP) for several.

    Args:
      num_ranks: p.
      chunks: chunks per rank.

    Returns:
      The `Placement` of p * chunks stages, one route through all of them.
    """
    n = num_ranks * chunks
    return cls(
        num_ranks, tuple(s % num_ranks for s in range(n)), tuple(range(n)), (tuple(range(n)),)
    )

  @classmethod
  def vshape(cls, num_ranks: int) -> Placement:
    """2p stages, down then up: stage s on rank s for s < p, on rank 2p-1-s after (ZB-V, DualPipeV).

    Args:
      num_ranks: p.

    Returns:
      The `Placement`, one route through all 2p stages.
    """
    p = num_ranks
    ranks = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return cls(p, ranks, tuple(range(2 * p)), (tuple(range(2 * p)),))

  @classmethod
  def bidirectional(cls, num_ranks: int) -> Placement:
    """Two copies of p model stages: virtual stage s on rank s, virtual p+s on rank p-1-s.

    Route 0 runs down (ranks 0..p-1), route 1 up (ranks p-1..0); this is also how the torch CSV
    writes a bidirectional schedule, as a 2p-stage pipeline.

    Args:
      num_ranks: p.

    Returns:
      The `Placement`.
    """
    p = num_ranks
    ranks = tuple(range(p)) + tuple(p - 1 - s for s in range(p))
    return cls(p, ranks, tuple(range(p)) * 2, (tuple(range(p)), tuple(range(p, 2 * p))))


@dataclasses.dataclass
class Schedule:
  """A pipeline schedule: per rank, the ordered ops it runs."""

  name: str
  placement: Placement
  num_microbatches: int
  ranks: tuple[tuple[Op, ...], ...]  # ranks[r] = ops of rank r in order
  microbatch_route: tuple[int, ...] = ()  # micro-batch -> index into placement.routes
  options: dict = dataclasses.field(default_factory=dict)  # generator parameters, for reports

  def __post_init__(self):
    self.ranks = tuple(tuple(ops) for ops in self.ranks)
    if not self.microbatch_route:
      self.microbatch_route = (0,) * self.num_microbatches
    self.microbatch_route = tuple(self.microbatch_route)
    if len(self.microbatch_route) != self.num_microbatches:
      raise ValueError(
          f"microbatch_route has {len(self.microbatch_route)} entries for "
          f"{self.num_microbatches} micro-batches"
      )
    if len(self.ranks) != self.placement.num_ranks:
      raise ValueError(
          f"schedule lists {len(self.ranks)} ranks, placement has {self.placement.num_ranks}"
      )

  @property
  def num_ranks(self) -> int:
    return self.placement.num_ranks

  @property
  def num_stages(self) -> int:
    """Model stages the schedule expects (stage_params has this leading size)."""
    return self.placement.num_stages

  def route(self, microbatch: int) -> tuple[int, ...]:
    """The virtual stages a micro-batch runs through, in order.

    Args:
      microbatch: the micro-batch.

    Returns:
      Its route's stages.
    """
    return self.placement.routes[self.microbatch_route[microbatch]]

  def actions(self) -> Iterator[tuple[int, int, Action]]:
    """Yields (rank, position in rank's list, action) for every action, overlaps unpacked."""
    for r, ops in enumerate(self.ranks):
      for i, op in enumerate(ops):
        for a in op.parts():
          yield r, i, a

  def validate(self) -> Schedule:
    from jaxpipe.pipeline.ir.validate import validate

    validate(self)
    return self

  def same_ops(self, other: Schedule) -> bool:
    """Same placement, micro-batches, routes and per-rank ops (names and options aside).

    Args:
      other: the schedule to compare with.

    Returns:
      True if they run the same ops.
    """
    return (
        self.placement == other.placement
        and self.ranks == other.ranks
        and self.num_microbatches == other.num_microbatches
        and self.microbatch_route == other.microbatch_route
    )

  def simulate(
      self, costs: Mapping[str, float] | None = None, lockstep: bool = False, latency: float = 0.0
  ):
    """Simulated timelines, bubble and activations; see jaxpipe.pipeline.ir.simulate.

    Args:
      costs: per-kind costs; None: the defaults (F = I = W = 1, B = I + W).
      lockstep: SPMD ticks instead of asynchronous execution.
      latency: cross-rank latency.

    Returns:
      The `SimResult`.
    """
    from jaxpipe.pipeline.ir.simulate import simulate

    return simulate(self, costs=costs, lockstep=lockstep, latency=latency)

  def to_csv(self, grid: str = "lockstep") -> str:
    """torch.distributed.pipelining's CSV; see jaxpipe.pipeline.ir.export.to_csv.

    Args:
      grid: 'lockstep' (empty cells are the bubble) or 'order' (no idle cells).

    Returns:
      The CSV text.
    """
    from jaxpipe.pipeline.ir.export import to_csv

    return to_csv(self, grid=grid)

  @classmethod
  def from_csv(cls, text_or_path: str | os.PathLike, name: str | None = None) -> Schedule:
    """Loads (and validates) a schedule from torch's CSV text or a path to it.

    Args:
      text_or_path: the CSV text, or the path of a file holding it.
      name: the schedule's name; None: the file's name ('csv' for text).

    Returns:
      The validated `Schedule`.

    Raises:
      FileNotFoundError: a .csv path that does not exist.
      ValueError: a CSV that cannot be read as a schedule, or an invalid one.
    """
    from jaxpipe.pipeline.ir.export import from_csv

    return from_csv(text_or_path, name=name)

  def to_perfetto(self, costs: Mapping[str, float] | None = None, lockstep: bool = False) -> str:
    """Chrome trace JSON (opens in Perfetto); see jaxpipe.pipeline.ir.export.to_perfetto.

    Args:
      costs: per-kind costs; None: the defaults.
      lockstep: the lock-step timeline instead of the asynchronous one.

    Returns:
      The trace as JSON text.
    """
    from jaxpipe.pipeline.ir.export import to_perfetto

    return to_perfetto(self, costs=costs, lockstep=lockstep)

  def to_grid(self, mark: Sequence[tuple[int, int]] = (), aligned: bool = False) -> str:
    """Text grid, one row per rank, one column per position in the rank's list.

    Args:
      mark: (rank, position) cells to mark as >op< (with `aligned`, none are marked).
      aligned: one column per lock-step tick instead, so idle cells show the bubble.

    Returns:
      The grid, a header line first.
    """
    if aligned:
      from jaxpipe.pipeline.ir.export import text_grid

      return text_grid(self)
    width = max([len(str(op)) for ops in self.ranks for op in ops] + [1]) + 3
    steps = max([len(ops) for ops in self.ranks] + [0])
    marked = set(mark)
    lines = ["step   " + "".join(f"{i:<{width}}" for i in range(steps))]
    for r, ops in enumerate(self.ranks):
      cells = []
      for i in range(steps):
        text = str(ops[i]) if i < len(ops) else ""
        cells.append(f"{('>' + text + '<') if (r, i) in marked else text:<{width}}")
      lines.append(f"rank {r:<2}" + "".join(cells).rstrip())
    return "\n".join(lines)
