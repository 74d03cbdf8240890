"""The engine loop: one thread runs the backend (an `Engine` or a deployment of several) and
request handlers on the asyncio event loop talk to it through a queue of commands (add, score,
cancel, drain, stop): scoring a prompt (`score`, for echo with logprobs) runs on this thread too,
never on the event loop. The thread steps while there is work and hands each iteration's tokens and
finishes back to the event loop in one call, so a step costs one hand-off whatever its batch.
An engine fault fails the requests it held and every later one (`failed` says why); the server
stays up to say so.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from jaxpipe.serve.http.metrics import Metrics
from jaxpipe.serve.http.protocol import FINISH
from jaxpipe.serve.refusal import Refusal
from jaxpipe.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


class Backend(Protocol):
  """What the server drives: an `Engine`, a deployment of several (`serve.deploy`: Colocated,
  Disaggregated) that lists them in `engines`, or a router's fleet (`serve.fleet.router`).

  The server reads the request limits (`limits`: a `request.RequestLimits`) of the backend's
  engines (`engines_of`), and its gauges from `load_of`."""

  def check_request(
      self,
      prompt: Sequence[int],
      max_tokens: int,
      sampling: SamplingParams,
      eos_id: int | Sequence[int] | None | str = ...,
  ) -> Refusal | None:
    """Why this request cannot be served, or None; reads configuration only.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: the request's sampling values.
      eos_id: as `add_request` takes it (ENGINE_EOS: the backend's own).

    Returns:
      None, or a `Refusal` naming the fix.
    """
    ...  # reads configuration only

  def add_request(
      self,
      prompt: Sequence[int],
      max_tokens: int,
      sampling: SamplingParams,
      *,
      eos_id: int | None | str,
  ) -> int:
    """Queues a request.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: the request's sampling values.
      eos_id: the token (or tokens) that end it; None: only max_tokens and stop ids do; or the
        ENGINE_EOS ("engine"): the backend's own.

    Returns:
      The request's id (`step`'s keys, `finished()`'s `.id`).
    """
    ...

  def step(self) -> dict[int, list[int]]:
    ...

  def cancel(self, rid: int) -> None:
    """Stops a request now.

    Args:
      rid: the request's id.
    """
    ...

  def finished(self) -> list[Any]:
    ...  # objects with .id, .finish_reason, .error

  # Optional: `score(prompt, top_logprobs)` (echo with logprobs) and `requests` (id -> object
  # with .logprobs) when the backend computes log-probabilities.

  def has_work(self) -> bool:
    ...


def engines_of(backend: Backend) -> list:
  """The engines behind a backend: a deployment's live workers', or the engine itself.

  Args:
    backend: an `Engine` or a deployment.

  Returns:
    The engines.
  """
  return list(getattr(backend, "engines", None) or [backend])


def take(inbox: queue.SimpleQueue, timeout: float) -> list:
  """Everything queued in an inbox, waiting up to `timeout` seconds for the first item.

  Args:
    inbox: the queue an engine thread's commands arrive in.
    timeout: seconds to wait when it is empty (0: do not wait).

  Returns:
    The items, oldest first; [] if none came.
  """
  items = []
  try:
    items.append(inbox.get(timeout=timeout) if timeout else inbox.get_nowait())
    while True:
      items.append(inbox.get_nowait())
  except queue.Empty:
    return items


ENGINE_COUNTS = ("preemptions", "prefix_hits", "spec_drafts", "spec_accepted")


def load_of(backend: Backend) -> dict:
  """What a backend holds now, summed over its engines, as the gauges read it.

  A backend that is not in this process (a router's fleet) gives its own `load()`.

  Args:
    backend: an `Engine`, a deployment, or anything with `load()`.

  Returns:
    {"running", "waiting", "incoming": requests; "usage": `Engine.kv_usage` summed; "counts":
    `Engine.counts`' ENGINE_COUNTS summed}.
  """
  load = getattr(backend, "load", None)
  if callable(load):
    return load()
  engines = engines_of(backend)
  usage = collections.Counter()
  for e in engines:
    usage.update(e.kv_usage())
  return {
      "running": sum(len(e.running) for e in engines),
      "waiting": sum(len(e.waiting) for e in engines),
      "incoming": sum(len(getattr(e, "incoming", ())) for e in engines),
      "usage": dict(usage),
      "counts": {
          k: sum(e.counts[k] for e in engines if hasattr(e, "counts")) for k in ENGINE_COUNTS
      },
  }


@dataclasses.dataclass(eq=False)
class Seq:
  """One choice of one request, as the engine loop sees it."""

  prompt: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: int | None | str
  arrival: float  # time.perf_counter() when the request arrived
  # (index, tokens, their logprobs or None, finish reason or None, error or None) on the event
  # loop; an event with logprobs and no tokens holds the prompt's (echo)
  sink: asyncio.Queue
  index: int  # choice index within the request
  echo: bool = False  # with sampling.logprobs: the prompt is scored first
  rid: int | None = None  # the backend's id (engine thread)
  first: float | None = None  # first token's time (engine thread)
  last: float | None = None
  n_tokens: int = 0
  stopped: bool = False  # ended by a stop sequence (set on the event loop before cancelling)
  done: bool = False  # its last event was delivered (event loop)
  prompt_logprobs: list | None = None  # the prompt's scores (event loop)


class EngineLoop:
  """Runs a backend on its own thread: adds and cancels what handlers queue, steps while there
  is work, and hands each iteration's tokens and finishes to the event loop in one call."""

  WINDOW_S = 10.0  # the tokens-per-second gauge's window

  def __init__(self, backend: Backend, metrics: Metrics):
    self.backend, self.metrics = backend, metrics
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._deadline: float | None = None  # drain: cancel whatever runs past it
    self.failed: str | None = None  # why the loop stopped on an error

  def start(self, aloop: asyncio.AbstractEventLoop, deliver) -> None:
    """Starts the engine thread.

    Args:
      aloop: the event loop the handlers run on.
      deliver: called on `aloop` with each hand-off: a list of (seq, tokens, logprobs or None,
        finish reason or None, error or None).
    """
    self._aloop, self._deliver = aloop, deliver
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._thread.start()

  def submit(self, seqs: list[Seq]) -> None:
    """Queues sequences to generate.

    Args:
      seqs: the request's sequences (echo ones are scored first).
    """
    self._inbox.put(("add", seqs))

  def submit_scores(self, seqs: list[Seq]) -> None:
    """Queues sequences that generate nothing (max_tokens 0, echo).

    Their prompts are scored when they ask for logprobs, and they finish with "length".

    Args:
      seqs: the request's sequences.
    """
    self._inbox.put(("score", seqs))

  def cancel(self, seqs: list[Seq]) -> None:
    """Queues the cancellation of sequences; those already finished are left.

    Args:
      seqs: the sequences to stop.
    """
    self._inbox.put(("cancel", seqs))

  def drain(self, seconds: float) -> None:
    """Lets what runs go on for `seconds`, then cancels the rest.

    Args:
      seconds: the time left to the running sequences.
    """
    self._inbox.put(("drain", time.perf_counter() + seconds))

  def stop(self) -> None:
    """Cancels everything, delivers the finishes and ends the thread."""
    if self._thread is not None:
      self._inbox.put(("stop", None))
      self._thread.join()
      self._thread = None

  def _run(self) -> None:
    live: dict[int, Seq] = {}
    window: collections.deque[tuple[float, int]] = collections.deque()
    stopping = False
    while not (stopping and not live):
      commands = self._take(0.0 if self.backend.has_work() else 1.0)
      events: dict[Seq, list] = {}
      try:
        for kind, arg in commands:
          if kind in ("add", "score"):
            arg = self._send_scores(arg)
          if kind == "add":
            for s in arg:
              s.rid = self.backend.add_request(s.prompt, s.max_tokens, s.sampling, eos_id=s.eos_id)
              live[s.rid] = s
              self.metrics.accepted(s)
          elif kind == "score":
            for s in arg:
              self.metrics.accepted(s)
              self._observe_finish(s, "length")
              events[s] = [[], None, "length", None]
          elif kind == "cancel":
            for s in arg:
              if s.rid in live:
                self.backend.cancel(s.rid)
          elif kind == "drain":
            self._deadline = arg
          else:
            stopping = True
        if stopping or (self._deadline is not None and time.perf_counter() >= self._deadline):
          for rid in list(live):
            self.backend.cancel(rid)
        stepped = self.backend.has_work()
        new = self.backend.step() if stepped else {}
        now = time.perf_counter()
        for rid, tokens in new.items():
          s = live[rid]
          if s.last is not None:
            self.metrics.observe_gaps(now - s.last, len(tokens))
          s.first = s.first or now
          s.last, s.n_tokens = now, s.n_tokens + len(tokens)
          events[s] = [list(tokens), self._logprobs(s, len(tokens)), None, None]
        for r in self.backend.finished():
          s = live.pop(r.id, None)
          if s is None:  # reported finished twice
            continue
          reason = "stop" if s.stopped else FINISH.get(r.finish_reason, "error")
          events.setdefault(s, [[], None, None, None])[2:] = [
              reason,
              r.error if reason == "error" else None,
          ]
          self._observe_finish(s, reason)
        self._update_gauges(stepped, new, now, window)
      except Exception as e:  # noqa: BLE001 -- an engine fault fails its requests, not the server
        log.exception("engine loop failed")
        self.failed = f"{type(e).__name__}: {e}"
        added = [s for kind, arg in commands if kind in ("add", "score") for s in arg]
        self._fail(set(live.values()) | set(added) | set(events), stopping)
        return
      if events:
        self._send([(s, *e) for s, e in events.items()])

  def _take(self, timeout: float) -> list[tuple[str, Any]]:
    return take(self._inbox, timeout)

  def _send(self, events: list) -> None:
    try:
      self._aloop.call_soon_threadsafe(self._deliver, events)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
      pass

  def _fail(self, seqs: set[Seq], stopping: bool) -> None:
    """After an engine fault: every sequence, now and later, ends with the error."""
    error = f"the engine failed: {self.failed}"
    while True:
      self._send([(s, [], None, None, error) for s in seqs])
      if stopping:
        return
      commands = self._take(1.0)
      seqs = {s for kind, arg in commands if kind in ("add", "score") for s in arg}
      stopping = any(kind == "stop" for kind, _ in commands)

  def _send_scores(self, seqs: list[Seq]) -> list[Seq]:
    """Sends the prompt logprobs of the echo sequences among `seqs` (a prompt scored once for
    all n of its choices); returns `seqs` less those whose prompt could not be scored, which
    end with the error (one bad prompt fails its request, not the server)."""
    done: dict[tuple, list | None] = {}
    failed = set()
    for s in seqs:
      if not s.echo:
        continue
      key = (tuple(s.prompt), s.sampling.logprobs)
      try:
        if key not in done:
          done[key] = self._score(s)
      except Exception as e:  # noqa: BLE001 -- reported to the request's client
        log.exception("scoring a prompt failed")
        self._send([(s, [], None, None, f"scoring the prompt failed: {type(e).__name__}: {e}")])
        failed.add(s)
        continue
      if done[key] is not None:
        self._send([(s, [], done[key], None, None)])
    return [s for s in seqs if s not in failed]

  def _score(self, s: Seq) -> list | None:
    """The prompt's logprobs (echo with logprobs), scored here on the engine thread."""
    if s.sampling.logprobs is None:
      return None
    return list(self.backend.score(s.prompt, s.sampling.logprobs))

  def _logprobs(self, s: Seq, n: int) -> list | None:
    """The logprobs of s's last n tokens, when it asked for them."""
    if s.sampling.logprobs is None:
      return None
    r = getattr(self.backend, "requests", {}).get(s.rid)
    return list(r.logprobs[-n:]) if r is not None and len(r.logprobs) >= n else None

  def _observe_finish(self, s: Seq, reason: str) -> None:
    self.metrics.finish(s, reason, time.perf_counter())

  def _update_gauges(self, stepped: bool, new: dict, now: float, window: collections.deque) -> None:
    m, load = self.metrics, load_of(self.backend)
    generated = sum(len(t) for t in new.values())
    usage = load["usage"]
    if stepped:  # as serve_bench sums them: after every step
      m.steps.inc()
      m.kv_tokens.inc(usage.get("tokens", 0))
      m.kv_slots.inc(usage.get("slots", 0))
    m.generated(generated)
    m.engines(load)
    window.append((now, generated))
    while window[0][0] < now - self.WINDOW_S:
      window.popleft()
    m.tokens_per_second.set(sum(n for _, n in window) / self.WINDOW_S)
    m.running.set(load["running"])
    m.waiting.set(load["waiting"])
    m.pages_total.set(usage.get("pages_total", 0))
    m.pages_used.set(usage.get("pages_in_use", 0))
    m.pages_running.set(usage.get("pages_running", 0))
    m.pages_cached.set(usage.get("cached_pages", 0))
