"""The one scheduler: its rules on toy pages, and the engine's and the simulator's decisions equal.

The simulator predicts what the engine does only if both schedule alike; they run the same
`Scheduler`, and here the same seeded requests under the same budgets give the same sequence of
steps (which requests, how many tokens each) and preemptions, one engine against a colocated
simulated worker and a disaggregated deployment (a prefill worker, two decode workers: routing
and K/V moves included) against the simulated one.
"""

import math

import jax
import numpy as np
import pytest

from jaxpipe.serve import sim
from jaxpipe.serve.deploy import Disaggregated
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.scheduler import Scheduler
from jaxpipe.serve.sim import CountedPages
from tests import helpers
from tests.helpers import ToySeq, toy_step

PAGE = helpers.PAGE
ARGS = helpers.ENGINE_ARGS  # max_batch 4, 16 tokens a step, pages of 4
NUM_PAGES = 17  # 16 usable: a pool small enough that requests are preempted


def test_the_newest_running_request_is_preempted():
  """Three 4-token prompts fill 3 pages; each then needs a second page and none is free. The
  newest (c) is preempted first, which gives its page to the oldest (a); b then needs one, and
  the newest running is b itself. Preempting the oldest instead would stop a, the request
  closest to done, and leave b running."""
  pages = CountedPages(3, PAGE)
  s = Scheduler(pages, max_batch=4, token_budget=64)
  s.trace = []
  a, b, c = ToySeq("a", 4), ToySeq("b", 4), ToySeq("c", 4)
  for seq in (a, b, c):
    s.add(seq)
  first = s.plan()
  assert [(q.name, n) for q, n in first] == [("a", 4), ("b", 4), ("c", 4)]
  toy_step(first)
  second = s.plan()
  assert [(q.name, n) for q, n in second] == [("a", 1)]
  assert s.trace[1:] == [("preempt", c), ("preempt", b), ("plan", [(a, 1)])]
  assert [q.name for q in s.running] == ["a"] and (a.computed, a.pages, a.preemptions) == (4, 2, 0)
  assert [q.name for q in s.waiting] == ["b", "c"]  # the preempted wait first, oldest first
  assert (b.computed, b.pages, b.preemptions) == (0, 0, 1) and pages.num_free == 1
  # the router's load, kept as the queues change: tokens left of the waiting and the running
  assert s.tokens_left() == (5 - 4) + 5 + 5 and s.held() == 3
  assert s.remove(c) and s.tokens_left() == 1 + 5 and s.held() == 2


def test_admission_is_in_order_and_bounded_by_batch_budget_and_pages():
  """A waiting request that does not fit stops admission (no overtaking); the batch bound counts
  incoming requests; a prompt longer than the budget is cut to it (chunked prefill)."""
  s = Scheduler(CountedPages(4, PAGE), max_batch=3, token_budget=10)
  big, small, chunked = ToySeq("big", 20), ToySeq("small", 2), ToySeq("chunked", 12)
  s.add(small)
  s.add(big)
  s.add(ToySeq("after", 1))
  assert [(q.name, n) for q, n in s.plan()] == [("small", 2), ("big", 8)]  # the budget cuts big
  s2 = Scheduler(CountedPages(1, PAGE), max_batch=3, token_budget=10)
  s2.add(chunked)
  s2.add(ToySeq("tiny", 1))
  assert s2.plan() == []  # chunked's first 10 tokens need 3 pages: tiny must wait behind it
  s3 = Scheduler(CountedPages(8, PAGE), max_batch=2, token_budget=10)
  s3.expect(ToySeq("incoming", 4))
  s3.add(ToySeq("x", 1))
  s3.add(ToySeq("y", 1))
  assert [q.name for q, _ in s3.plan()] == ["x"]  # the incoming one holds the second slot


def test_removing_a_request_frees_its_pages_at_once():
  pages = CountedPages(8, PAGE)
  s = Scheduler(pages, max_batch=4, token_budget=16)
  a = ToySeq("a", 9)
  s.add(a)
  toy_step(s.plan())
  assert pages.num_free == 8 - 3 and s.remove(a) and pages.num_free == 8
  assert not s.remove(a) and not s.has_work()


@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_prefill_first_runs_whole_prompts_in_steps_of_their_own(policy):
  s = Scheduler(CountedPages(64, PAGE), max_batch=4, token_budget=16, policy=policy)
  old = ToySeq("old", 4)
  s.add(old)
  toy_step(s.plan())
  s.add(ToySeq("p1", 6))
  s.add(ToySeq("p2", 12))
  plan = [(q.name, n) for q, n in s.plan()]
  if policy == "prefill-first":
    assert plan == [("p1", 6)]  # p2 does not fit whole beside it; no decoding in this step
  else:
    assert plan == [("old", 1), ("p1", 6), ("p2", 9)]
  with pytest.raises(ValueError, match="policy='sideways'"):
    Scheduler(CountedPages(1, PAGE), max_batch=1, token_budget=1, policy="sideways")


def test_prefill_first_cuts_the_first_prompt_to_the_budget_and_only_the_first():
  """A step must make progress: a prompt longer than the token budget, first in line, runs in
  budget-sized chunks; whole-prompt admission holds for the ones behind it."""
  s = Scheduler(CountedPages(64, PAGE), max_batch=4, token_budget=8, policy="prefill-first")
  long, short = ToySeq("long", 20), ToySeq("short", 4)
  s.add(long)
  s.add(short)
  plans = []
  for _ in range(6):
    plan = s.plan()
    plans.append([(q.name, n) for q, n in plan])
    toy_step(plan)
  assert plans[0] == [("long", 8)]  # cut to the budget: whole, it would never run
  assert [("short", 4)] in plans  # the prompt behind it runs whole, in a step of its own
  assert long.computed >= 20 and sum(n for p in plans for q, n in p if q == "long") >= 20


class PrefixPages(CountedPages):
  """CountedPages with a prefix cache holding the first `hit` tokens of every prompt in a shared,
  partly filled page: a hit saves those tokens' compute but copies that page before writing into
  it, one page more than computing the prompt whole."""

  def __init__(self, free: int, hit: int):
    super().__init__(free, PAGE)
    self.hit = hit

  def match_prefix(self, seq):
    seq.computed, seq.shared = self.hit, True
    return True

  def reserve(self, seq, n):
    copy = int(getattr(seq, "shared", False))
    need = max(0, math.ceil((seq.computed + n) / self.page_size) - seq.pages + copy)
    if need > self.free:
      return False
    self.free, seq.pages, seq.shared = self.free - need, seq.pages + need, False
    return True

  def release(self, seq):
    seq.shared = False
    super().release(seq)


def test_prefix_hits_of_a_request_that_is_not_admitted_are_given_back():
  pages = PrefixPages(free=4, hit=2)
  s = Scheduler(pages, max_batch=4, token_budget=64)
  busy = ToySeq("busy", 3 * PAGE - 1)
  s.add(busy)
  assert s.plan() == [(busy, 3 * PAGE - 1 - 2)] and pages.num_free == 0  # its hits used
  late = ToySeq("late", 5)
  s.add(late)
  toy_step([(busy, busy.length - busy.computed)])
  assert [(q.name, n) for q, n in s.plan()] == [("busy", 1)]  # no page is left for `late`
  assert (late.computed, late.pages, pages.num_free) == (0, 0, 0)  # its hits went back
  assert list(s.waiting) == [late]


def test_an_idle_worker_retries_a_pool_sized_prompt_without_its_prefix_hits():
  """With nothing running, a prompt that fits the pool only when computed whole (the copy of a
  shared page would be one page too many) is admitted without the prefix cache."""
  prompt = 3 * PAGE
  pages = PrefixPages(free=3, hit=2)
  s = Scheduler(pages, max_batch=4, token_budget=64)
  seq = ToySeq("whole", prompt)
  s.add(seq)
  assert s.plan() == [(seq, prompt)]  # all of it computed, none taken from the cache
  assert (seq.pages, pages.num_free) == (3, 0)


# -- the engine and the simulator, decision for decision ----------------------------------------


class PerStep:
  """A cost model of one second per step: the simulator's clock counts the engine's steps."""

  def step_time(self, new, context):
    return 1.0


def _workload(seed, n=14):
  """Prompts of 1-30 random tokens, 1-12 output tokens, arriving 0-2 steps apart."""
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(0, 64, rng.integers(1, 31))] for _ in range(n)]
  outputs = [int(o) for o in rng.integers(1, 13, n)]
  arrivals = [int(a) for a in np.cumsum(rng.integers(0, 3, n))]
  return prompts, outputs, arrivals


def _ids(trace, id_of):
  return [
      ("plan", [(id_of(r), n) for r, n in x]) if kind == "plan" else ("preempt", id_of(x))
      for kind, x in trace
  ]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_engine_and_the_simulator_make_the_same_decisions(seed):
  """Requests arriving while others run, a pool that preempts: the engine (no prefix cache: the
  simulator models none) and a colocated simulated worker with the same budgets step for step.
  The simulator plans a step after the one before is read back, as the engine without async
  scheduling does (async, the engine plans step n+1 while step n runs)."""
  prompts, outputs, arrivals = _workload(seed)
  engine = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=NUM_PAGES,
      prefix_caching=False,
      async_scheduling=False,
      **ARGS,
  )
  engine.scheduler.trace = []
  pending, step, ids = list(zip(arrivals, prompts, outputs)), 0, []
  while pending or engine.has_work():
    while pending and pending[0][0] <= step:
      _, prompt, out = pending.pop(0)
      ids.append(engine.add_request(prompt, out, eos_id=None))
    if engine.has_work():
      engine.step()
    step += 1
  done = {r.id: r for r in engine.finished()}
  assert [len(done[i].output) for i in ids] == outputs and ids == list(range(len(prompts)))

  pool = sim.Pool(1, PerStep(), ARGS["max_batch"], ARGS["max_tokens_per_step"], NUM_PAGES - 1)
  trace = {}
  simulated = sim.simulate(
      sim.Cluster(PAGE, colocated=pool, lockstep=True),
      [(float(a), len(p), o) for a, p, o in zip(arrivals, prompts, outputs)],
      trace,
  )
  want = _ids(engine.scheduler.trace, lambda r: r.id)
  assert _ids(trace["W0"], lambda r: r.id) == want
  assert sum(kind == "preempt" for kind, _ in want) > 0  # the rule that matters most was used
  assert [r.preemptions for r in simulated] == [done[i].preemptions for i in ids]
  # the clock: one second per engine step, so TTFT is the engine's steps to the first token
  assert len([x for x in want if x[0] == "plan"]) == engine.steps


@pytest.mark.parametrize("prefill_workers", [1, 2])
def test_a_disaggregated_deployment_and_the_simulator_make_the_same_decisions(prefill_workers):
  """One or two prefill workers and two decode workers: the same prefill steps, the same choice
  of decode worker for each request (the router), the same order of handoffs while the decode
  side is full (parked requests leave in the order they parked, whichever worker holds them) and
  the same decode steps, preemptions included."""
  prompts, outputs, _ = _workload(2, n=16)
  outputs = [o + 8 for o in outputs]  # long enough to fill the decode workers' pools
  d = jax.devices()
  dep = Disaggregated(
      helpers.DENSE,
      helpers.engine_params("dense"),
      [d[i : i + 1] for i in range(6 - prefill_workers, 6)],
      [d[6:7], d[7:8]],
      num_pages=NUM_PAGES,
      prefill_kwargs={"prefix_caching": False},
      **ARGS,
  )
  for w in dep.workers:
    w.engine.scheduler.trace = []
  ids = [dep.add_request(p, o, eos_id=None) for p, o in zip(prompts, outputs)]
  owner = {}  # engine request -> deployment request id
  while dep.has_work():
    for w in dep.workers:
      owner.update({w.engine.requests[erid]: rid for erid, rid in w.ids.items()})
    dep.step()
  done = {r.id: r for r in dep.finished()}
  assert [len(done[i].output) for i in ids] == outputs

  kw = dict(
      max_batch=ARGS["max_batch"], token_budget=ARGS["max_tokens_per_step"], kv_pages=NUM_PAGES - 1
  )
  cluster = sim.Cluster(
      PAGE,
      prefill=sim.Pool(prefill_workers, PerStep(), **kw),
      decode=sim.Pool(2, PerStep(), **kw),
      kv_bytes_per_token=1,
      lockstep=True,
  )
  trace = {}
  sim.simulate(cluster, [(0.0, len(p), o) for p, o in zip(prompts, outputs)], trace)
  for w in dep.workers:
    want = _ids(w.engine.scheduler.trace, owner.__getitem__)
    assert _ids(trace[w.name], lambda r: r.id) == want, w.name
  preempted = {w.name: sum(k == "preempt" for k, _ in trace[w.name]) for w in dep.workers}
  assert preempted["D0"] + preempted["D1"] > 0, preempted
  assert {done[i].worker for i in ids} == {"D0", "D1"}
