"""The HTTP application: Starlette routes for POST /v1/completions (whole, or streamed as
server-sent events, one chunk per token), GET /v1/models, /health and /metrics, over an
`EngineLoop`; admission and backpressure (at most `max_batch + max_queue` sequences, then 429
with `Retry-After`); client disconnects cancelling their sequences; and uvicorn with SIGTERM /
SIGINT draining (the listening socket closes, running and queued requests get `drain_s` seconds,
what is left is cancelled with finish_reason "abort", and `run` returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxpipe.serve.engine import ENGINE_EOS
from jaxpipe.serve.http.loop import Backend, EngineLoop, Seq, engines_of
from jaxpipe.serve.http.metrics import Metrics
from jaxpipe.serve.http.protocol import (
    MAX_STOPS,
    BadRequest,
    Choice,
    CompletionRequest,
    parse_request,
    prompts_of,
    stop_list,
    usage_of,
)
from jaxpipe.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


def error_response(e: BadRequest) -> JSONResponse:
  """OpenAI's error body."""
  return JSONResponse(
      {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
      status_code=e.status,
      headers=e.headers,
  )


class CompletionServer:
  """The Starlette app over a backend; `run` serves it with uvicorn until SIGTERM/SIGINT."""

  def __init__(
      self,
      backend: Backend,
      *,
      model_name: str,
      max_batch: int,
      max_queue: int = 64,
      drain_s: float = 30.0,
      engine_info: dict | None = None,
  ):
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
        routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ],
        exception_handlers={HTTPException: self._http_error, Exception: self._server_error},
        lifespan=self._lifespan,
    )

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
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "jaxpipe",
                    "max_model_len": self.max_seq_len,
                    "engine": self.engine_info,
                }
            ],
        }
    )

  async def prometheus(self, request: Request) -> Response:
    return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  async def _http_error(self, request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(
        BadRequest(
            f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, kind=kind
        )
    )

  async def _server_error(self, request: Request, exc: Exception) -> Response:
    log.exception("request failed")
    return error_response(
        BadRequest(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error")
    )

  async def completions(self, request: Request) -> Response:
    arrival = time.perf_counter()
    try:
      seqs, req, prompt_tokens = self._accept(parse_request(await request.body()), arrival)
    except BadRequest as e:
      self.metrics.rejected.labels(str(e.status)).inc()
      return error_response(e)
    sink = seqs[0].sink
    stops = stop_list(req.stop)
    eos = None if req.ignore_eos else self.eos_id
    choices = [Choice(i, stops, eos) for i in range(len(seqs))]
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": self.model_name,
    }
    self.loop.submit(seqs)
    updates = self._updates(sink, seqs, choices)
    if req.stream:
      include_usage = bool(req.stream_options and req.stream_options.include_usage)
      return _Stream(
          self._sse(updates, head, choices, prompt_tokens, include_usage),
          media_type="text/event-stream",
          on_close=lambda: self._cancel(seqs),
      )
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
    body = {
        **head,
        "choices": [self._choice(c, c.text, c.tokens) for c in choices],
        "usage": usage_of(prompt_tokens, choices),
    }
    return JSONResponse(body)

  def _accept(
      self, req: CompletionRequest, arrival: float
  ) -> tuple[list[Seq], CompletionRequest, int]:
    """The request's sequences, or BadRequest saying why it cannot be served now."""
    if req.model is not None and req.model != self.model_name:
      raise BadRequest(
          f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
          "model",
          404,
          "not_found_error",
          "model_not_found",
      )
    n = 1 if req.n is None else req.n
    if n < 1:
      raise BadRequest(f"n={n} must be >= 1", "n")
    stops = stop_list(req.stop)
    if len(stops) > MAX_STOPS or any(not s for s in stops):
      raise BadRequest(f"stop={req.stop!r}: give at most {MAX_STOPS} non-empty strings", "stop")
    prompts = prompts_of(req.prompt)
    if not prompts:
      raise BadRequest("the prompt list is empty; give at least one prompt", "prompt")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    sampling = SamplingParams(
        1.0 if req.temperature is None else req.temperature,
        top_k,
        1.0 if req.top_p is None else req.top_p,
    )
    for i, (tokens, text) in enumerate(prompts):
      why = self.backend.check_request(tokens, max_tokens, sampling)
      if why:
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        how = (
            "; text prompts are UTF-8 bytes, one token each" if text and "vocabulary" in why else ""
        )
        first = why.split(" ")[0]
        param = (
            first.split("=")[0]
            if "=" in first
            else "max_tokens"
            if "max_tokens" in why
            else "prompt"
        )
        raise BadRequest(where + why + how, param)
    k = n * len(prompts)
    if k > self.capacity:
      raise BadRequest(
          f"n x prompts = {k} sequences exceed the server's {self.capacity} "
          "(--max_batch + --max_queue); send fewer",
          "n",
      )
    if self.loop.failed:
      raise BadRequest(f"the engine failed: {self.loop.failed}", status=503, kind="server_error")
    if self.draining:
      raise BadRequest("the server is shutting down", status=503, kind="server_error")
    if self.inflight + k > self.capacity:
      raise BadRequest(
          f"the server is full ({self.inflight} of {self.capacity} sequences in "
          "flight); retry later",
          status=429,
          kind="rate_limit_error",
          headers={"Retry-After": "1"},
      )
    if req.seed is not None and not 0 <= req.seed < 2**31:
      raise BadRequest(f"seed={req.seed} must lie in [0, 2**31)", "seed")
    seed = random.randrange(2**31) if req.seed is None else req.seed
    sink: asyncio.Queue = asyncio.Queue()
    eos = None if req.ignore_eos else ENGINE_EOS
    seqs = [
        Seq(
            tokens,
            max_tokens,
            dataclasses.replace(sampling, seed=(seed + i) % 2**31),
            eos,
            arrival,
            sink,
            i,
        )
        for i, (tokens, _) in enumerate(p for p in prompts for _ in range(n))
    ]
    self.inflight += k
    return seqs, req, sum(len(t) for t, _ in prompts)

  def _cancel(self, seqs: list[Seq]) -> None:
    live = [s for s in seqs if not s.done]
    if live:
      self.loop.cancel(live)

  async def _updates(
      self, sink: asyncio.Queue, seqs: list[Seq], choices: list[Choice]
  ) -> AsyncIterator[tuple[Choice, str, list[int]]]:
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

  async def _sse(
      self, updates, head: dict, choices: list[Choice], prompt_tokens: int, include_usage: bool
  ) -> AsyncIterator[str]:
    try:
      left = len(choices)
      async for c, text, tokens in updates:
        left -= c.finish_reason is not None
        chunk = {**head, "choices": [self._choice(c, text, tokens)], "usage": None}
        if not left:  # the last chunk carries the usage
          chunk["usage"] = usage_of(prompt_tokens, choices)
        yield f"data: {json.dumps(chunk)}\n\n"
      if include_usage:
        chunk = {**head, "choices": [], "usage": usage_of(prompt_tokens, choices)}
        yield f"data: {json.dumps(chunk)}\n\n"
    except RuntimeError as e:
      yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
    yield "data: [DONE]\n\n"

  @staticmethod
  def _choice(c: Choice, text: str, tokens: list[int]) -> dict:
    return {
        "index": c.index,
        "text": text,
        "logprobs": None,
        "finish_reason": c.finish_reason,
        "token_ids": tokens,
    }

  # -- running --

  def uvicorn_server(
      self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
  ) -> uvicorn.Server:
    """A uvicorn server for the app whose signals drain it (see the module docstring)."""
    config = uvicorn.Config(
        self.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=self.drain_s + 5,
        lifespan="on",
    )
    return _DrainingServer(config, self)

  def run(self, host: str, port: int, log_level: str = "warning") -> None:
    """Serves on host:port until SIGTERM/SIGINT, then drains and returns."""
    try:
      sock = socket.create_server(
          (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
      )
    except OSError as e:
      raise OSError(
          f"cannot listen on {host}:{port} ({e.strerror}); choose another --port"
      ) from None
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
