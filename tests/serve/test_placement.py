"""The one router (deployments and the simulator route with it), rule by rule, on toy workers."""

import dataclasses

from jaxpipe.serve import placement
from jaxpipe.serve.scheduler import Scheduler
from jaxpipe.serve.sim import CountedPages
from tests import helpers
from tests.helpers import ToySeq, toy_step

PAGE = helpers.PAGE


@dataclasses.dataclass(eq=False)
class Worker:
  name: str
  scheduler: Scheduler


def worker(name, free, running=0, waiting=(), max_batch=4):
  """A worker with `free` pages free after `running` one-page requests and `waiting` ones."""
  s = Scheduler(CountedPages(free + running, PAGE), max_batch=max_batch, token_budget=64)
  for i in range(running):
    s.add(ToySeq(f"{name}{i}", 2))
  toy_step(s.plan())
  for length in waiting:
    s.add(ToySeq(f"{name}w", length))
  assert s.pages.num_free == free and len(s.running) == running
  return Worker(name, s)


def test_a_prefilled_request_goes_to_the_decode_worker_with_the_most_free_pages():
  """Of the decode workers with a free batch slot and the request's pages free, the one with the
  most free pages: c, although it runs a request and the others none (the opposite rule, fewest
  free pages, would pick a; the first in the list is a too)."""
  ws = [worker("a", 5), worker("b", 7), worker("c", 9, running=1), worker("d", 6)]
  assert placement.decode_worker(ws, pages=2).name == "c"
  # a full batch or too few pages rule a worker out, however many pages it has
  full = worker("full", 20, running=4)
  assert placement.decode_worker([full] + ws, pages=2).name == "c"
  assert placement.decode_worker(ws, pages=8).name == "c"
  assert placement.decode_worker(ws, pages=10) is None  # it waits on its prefill worker
  # equal free pages: the one with fewer running requests, then the first
  assert (
      placement.decode_worker(
          [worker("x", 9, running=2), worker("y", 9, running=1), worker("z", 9, running=1)], pages=1
      ).name
      == "y"
  )


def test_a_new_request_goes_to_the_least_loaded_entry_worker():
  """Prefill workers: the fewest prompt tokens left to compute; colocated: the fewest requests;
  ties to the first."""
  long_one = worker("long", 64, waiting=[40])  # 1 request, 40 tokens
  short_ones = worker("short", 64, waiting=[3, 3, 3])  # 3 requests, 9 tokens
  busy = worker("busy", 64, running=2)  # 2 requests, a token each left
  assert placement.entry_worker([long_one, short_ones, busy], prefill=True).name == "busy"
  assert placement.entry_worker([long_one, short_ones], prefill=True).name == "short"
  assert placement.entry_worker([short_ones, long_one, busy], prefill=False).name == "long"
  twins = [worker("first", 64, waiting=[5]), worker("second", 64, waiting=[5])]
  assert placement.entry_worker(twins, prefill=True).name == "first"
  assert placement.entry_worker(twins, prefill=False).name == "first"
