"""Where a deployment's requests go, for `serve.deploy` and `serve.sim` alike (pure Python).

Two decisions, each over workers that expose their `scheduler.Scheduler` as `.scheduler`:

- `entry_worker`: a new request goes to the least-loaded worker that takes new requests: on
  prefill workers (disaggregated) the fewest prompt tokens left to compute (`tokens_left`: a
  prefill step's cost grows with its tokens), on colocated workers the fewest requests waiting
  or running (`held`); ties go to the first worker.
- `decode_worker`: a prefilled request of `pages` pages moves to a decode worker that has a
  free batch slot and that many free pages; of those, the one with the MOST free pages (least
  loaded by KV memory, so the next long request still fits somewhere), ties to the one with the
  fewest running requests, then the first; None if none can take it now (it waits, pages held,
  on its prefill worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from jaxpipe.serve.scheduler import Scheduler


class HasScheduler(Protocol):
  scheduler: Scheduler


W = TypeVar("W", bound=HasScheduler)


def entry_worker(workers: Sequence[W], prefill: bool) -> W:
  """The worker a new request goes to (module docstring).

  Args:
    workers: the workers that take new requests.
    prefill: the disaggregated entry side: the fewest prompt tokens left to compute; else the
      fewest requests waiting or running.

  Returns:
    The least-loaded worker; ties go to the first.
  """
  if prefill:
    return min(workers, key=lambda w: w.scheduler.tokens_left())
  return min(workers, key=lambda w: w.scheduler.held())


def decode_worker(workers: Sequence[W], pages: int) -> W | None:
  """The decode worker a prefilled request of `pages` pages moves to, or None for now.

  Of those with a free batch slot and that many free pages, the one with the most free pages,
  ties to the fewest running requests, then the first.

  Args:
    workers: the decode workers.
    pages: the request's pages.

  Returns:
    The worker, or None if none can take it now.
  """
  # Pages first: the engine's check may reclaim prefix-cache pages, which `num_free` then counts.
  fits = [w for w in workers if w.scheduler.pages.can_alloc(pages) and w.scheduler.has_slot()]
  if not fits:
    return None
  return max(fits, key=lambda w: (w.scheduler.pages.num_free, -len(w.scheduler.running)))
