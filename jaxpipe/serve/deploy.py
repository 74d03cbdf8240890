"""Two deployments of one engine: colocated workers, and prefill and decode workers apart.

Both are driven like an `Engine`: `add_request`, `step` (returns the tokens each request
generated in it, by request id, to stream), `cancel`, `finished`, `has_work`. Each worker is an
`Engine` on its own group of devices; every `step` launches all the workers' steps before it
collects any, so they run at once on their devices (one host thread drives them all).

Where requests go is `serve.placement`'s, the same code the simulator routes with:

- `Colocated`: every worker prefills and decodes (continuous batching, chunked prefill under
  its token budget). A new request goes to the worker with the fewest requests, ties to the first.
- `Disaggregated` (DistServe, Splitwise, vLLM's disaggregated prefill, Mooncake): `prefill_only`
  engines on P device groups and decode engines on D others. A new request goes to the prefill
  worker with the fewest prompt tokens left to compute. Once its first token is sampled it waits
  there, pages kept, until a decode worker can take it: of those with a free batch slot and
  enough free pages, the one with the most free pages (least loaded by KV memory). The transfer
  reserves the pages on D, gathers exactly the request's pages on P and copies them to D's
  devices (`jax.device_put` between the device sets: a device-to-device copy, KV heads split as
  D splits them) in chunks of a power of two pages (at most log2(pages) + 1 copies), all layers
  in each copy or, with `stream_layers`, one layer per copy (Mooncake
  and DistServe stream layer by layer; here the prefill is one compiled program over all
  layers, so streaming bounds the staging buffer to one layer and lets D write layer l while
  l+1 is in flight, but cannot overlap P's compute). The copy is dispatched at the end of a step
  and written into D's pool in the next one, after every worker's step was launched, so it
  overlaps those steps; only then does the request join D's batch and P free its pages.

Faults lose nothing: `stop_worker` takes a worker out as if its process had died. A transfer to
it is abandoned (the request, still held on P, waits for another decode worker); a transfer
from it is abandoned and D's reservation freed; every request it held is recomputed on a live
worker from its tokens (generated tokens kept: sampling depends only on the request's seed and
position). A request that cannot be served (no prefill or no decode worker left) finishes with
an `error` saying why. A full decode side only delays: the request waits on P.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Sequence

import jax

from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.serve import placement
from jaxpipe.serve.engine import Engine, EngineConfig
from jaxpipe.serve.refusal import Refusal
from jaxpipe.serve.request import ENGINE_EOS, FINISHED, RUNNING, KVState, Request
from jaxpipe.serve.sampling import SamplingParams, TokenLogprobs
from jaxpipe.serve.scheduler import Scheduler

QUEUED, PREFILL, HANDOFF, TRANSFER, DECODE, DONE = (
    "queued",
    "prefill",
    "handoff",
    "transfer",
    "decode",
    "done",
)


@dataclasses.dataclass(eq=False)
class Served(Request):
  """A request of a deployment: the engine's fields (output, logprobs, times, finish_reason,
  error) plus where it ran and what it moved."""

  phase: str = QUEUED
  worker: str | None = None  # where it is now (or last was)
  prefill_start: float | None = None  # first scheduled on a prefill (or colocated) worker
  kv_bytes: int = 0  # K/V bytes copied between workers for it
  transfers: int = 0  # transfers that landed
  copies: int = 0  # device-to-device copies they took (chunks of pages, per layer if streamed)
  recomputes: int = 0  # times it was restarted from its tokens after a worker stopped
  note: str | None = None  # why it is waiting, when it is
  parked: int | None = None  # its place in the handoff order (prefilled requests, as they park)
  spans: list[tuple[str, str, float, float]] = dataclasses.field(default_factory=list)
  # (worker, 'queue'|'prefill'|'handoff'|'transfer'|'decode', start, end), times perf_counter


@dataclasses.dataclass(eq=False)
class Worker:
  name: str  # 'W0', 'P0', 'D1'
  engine: Engine
  ids: dict[int, int] = dataclasses.field(default_factory=dict)  # engine id -> request id
  stopped: bool = False

  def __repr__(self) -> str:
    return self.name

  @property
  def scheduler(self) -> Scheduler:
    """The engine's scheduler (what `serve.placement` compares)."""
    return self.engine.scheduler


@dataclasses.dataclass(eq=False)
class Transfer:
  """A copy of one request's pages from a prefill worker to a decode worker, in flight."""

  rid: int
  src: Worker
  src_rid: int
  dst: Worker
  dst_rid: int
  parts: list[tuple[int | None, int, object, object]]  # (layer or None: all, first page, k, v
  # as `KVTransfer.kv_of` gives them), already on dst's devices
  nbytes: int
  start: float


def device_groups(
    workers: int, devices_per_worker: int, devices: Sequence[jax.Device] | None = None
) -> list[list[jax.Device]]:
  """`workers` disjoint groups of `devices_per_worker` consecutive devices.

  Args:
    workers: groups to make.
    devices_per_worker: devices in each group.
    devices: the devices to split, in order; None: `jax.devices()`.

  Returns:
    [workers] lists of `devices_per_worker` devices.

  Raises:
    ValueError: `devices_per_worker` below 1, or more devices needed than there are.
  """
  devices = list(jax.devices() if devices is None else devices)
  if devices_per_worker < 1:
    raise ValueError(f"devices per worker={devices_per_worker} must be >= 1")
  if workers * devices_per_worker > len(devices):
    raise ValueError(
        f"{workers} workers x {devices_per_worker} devices need "
        f"{workers * devices_per_worker} devices; there are {len(devices)}: "
        "use fewer workers or fewer devices per worker"
    )
  return [devices[i * devices_per_worker : (i + 1) * devices_per_worker] for i in range(workers)]


def _check_groups(groups: Sequence[Sequence[jax.Device]], what: str) -> None:
  seen = set()
  for g in groups:
    if not g:
      raise ValueError(f"a {what} worker has no devices; give each worker at least one")
    for d in g:
      if d in seen:
        raise ValueError(
            f"device {d} is in two workers; the workers' device groups must be disjoint"
        )
      seen.add(d)


class _Deployment:
  """What both deployments share: requests, routing new ones, stepping, finishing, faults."""

  def __init__(self, workers: list[Worker]):
    self.workers = workers
    self.requests: dict[int, Served] = {}
    self._pending: collections.deque[Served] = collections.deque()  # to (re)submit
    self._finished: list[Served] = []
    self._next_id = 0
    self.steps = 0
    self.counts = collections.Counter()  # transfers, kv_bytes, recomputes, stopped, ...

  # -- the Engine interface ---------------------------------------------------------------------

  @property
  def engines(self) -> list[Engine]:
    return [w.engine for w in self.workers if not w.stopped]

  def check_request(
      self,
      prompt: Sequence[int],
      max_tokens: int,
      sampling: SamplingParams,
      eos_id: int | Sequence[int] | None | str = ENGINE_EOS,
  ) -> Refusal | None:
    """Why this request cannot be served by every kind of worker (`Engine.check_request`), or
    None."""
    for e in self._kinds():
      error = e.check_request(prompt, max_tokens, sampling, eos_id)
      if error:
        return error
    return None

  def add_request(
      self,
      prompt: Sequence[int],
      max_tokens: int = 16,
      sampling: SamplingParams | None = None,
      *,
      eos_id: int | Sequence[int] | None | str = ENGINE_EOS,
  ) -> int:
    """Queues a request and returns its id; a bad one is finished at once with `error` set."""
    sampling = sampling or SamplingParams()
    rid = self._next_id
    self._next_id += 1
    engine = self.workers[0].engine
    r = Served(
        rid,
        list(prompt),
        max_tokens,
        sampling,
        engine.eos_id if eos_id == ENGINE_EOS else eos_id,
        arrival=time.perf_counter(),
    )
    self.requests[rid] = r
    error = self._lost() or self.check_request(r.prompt, max_tokens, sampling, r.eos_id)
    if error:
      self._fail(r, error)
    else:
      self._submit(r)
    return rid

  def step(self) -> dict[int, list[int]]:
    """One iteration of every worker; returns the tokens each request generated in it."""
    self._submit_pending()
    start = time.perf_counter()
    live = [w for w in self.workers if not w.stopped]
    launched = [(w, w.engine.launch()) for w in live]
    out: dict[int, list[int]] = {}
    for w, step in launched:
      new = w.engine.collect(step)
      now = time.perf_counter()
      if step is not None:
        for er, _ in step.plan:
          r = self.requests.get(w.ids.get(er.id))
          if r is not None and r.phase == QUEUED:
            r.spans.append((w.name, "queue", self._phase_start(r), start))
            r.prefill_start = r.prefill_start or start
            r.phase = PREFILL
      for erid, tokens in new.items():
        r = self.requests[w.ids[erid]]
        r.output += tokens
        if r.sampling.logprobs is not None:  # the engine's request stays until _drain below
          r.logprobs += w.engine.requests[erid].logprobs[-len(tokens) :]
        r.token_times += [now] * len(tokens)
        if r.first_token_time is None:
          r.first_token_time = now
          r.state = RUNNING
        out.setdefault(r.id, []).extend(tokens)
      self._drain(w)
    self._after_step()
    self.steps += 1
    return out

  def score(self, prompt: Sequence[int], top_logprobs: int = 0) -> list[TokenLogprobs | None]:
    """`Engine.score` on the first live worker's engine."""
    engines = self.engines
    if not engines:
      raise ValueError("no worker is left (all stopped); nothing can score the prompt")
    return engines[0].score(prompt, top_logprobs)

  def cancel(self, rid: int) -> None:
    """Stops a request now, wherever it is; every page it holds on any worker is freed. A
    finished request is left as it is, also one that `finished()` has returned.

    Args:
      rid: the request's id, from `add_request`.

    Raises:
      KeyError: this deployment never gave that id.
    """
    r = self.requests.get(rid)
    if r is None:
      if 0 <= rid < self._next_id:
        return  # finished and returned by `finished()`: a client leaving after its last token
      raise KeyError(
          f"no request {rid}: this deployment never gave that id "
          f"(its ids so far: 0 to {self._next_id - 1})"
      )
    if r.state == FINISHED:
      return
    if r in self._pending:
      self._pending.remove(r)
    self._finish(r, "cancelled")  # first: draining the workers then skips it, so it finishes once
    self._cancel_on_workers(r)

  def finished(self) -> list[Served]:
    """Requests finished since the last call (they leave `requests`)."""
    done, self._finished = self._finished, []
    for r in done:
      self.requests.pop(r.id, None)
    return done

  def has_work(self) -> bool:
    return any(r.state != FINISHED for r in self.requests.values())

  def kv_usage(self) -> dict[str, dict[str, float]]:
    """Each live worker's `Engine.kv_usage()`, by worker name."""
    return {w.name: w.engine.kv_usage() for w in self.workers if not w.stopped}

  def precompile(self, max_prompt: int | None = None) -> None:
    """Compiles every worker's step programs (colocated workers move no K/V)."""
    for e in self.engines:
      e.precompile()

  def stop_worker(self, name: str) -> None:
    """Takes a worker out as if its process died; what it held is recomputed elsewhere."""
    w = next((w for w in self.workers if w.name == name), None)
    if w is None or w.stopped:
      raise ValueError(
          f"no live worker named {name!r}; live: "
          f"{[x.name for x in self.workers if not x.stopped]}"
      )
    w.stopped = True
    self.counts["stopped"] += 1
    self._on_stop(w)
    for _erid, rid in list(w.ids.items()):
      r = self.requests.get(rid)
      if r is not None and r.state != FINISHED:
        self._recompute(r, f"{w.name} stopped")
    w.ids.clear()

  # -- shared machinery -------------------------------------------------------------------------

  def _kinds(self) -> list[Engine]:
    """One engine of each kind, for request checks."""
    return [self.workers[0].engine]

  def _lost(self) -> str | None:
    """Why no request can be served any more, or None."""
    return None

  def _submit(self, r: Served) -> None:
    self._pending.append(r)
    self._submit_pending()

  def _entry_workers(self) -> list[Worker]:
    """Live workers that take new requests."""
    raise NotImplementedError

  def _route(self, entries: list[Worker]) -> Worker:
    """The entry worker a new request goes to (`serve.placement.entry_worker`)."""
    raise NotImplementedError

  def _submit_pending(self) -> None:
    """Hands queued requests to the least-loaded entry worker; keeps those none can take yet."""
    lost = self._lost()
    for _ in range(len(self._pending)):
      r = self._pending.popleft()
      if lost:
        self._fail(r, lost)
        continue
      w = self._route(self._entry_workers())
      if not r.output:  # a new request: the engine may take its prefix from its cache
        erid = w.engine.add_request(r.prompt, r.max_tokens, r.sampling, eos_id=r.eos_id)
      else:  # resumed after a fault: recompute its tokens, keep what it generated
        state = KVState(
            r.prompt,
            r.output,
            r.max_tokens,
            r.sampling,
            r.eos_id,
            0,
            None,
            None,
            r.arrival,
            r.first_token_time,
            list(r.token_times),
            list(r.logprobs),
        )
        try:
          erid = w.engine.transfer.import_request(state)
        except ValueError as e:  # no batch slot now: try again next step
          r.note = str(e)
          self._pending.append(r)
          continue
      w.engine.requests[erid].arrival = r.arrival
      w.ids[erid] = r.id
      r.worker, r.note = w.name, None

  def _drain(self, w: Worker) -> None:
    """Applies what finished on a worker (requests the deployment cancelled are already done)."""
    for er in w.engine.finished():
      rid = w.ids.pop(er.id, None)
      r = self.requests.get(rid)
      if r is not None and r.state != FINISHED:
        self._finish(r, er.finish_reason, er.error)

  def _recompute(self, r: Served, why: str) -> None:
    self._close_span(r, time.perf_counter())
    r.recomputes += 1
    r.phase, r.note = QUEUED, f"recomputing: {why}"
    self.counts["recomputes"] += 1
    self._pending.append(r)

  def _fail(self, r: Served, error: str) -> None:
    r.error = error
    self._finish(r, "error")

  def _finish(self, r: Served, reason: str, error: str | None = None) -> None:
    now = time.perf_counter()
    if error:
      r.error = error
    self._close_span(r, now)
    r.state, r.phase, r.finish_reason, r.finish_time = FINISHED, DONE, reason, now
    self._finished.append(r)

  def _close_span(self, r: Served, now: float) -> None:
    """Records the span of the phase r is leaving (prefill, handoff or decode) up to now."""
    kind = {PREFILL: "prefill", DECODE: "decode", HANDOFF: "handoff"}.get(r.phase)
    if kind and r.worker is not None:
      r.spans.append((r.worker, kind, self._phase_start(r), now))

  def _phase_start(self, r: Served) -> float:
    return r.spans[-1][3] if r.spans else r.arrival

  def _cancel_on_workers(self, r: Served) -> None:
    for w in self.workers:
      for erid, rid in list(w.ids.items()):
        if rid == r.id and not w.stopped:
          w.engine.cancel(erid)
          self._drain(w)

  def _after_step(self) -> None:
    pass

  def _on_stop(self, w: Worker) -> None:
    pass


class Colocated(_Deployment):
  """Every worker prefills and decodes; a new request goes to the one with the fewest requests."""

  def __init__(
      self,
      model_cfg: TransformerConfig,
      params: dict,
      groups: Sequence[Sequence[jax.Device]],
      **engine_kwargs,
  ):
    if not groups:
      raise ValueError("a colocated deployment needs at least one worker")
    _check_groups(groups, "colocated")
    super().__init__(
        [
            Worker(f"W{i}", Engine(model_cfg, params, devices=g, **engine_kwargs))
            for i, g in enumerate(groups)
        ]
    )

  def _entry_workers(self) -> list[Worker]:
    return [w for w in self.workers if not w.stopped]

  def _route(self, entries: list[Worker]) -> Worker:
    return placement.entry_worker(entries, prefill=False)

  def _lost(self) -> str | None:
    if not self._entry_workers():
      return "no worker is left (all stopped)"
    return None

  def step(self) -> dict[int, list[int]]:
    out = super().step()
    for rid in out:  # after the first token a colocated request is decoding where it is
      r = self.requests.get(rid)
      if r is not None and r.phase == PREFILL:
        r.spans.append((r.worker, "prefill", self._phase_start(r), r.token_times[-1]))
        r.phase = DECODE
    return out


class Disaggregated(_Deployment):
  """Prefill workers and decode workers on disjoint devices, with a K/V transfer between them."""

  def __init__(
      self,
      model_cfg: TransformerConfig,
      params: dict,
      prefill_groups: Sequence[Sequence[jax.Device]],
      decode_groups: Sequence[Sequence[jax.Device]],
      *,
      stream_layers: bool = False,
      prefill_kwargs: dict | None = None,
      decode_kwargs: dict | None = None,
      **engine_kwargs,
  ):
    """engine_kwargs go to every engine; prefill_kwargs / decode_kwargs override them for one
    side (decode engines default to no prefix cache: they take whole requests, never prompts)."""
    if not prefill_groups:
      raise ValueError("the split leaves no prefill worker; give at least one (--prefill-workers)")
    if not decode_groups:
      raise ValueError("the split leaves no decode worker; give at least one (--decode-workers)")
    _check_groups(list(prefill_groups) + list(decode_groups), "prefill or decode")
    p_kwargs = {**engine_kwargs, **(prefill_kwargs or {}), "prefill_only": True}
    d_kwargs = {"prefix_caching": False, **engine_kwargs, **(decode_kwargs or {})}
    defaults = EngineConfig()  # what an engine takes when not given
    for name in ("page_size", "kv_cache_dtype"):
      p, d = (kw.get(name, getattr(defaults, name)) for kw in (p_kwargs, d_kwargs))
      if p != d:
        raise ValueError(
            f"prefill and decode workers must share {name} ({p} vs {d}): pages move between "
            "them as they are"
        )
    self.prefill = [
        Worker(f"P{i}", Engine(model_cfg, params, devices=g, **p_kwargs))
        for i, g in enumerate(prefill_groups)
    ]
    self.decode = [
        Worker(f"D{i}", Engine(model_cfg, params, devices=g, **d_kwargs))
        for i, g in enumerate(decode_groups)
    ]
    super().__init__(self.prefill + self.decode)
    self.stream_layers = stream_layers
    self.transfers: dict[int, Transfer] = {}  # request id -> its copy in flight
    self._park_order = itertools.count()  # `Served.parked`: the handoff order

  def _kinds(self) -> list[Engine]:
    return [self.prefill[0].engine, self.decode[0].engine]

  def precompile(self, max_prompt: int | None = None) -> None:
    """Compiles what the workers will run.

    Prefill workers: steps up to max_prompt tokens of context; decode workers: every step; both:
    the K/V moves of up to that many tokens' pages (one layer's with `stream_layers`).

    Args:
      max_prompt: the longest context a prefill worker computes; None: each engine's
        max_seq_len.

    Raises:
      ValueError: a model with sliding-window ring layers, whose K/V cannot move.
    """
    for w in self.prefill + self.decode:
      e = w.engine
      pages = math.ceil((max_prompt or e.max_seq_len) / e.page_size)
      e.precompile(pages if w in self.prefill else None, pages, self.stream_layers)

  def _entry_workers(self) -> list[Worker]:
    return [w for w in self.prefill if not w.stopped]

  def _route(self, entries: list[Worker]) -> Worker:
    return placement.entry_worker(entries, prefill=True)

  def _lost(self) -> str | None:
    for side, workers in (("prefill", self.prefill), ("decode", self.decode)):
      if all(w.stopped for w in workers):
        return (
            f"no {side} worker is left ({', '.join(w.name for w in workers)} stopped); "
            "the request cannot be served"
        )
    return None

  def _after_step(self) -> None:
    self._land()
    self._handoff()

  def _handoff(self) -> None:
    """Starts a transfer for every prefilled request a decode worker can take now.

    Parked requests are offered in the order they parked, whichever prefill worker holds them
    (one queue for the deployment, as the simulator's `_Sim.handoff`): while the decode side is
    full, the request that finished its prefill first is the first to move.
    """
    lost = self._lost()
    parked = []
    for p in self.prefill:
      if p.stopped:
        continue
      for er in list(p.engine.prefilled):
        r = self.requests[p.ids[er.id]]
        if r.phase == TRANSFER:
          continue
        if r.phase == PREFILL:
          r.spans.append((p.name, "prefill", self._phase_start(r), r.token_times[-1]))
          r.phase, r.parked = HANDOFF, next(self._park_order)
        parked.append((r.parked, p, er))
    for _, p, er in sorted(parked, key=lambda x: x[0]):
      r = self.requests[p.ids[er.id]]
      if lost:
        p.engine.cancel(er.id)
        self._drain(p)
        self._fail(r, lost)
        continue
      pages = p.engine.transfer.kv_shape(er.computed)[2]
      d = placement.decode_worker([d for d in self.decode if not d.stopped], pages)
      if d is None:
        r.note = f"waiting for a decode worker with a free slot and {pages} free pages"
        continue
      self._start(r, p, er.id, d)

  def _start(self, r: Served, p: Worker, src_rid: int, d: Worker) -> None:
    state = p.engine.transfer.export_request(src_rid, with_kv=False)
    dst_rid = d.engine.transfer.reserve_request(state)
    parts, nbytes = [], 0
    layers = range(p.engine.cfg.n_layers) if self.stream_layers else [None]
    for layer in layers:
      for first, k, v in p.engine.transfer.kv_of(src_rid, layer):
        k, v = jax.device_put((k, v), d.engine.transfer.sharding)  # device to device, asynchronous
        parts.append((layer, first, k, v))
        nbytes += sum(x.nbytes for x in jax.tree.leaves((k, v)))  # 8-bit: scales too
    now = time.perf_counter()
    r.spans.append((p.name, "handoff", self._phase_start(r), now))
    r.phase, r.note = TRANSFER, None
    self.transfers[r.id] = Transfer(r.id, p, src_rid, d, dst_rid, parts, nbytes, now)

  def _land(self) -> None:
    """Writes every copy started last step into its decode worker's pool; the request joins
    D's batch and P frees its pages."""
    for rid, t in list(self.transfers.items()):
      for layer, first, k, v in t.parts:
        t.dst.engine.transfer.write_kv(t.dst_rid, k, v, layer, first)
      jax.block_until_ready([x for *_, k, v in t.parts for x in (k, v)])
      t.dst.engine.transfer.admit_request(t.dst_rid)
      t.src.engine.release(t.src_rid)
      del t.src.ids[t.src_rid]
      t.dst.ids[t.dst_rid] = rid
      del self.transfers[rid]
      r = self.requests[rid]
      now = time.perf_counter()
      r.spans.append((f"{t.src.name}->{t.dst.name}", "transfer", t.start, now))
      r.kv_bytes += t.nbytes
      r.transfers += 1
      r.copies += len(t.parts)
      r.phase, r.worker = DECODE, t.dst.name
      self.counts["transfers"] += 1
      self.counts["kv_bytes"] += t.nbytes

  def _cancel_on_workers(self, r: Served) -> None:
    t = self.transfers.pop(r.id, None)
    if t is not None and not t.dst.stopped:
      t.dst.engine.cancel(t.dst_rid)
      self._drain(t.dst)
    super()._cancel_on_workers(r)

  def _on_stop(self, w: Worker) -> None:
    for rid, t in list(self.transfers.items()):
      if w not in (t.src, t.dst):
        continue
      del self.transfers[rid]
      r = self.requests[rid]
      if t.dst is w:  # the request is still whole on P: it waits for another decode worker
        r.phase, r.note = HANDOFF, f"transfer to {w.name} failed: {w.name} stopped"
      else:  # its source is gone mid-copy: give back D's reservation; it is recomputed
        t.dst.engine.cancel(t.dst_rid)
        self._drain(t.dst)
