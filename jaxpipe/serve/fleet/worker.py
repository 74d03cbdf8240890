"""One engine served to a router: a prefill, decode or replica server (`WorkerServer`).

The router speaks token ids to it over HTTP; every `/fleet/` route needs the fleet's shared
secret (`Authorization: Bearer <secret>`) when one is set. Streamed answers are NDJSON, one
event per line: `{"tokens": [...], "logprobs": [...] | null}`, `{"pulled": true}` (a decode
server's K/V landed), `{"ticket": {...}}` (a prefill server's offer), and last `{"finish":
reason, "error": text | null}` (the engine's finish reasons: eos, length, cancelled, error).

- `POST /fleet/generate` (replica): a job (`job_json`) in, its tokens streamed to the end.
- `POST /fleet/prefill` (prefill): a job in; its first token, then the ticket of its K/V pages
  (`kv_wire.KVWire.offer`): the pages stay until `POST /fleet/release {"uuid"}` or until the
  offer lapses (`offer_timeout_s`: a router or decode server that died frees them so). A request
  that ends at its first token (EOS, max_tokens 1) finishes instead.
- `POST /fleet/decode` (decode): `{"ticket": ...}` in; once the engine has a batch slot and the
  pages (tickets wait their turn, first come first served, up to `pull_timeout_s`), the server
  reserves them, pulls the ticket's pages while it steps its other requests (`KVWire.pull`), says
  `pulled`, and streams the tokens after the ticket's.
- `POST /fleet/score` (prefill, replica): a prompt's log-probabilities (echo with logprobs).
- `GET /fleet/info`: the role, the engine's request limits, pages and transfer address;
  `GET /fleet/load`: what it holds now (requests, pages, offers, counters).
- `GET /health`: 200 while the engine runs (503 failed or draining); `GET /ready`: 200 when it
  takes work. A closed stream cancels its request (an offered one stays until released).
  SIGTERM drains: nothing new is taken, running requests and held offers get `drain_s` seconds,
  then what is left is cancelled and the process exits.

One thread steps the engine (`WorkerLoop`); handlers on the event loop hand it commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxpipe
from jaxpipe.serve.http import serving
from jaxpipe.serve.http.auth import ApiKey
from jaxpipe.serve.http.loop import take
from jaxpipe.serve.kv_wire import KVWire, Pull, Ticket
from jaxpipe.serve.sampling import SamplingParams

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "replica")
GUARDED = "/fleet/"  # the routes that need the fleet's secret


@dataclasses.dataclass(eq=False)
class Job:
  """One request a worker serves for the router."""

  prompt: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: int | tuple[int, ...] | None | str  # "engine": the engine's own
  sink: asyncio.Queue  # its events, on the event loop
  ticket: Ticket | None = None  # decode: the K/V to pull
  rid: int | None = None  # the engine's id (engine thread)
  pull: Pull | None = None  # decode: its K/V on the way
  offer: Ticket | None = None  # prefill: its K/V offered, pages held until released
  deadline: float = 0.0  # prefill: when the offer lapses; decode: when the pull gives up


def job_json(prompt, max_tokens: int, sampling: SamplingParams, eos_id) -> dict:
  """A request as the router sends it (`job_from_json` reads it).

  Args:
    prompt: token ids.
    max_tokens: the most tokens to generate.
    sampling: its sampling values (no grammar: `SamplingParams.to_dict`).
    eos_id: one id, several, None, or "engine" (the server's own).

  Returns:
    The JSON object.
  """
  eos = list(eos_id) if isinstance(eos_id, (list, tuple)) else eos_id
  return {
      "prompt": [int(t) for t in prompt],
      "max_tokens": int(max_tokens),
      "sampling": sampling.to_dict(),
      "eos_id": eos,
  }


def job_from_json(body) -> tuple[list[int], int, SamplingParams, object]:
  """A request from `job_json`'s object.

  Args:
    body: the parsed JSON.

  Returns:
    (prompt, max_tokens, sampling, eos_id).

  Raises:
    ValueError: one line naming what is malformed.
  """
  if not isinstance(body, dict) or not {"prompt", "max_tokens", "sampling"} <= set(body):
    raise ValueError("send a JSON object with prompt, max_tokens, sampling and eos_id")
  prompt, max_tokens, eos = body["prompt"], body["max_tokens"], body.get("eos_id", "engine")
  if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
    raise ValueError("prompt must be a list of token ids")
  if not isinstance(max_tokens, int):
    raise ValueError(f"max_tokens={max_tokens!r} must be an integer")
  if isinstance(eos, list):
    eos = tuple(eos)
  if not (eos is None or eos == "engine" or isinstance(eos, (int, tuple))):
    raise ValueError(f"eos_id={eos!r} must be an id, a list of ids, null or 'engine'")
  if not isinstance(body["sampling"], dict):
    raise ValueError("sampling must be an object (SamplingParams.to_dict)")
  return prompt, max_tokens, SamplingParams.from_dict(body["sampling"]), eos


class WorkerLoop:
  """Steps the engine on its own thread and turns its tokens, offers and finishes into events."""

  def __init__(
      self, engine, role: str, wire: KVWire | None, offer_timeout_s: float, pull_timeout_s: float
  ):
    self.engine, self.role, self.wire = engine, role, wire
    self.offer_timeout_s, self.pull_timeout_s = offer_timeout_s, pull_timeout_s
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._deadline: float | None = None  # drain: cancel whatever runs past it
    self.failed: str | None = None  # why the loop stopped on an error
    self.lapsed = 0  # offers no one released in time (their pages freed)
    # decode: K/V pulls landed, their bytes and seconds (pull to admission), summed
    self.moved = {"pulls": 0, "bytes": 0, "seconds": 0.0}
    self.snapshot: dict = {}  # the latest `load` (the engine thread writes it whole)

  def start(self, aloop: asyncio.AbstractEventLoop) -> None:
    """Starts the engine thread.

    Args:
      aloop: the event loop the handlers (and their jobs' sinks) run on.
    """
    self._aloop = aloop
    self._thread = threading.Thread(target=self._run, name="worker-loop", daemon=True)
    self._thread.start()

  def submit(self, kind: str, arg) -> None:
    """Queues a command for the engine thread.

    Args:
      kind: "add" (a job to generate or prefill), "pull" (a decode job), "cancel" (a job),
        "release" (an offer's uuid), "score" ((prompt, top_logprobs, an asyncio future)),
        "drain" (the time.perf_counter deadline), "stop".
      arg: the job, uuid, score or deadline.
    """
    self._inbox.put((kind, arg))

  def stop(self) -> None:
    """Cancels everything, sends the finishes and ends the thread."""
    if self._thread is not None:
      self.submit("stop", None)
      self._thread.join()
      self._thread = None

  @property
  def idle(self) -> bool:
    """Nothing runs, arrives or waits to be pulled."""
    return not self.snapshot.get("jobs", 0)

  def _send(self, job: Job, event: dict) -> None:
    try:
      self._aloop.call_soon_threadsafe(job.sink.put_nowait, event)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
      pass

  def _end(self, job: Job, reason: str, error: str | None = None) -> None:
    self._send(job, {"finish": reason, "error": error})

  def _take(self, timeout: float) -> list:
    return take(self._inbox, timeout)

  def _run(self) -> None:
    e = self.engine
    live: dict[int, Job] = {}  # engine id -> job (running, waiting, or offered)
    queued: list[Job] = []  # decode: tickets waiting for a batch slot and pages, oldest first
    pulls: list[Job] = []  # decode: K/V on the way
    offers: dict[int, Job] = {}  # prefill: ticket uuid -> job whose pages wait to be pulled
    stopping = False
    self._publish(live, pulls, offers, queued)
    while not (stopping and not live and not pulls and not queued):
      # a pull in flight is polled every millisecond; nothing at all: every 20 ms
      commands = self._take(0.0 if e.has_work() else 0.001 if pulls or queued else 0.02)
      try:
        for kind, arg in commands:
          if kind == "add":
            arg.rid = e.add_request(arg.prompt, arg.max_tokens, arg.sampling, eos_id=arg.eos_id)
            live[arg.rid] = arg
          elif kind == "pull":  # pulled once the engine has room (`_start_pulls`)
            arg.deadline = time.perf_counter() + self.pull_timeout_s
            queued.append(arg)
          elif kind == "cancel":
            if arg in queued:
              queued.remove(arg)
              self._end(arg, "cancelled")
            elif arg in pulls:
              pulls.remove(arg)
              arg.pull.cancel()
              self._end(arg, "cancelled")
            elif arg.offer is not None and offers.pop(arg.offer.uuid, None) is arg:
              e.release(arg.rid)  # offered as the stream closed: its ticket never left
              del live[arg.rid]
            elif arg.rid in live:
              e.cancel(arg.rid)
          elif kind == "release":
            job = offers.pop(arg, None)
            if job is not None:
              e.release(job.rid)
              del live[job.rid]
          elif kind == "score":
            prompt, top, done = arg
            try:
              scores = [None if x is None else _lp(x) for x in e.score(prompt, top)]
              self._resolve(done, scores)
            except Exception as err:  # noqa: BLE001 -- this prompt's error, not the engine's
              self._resolve(done, exception=ValueError(str(err)))
          elif kind == "drain":
            self._deadline = arg
          else:
            stopping = True
        if stopping or (self._deadline is not None and time.perf_counter() >= self._deadline):
          for job in queued:
            self._end(job, "cancelled")
          queued.clear()
          self._cancel_all(live, pulls, offers)
        self._start_pulls(queued, pulls)
        for job in list(pulls):
          try:
            if not job.pull.ready():
              continue
            job.rid = job.pull.land()
          except ValueError as err:  # its reservation is cancelled; the others go on
            pulls.remove(job)
            self._end(job, "error", str(err))
            continue
          pulls.remove(job)
          live[job.rid] = job
          self.moved.update(
              pulls=self.moved["pulls"] + 1,
              bytes=self.moved["bytes"] + job.pull.nbytes,
              seconds=self.moved["seconds"] + job.pull.seconds,
          )
          self._send(job, {"pulled": True})
        new = e.step() if e.has_work() else {}
        events = {}  # a job's tokens of this step, and its finish with them (one event)
        for rid, tokens in new.items():
          job = live.get(rid)
          if job is not None:
            events[job] = {"tokens": list(tokens), "logprobs": self._logprobs(rid, len(tokens))}
        for r in e.finished():
          job = live.pop(r.id, None)
          if job is not None:
            events.setdefault(job, {}).update(finish=r.finish_reason, error=r.error)
        for job, event in events.items():
          self._send(job, event)
        if self.role == "prefill":
          self._offer(live, offers)
        self._publish(live, pulls, offers, queued)
      except Exception as err:  # noqa: BLE001 -- an engine fault fails its jobs, not the server
        log.exception("worker loop failed")
        self.failed = f"{type(err).__name__}: {err}"
        for job in set(live.values()) | set(pulls) | set(queued):
          self._end(job, "error", f"the engine failed: {self.failed}")
        self.snapshot = {**self.snapshot, "jobs": 0}  # nothing runs any more: SIGTERM exits
        self._refuse(commands)  # the rest of this batch (those done are answered already)
        self._fail_later(stopping)
        return

  def _start_pulls(self, queued: list[Job], pulls: list[Job]) -> None:
    """Starts the queued pulls the engine has room for, in order (a ticket that does not fit
    waits, and those behind it: first come, first served); ends those past their timeout."""
    now = time.perf_counter()
    while queued:
      job = queued[0]
      if now > job.deadline:
        queued.pop(0)
        self._end(job, "error", "no batch slot or pages came free before the pull's timeout")
        continue
      try:
        if not self.wire.fits(self.engine, job.ticket):
          return
        queued.pop(0)
        job.pull = self.wire.pull(self.engine, job.ticket, max(job.deadline - now, 0.0))
        pulls.append(job)
      except Exception as err:  # noqa: BLE001 -- this ticket's fault (malformed), not the server's
        if queued and queued[0] is job:
          queued.pop(0)
        self._end(job, "error", f"{type(err).__name__}: {err}".splitlines()[0])

  def _offer(self, live: dict[int, Job], offers: dict[int, Job]) -> None:
    """Offers each newly prefilled request's K/V; frees the pages of offers that lapsed."""
    e, now = self.engine, time.perf_counter()
    for r in list(e.prefilled):
      job = live.get(r.id)
      if job is None or job.offer is not None:
        continue
      try:
        job.offer = self.wire.offer(e, r.id, timeout_s=self.offer_timeout_s)
      except Exception as err:  # noqa: BLE001 -- this request's offer failed, not the server
        e.cancel(r.id)
        live.pop(r.id)
        self._end(job, "error", f"offering its K/V failed: {err}".splitlines()[0])
        continue
      job.deadline = now + self.offer_timeout_s
      offers[job.offer.uuid] = job
      self._send(job, {"ticket": job.offer.to_dict()})
    for uuid, job in list(offers.items()):
      if now > job.deadline:  # no decode server took it: its router or puller is gone
        del offers[uuid]
        e.release(job.rid)
        del live[job.rid]
        self.lapsed += 1

  def _cancel_all(self, live: dict[int, Job], pulls: list[Job], offers: dict[int, Job]) -> None:
    for job in pulls:
      job.pull.cancel()
      self._end(job, "cancelled")
    pulls.clear()
    for job in offers.values():
      self.engine.release(job.rid)
      del live[job.rid]
    offers.clear()
    for rid in list(live):
      self.engine.cancel(rid)

  def _fail_later(self, stopping: bool) -> None:
    """After an engine fault: every later job ends with the error."""
    while not stopping:
      commands = self._take(1.0)
      self._refuse(commands)
      stopping = any(kind == "stop" for kind, _ in commands)

  def _refuse(self, commands: list) -> None:
    """Answers commands with the engine's failure (a job's end; a score's exception)."""
    error = f"the engine failed: {self.failed}"
    for kind, arg in commands:
      if kind in ("add", "pull"):
        self._end(arg, "error", error)
      elif kind == "score":
        self._resolve(arg[2], exception=RuntimeError(error))

  def _resolve(self, done: asyncio.Future, value=None, exception=None) -> None:
    """Sets a handler's future from this thread (a handler gone: nothing to set)."""

    def resolve():
      if not done.done():
        done.set_exception(exception) if exception is not None else done.set_result(value)

    try:
      self._aloop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the event loop is closed
      pass

  def _logprobs(self, rid: int, n: int) -> list | None:
    r = self.engine.requests.get(rid)
    if r is None or r.sampling.logprobs is None or len(r.logprobs) < n:
      return None
    return [_lp(x) for x in r.logprobs[-n:]]

  def _publish(self, live: dict, pulls: list, offers: dict, queued: list) -> None:
    e = self.engine
    self.snapshot = {
        "role": self.role,
        "running": len(e.running),
        "waiting": len(e.waiting),
        "incoming": len(e.incoming),
        "prefilled": len(e.prefilled),
        "offers": len(offers),
        "pulls": len(pulls),
        "queued": len(queued),
        "jobs": len(live) + len(pulls) + len(queued),
        "lapsed": self.lapsed,
        "moved": dict(self.moved),
        "free_pages": e.allocator.num_free,
        "usage": e.kv_usage(),
        "counts": dict(e.counts),
    }


class WorkerServer:
  """An engine served to a router (module docstring); `run` serves it until SIGTERM drains it."""

  def __init__(
      self,
      engine,
      role: str,
      *,
      transfer_address: str = "127.0.0.1:0",
      fleet_secret: str | None = None,
      offer_timeout_s: float = 30.0,
      pull_timeout_s: float = 30.0,
      drain_s: float = 30.0,
      info: dict | None = None,
  ):
    """Args:
    engine: the `Engine` (prefill_only for the prefill role).
    role: one of ROLES.
    transfer_address: where the transfer server listens (prefill and decode; port 0 picks one).
    fleet_secret: the Bearer token every /fleet/ call must carry (None: anyone may call).
    offer_timeout_s: prefill: how long an offer's pages wait to be pulled and released.
    pull_timeout_s: decode: how long a ticket may wait for room and be pulled, together.
    drain_s: after SIGTERM, how long running requests may go on.
    info: more to show at /fleet/info (the model's name, its source).
    """
    if role not in ROLES:
      raise ValueError(f"role={role!r}: use one of {', '.join(ROLES)}")
    if role == "prefill" and not engine.prefill_only:
      raise ValueError("a prefill server's engine must be prefill_only (it parks each request)")
    if role != "prefill" and engine.prefill_only:
      raise ValueError(f"a {role} server's engine must not be prefill_only")
    if fleet_secret is not None and not fleet_secret:
      raise ValueError("the fleet secret is empty; give a non-empty --fleet_secret or none")
    self.engine, self.role, self.drain_s = engine, role, drain_s
    self.wire = KVWire(transfer_address) if role != "replica" else None
    if self.wire is not None:
      engine.transfer.check_movable()
    self.loop = WorkerLoop(engine, role, self.wire, offer_timeout_s, pull_timeout_s)
    self.draining = False
    self.info = {
        "role": role,
        "version": jaxpipe.__version__,
        "limits": dataclasses.asdict(engine.limits),
        "max_batch": engine.max_batch,
        "kv_cache_dtype": str(engine.kv_dtype),
        "transfer_address": self.wire.address if self.wire else None,
        **(info or {}),
    }
    routes = [
        Route("/fleet/info", self.get_info, methods=["GET"]),
        Route("/fleet/load", self.load, methods=["GET"]),
        Route("/health", self.health, methods=["GET"]),
        Route("/ready", self.ready, methods=["GET"]),
    ]
    if role == "replica":
      routes.append(Route("/fleet/generate", self.generate, methods=["POST"]))
    if role == "prefill":
      routes.append(Route("/fleet/prefill", self.prefill, methods=["POST"]))
      routes.append(Route("/fleet/release", self.release, methods=["POST"]))
    if role == "decode":
      routes.append(Route("/fleet/decode", self.decode, methods=["POST"]))
    else:
      routes.append(Route("/fleet/score", self.score, methods=["POST"]))
    guard = [Middleware(ApiKey, key=fleet_secret, guarded=GUARDED, what="fleet secret")]
    self.app = Starlette(
        routes=routes, lifespan=self._lifespan, middleware=guard if fleet_secret else []
    )

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    self.loop.start(asyncio.get_running_loop())
    try:
      yield
    finally:
      await asyncio.to_thread(self.loop.stop)

  def drain(self) -> None:
    """Stops taking requests; those running (and offers held) get drain_s seconds."""
    if not self.draining:
      self.draining = True
      self.loop.submit("drain", time.perf_counter() + self.drain_s)

  @property
  def drained(self) -> bool:
    """Draining, and nothing is in flight any more (or the engine failed: nothing can run)."""
    return self.draining and (self.loop.idle or self.loop.failed is not None)

  def run(self, host: str, port: int, log_level: str = "warning") -> None:
    """Serves on host:port until SIGTERM/SIGINT, then drains and returns.

    Args:
      host: the address to listen on.
      port: the port to listen on.
      log_level: uvicorn's log level.

    Raises:
      OSError: the address cannot be listened on.
    """
    serving.run(self, host, port, log_level)

  # -- routes -----------------------------------------------------------------------------------

  async def get_info(self, request: Request) -> Response:
    """GET /fleet/info: the role, request limits and transfer address.

    Args:
      request: the HTTP request.

    Returns:
      The info object.
    """
    return JSONResponse(self.info)

  async def load(self, request: Request) -> Response:
    """GET /fleet/load: what the engine holds now (`WorkerLoop.snapshot`).

    Args:
      request: the HTTP request.

    Returns:
      The snapshot, with "draining" and "failed".
    """
    state = {"draining": self.draining, "failed": self.loop.failed}
    return JSONResponse({**self.loop.snapshot, **state})

  async def health(self, request: Request) -> Response:
    """GET /health: whether the engine runs.

    Args:
      request: the HTTP request.

    Returns:
      {"status": "ok"}; 503 with "failed" (and the error) or "draining".
    """
    if self.loop.failed:
      return JSONResponse({"status": "failed", "error": self.loop.failed}, status_code=503)
    if self.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok", "role": self.role})

  async def ready(self, request: Request) -> Response:
    """GET /ready: whether the server takes work now.

    Args:
      request: the HTTP request.

    Returns:
      {"ready": true}; 503 with {"ready": false, "why"} otherwise.
    """
    why = self._refusal()
    if why:
      return JSONResponse({"ready": False, "why": why}, status_code=503)
    return JSONResponse({"ready": True, "role": self.role})

  async def generate(self, request: Request) -> Response:
    """POST /fleet/generate (replica): a job's tokens, streamed to its finish.

    Args:
      request: the HTTP request: a `job_json` object.

    Returns:
      The NDJSON stream; 400 for a bad job, 503 when not taking work.
    """
    job = await self._job(request)
    if isinstance(job, Response):
      return job
    self.loop.submit("add", job)
    return self._stream(job)

  async def prefill(self, request: Request) -> Response:
    """POST /fleet/prefill (prefill): a job's first token, then its K/V's ticket.

    Args:
      request: the HTTP request: a `job_json` object.

    Returns:
      The NDJSON stream, ending at the ticket or a finish; 400 / 503 as `generate`.
    """
    return await self.generate(request)

  async def decode(self, request: Request) -> Response:
    """POST /fleet/decode (decode): pulls a ticket's K/V and streams the tokens after it.

    Args:
      request: the HTTP request: {"ticket": a `Ticket`'s JSON object}.

    Returns:
      The NDJSON stream (`pulled`, then tokens, then the finish); 400 for a bad ticket, 503 when
      not taking work.
    """
    why = self._refusal()
    if why:
      return _error(why, 503)
    try:
      body = json.loads(await request.body())
      ticket = Ticket.from_dict(body["ticket"])
      q = ticket.request
      prompt, max_tokens, sampling, eos = job_from_json({**q, "eos_id": q.get("eos_id")})
      refusal = self.engine.check_request(prompt, max_tokens, sampling, eos)
      if refusal:
        raise ValueError(refusal)
    except (ValueError, KeyError, TypeError) as e:
      return _error(f"bad decode request: {e}", 400)
    job = Job(prompt, max_tokens, sampling, eos, asyncio.Queue(), ticket=ticket)
    self.loop.submit("pull", job)
    return self._stream(job)

  async def score(self, request: Request) -> Response:
    """POST /fleet/score (prefill, replica): a prompt's log-probabilities (`Engine.score`).

    Args:
      request: the HTTP request: {"prompt": token ids, "top_logprobs": k}.

    Returns:
      {"logprobs": [null, [logprob, [[id, logprob], ...]], ...]}; 400 for a bad prompt.
    """
    why = self._refusal()
    if why:
      return _error(why, 503)
    try:
      body = json.loads(await request.body())
      prompt, top = body["prompt"], body.get("top_logprobs", 0)
      if not isinstance(top, int) or top < 0:
        raise ValueError(f"top_logprobs={top!r} must be an integer >= 0")
      refusal = self.engine.check_request(prompt, 1, SamplingParams(), None)
      if refusal:
        raise ValueError(refusal)
    except (ValueError, KeyError, TypeError) as e:
      return _error(f"bad score request: {e}", 400)
    done = asyncio.get_running_loop().create_future()
    self.loop.submit("score", (prompt, top, done))
    try:
      return JSONResponse({"logprobs": await done})
    except ValueError as e:
      return _error(f"scoring failed: {e}", 400)

  async def release(self, request: Request) -> Response:
    """POST /fleet/release (prefill): frees an offer's pages (its K/V moved, or never will).

    Args:
      request: the HTTP request: {"uuid": the ticket's uuid}.

    Returns:
      {"released": uuid}; 400 for a body without an integer uuid.
    """
    try:
      uuid = json.loads(await request.body())["uuid"]
      if not isinstance(uuid, int):
        raise ValueError(f"uuid={uuid!r} is not an integer")
    except (ValueError, KeyError, TypeError) as e:
      return _error(f"bad release request: {e}", 400)
    self.loop.submit("release", uuid)
    return JSONResponse({"released": uuid})

  # -- helpers ----------------------------------------------------------------------------------

  def _refusal(self) -> str | None:
    if self.loop.failed:
      return f"the engine failed: {self.loop.failed}"
    if self.draining:
      return "the server is draining (SIGTERM); send the request to another"
    return None

  async def _job(self, request: Request) -> Job | Response:
    why = self._refusal()
    if why:
      return _error(why, 503)
    try:
      prompt, max_tokens, sampling, eos = job_from_json(json.loads(await request.body()))
      refusal = self.engine.check_request(prompt, max_tokens, sampling, eos)
    except (ValueError, TypeError) as e:
      return _error(f"bad job: {e}", 400)
    if refusal:
      return _error(str(refusal), 400)
    return Job(prompt, max_tokens, sampling, eos, asyncio.Queue())

  def _stream(self, job: Job) -> Response:
    ended = []  # the finish (or the ticket) was sent: closing cancels nothing

    async def lines():
      while True:
        event = await job.sink.get()
        yield json.dumps(event) + "\n"
        if "finish" in event or "ticket" in event:
          ended.append(True)
          return

    def closed():
      if not ended:  # the router went away: nobody wants the request any more
        self.loop.submit("cancel", job)

    return serving.Stream(lines(), media_type="application/x-ndjson", on_close=closed)


def _lp(x) -> list:
  """A `TokenLogprobs` as JSON: [logprob, [[id, logprob], ...]]."""
  return [x[0], [list(pair) for pair in x[1]]]


def _error(message: str, status: int) -> JSONResponse:
  return JSONResponse({"error": {"message": message}}, status_code=status)
