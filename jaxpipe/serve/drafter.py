"""A smaller model as the drafter of speculative decoding (`speculative.SpecConfig(method=
"draft", drafter=ModelDrafter(...))`).

The drafter runs its own paged `Engine` (its own pages and programs) in which each target
request that speculates has a mirror. Before a target step, each mirror is rewound to its
request's tokens (the K/V of what they share stay cached; what the target rejected is
recomputed), and the mirrors decode greedily, one token a drafter step, until each has its
drafts. Mirrors not drafting sit out of the drafter's batch, their pages kept. The drafter's
tokens are greedy, so the target keeps each with its own probability of it
(`speculative.verify`) and its distribution stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.request import FINISHED, PREFILLED, RUNNING, WAITING, Request
from jaxpipe.serve.sampling import SamplingParams


class ModelDrafter:
  """Greedy drafts from a smaller model that shares the target's tokenizer (`Drafter`)."""

  def __init__(self, cfg: TransformerConfig, params: dict, **engine_fields):
    """cfg, params: the draft model; engine_fields: its engine's settings (`EngineConfig`:
    pages, batch, context; async scheduling and the prefix cache are off)."""
    self.engine = Engine(
        cfg, params, async_scheduling=False, prefix_caching=False, eos_id=None, **engine_fields
    )
    self._mirrors: dict[int, int] = {}  # target request id -> the drafter's

  def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
    """Each request's greedy continuation by the draft model.

    Args:
      requests: the target's requests that may speculate.
      limits: the most drafts each may take.

    Returns:
      Their drafts; [] for a request the drafter cannot hold (context or pages).
    """
    e = self.engine
    want: dict[int, int] = {}  # drafter id -> drafts wanted
    for r, k in zip(requests, limits):
      mid = self._mirror(r)
      if mid is not None and k > 0:
        want[mid] = k
    got: dict[int, list[int]] = {mid: [] for mid in want}
    for _ in range(max(want.values(), default=0) + 2):  # + the catch-up chunk (and a spare)
      if all(len(got[mid]) >= k for mid, k in want.items()):
        break
      for mid, tokens in e.step().items():
        got[mid] += tokens
        if mid in want and len(got[mid]) >= want[mid] and e.requests[mid].state == RUNNING:
          e.pause(mid)  # enough: out of the drafter's batch until the next proposal
    for mid in want:
      if e.requests[mid].state == RUNNING:
        e.pause(mid)
    return [got.get(self._mirrors.get(r.id), [])[:k] for r, k in zip(requests, limits)]

  def _mirror(self, r: Request) -> int | None:
    """The drafter's request following r, rewound to r's tokens and in the drafter's batch
    (or waiting to join it); None if the drafter cannot hold r now."""
    e = self.engine
    mid = self._mirrors.get(r.id)
    if mid is not None and e.requests[mid].state == FINISHED:
      del self._mirrors[r.id]  # it reached the drafter's context: start again
      mid = None
    if mid is None:  # a new mirror: the request's tokens so far are its prompt
      tokens = r.tokens
      left = e.max_seq_len - len(tokens)
      if left < 1 or e.check_request(tokens, left, SamplingParams(), None) is not None:
        return None
      self._mirrors[r.id] = e.add_request(tokens, left, SamplingParams(), eos_id=None)
      return self._mirrors[r.id]
    m = e.requests[mid]
    if m.state == WAITING:  # not admitted yet (the drafter's batch or pages were full)
      return None
    e.rewind(mid, r.tokens[len(m.prompt) :])
    if m.state == PREFILLED:
      if not e.scheduler.has_slot():
        return None
      e.resume(mid)
    return mid

  def forget(self, rid: int) -> None:
    """Cancels the mirror of a target request that finished.

    Args:
      rid: the target request's id.
    """
    mid = self._mirrors.pop(rid, None)
    if mid is not None:
      self.engine.cancel(mid)
      self.engine.finished()
