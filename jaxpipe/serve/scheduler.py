"""The iteration-level scheduler that `serve.Engine` and `serve.sim` both run (pure Python).

One scheduler per worker holds its sequences in four queues: `waiting` (arrival order; a
preempted sequence goes back to the front), `running` (admission order, oldest first), `parked`
(a prefill worker's sequences whose first token is sampled, pages kept until they move on) and
`incoming` (batch slots held for sequences whose K/V are on their way from another worker).
Each `plan()` fills one step under a token budget and the batch size:

1. running sequences first, oldest first: each gets min(its tokens left to compute, the budget
   left) — a decode token, or the next chunk of a prompt (chunked prefill);
2. when a running sequence's pages cannot be had, the NEWEST running sequence is preempted by
   recompute (its pages freed, its computed tokens forgotten, first in line again), and the
   loop retries: the oldest requests, closest to done, keep going, and the work thrown away is
   the least (vLLM's rule);
3. then waiting sequences in order while a batch slot (running + incoming < max_batch), budget
   and pages allow; a sequence that does not fit stops admission (no overtaking: FCFS). A
   sequence first takes what the prefix cache holds of its tokens, where there is one.

`policy='prefill-first'` instead runs whole waiting prompts in a step of their own before any
decoding (vLLM's first scheduler; DistServe's baseline), used by the simulator.

What only the owner of the pages knows comes through `Pages`: the engine's adapter wraps its
reference-counted allocator, prefix cache and copy-on-write; the simulator's is a count of free
pages. Both schedule through this one class, so the simulator's predictions are of what the
engine does (tests/serve/test_scheduler.py holds their plans equal on a seeded workload).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Generic, Literal, Protocol, TypeVar

POLICIES = ("decode-first", "prefill-first")


class Seq(Protocol):
  """What the scheduler reads and writes of a sequence."""

  computed: int  # leading tokens whose K/V are cached (the scheduler resets it on preemption)
  preemptions: int

  @property
  def length(self) -> int:
    """Tokens the sequence has now: prompt + generated."""
    ...


S = TypeVar("S", bound=Seq)


class Pages(Protocol[S]):
  """The page side of scheduling, supplied by whoever owns the pages."""

  @property
  def num_free(self) -> int:
    """Pages free now (what the router compares between decode workers)."""
    ...

  def can_alloc(self, n: int) -> bool:
    """Whether n pages can be had now (the engine may reclaim prefix-cache pages for them).

    Args:
      n: pages wanted.

    Returns:
      True if they can.
    """
    ...

  def match_prefix(self, seq: S) -> bool:
    """Gives a sequence with nothing computed what the prefix cache holds of its tokens.

    Its pages, `seq.computed` set to the tokens they hold. The scheduler releases the hits again if
    the sequence cannot be admitted.

    Args:
      seq: a sequence with nothing computed.

    Returns:
      True if there is a prefix cache, hit or not.
    """
    ...

  def reserve(self, seq: S, n: int) -> bool:
    """Pages for seq's tokens computed..computed+n-1 (a shared one copied before it is written).

    Args:
      seq: the sequence.
      n: tokens to hold.

    Returns:
      True; False, taking nothing, if too few are free.
    """
    ...

  def release(self, seq: S) -> None:
    """Frees every page seq holds.

    Args:
      seq: the sequence.
    """
    ...


class Scheduler(Generic[S]):
  """A worker's queues and the rules that fill each step from them (see the module docstring)."""

  def __init__(
      self,
      pages: Pages[S],
      *,
      max_batch: int,
      token_budget: int,
      policy: Literal["decode-first", "prefill-first"] = "decode-first",
      on_admit: Callable[[S], None] | None = None,
      on_preempt: Callable[[S], None] | None = None,
  ):
    """on_admit(seq): called when a waiting sequence joins the batch (its prefix-cache hits in
    seq.computed); on_preempt(seq): after a sequence is preempted (pages freed, computed 0)."""
    if policy not in POLICIES:
      raise ValueError(f"policy={policy!r}: use one of {POLICIES}")
    self.pages, self.policy = pages, policy
    self.max_batch, self.token_budget = max_batch, token_budget
    self._on_admit, self._on_preempt = on_admit, on_preempt
    self.waiting: collections.deque[S] = collections.deque()
    self._waiting_left = 0  # sum of length - computed over `waiting` (constant while they wait)
    self.running: list[S] = []
    self.parked: list[S] = []
    self.incoming: list[S] = []
    # When a list: every non-empty plan as ('plan', [(seq, tokens), ...]) and every preemption
    # as ('preempt', seq), in order (tests compare the engine's decisions with the simulator's).
    self.trace: list | None = None

  # -- the queues -------------------------------------------------------------------------------

  def add(self, seq: S) -> None:
    """A new sequence waits, last in line.

    Args:
      seq: the sequence.
    """
    self.waiting.append(seq)
    self._waiting_left += seq.length - seq.computed

  def expect(self, seq: S) -> None:
    """Holds a batch slot for a sequence whose K/V are on their way.

    The owner reserved its pages; it is not scheduled until `join`.

    Args:
      seq: the incoming sequence.
    """
    self.incoming.append(seq)

  def join(self, seq: S) -> None:
    """A sequence joins the batch as it is, K/V cached (an incoming one, or a fork).

    Args:
      seq: the sequence.
    """
    if seq in self.incoming:
      self.incoming.remove(seq)
    self.running.append(seq)

  def park(self, seq: S) -> None:
    """A prefill worker's sequence sampled its first token: out of the batch, pages kept.

    Args:
      seq: a running sequence.
    """
    self.running.remove(seq)
    self.parked.append(seq)

  def remove(self, seq: S) -> bool:
    """Takes a sequence off this worker (finished, cancelled, or moved on).

    Its pages are freed at once.

    Args:
      seq: the sequence.

    Returns:
      True; False if no queue held it.
    """
    for queue in (self.running, self.waiting, self.parked, self.incoming):
      if seq in queue:
        queue.remove(seq)
        if queue is self.waiting:
          self._waiting_left -= seq.length - seq.computed
        self.pages.release(seq)
        return True
    return False

  def has_work(self) -> bool:
    """Whether a step would compute anything (parked and incoming sequences do not)."""
    return bool(self.waiting or self.running)

  def has_slot(self) -> bool:
    """Whether the batch has room for one more sequence (incoming ones hold theirs)."""
    return len(self.running) + len(self.incoming) < self.max_batch

  def held(self) -> int:
    """Sequences waiting or running (a colocated worker's load)."""
    return len(self.waiting) + len(self.running)

  def tokens_left(self) -> int:
    """Tokens left to compute of the waiting and running sequences (a prefill worker's load)."""
    return self._waiting_left + sum(s.length - s.computed for s in self.running)

  # -- one step ---------------------------------------------------------------------------------

  def plan(self) -> list[tuple[S, int]]:
    """The step's (sequence, tokens to compute) in batch order; pages reserved for them."""
    plan = self._plan()
    if self.trace is not None and plan:
      self.trace.append(("plan", list(plan)))
    return plan

  def _plan(self) -> list[tuple[S, int]]:
    if self.policy == "prefill-first" and self.waiting:
      plan = self._admit(self.token_budget, whole=True)
      if plan:
        return plan
    budget, plan, i = self.token_budget, [], 0
    while i < len(self.running) and budget > 0:
      seq = self.running[i]
      n = min(seq.length - seq.computed, budget)
      if self.pages.reserve(seq, n):
        plan.append((seq, n))
        budget -= n
        i += 1
      else:  # preempt the newest; if that is seq itself, the next sequence moves into slot i
        self.preempt(self.running[-1])
    if self.policy != "prefill-first":
      plan += self._admit(budget, whole=False)
    return plan

  def preempt(self, seq: S) -> None:
    """Recompute preemption: seq's pages are freed and it waits first in line with its tokens.

    Args:
      seq: a running sequence; its computed tokens are reset to 0.
    """
    self.running.remove(seq)
    self.pages.release(seq)
    seq.computed = 0
    seq.preemptions += 1
    if self._on_preempt is not None:
      self._on_preempt(seq)
    self.waiting.appendleft(seq)
    self._waiting_left += seq.length
    if self.trace is not None:
      self.trace.append(("preempt", seq))

  def _admit(self, budget: int, whole: bool) -> list[tuple[S, int]]:
    """Waiting sequences that fit, in order; whole: only whole prompts (the first one may be cut
    to the budget, as a step must make progress)."""
    plan = []
    while self.waiting and budget > 0 and self.has_slot():
      seq = self.waiting[0]
      left = seq.length - seq.computed  # before its prefix-cache hits change `computed`
      n = self._fit(seq, budget, whole and bool(plan))
      if n == 0:
        break
      self.waiting.popleft()
      self._waiting_left -= left
      self.running.append(seq)
      if self._on_admit is not None:
        self._on_admit(seq)
      plan.append((seq, n))
      budget -= n
    return plan

  def _fit(self, seq: S, budget: int, whole: bool, use_cache: bool = True) -> int:
    """Tokens of a waiting sequence to schedule now, pages reserved (0: it does not fit); it
    takes its cached prefix first."""
    matched = use_cache and seq.computed == 0 and self.pages.match_prefix(seq)
    n = min(seq.length - seq.computed, budget)
    if not (whole and n < seq.length - seq.computed) and self.pages.reserve(seq, n):
      return n
    if matched:
      self.pages.release(seq)
      seq.computed = 0
      if not self.running:  # a shared page to copy can be one too many for a pool-sized request
        return self._fit(seq, budget, whole, use_cache=False)
    return 0
