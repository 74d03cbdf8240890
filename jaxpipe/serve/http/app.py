"""The HTTP application: Starlette routes for POST /v1/completions and /v1/chat/completions
(whole, or streamed as server-sent events), POST /tokenize and /detokenize (vLLM's), GET
/v1/models, /version, /health, /ready and /metrics, over an `EngineLoop`; admission and
backpressure (at most `max_batch + max_queue` sequences, then 429 with `Retry-After`); client
disconnects cancelling their sequences; and uvicorn with SIGTERM / SIGINT draining (the
listening socket stays open so that /health can answer 503 "draining" and new requests 503,
running and queued requests get `drain_s` seconds, what is left is cancelled with finish_reason
"abort", and `run` returns once nothing is in flight).

Both generating endpoints reduce a request to a `protocol.Job` (prompts as token ids, sampling,
stops, logprobs) and share its sequences, choices and streaming; only the JSON shapes differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxpipe
from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.serve import grammar
from jaxpipe.serve.http import checks, protocol, serving
from jaxpipe.serve.http import logprobs as logprobs_lib
from jaxpipe.serve.http import tools as tools_lib
from jaxpipe.serve.http.auth import ApiKey
from jaxpipe.serve.http.loop import Backend, EngineLoop, Seq, engines_of
from jaxpipe.serve.http.metrics import Metrics
from jaxpipe.serve.http.protocol import BadRequest, Choice, Job, usage_of
from jaxpipe.serve.request import ENGINE_EOS, eos_ids

log = logging.getLogger(__name__)
DECODER_CONTEXT = 6  # prompt ids a choice's decoder starts from (SentencePiece's leading space)


def error_response(e: BadRequest) -> JSONResponse:
  """OpenAI's error body.

  Args:
    e: the refusal: its message, kind, param, code, status and headers.

  Returns:
    {"error": {"message", "type", "param", "code"}} with the refusal's status and headers.
  """
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
      tokenizer: tokenizer_lib.Tokenizer | None = None,
      tool_call_parser: str | None = None,
      api_key: str | None = None,
  ):
    """max_batch + max_queue: the sequences held at once; drain_s: how long running requests
    may go on after SIGTERM before they are cancelled; engine_info: shown by /v1/models;
    tokenizer: the model's (default: bytes); its EOS ids end a choice (without any, the
    engine's own EOS does); tool_call_parser: the format of the model's tool calls (one of
    `tools.PARSERS`; default: the one its chat template writes, if known); api_key: the
    Bearer token every request but monitoring must carry (`http.auth`; None: anyone may
    call)."""
    if max_queue < 0 or drain_s < 0:
      raise ValueError(f"max_queue={max_queue} and drain_s={drain_s} must be >= 0")
    if api_key is not None and not api_key:
      raise ValueError("the API key is empty; give a non-empty --api_key or leave it unset")
    self.backend, self.model_name, self.drain_s = backend, model_name, drain_s
    engines = engines_of(backend)
    self.max_seq_len = min(e.limits.max_seq_len for e in engines)
    self.tok = tokenizer or tokenizer_lib.ByteTokenizer()
    self.eos = tuple(self.tok.eos_ids) or ENGINE_EOS
    self.limits = checks.Limits(self.max_seq_len, self.eos)
    self.hidden = self.tok.special_ids  # dropped from output text (skip_special_tokens)
    if tool_call_parser is not None and tool_call_parser not in tools_lib.PARSERS:
      raise ValueError(
          f"tool_call_parser={tool_call_parser!r}: use one of {', '.join(tools_lib.PARSERS)}"
      )
    self.tool_parser = tool_call_parser or tools_lib.detect(self.tok.chat_template)
    self.capacity = max_batch + max_queue
    self.engine_info = engine_info or {}
    self.metrics = Metrics(model_name, self.max_seq_len)
    self.loop = EngineLoop(backend, self.metrics)
    self.inflight = 0  # sequences accepted and not yet finished (event loop only)
    self.draining = False
    self.created = int(time.time())
    self.app = Starlette(
        routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ],
        exception_handlers={HTTPException: self._http_error, Exception: self._server_error},
        lifespan=self._lifespan,
        middleware=[] if api_key is None else [Middleware(ApiKey, key=api_key)],
    )

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    self.loop.start(asyncio.get_running_loop(), self._deliver)
    try:
      yield
    finally:
      await asyncio.to_thread(self.loop.stop)

  def _deliver(self, events: list) -> None:
    for s, tokens, logprobs, finish, error in events:
      if s.done:
        continue
      s.sink.put_nowait((s.index, tokens, logprobs, finish, error))
      if finish is not None or error is not None:
        s.done = True
        self.inflight -= 1

  def drain(self) -> None:
    """Stops taking requests; those running get drain_s seconds, then are cancelled."""
    if not self.draining:
      self.draining = True
      self.loop.drain(self.drain_s)

  @property
  def drained(self) -> bool:
    """Draining, and nothing is in flight any more."""
    return self.draining and self.inflight == 0

  # -- endpoints --

  async def health(self, request: Request) -> Response:
    """GET /health: whether the server takes requests.

    Args:
      request: the HTTP request.

    Returns:
      {"status": "ok"}; 503 with "failed" (and the engine's error) or "draining".
    """
    if self.loop.failed:
      return JSONResponse({"status": "failed", "error": self.loop.failed}, status_code=503)
    if self.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})

  async def ready(self, request: Request) -> Response:
    """GET /ready: whether the server takes requests now (a router: and its fleet can serve).

    Args:
      request: the HTTP request.

    Returns:
      {"ready": true}; 503 with {"ready": false, "why"} when failed, draining, or the backend
      says it cannot serve (`ready()`: a fleet without a server of some role up).
    """
    why = None
    if self.loop.failed:
      why = f"the engine failed: {self.loop.failed}"
    elif self.draining:
      why = "the server is draining"
    elif callable(getattr(self.backend, "ready", None)):
      why = self.backend.ready()
    if why:
      return JSONResponse({"ready": False, "why": why}, status_code=503)
    return JSONResponse({"ready": True})

  async def version(self, request: Request) -> Response:
    """GET /version: jaxpipe's version.

    Args:
      request: the HTTP request.

    Returns:
      {"version": jaxpipe.__version__}.
    """
    return JSONResponse({"version": jaxpipe.__version__})

  async def tokenizer_info(self, request: Request) -> Response:
    """vLLM's GET /tokenizer_info: the special tokens' text and the chat template.

    lm-evaluation-harness reads it to tokenize through the server (with /tokenize, /detokenize).

    Args:
      request: the HTTP request.

    Returns:
      tokenizer_class, bos_token, eos_token and the other special tokens, eos_token_ids,
      chat_template and model_max_length.
    """
    tok = self.tok
    return JSONResponse(
        {
            "tokenizer_class": type(tok).__name__,
            **{name: tok.special_tokens.get(name) for name in ("bos_token", "eos_token")},
            **tok.special_tokens,
            "eos_token_ids": list(tok.eos_ids),
            "chat_template": tok.chat_template,
            "model_max_length": self.max_seq_len,
        }
    )

  async def models(self, request: Request) -> Response:
    """GET /v1/models: the one model served.

    Args:
      request: the HTTP request.

    Returns:
      OpenAI's model list, its entry with max_model_len and the engine's settings.
    """
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
    """GET /metrics: the Prometheus metrics.

    Args:
      request: the HTTP request.

    Returns:
      The registry in Prometheus' text format.
    """
    return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  async def tokenize(self, request: Request) -> Response:
    """vLLM's POST /tokenize: {"prompt": text} or {"messages": [...]}.

    add_special_tokens defaults to true for a prompt, false for messages, whose template writes
    its own; add_generation_prompt (messages) to true.

    Args:
      request: the HTTP request.

    Returns:
      {"tokens", "count", "max_model_len"}; OpenAI's error body (400, or 404 for another model)
      for a request that is refused.
    """
    try:
      body = protocol.parse_json(await request.body())
      self._check_model(body.get("model"))
      extra = set(body) - {
          "model",
          "prompt",
          "messages",
          "add_special_tokens",
          "add_generation_prompt",
      }
      if extra or ("prompt" in body) == ("messages" in body):
        raise BadRequest(
            'give "prompt" (text) or "messages" (a chat), one of them'
            + (f"; unrecognized: {sorted(extra)}" if extra else ""),
            "prompt",
        )
      special = body.get("add_special_tokens", "prompt" in body)
      generation = body.get("add_generation_prompt", True)
      if not isinstance(special, bool) or not isinstance(generation, bool):
        raise BadRequest("add_special_tokens and add_generation_prompt must be booleans")
      if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
          raise BadRequest(f"prompt={prompt!r:.80} must be a string", "prompt")
        protocol.check_text(prompt, "the prompt", "prompt")
        tokens = self._encode(prompt, special)
      else:
        if not isinstance(body["messages"], list):
          raise BadRequest("messages must be a list of messages", "messages")
        tokens = self._chat_ids(protocol.chat_messages(body["messages"]), generation)
        if special and self.tok.bos_id is not None:
          tokens = [self.tok.bos_id, *tokens]
    except BadRequest as e:
      return error_response(e)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_seq_len})

  async def detokenize(self, request: Request) -> Response:
    """vLLM's POST /detokenize: {"tokens": [ids...]} -> {"prompt": text}.

    Args:
      request: the HTTP request.

    Returns:
      {"prompt": the decoded text}; OpenAI's error body (400, or 404 for another model) for a
      request that is refused, e.g. an id outside the vocabulary.
    """
    try:
      body = protocol.parse_json(await request.body())
      self._check_model(body.get("model"))
      tokens = body.get("tokens")
      if set(body) - {"model", "tokens"} or not isinstance(tokens, list):
        raise BadRequest('give {"tokens": [ids...]}', "tokens")
      bad = [t for t in tokens if type(t) is not int or not 0 <= t < self.tok.vocab_size]
      if bad:
        raise BadRequest(
            f"token {bad[0]!r} is not an id of the tokenizer's {self.tok.vocab_size}", "tokens"
        )
    except BadRequest as e:
      return error_response(e)
    return JSONResponse({"prompt": self.tok.decode(tokens)})

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

  # -- text in --

  def _check_model(self, model) -> None:
    if model is not None and model != self.model_name:
      raise BadRequest(
          f"the model {model!r} does not exist; this server serves {self.model_name!r}",
          "model",
          404,
          "not_found_error",
          "model_not_found",
      )

  def _eos_ids(self, eos_id) -> tuple[int, ...]:
    """An eos_id as the engine reads it (ENGINE_EOS: the engine's own), as a tuple of ids."""
    return eos_ids(engines_of(self.backend)[0].limits.eos_id if eos_id == ENGINE_EOS else eos_id)

  def _ends(self, s: Seq) -> frozenset[int]:
    """The ids that end a sequence (EOS and stop ids): a choice does not show their text."""
    return frozenset(self._eos_ids(s.eos_id) + tuple(s.sampling.stop_token_ids))

  @functools.cached_property
  def _grammars(self) -> grammar.Compiler:
    """The compiler of requests' grammars over this model's tokenizer and vocabulary."""
    vocab = engines_of(self.backend)[0].limits.vocab
    return grammar.Compiler(self.tok, vocab, self._eos_ids(self.eos))

  def _guide(self, structured: protocol.Structured) -> grammar.Guide:
    """A request's structured output compiled (`grammar.Compiler`), or BadRequest naming it."""
    try:
      return self._grammars.compile(structured.kind, structured.spec)
    except ValueError as e:
      raise BadRequest(f"{structured.param}: {e}", structured.param.split(".")[0]) from None

  def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    if add_special_tokens or isinstance(self.tok, tokenizer_lib.ByteTokenizer):
      return self.tok.encode(text)
    return self.tok.encode(text, add_special_tokens=False)

  def _chat_ids(
      self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
  ) -> list[int]:
    try:
      if tools:
        return self.tok.apply_chat_template(messages, add_generation_prompt, tools)
      return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
      if "chat template" in str(e):
        raise BadRequest(
            f"this model's tokenizer has no chat template ({e}); send a prompt to "
            "/v1/completions instead",
            "messages",
        ) from None
      raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None
    except Exception as e:  # noqa: BLE001 -- the template's own raise_exception, jinja's errors
      raise BadRequest(
          f"the chat template refused the messages: {type(e).__name__}: {e}", "messages"
      ) from None

  def _job(self, body: bytes, chat: bool) -> Job:
    if chat:
      req = protocol.parse_chat(body)
      self._check_model(req.model)
      plan = tools_lib.plan_of(
          req.tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls
      )
      messages = tools_lib.template_messages(protocol.chat_messages(req.messages))
      ids = self._chat_ids(messages, tools=plan and plan.tools)
      job = protocol.job_of(req, [(ids, None)], chat=True)
      forced = plan and tools_lib.structured(plan)
      if forced and job.structured:
        raise BadRequest(
            f"tool_choice {plan.choice!r} and {job.structured.param} both constrain the output; "
            "give one",
            "tool_choice",
        )
      job.structured, job.tools = job.structured or forced, plan
      return job
    req = protocol.parse_request(body)
    self._check_model(req.model)
    return protocol.job_of(req, protocol.prompts_of(req.prompt, self.tok), chat=False)

  # -- generating --

  async def completions(self, request: Request) -> Response:
    """POST /v1/completions: OpenAI's completions, whole or streamed.

    A request the server refuses is answered with OpenAI's error body: 400 for its content, 404
    for another model, 429 (with Retry-After) when the server is full, 503 when the engine failed
    or the server is draining; 500 when the engine fails during it; 499 when the client goes away
    before the end.

    Args:
      request: the HTTP request.

    Returns:
      The whole response as JSON, or with "stream" server-sent events ending in `data: [DONE]`.
    """
    return await self._serve(request, chat=False)

  async def chat_completions(self, request: Request) -> Response:
    """POST /v1/chat/completions: OpenAI's chat completions, whole or streamed.

    Refusals are answered as `completions` answers them.

    Args:
      request: the HTTP request.

    Returns:
      The whole response as JSON, or with "stream" server-sent events ending in `data: [DONE]`.
    """
    return await self._serve(request, chat=True)

  async def _serve(self, request: Request, chat: bool) -> Response:
    arrival = time.perf_counter()
    try:
      job = self._job(await request.body(), chat)
      if job.structured is not None:  # compiling can take a second: off the event loop
        guide = await asyncio.to_thread(self._guide, job.structured)
        job.sampling = dataclasses.replace(job.sampling, guide=guide)
      seqs, prompt_tokens = self._accept(job, arrival)
    except BadRequest as e:
      self.metrics.rejected.labels(str(e.status)).inc()
      return error_response(e)
    choices = [
        Choice(
            i,
            job.stops,
            self.tok.decoder(s.prompt[-DECODER_CONTEXT:]),
            self.hidden,
            self._ends(s),
        )
        for i, s in enumerate(seqs)
    ]
    fmt = (_ChatFormat if chat else _CompletionFormat)(self, job, seqs)
    if seqs[0].max_tokens > 0:
      self.loop.submit(seqs)
    else:  # echo with max_tokens 0: the prompts are scored, nothing is generated
      self.loop.submit_scores(seqs)
    updates = self._updates(seqs[0].sink, seqs, choices)
    if job.stream:
      return serving.Stream(
          self._sse(updates, fmt, choices, prompt_tokens, job.include_usage),
          media_type="text/event-stream",
          on_close=lambda: self._cancel(seqs),
      )
    collect = asyncio.ensure_future(self._collect(updates))
    gone = asyncio.ensure_future(serving.disconnected(request))
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
    choices = best(choices, job.candidates, job.n)
    return JSONResponse(fmt.whole(choices, usage_of(prompt_tokens, choices)))

  def _accept(self, job: Job, arrival: float) -> tuple[list[Seq], int]:
    """The job's sequences, or BadRequest saying why it cannot be served now.

    Args:
      job: the request, from either endpoint.
      arrival: when it came (`time.perf_counter`), for the latency metrics.

    Returns:
      The sequences (n per prompt, prompt by prompt) and the prompts' token count.

    Raises:
      BadRequest: its content is refused (`checks.check`: 400), it asks for more sequences than
        the server holds (400), the engine failed or the server is draining (503), or the server
        is full (429, with Retry-After).
    """
    max_tokens = checks.check(job, self.backend, self.limits)
    sampling = logprobs_lib.with_logprobs(job.sampling, job.logprobs)
    if job.candidates > job.n and sampling.logprobs is None:  # best_of ranks by log-probability
      sampling = dataclasses.replace(sampling, logprobs=0)
    k = job.candidates * len(job.prompts)
    if k > self.capacity:
      raise BadRequest(
          f"n x prompts = {k} sequences exceed the server's {self.capacity} "
          "(--max_batch + --max_queue); send fewer",
          "n",
      )
    if self.loop.failed:
      raise BadRequest(f"the engine failed: {self.loop.failed}", status=503, kind="server_error")
    if self.draining:
      raise BadRequest(
          "the server is shutting down (draining); send the request to another replica",
          status=503,
          kind="server_error",
      )
    if self.inflight + k > self.capacity:
      raise BadRequest(
          f"the server is full ({self.inflight} of {self.capacity} sequences in "
          "flight); retry later",
          status=429,
          kind="rate_limit_error",
          headers={"Retry-After": "1"},
      )
    seed = random.randrange(2**31) if job.seed is None else job.seed
    sink: asyncio.Queue = asyncio.Queue()
    eos = None if job.ignore_eos else self.eos
    seqs = [
        Seq(
            tokens,
            m,
            dataclasses.replace(sampling, seed=(seed + i) % 2**31),
            eos,
            arrival,
            sink,
            i,
            echo=job.echo,
        )
        for i, (tokens, m) in enumerate(
            (t, m) for (t, _), m in zip(job.prompts, max_tokens) for _ in range(job.candidates)
        )
    ]
    self.inflight += k
    return seqs, sum(len(t) for t, _ in job.prompts)

  def _cancel(self, seqs: list[Seq]) -> None:
    live = [s for s in seqs if not s.done]
    if live:
      self.loop.cancel(live)

  async def _updates(
      self, sink: asyncio.Queue, seqs: list[Seq], choices: list[Choice]
  ) -> AsyncIterator[tuple[Choice, str, list[int], list]]:
    """(choice, text released, token ids, their logprobs) once per token and once per finish
    without a token, until every choice has finished; an engine error raises RuntimeError."""
    left = len(choices)
    while left:
      index, tokens, logprobs, finish, error = await sink.get()
      c = choices[index]
      if c.finish_reason is not None:  # ended by a stop sequence; the engine's echo of it
        continue
      if error is not None:
        self._cancel(seqs)
        raise RuntimeError(error)
      if logprobs is not None and not tokens:  # the prompt's scores (echo)
        seqs[index].prompt_logprobs = logprobs
        continue
      for j, token in enumerate(tokens or [None]):
        if c.finish_reason is not None:
          break
        text = c.add(token, finish if j == len(tokens or [None]) - 1 else None)
        lp = []
        if token is not None and logprobs is not None and j < len(logprobs):
          lp = [logprobs[j]]
          c.logprobs.append(logprobs[j])
        if c.finish_reason == "stop" and finish is None:  # a stop sequence: end it in the engine
          seqs[index].stopped = True
          self._cancel([seqs[index]])
        yield c, text, [] if token is None else [token], lp
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
      self, updates, fmt, choices: list[Choice], prompt_tokens: int, include_usage: bool
  ) -> AsyncIterator[str]:
    try:
      for chunk in fmt.opening(choices):
        yield f"data: {json.dumps(chunk)}\n\n"
      left = len(choices)
      async for c, text, tokens, lp in updates:
        left -= c.finish_reason is not None
        usage = None if left else usage_of(prompt_tokens, choices)
        for chunk in fmt.chunks(c, text, tokens, lp, usage):
          yield f"data: {json.dumps(chunk)}\n\n"
      if include_usage:
        chunk = {**fmt.stream_head, "choices": [], "usage": usage_of(prompt_tokens, choices)}
        yield f"data: {json.dumps(chunk)}\n\n"
    except RuntimeError as e:
      yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
    yield "data: [DONE]\n\n"

  # -- running --

  def uvicorn_server(
      self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
  ) -> uvicorn.Server:
    """A uvicorn server for the app whose signals drain it (see the module docstring).

    Args:
      host: the address to listen on.
      port: the port to listen on.
      log_level: uvicorn's log level.

    Returns:
      The server (not started).
    """
    return serving.draining_server(self, host, port, log_level)

  def run(self, host: str, port: int, log_level: str = "warning") -> None:
    """Serves on host:port until SIGTERM/SIGINT, then drains and returns.

    Args:
      host: the address to listen on (IPv6 if it holds a ':').
      port: the port to listen on.
      log_level: uvicorn's log level.

    Raises:
      OSError: the address cannot be listened on.
    """
    serving.run(self, host, port, log_level)


def best(choices: list[Choice], candidates: int, n: int) -> list[Choice]:
  """Each prompt's n candidates of highest cumulative log-probability (best_of), most likely first.

  Args:
    choices: `candidates` per prompt, prompt by prompt, each with its tokens' log-probabilities.
    candidates: the candidates per prompt (best_of).
    n: the choices to keep per prompt.

  Returns:
    The kept choices, prompt by prompt; `choices` itself when every candidate is kept.
  """
  if candidates == n:
    return choices
  out = []
  for at in range(0, len(choices), candidates):
    group = choices[at : at + candidates]
    score = lambda c: sum(lp[0] for lp in c.logprobs)
    out += sorted(group, key=score, reverse=True)[:n]
  return out


class _CompletionFormat:
  """OpenAI's text_completion bodies and chunks."""

  def __init__(self, server: CompletionServer, job: Job, seqs: list[Seq]):
    self.server, self.job, self.seqs = server, job, seqs
    self.head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model_name,
    }
    self.stream_head = self.head
    # The echoed prompt of each choice: the text as sent, or the decode of the ids sent.
    tok = server.tok
    self.echoed = [
        (text if text is not None else tok.decode(tokens)) if job.echo else ""
        for tokens, text in job.prompts
        for _ in range(job.candidates)
    ]

  def _logprobs(self, c: Choice, whole: bool) -> dict | None:
    if self.job.logprobs is None:
      return None
    tok, k, s = self.server.tok, self.job.logprobs, self.seqs[c.index]
    ids, entries = c.tokens, c.logprobs
    if not whole:
      ids, entries = ids[-len(entries) :] if entries else [], entries
    if whole and self.job.echo:
      prompt = logprobs_lib.legacy(tok, s.prompt, s.prompt_logprobs or [None] * len(s.prompt), k)
      rest = logprobs_lib.legacy(tok, ids, entries, k, len(self.echoed[c.index]))
      return {key: prompt[key] + rest[key] for key in prompt}
    return logprobs_lib.legacy(tok, ids, entries, k)

  def _choice(self, c: Choice, text: str, tokens: list[int], logprobs: dict | None) -> dict:
    return {
        "index": c.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "token_ids": tokens,
    }

  def whole(self, choices: list[Choice], usage: dict) -> dict:
    return {
        **self.head,
        "choices": [
            self._choice(c, self.echoed[c.index] + c.text, c.tokens, self._logprobs(c, True))
            | {"index": i}
            for i, c in enumerate(choices)
        ],
        "usage": usage,
    }

  def opening(self, choices: list[Choice]) -> list[dict]:
    """The echoed prompts, first (streams with echo)."""
    if not self.job.echo:
      return []
    return [
        {**self.head, "choices": [self._choice(c, self.echoed[c.index], [], None)], "usage": None}
        for c in choices
    ]

  def chunks(self, c: Choice, text: str, tokens: list[int], lp: list, usage) -> list[dict]:
    logprobs = None
    if self.job.logprobs is not None:
      logprobs = logprobs_lib.legacy(self.server.tok, tokens, lp, self.job.logprobs)
    return [{**self.head, "choices": [self._choice(c, text, tokens, logprobs)], "usage": usage}]


class _ChatFormat:
  """OpenAI's chat.completion bodies and chat.completion.chunk chunks."""

  def __init__(self, server: CompletionServer, job: Job, seqs: list[Seq]):
    self.server, self.job = server, job
    # with tools the model may call, a streamed choice goes through a ToolStream
    self.streams: dict[int, tools_lib.ToolStream] | None = None
    if job.tools is not None and job.tools.choice != "none":
      self.streams = {s.index: tools_lib.ToolStream(job.tools) for s in seqs}
    self._unsent: dict[int, tuple[list, list]] = {}  # per choice: tokens and logprobs not sent
    self.head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": server.model_name,
    }
    self.stream_head = {**self.head, "object": "chat.completion.chunk"}
    if job.include_usage:
      self.stream_head["usage"] = None

  def _logprobs(self, tokens: list[int], entries: list) -> dict | None:
    if self.job.logprobs is None:
      return None
    return logprobs_lib.chat(self.server.tok, tokens, entries, self.job.logprobs)

  def _reply(self, c: Choice) -> tuple[str | None, list[tools_lib.ToolCall], str | None]:
    """(content, tool calls, finish reason) of a finished choice."""
    if self.job.tools is None:
      return c.text, [], c.finish_reason
    raw = self.server.tok.decode([t for t in c.tokens if t not in c.ends])
    content, calls = tools_lib.calls_of(self.job.tools, c.text, raw)
    called = calls and c.finish_reason == "stop" and self.job.tools.choice != "named"
    return content, calls, "tool_calls" if called else c.finish_reason

  def whole(self, choices: list[Choice], usage: dict) -> dict:
    out = []
    for c in choices:
      content, calls, finish = self._reply(c)
      message = {"role": "assistant", "content": content}
      if self.job.tools is not None:
        message["tool_calls"] = [call.as_json() for call in calls]
      out.append(
          {
              "index": c.index,
              "message": message,
              "logprobs": self._logprobs(c.tokens, c.logprobs),
              "finish_reason": finish,
              "token_ids": c.tokens,
          }
      )
    return {**self.head, "choices": out, "usage": usage}

  def _chunk(self, c: Choice, delta: dict, logprobs=None, finish=None, tokens=()) -> dict:
    choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {**self.stream_head, "choices": [{**choice, "token_ids": list(tokens)}]}

  def opening(self, choices: list[Choice]) -> list[dict]:
    """Each choice's first delta: the role."""
    return [self._chunk(c, {"role": "assistant", "content": ""}) for c in choices]

  def chunks(self, c: Choice, text: str, tokens: list[int], lp: list, usage) -> list[dict]:
    del usage  # only the include_usage chunk carries it
    if self.streams is not None:
      return self._tool_chunks(c, tokens, lp)
    out = []
    if text or lp:
      out.append(self._chunk(c, {"content": text}, self._logprobs(tokens, lp), tokens=tokens))
      tokens = []
    if c.finish_reason is not None:
      out.append(self._chunk(c, {}, finish=c.finish_reason, tokens=tokens))
    return out

  def _tool_chunks(self, c: Choice, tokens: list[int], lp: list) -> list[dict]:
    """A choice that may call tools (`tools.ToolStream`): content while it cannot be a call, a
    named function's arguments as they come, other calls when it ends (one delta each, OpenAI's
    form). Tokens and logprobs ride on the next chunk sent."""
    held_tokens, held_lp = self._unsent.pop(c.index, ([], []))
    tokens, lp = held_tokens + tokens, held_lp + lp
    raw = self.server.tok.decode([t for t in c.tokens if t not in c.ends])
    stream = self.streams[c.index]
    if c.finish_reason is None:
      content, calls = stream.push(c.text[: c.sent], raw)
    else:
      content, calls = stream.finish(c.text, raw)
    out = []
    if content:
      out.append(self._chunk(c, {"content": content}, self._logprobs(tokens, lp), tokens=tokens))
      tokens, lp = [], []
    for delta in calls:
      out.append(self._chunk(c, {"tool_calls": [delta]}, tokens=tokens))
      tokens = []
    if c.finish_reason is not None:
      out.append(self._chunk(c, {}, finish=self._reply(c)[2], tokens=tokens))
    elif tokens or lp:
      self._unsent[c.index] = (tokens, lp)
    return out
