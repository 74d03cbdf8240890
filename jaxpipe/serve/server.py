"""An OpenAI-compatible HTTP server over a serving engine: completions (streamed as server-sent
events, one chunk per token), models, health and Prometheus metrics.

  python -m jaxpipe.serve --workdir /tmp/qs --http --host 127.0.0.1 --port 8000

The engine runs on its own thread (`EngineLoop`); request handlers on the event loop queue
sequences to it and read their tokens back. The server holds at most `max_batch + max_queue`
sequences (a request of n choices over p prompts counts n·p); beyond that it answers 429 with
`Retry-After`. A client that disconnects cancels its sequences, which frees their pages at once.
SIGTERM or SIGINT drains: the listening socket closes, running and queued requests get
`drain_s` seconds to finish, what is left is cancelled (finish_reason "abort"), and `run`
returns (the process exits 0).

Text is the byte tokenizer of jaxpipe's models: a prompt's UTF-8 bytes are its tokens, and
generated tokens below 256 are bytes of the output (decoded incrementally, so a character split
over tokens appears whole in the chunk of its last byte). Beyond the OpenAI fields, every
choice carries `token_ids` (its generated tokens; in a stream, the chunk's), and requests
accept vLLM's `top_k` and `ignore_eos`.
"""
from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import dataclasses
import json
import logging
import queue
import random
import signal
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Protocol, Sequence

import pydantic
import uvicorn
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, generate_latest)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxpipe.serve.engine import ENGINE_EOS
from jaxpipe.serve.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_STOPS = 4  # OpenAI's limit on stop sequences
FINISH = {"eos": "stop", "length": "length", "cancelled": "abort"}  # engine reason -> OpenAI's


class Backend(Protocol):
  """What the server drives: an `Engine`, or a deployment of several (`serve.deploy`: Colocated,
  Disaggregated) that lists them in `engines`; limits and gauges are read from those engines."""

  def check_request(self, prompt: Sequence[int], max_tokens: int,
                    sampling: SamplingParams) -> str | None: ...  # reads configuration only
  def add_request(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams, *,
                  eos_id: int | None | str) -> int: ...
  def step(self) -> dict[int, list[int]]: ...
  def cancel(self, rid: int) -> None: ...
  def finished(self) -> list[Any]: ...  # objects with .id, .finish_reason, .error
  def has_work(self) -> bool: ...


def engines_of(backend: Backend) -> list:
  """The engines behind a backend: a deployment's live workers', or the engine itself."""
  return list(getattr(backend, "engines", None) or [backend])


# -- requests ---------------------------------------------------------------------------------------


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  include_usage: bool | None = None  # a last chunk with empty choices and the usage
  continuous_usage_stats: bool | None = None  # accepted (vLLM's); every chunk's usage is null


class CompletionRequest(pydantic.BaseModel):
  """The body of POST /v1/completions; null means the default."""
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  model: str | None = None  # must be the served model's name when given
  prompt: str | list[int] | list[str] | list[list[int]]  # text (UTF-8 bytes) or token ids, or a list
  max_tokens: int | None = None  # default 16, OpenAI's
  temperature: float | None = None  # default 1, OpenAI's; 0 = greedy
  top_p: float | None = None
  top_k: int | None = None  # vLLM's; 0 or -1 = no limit
  seed: int | None = None  # choice k samples with seed + k (mod 2**31); default random
  stop: str | list[str] | None = None  # up to 4; the text ends before the first one found
  n: int | None = None  # choices per prompt
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  ignore_eos: bool | None = None  # vLLM's: only max_tokens or a stop sequence ends the choice
  user: str | None = None  # accepted, unused
  # Accepted only at their defaults (clients send them unasked); anything else is refused.
  echo: bool | None = None
  logprobs: int | None = None
  best_of: int | None = None
  suffix: str | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  logit_bias: dict[str, float] | None = None


UNSUPPORTED = {"echo": (None, False), "logprobs": (None, 0), "suffix": (None, ""),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "repetition_penalty": (None, 1), "logit_bias": (None, {})}


class BadRequest(Exception):
  """A request the server refuses: status, message and the offending parameter."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error", code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
    self.headers = headers


def error_response(e: BadRequest) -> JSONResponse:
  """OpenAI's error body."""
  return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param,
                                 "code": e.code}}, status_code=e.status, headers=e.headers)


def _validation_message(e: pydantic.ValidationError) -> tuple[str, str | None]:
  err = e.errors()[0]
  loc = [str(x) for x in err["loc"]]
  param = loc[0] if loc else None
  if err["type"] == "extra_forbidden":
    return (f"unrecognized request argument {'.'.join(loc)!r}; supported: "
            f"{', '.join(CompletionRequest.model_fields)}", param)
  if err["type"] == "missing":
    return f"{param!r} is required", param
  if param == "prompt":
    return (f"prompt={err.get('input')!r:.80} must be a string, a list of token ids, or a list of "
            "either", param)
  return f"{param}={err.get('input')!r:.80}: {err['msg']}", param


def parse_request(body: bytes) -> CompletionRequest:
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not valid JSON ({e}); send a JSON object") from None
  if not isinstance(obj, dict):
    raise BadRequest(f"the request body is a JSON {type(obj).__name__}; send a JSON object")
  try:
    req = CompletionRequest.model_validate(obj)
  except pydantic.ValidationError as e:
    raise BadRequest(*_validation_message(e)) from None
  for name, defaults in UNSUPPORTED.items():
    if getattr(req, name) not in defaults:
      raise BadRequest(f"{name}={getattr(req, name)!r} is not supported; leave it out", name)
  if req.best_of not in (None, 1, req.n or 1):
    raise BadRequest(f"best_of={req.best_of} is not supported; leave it out (or equal to n)",
                     "best_of")
  return req


def prompts_of(prompt: str | list) -> list[tuple[list[int], bool]]:
  """(tokens, given as text) of each prompt of a request."""
  if isinstance(prompt, str):
    return [(list(prompt.encode("utf-8")), True)]
  if not prompt or isinstance(prompt[0], int):
    return [(list(prompt), False)]
  return [(list(p.encode("utf-8")), True) if isinstance(p, str) else (list(p), False)
          for p in prompt]


# -- choices: tokens to text ------------------------------------------------------------------------


class Choice:
  """One choice's text as its tokens arrive: incremental UTF-8, stop sequences, finish reason.

  Text that could be the start of a stop sequence is held back until it is not, so no chunk
  ever carries part of a stop sequence.
  """

  def __init__(self, index: int, stops: Sequence[str], eos_id: int | None):
    self.index, self.stops, self.eos_id = index, list(stops), eos_id
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.text, self.sent, self.tokens = "", 0, []
    self.finish_reason: str | None = None

  def add(self, token: int | None, finish: str | None) -> str:
    """Takes one token (None: none) and the finish reason if the choice ends with it; returns
    the text it releases."""
    if token is not None:
      self.tokens.append(token)
      if token < 256 and token != self.eos_id:
        self.text += self._decoder.decode(bytes([token]))
    if finish is not None:
      self.text += self._decoder.decode(b"", final=True)
    hold = 0
    if self.stops:
      found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
      if found:
        self.text, finish = self.text[:min(found)], "stop"
      elif finish is None:
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])),
                   default=0)
    out = self.text[self.sent:len(self.text) - hold]
    self.sent += len(out)
    self.finish_reason = finish
    return out


# -- the engine loop --------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Seq:
  """One choice of one request, as the engine loop sees it."""
  prompt: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: int | None | str
  arrival: float  # time.perf_counter() when the request arrived
  sink: asyncio.Queue  # (index, tokens, finish reason or None, error or None) on the event loop
  index: int  # choice index within the request
  rid: int | None = None  # the backend's id (engine thread)
  first: float | None = None  # first token's time (engine thread)
  last: float | None = None
  n_tokens: int = 0
  stopped: bool = False  # ended by a stop sequence (set on the event loop before cancelling)
  done: bool = False  # its last event was delivered (event loop)


class Metrics:
  """Prometheus metrics of one server (its own registry), and the process' own (CPU, memory)."""

  def __init__(self):
    r = self.registry = CollectorRegistry()
    ProcessCollector(registry=r)
    self.running = Gauge("jaxpipe_num_requests_running", "Sequences in the running batch.", registry=r)
    self.waiting = Gauge("jaxpipe_num_requests_waiting", "Sequences accepted, not yet running.",
                         registry=r)
    self.pages_total = Gauge("jaxpipe_kv_pages_total", "KV pages per layer (not the scratch page).",
                             registry=r)
    self.pages_used = Gauge("jaxpipe_kv_pages_used", "KV pages allocated, to sequences or the "
                            "prefix cache.", registry=r)
    self.pages_running = Gauge("jaxpipe_kv_pages_running", "KV pages held by running sequences.",
                               registry=r)
    self.pages_cached = Gauge("jaxpipe_kv_pages_cached", "KV pages in the prefix cache.", registry=r)
    self.kv_tokens = Counter("jaxpipe_kv_tokens_stored", "Tokens stored for running sequences, "
                             "summed over steps.", registry=r)
    self.kv_slots = Counter("jaxpipe_kv_slots_held", "KV slots of the pages running sequences "
                            "hold, summed over steps.", registry=r)
    self.steps = Counter("jaxpipe_engine_steps", "Engine iterations that ran the model.", registry=r)
    self.prompt_tokens = Counter("jaxpipe_prompt_tokens", "Prompt tokens accepted.", registry=r)
    self.generation_tokens = Counter("jaxpipe_generation_tokens", "Tokens generated.", registry=r)
    self.tokens_per_second = Gauge("jaxpipe_generation_tokens_per_second",
                                   "Tokens generated per second over the last 10 s.", registry=r)
    self.ttft = Histogram("jaxpipe_time_to_first_token_seconds", "Arrival to first token.",
                          buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5,
                                   5, 7.5, 10, 20, 40, 80), registry=r)
    self.tpot = Histogram("jaxpipe_time_per_output_token_seconds", "A sequence's mean time per "
                          "output token after the first.",
                          buckets=(.001, .0025, .005, .01, .025, .05, .075, .1, .15, .2, .3, .4,
                                   .5, .75, 1, 2.5), registry=r)
    self.e2e = Histogram("jaxpipe_e2e_request_latency_seconds", "Arrival to last token.",
                         buckets=(.1, .3, .5, 1, 2, 5, 10, 20, 40, 80, 160), registry=r)
    self.finished = Counter("jaxpipe_request_finished", "Sequences finished, by reason.",
                            ["finish_reason"], registry=r)
    self.rejected = Counter("jaxpipe_request_rejected", "Requests refused, by HTTP status.",
                            ["status"], registry=r)


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
    self._aloop, self._deliver = aloop, deliver
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._thread.start()

  def submit(self, seqs: list[Seq]) -> None:
    self._inbox.put(("add", seqs))

  def cancel(self, seqs: list[Seq]) -> None:
    self._inbox.put(("cancel", seqs))

  def drain(self, seconds: float) -> None:
    """Lets what runs go on for `seconds`, then cancels the rest."""
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
          if kind == "add":
            for s in arg:
              s.rid = self.backend.add_request(s.prompt, s.max_tokens, s.sampling, eos_id=s.eos_id)
              live[s.rid] = s
              self.metrics.prompt_tokens.inc(len(s.prompt))
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
          s.first = s.first or now
          s.last, s.n_tokens = now, s.n_tokens + len(tokens)
          events[s] = [list(tokens), None, None]
        for r in self.backend.finished():
          s = live.pop(r.id, None)
          if s is None:  # reported finished twice
            continue
          reason = "stop" if s.stopped else FINISH.get(r.finish_reason, "error")
          events.setdefault(s, [[], None, None])[1:] = [reason, r.error if reason == "error" else None]
          self._observe_finish(s, reason)
        self._update_gauges(stepped, new, now, window)
      except Exception as e:  # noqa: BLE001 -- an engine fault fails its requests, not the server
        log.exception("engine loop failed")
        self.failed = f"{type(e).__name__}: {e}"
        added = [s for kind, arg in commands if kind == "add" for s in arg]
        self._fail(set(live.values()) | set(added) | set(events), stopping)
        return
      if events:
        self._send([(s, *e) for s, e in events.items()])

  def _take(self, timeout: float) -> list[tuple[str, Any]]:
    """The queued commands, waiting up to `timeout` seconds for the first."""
    commands = []
    try:
      commands.append(self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait())
      while True:
        commands.append(self._inbox.get_nowait())
    except queue.Empty:
      return commands

  def _send(self, events: list) -> None:
    try:
      self._aloop.call_soon_threadsafe(self._deliver, events)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
      pass

  def _fail(self, seqs: set[Seq], stopping: bool) -> None:
    """After an engine fault: every sequence, now and later, ends with the error."""
    error = f"the engine failed: {self.failed}"
    while True:
      self._send([(s, [], None, error) for s in seqs])
      if stopping:
        return
      commands = self._take(1.0)
      seqs = {s for kind, arg in commands if kind == "add" for s in arg}
      stopping = any(kind == "stop" for kind, _ in commands)

  def _observe_finish(self, s: Seq, reason: str) -> None:
    m = self.metrics
    m.finished.labels(reason).inc()
    if s.first is not None:
      m.ttft.observe(s.first - s.arrival)
      m.e2e.observe(s.last - s.arrival)
    if s.n_tokens > 1:
      m.tpot.observe((s.last - s.first) / (s.n_tokens - 1))

  def _update_gauges(self, stepped: bool, new: dict, now: float, window: collections.deque) -> None:
    m, engines = self.metrics, engines_of(self.backend)
    generated = sum(len(t) for t in new.values())
    usage = collections.Counter()
    for e in engines:
      usage.update(e.kv_usage())
    if stepped:  # as serve_bench sums them: after every step
      m.steps.inc()
      m.kv_tokens.inc(usage["tokens"])
      m.kv_slots.inc(usage["slots"])
    m.generation_tokens.inc(generated)
    window.append((now, generated))
    while window[0][0] < now - self.WINDOW_S:
      window.popleft()
    m.tokens_per_second.set(sum(n for _, n in window) / self.WINDOW_S)
    m.running.set(sum(len(e.running) for e in engines))
    m.waiting.set(sum(len(e.waiting) for e in engines))
    m.pages_total.set(usage["pages_total"])
    m.pages_used.set(usage["pages_in_use"])
    m.pages_running.set(usage["pages_running"])
    m.pages_cached.set(usage["cached_pages"])


# -- the HTTP application ---------------------------------------------------------------------------


class CompletionServer:
  """The Starlette app over a backend; `run` serves it with uvicorn until SIGTERM/SIGINT."""

  def __init__(self, backend: Backend, *, model_name: str, max_batch: int, max_queue: int = 64,
               drain_s: float = 30.0, engine_info: dict | None = None):
    """max_batch + max_queue: the sequences held at once; drain_s: how long running requests
    may go on after SIGTERM before they are cancelled; engine_info: shown by /v1/models."""
    if max_queue < 0 or drain_s < 0:
      raise ValueError(f"max_queue={max_queue} and drain_s={drain_s} must be >= 0")
    self.backend, self.model_name, self.drain_s = backend, model_name, drain_s
    engines = engines_of(backend)
    self.max_seq_len, self.eos_id = min(e.max_seq_len for e in engines), engines[0].eos_id
    self.capacity = max_batch + max_queue
    self.engine_info = engine_info or {}
    self.metrics = Metrics()
    self.loop = EngineLoop(backend, self.metrics)
    self.inflight = 0  # sequences accepted and not yet finished (event loop only)
    self.draining = False
    self.created = int(time.time())
    self.app = Starlette(
        routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"])],
        exception_handlers={HTTPException: self._http_error, Exception: self._server_error},
        lifespan=self._lifespan)

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    self.loop.start(asyncio.get_running_loop(), self._deliver)
    try:
      yield
    finally:
      await asyncio.to_thread(self.loop.stop)

  def _deliver(self, events: list[tuple[Seq, list[int], str | None, str | None]]) -> None:
    for s, tokens, finish, error in events:
      if s.done:
        continue
      s.sink.put_nowait((s.index, tokens, finish, error))
      if finish is not None or error is not None:
        s.done = True
        self.inflight -= 1

  def drain(self) -> None:
    """Stops taking requests; those running get drain_s seconds, then are cancelled."""
    if not self.draining:
      self.draining = True
      self.loop.drain(self.drain_s)

  # -- endpoints --

  async def health(self, request: Request) -> Response:
    if self.loop.failed:
      return JSONResponse({"status": "failed", "error": self.loop.failed}, status_code=503)
    if self.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})

  async def models(self, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxpipe",
        "max_model_len": self.max_seq_len, "engine": self.engine_info}]})

  async def prometheus(self, request: Request) -> Response:
    return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  async def _http_error(self, request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(BadRequest(f"{request.method} {request.url.path}: {exc.detail}",
                                     status=exc.status_code, kind=kind))

  async def _server_error(self, request: Request, exc: Exception) -> Response:
    log.exception("request failed")
    return error_response(BadRequest(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                     kind="server_error"))

  async def completions(self, request: Request) -> Response:
    arrival = time.perf_counter()
    try:
      seqs, req, prompt_tokens = self._accept(parse_request(await request.body()), arrival)
    except BadRequest as e:
      self.metrics.rejected.labels(str(e.status)).inc()
      return error_response(e)
    sink = seqs[0].sink
    stops = _stops(req.stop)
    eos = None if req.ignore_eos else self.eos_id
    choices = [Choice(i, stops, eos) for i in range(len(seqs))]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model_name}
    self.loop.submit(seqs)
    updates = self._updates(sink, seqs, choices)
    if req.stream:
      include_usage = bool(req.stream_options and req.stream_options.include_usage)
      return _Stream(self._sse(updates, head, choices, prompt_tokens, include_usage),
                     media_type="text/event-stream", on_close=lambda: self._cancel(seqs))
    collect = asyncio.ensure_future(self._collect(updates))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
    if not collect.done():  # the client went away: its sequences stop now
      collect.cancel()
      self._cancel(seqs)
      return Response(status_code=499)
    error = collect.result()
    if error:
      return error_response(BadRequest(error, status=500, kind="server_error"))
    body = {**head, "choices": [self._choice(c, c.text, c.tokens) for c in choices],
            "usage": _usage(prompt_tokens, choices)}
    return JSONResponse(body)

  def _accept(self, req: CompletionRequest, arrival: float) -> tuple[list[Seq], CompletionRequest, int]:
    """The request's sequences, or BadRequest saying why it cannot be served now."""
    if req.model is not None and req.model != self.model_name:
      raise BadRequest(f"the model {req.model!r} does not exist; this server serves "
                       f"{self.model_name!r}", "model", 404, "not_found_error", "model_not_found")
    n = 1 if req.n is None else req.n
    if n < 1:
      raise BadRequest(f"n={n} must be >= 1", "n")
    stops = _stops(req.stop)
    if len(stops) > MAX_STOPS or any(not s for s in stops):
      raise BadRequest(f"stop={req.stop!r}: give at most {MAX_STOPS} non-empty strings", "stop")
    prompts = prompts_of(req.prompt)
    if not prompts:
      raise BadRequest("the prompt list is empty; give at least one prompt", "prompt")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    sampling = SamplingParams(1.0 if req.temperature is None else req.temperature, top_k,
                              1.0 if req.top_p is None else req.top_p)
    for i, (tokens, text) in enumerate(prompts):
      why = self.backend.check_request(tokens, max_tokens, sampling)
      if why:
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        how = "; text prompts are UTF-8 bytes, one token each" if text and "vocabulary" in why else ""
        first = why.split(" ")[0]
        param = first.split("=")[0] if "=" in first else "max_tokens" if "max_tokens" in why \
            else "prompt"
        raise BadRequest(where + why + how, param)
    k = n * len(prompts)
    if k > self.capacity:
      raise BadRequest(f"n x prompts = {k} sequences exceed the server's {self.capacity} "
                       "(--max_batch + --max_queue); send fewer", "n")
    if self.loop.failed:
      raise BadRequest(f"the engine failed: {self.loop.failed}", status=503, kind="server_error")
    if self.draining:
      raise BadRequest("the server is shutting down", status=503, kind="server_error")
    if self.inflight + k > self.capacity:
      raise BadRequest(f"the server is full ({self.inflight} of {self.capacity} sequences in "
                       "flight); retry later", status=429, kind="rate_limit_error",
                       headers={"Retry-After": "1"})
    if req.seed is not None and not 0 <= req.seed < 2**31:
      raise BadRequest(f"seed={req.seed} must lie in [0, 2**31)", "seed")
    seed = random.randrange(2**31) if req.seed is None else req.seed
    sink: asyncio.Queue = asyncio.Queue()
    eos = None if req.ignore_eos else ENGINE_EOS
    seqs = [Seq(tokens, max_tokens, dataclasses.replace(sampling, seed=(seed + i) % 2**31), eos,
                arrival, sink, i)
            for i, (tokens, _) in enumerate(p for p in prompts for _ in range(n))]
    self.inflight += k
    return seqs, req, sum(len(t) for t, _ in prompts)

  def _cancel(self, seqs: list[Seq]) -> None:
    live = [s for s in seqs if not s.done]
    if live:
      self.loop.cancel(live)

  async def _updates(self, sink: asyncio.Queue, seqs: list[Seq],
                     choices: list[Choice]) -> AsyncIterator[tuple[Choice, str, list[int]]]:
    """(choice, text released, token ids) once per token and once per finish without a token,
    until every choice has finished; an engine error raises RuntimeError."""
    left = len(choices)
    while left:
      index, tokens, finish, error = await sink.get()
      c = choices[index]
      if c.finish_reason is not None:  # ended by a stop sequence; the engine's echo of it
        continue
      if error is not None:
        self._cancel(seqs)
        raise RuntimeError(error)
      for j, token in enumerate(tokens or [None]):
        if c.finish_reason is not None:
          break
        text = c.add(token, finish if j == len(tokens or [None]) - 1 else None)
        if c.finish_reason == "stop" and finish is None:  # a stop sequence: end it in the engine
          seqs[index].stopped = True
          self._cancel([seqs[index]])
        yield c, text, [] if token is None else [token]
      left -= c.finish_reason is not None

  async def _collect(self, updates) -> str | None:
    """Runs a request to its end; returns the engine's error, if any."""
    try:
      async for _ in updates:
        pass
    except RuntimeError as e:
      return str(e)
    return None

  async def _sse(self, updates, head: dict, choices: list[Choice], prompt_tokens: int,
                 include_usage: bool) -> AsyncIterator[str]:
    try:
      left = len(choices)
      async for c, text, tokens in updates:
        left -= c.finish_reason is not None
        chunk = {**head, "choices": [self._choice(c, text, tokens)], "usage": None}
        if not left:  # the last chunk carries the usage
          chunk["usage"] = _usage(prompt_tokens, choices)
        yield f"data: {json.dumps(chunk)}\n\n"
      if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(prompt_tokens, choices)})}\n\n"
    except RuntimeError as e:
      yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
    yield "data: [DONE]\n\n"

  @staticmethod
  def _choice(c: Choice, text: str, tokens: list[int]) -> dict:
    return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason,
            "token_ids": tokens}

  # -- running --

  def uvicorn_server(self, host: str = "127.0.0.1", port: int = 8000,
                     log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for the app whose signals drain it (see the module docstring)."""
    config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=self.drain_s + 5, lifespan="on")
    return _DrainingServer(config, self)

  def run(self, host: str, port: int, log_level: str = "warning") -> None:
    """Serves on host:port until SIGTERM/SIGINT, then drains and returns."""
    try:
      sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else
                                  socket.AF_INET)
    except OSError as e:
      raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    self.uvicorn_server(host, port, log_level).run(sockets=[sock])


class _DrainingServer(uvicorn.Server):
  """uvicorn, with SIGTERM/SIGINT draining the app first and no signal re-raised after."""

  def __init__(self, config: uvicorn.Config, app: CompletionServer):
    super().__init__(config)
    self._app = app

  @contextlib.contextmanager
  def capture_signals(self):
    if threading.current_thread() is not threading.main_thread():
      yield
      return

    def handle(sig, frame):
      if self.should_exit and sig == signal.SIGINT:
        self.force_exit = True
      self._app.drain()
      self.should_exit = True

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)


class _Stream(StreamingResponse):
  """A streamed response that calls `on_close` however it ends: done, failed, or the client gone
  (Starlette then cancels the stream, possibly before it has started)."""

  def __init__(self, content, *, media_type: str, on_close):
    super().__init__(content, media_type=media_type)
    self._on_close = on_close

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._on_close()


async def _disconnected(request: Request) -> None:
  """Returns when the client disconnects (the body must have been read)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def _stops(stop: str | list[str] | None) -> list[str]:
  return [stop] if isinstance(stop, str) else stop or []


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict:
  completion = sum(len(c.tokens) for c in choices)
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
          "total_tokens": prompt_tokens + completion}
