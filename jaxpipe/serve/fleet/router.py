"""The router's backend: requests sent to prefill and decode servers, or to replicas.

`FleetBackend` is driven by the OpenAI server (`serve.http.CompletionServer`) as an engine is:
`add_request`, `step` (the tokens that arrived since the last call), `cancel`, `finished`,
`has_work`. The router tokenizes, applies chat templates, stops on strings and formats
logprobs; its servers see token ids only (`worker`'s `/fleet/` routes, with the fleet's secret).

A request, disaggregated: a prefill server (`routing.choose`, cache-aware) computes the prompt
and streams back its first token and the ticket of its K/V pages; a decode server (least loaded
by KV pages) pulls them and streams the rest; once it says `pulled` the router releases the
prefill server's pages. With replicas, one replica serves the whole request.

Faults end in a retry or one line, and the router stays up:
- a server that cannot be reached, or answers 503 (draining, failed), before the request's first
  token from it: the next server of that role is tried (a ticket no decode server began to pull
  stays valid on its prefill server until it is released or lapses);
- a server that dies mid-stream: the request ends with `error` naming it;
- a prefill server that dies holding the pages: the decode server's pull fails and frees its
  reservation; the request ends with that error;
- the router itself: its servers see the streams close and cancel (held offers lapse).
A server is polled (`/fleet/load`) every `poll_s`; one that refuses the connection, says it
takes no work, or leaves POLL_MISSES polls in a row unanswered is routed around until it answers
again (a server restarted at the same address rejoins).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence

import httpx

from jaxpipe.serve.fleet import routing
from jaxpipe.serve.fleet.worker import job_json
from jaxpipe.serve.refusal import Refusal
from jaxpipe.serve.request import RequestLimits
from jaxpipe.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


POLL_MISSES = 3  # polls in a row a server may leave unanswered before it counts as down


class Unreachable(Exception):
  """A server did not take the request (no connection, or 503): another may."""


@dataclasses.dataclass(eq=False)
class Server:
  """One server the router sends requests to."""

  url: str
  role: str  # "prefill", "decode" or "replica"
  info: dict  # its /fleet/info
  prefix: routing.PrefixIndex | None  # the prompts sent there (servers with a prefix cache)
  up: bool = True  # answered the last poll, and takes work
  # KV pages of the requests the router has in flight there (a prefill server's until their
  # ticket arrives, though it holds their pages until released)
  load: int = 0
  snapshot: dict = dataclasses.field(default_factory=dict)  # its last /fleet/load
  misses: int = 0  # polls in a row it did not answer
  routed: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by why

  def __repr__(self) -> str:
    return f"{self.role} server {self.url}"


@dataclasses.dataclass(eq=False)
class Remote:
  """A request the router serves, as the HTTP server reads an engine's."""

  id: int
  prompt: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: object
  pages: int  # KV pages it may hold (prompt + max_tokens)
  output: list[int] = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  error: str | None = None
  done: bool = False  # finished, as `step` saw it
  servers: list[str] = dataclasses.field(default_factory=list)  # where it went, in order
  future: object = None  # its coroutine on the router's event loop


class FleetBackend:
  """Requests served by remote prefill and decode servers, or replicas (module docstring)."""

  def __init__(
      self,
      *,
      prefill_urls: Sequence[str] = (),
      decode_urls: Sequence[str] = (),
      replica_urls: Sequence[str] = (),
      fleet_secret: str | None = None,
      routing_config: routing.RoutingConfig | None = None,
      startup_timeout_s: float = 120.0,
      poll_s: float = 0.25,
  ):
    """Args:
    prefill_urls: the prefill servers (with decode_urls; not with replica_urls).
    decode_urls: the decode servers.
    replica_urls: servers that prefill and decode (colocated).
    fleet_secret: the Bearer token the servers ask for (None: none).
    routing_config: how servers are chosen (default: cache-aware).
    startup_timeout_s: how long to wait for every server's /fleet/info.
    poll_s: how often every server's load and health are read.

    Raises:
      ValueError: one line: no servers, both kinds, a server of another role than its list's,
        servers that disagree on the request limits or page size, or one not up in time.
    """
    if bool(replica_urls) == bool(prefill_urls or decode_urls):
      raise ValueError(
          "give --replica_urls (colocated servers) or both --prefill_urls and --decode_urls"
      )
    if not replica_urls and not (prefill_urls and decode_urls):
      raise ValueError("a disaggregated fleet needs at least one prefill and one decode server")
    self.routing = routing_config or routing.RoutingConfig()
    self.poll_s = poll_s
    self._headers = {"Authorization": f"Bearer {fleet_secret}"} if fleet_secret else {}
    self.requests: dict[int, Remote] = {}
    self._ids = iter(range(1 << 62))
    self._events: queue.SimpleQueue = queue.SimpleQueue()
    self._finished: list[Remote] = []
    self.releases = 0  # offers released after their K/V moved or the request ended
    self._tasks: set[asyncio.Task] = set()
    self._aloop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._aloop.run_forever, name="router", daemon=True)
    self._thread.start()
    wanted = [("prefill", u) for u in prefill_urls] + [("decode", u) for u in decode_urls]
    wanted += [("replica", u) for u in replica_urls]
    try:
      servers = self._call(self._connect(wanted, startup_timeout_s), startup_timeout_s + 10)
    except ValueError:
      self.close()
      raise
    except Exception as e:  # noqa: BLE001 -- reported in one line
      self.close()
      raise ValueError(f"the fleet's servers could not be read: {type(e).__name__}: {e}") from None
    self.prefill = [s for s in servers if s.role == "prefill"]
    self.decode = [s for s in servers if s.role == "decode"]
    self.replicas = [s for s in servers if s.role == "replica"]
    self.servers = servers
    limits = dict(servers[0].info["limits"])
    eos = limits["eos_id"]
    limits["eos_id"] = tuple(eos) if isinstance(eos, list) else eos
    self.limits = RequestLimits(**limits)
    self._poller = asyncio.run_coroutine_threadsafe(self._poll(), self._aloop)

  # -- the backend, as the HTTP server drives it ------------------------------------------------

  @property
  def max_batch(self) -> int:
    """Sequences the fleet runs at once: its decode servers' (or replicas') batches."""
    return sum(s.info["max_batch"] for s in (self.replicas or self.decode))

  def check_request(
      self, prompt, max_tokens: int, sampling: SamplingParams, eos_id="engine"
  ) -> Refusal | None:
    """Why this request cannot be served by the fleet, or None (`RequestLimits.check`).

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: the request's sampling values.
      eos_id: as `add_request` takes it.

    Returns:
      None, or a `Refusal` naming the fix.
    """
    if sampling.guide is not None:
      return Refusal(
          "structured output (response_format, or tool_choice 'required' or a named function) "
          "is not served through the router: its grammar does not travel to the servers; serve "
          "such requests from one `python -m jaxpipe.serve --http` process",
          "response_format",
      )
    return self.limits.check(prompt, max_tokens, sampling, eos_id)

  def add_request(self, prompt, max_tokens: int, sampling: SamplingParams, *, eos_id) -> int:
    """Sends a request into the fleet.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: its sampling values.
      eos_id: one id, several, None, or "engine" (the servers' own).

    Returns:
      The request's id (`step`'s keys, `finished()`'s `.id`).
    """
    pages = math.ceil((len(prompt) + max_tokens) / self.limits.page_size)
    r = Remote(next(self._ids), list(prompt), max_tokens, sampling, eos_id, pages)
    self.requests[r.id] = r
    r.future = asyncio.run_coroutine_threadsafe(self._serve(r), self._aloop)
    return r.id

  def step(self) -> dict[int, list[int]]:
    """The tokens that arrived since the last call (waiting up to 5 ms for the first).

    Returns:
      The new tokens of each request, by id.
    """
    out: dict[int, list[int]] = {}
    events = []
    try:
      events.append(self._events.get(timeout=0.005))
      while True:
        events.append(self._events.get_nowait())
    except queue.Empty:
      pass
    for rid, tokens, logprobs, finish, error in events:
      r = self.requests.get(rid)
      if r is None or r.done:
        continue
      if tokens:
        r.output += tokens
        out.setdefault(rid, []).extend(tokens)
        if logprobs is not None:
          r.logprobs += logprobs
      if finish is not None:
        r.finish_reason, r.error, r.done = finish, error, True
        self._finished.append(r)
    return out

  def score(self, prompt, top_logprobs: int = 0) -> list:
    """Each prompt token's log-probability, from a prefill server or replica (`Engine.score`).

    Args:
      prompt: token ids.
      top_logprobs: how many of the most likely tokens to list at each place.

    Returns:
      None for the first token, then each token's `TokenLogprobs`.

    Raises:
      RuntimeError: one line: no server could score it.
    """
    return self._call(self._score(list(prompt), top_logprobs), None)

  def cancel(self, rid: int) -> None:
    """Stops a request now: its streams close, and its servers cancel it.

    Args:
      rid: the request's id.
    """
    r = self.requests.get(rid)
    if r is None or r.done:
      return
    r.future.cancel()
    self._events.put((rid, [], None, "cancelled", None))

  def finished(self) -> list[Remote]:
    """The requests finished since the last call (and forgets them).

    Returns:
      Objects with .id, .finish_reason and .error.
    """
    done, self._finished = self._finished, []
    for r in done:
      self.requests.pop(r.id, None)
    return done

  def has_work(self) -> bool:
    """Whether a request is in flight."""
    return bool(self.requests)

  def ready(self) -> str | None:
    """Why the fleet cannot serve a request now (a role with no server up), or None.

    Returns:
      One line naming the role and its servers, or None.
    """
    for role, servers in (("prefill", self.prefill), ("decode", self.decode)):
      if servers and not any(s.up for s in servers):
        return f"no {role} server is up ({', '.join(s.url for s in servers)})"
    if self.replicas and not any(s.up for s in self.replicas):
      return f"no replica is up ({', '.join(s.url for s in self.replicas)})"
    return None

  def precompile(self) -> None:
    """Nothing: every server compiles its own programs before it says it is up."""

  def load(self) -> dict:
    """What the fleet's servers hold, summed from their last polls (`loop.load_of`'s keys).

    Returns:
      {"running", "waiting", "incoming", "usage", "counts"}.
    """
    usage, counts = collections.Counter(), collections.Counter()
    load = {"running": 0, "waiting": 0, "incoming": 0}
    for s in self.servers:
      snap = s.snapshot
      for key in load:
        load[key] += snap.get(key, 0)
      usage.update(snap.get("usage", {}))
      counts.update(snap.get("counts", {}))
    return {**load, "usage": dict(usage), "counts": dict(counts)}

  def close(self) -> None:
    """Stops polling, closes the connections and the router's event loop (requests in flight
    are dropped)."""
    if not self._aloop.is_running():
      return
    poller = getattr(self, "_poller", None)
    if poller is not None:
      poller.cancel()
    client = getattr(self, "client", None)
    if client is not None:
      try:
        self._call(client.aclose(), 5)
      except Exception:  # noqa: BLE001 -- closing anyway
        pass
    self._aloop.call_soon_threadsafe(self._aloop.stop)
    self._thread.join(timeout=5)

  # -- on the router's event loop ---------------------------------------------------------------

  def _call(self, coro, timeout: float):
    return asyncio.run_coroutine_threadsafe(coro, self._aloop).result(timeout)

  async def _connect(self, wanted: list[tuple[str, str]], timeout_s: float) -> list[Server]:
    self.client = httpx.AsyncClient(  # a stream per request in flight: no connection limit
        headers=self._headers,
        timeout=httpx.Timeout(5.0, read=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )
    deadline = time.monotonic() + timeout_s
    servers = []
    for role, url in wanted:
      url = url.rstrip("/")
      while True:
        try:
          got = await self.client.get(url + "/fleet/info")
          if got.status_code == 401:
            raise ValueError(f"{url} refused the router's fleet secret (401); give the same one")
          got.raise_for_status()
          info = got.json()
          if not isinstance(info, dict) or "limits" not in info:
            raise ValueError(f"{url}/fleet/info is not a jaxpipe server's: {str(info)[:100]}")
          break
        except (httpx.HTTPError, ValueError) as e:
          if isinstance(e, ValueError) or time.monotonic() > deadline:
            raise ValueError(f"the {role} server {url} is not up: {e}") from None
          await asyncio.sleep(0.25)
      if info.get("role") != role:
        raise ValueError(f"{url} is a {info.get('role')} server, listed as a {role} server")
      limits = info["limits"]
      prefix = None
      if role != "decode":
        prefix = routing.PrefixIndex(limits["page_size"], limits["num_pages"] - 1)
      servers.append(Server(url, role, info, prefix))
    first = servers[0]
    for s in servers[1:]:
      for key in ("limits", "kv_cache_dtype"):
        if s.info[key] != first.info[key]:
          raise ValueError(
              f"{s.url} serves {key} {s.info[key]}, {first.url} {first.info[key]}: a fleet's "
              "servers serve one model with the same engine settings"
          )
    return servers

  async def _poll(self) -> None:
    while True:
      await asyncio.gather(*(self._poll_one(s) for s in self.servers))
      await asyncio.sleep(self.poll_s)

  async def _poll_one(self, s: Server) -> None:
    """Reads a server's load. It is down at once when it refuses the connection or says it
    does not take work, and after POLL_MISSES polls in a row without an answer (a busy host
    answers late)."""
    try:
      got = await self.client.get(s.url + "/fleet/load", timeout=max(1.0, 4 * self.poll_s))
      snap = got.json() if got.status_code == 200 else {}
      if not isinstance(snap, dict):
        snap = {}
      up = bool(snap) and not snap.get("draining") and not snap.get("failed")
      s.misses = 0
    except httpx.ConnectError:
      snap, up = {}, False
    except Exception:  # noqa: BLE001 -- no answer in time, or not a server's: missed
      s.misses += 1
      snap, up = {}, s.up and s.misses < POLL_MISSES
    if not snap:  # its counters stay summed until it answers
      snap = {"counts": s.snapshot.get("counts", {})}
    s.snapshot, s.up = snap, up

  def _emit(self, r: Remote, tokens=(), logprobs=None, finish=None, error=None) -> None:
    self._events.put((r.id, list(tokens), logprobs, finish, error))

  def _pick(self, servers: list[Server], r: Remote, tried: set) -> Server:
    candidates = [s for s in servers if s.up and s not in tried]
    if not candidates:
      role = servers[0].role
      raise RuntimeError(
          f"no {role} server is up ({', '.join(s.url for s in servers)} tried or down); the "
          "request cannot be served"
      )
    matches = None
    if candidates[0].prefix is not None:
      matches = [s.prefix.match(r.prompt) for s in candidates]
    i, why = routing.choose([s.load for s in candidates], matches, len(r.prompt), self.routing)
    s = candidates[i]
    s.routed[why] += 1
    if s.prefix is not None:
      s.prefix.insert(r.prompt)
    tried.add(s)
    return s

  async def _serve(self, r: Remote) -> None:
    try:
      if self.replicas:
        await self._colocated(r)
      else:
        await self._disaggregated(r)
    except asyncio.CancelledError:
      raise
    except Exception as e:  # noqa: BLE001 -- the request ends in one line; the router stays up
      log.warning("request %d failed: %s", r.id, e)
      self._emit(r, finish="error", error=str(e).splitlines()[0] if str(e) else repr(e))

  async def _colocated(self, r: Remote) -> None:
    job = job_json(r.prompt, r.max_tokens, r.sampling, r.eos_id)
    await self._on_one(self.replicas, r, "/fleet/generate", job, lambda s, e: self._forward(r, e))

  async def _disaggregated(self, r: Remote) -> None:
    state = {"p": None, "ticket": None, "pulled": False}
    try:
      await self._prefill_then_decode(r, state)
    finally:
      if state["ticket"] is not None and not state["pulled"]:  # its pages go back now
        self._release(state["p"], state["ticket"]["uuid"])

  async def _prefill_then_decode(self, r: Remote, state: dict) -> None:
    def prefilled(p: Server, event: dict) -> bool:
      if "ticket" in event:
        state["p"], state["ticket"] = p, event["ticket"]
        return True
      return self._forward(r, event)

    def decoded(d: Server, event: dict) -> bool:
      if event.get("pulled"):
        state["pulled"] = True
        self._release(state["p"], state["ticket"]["uuid"])
        return False
      return self._forward(r, event)

    job = job_json(r.prompt, r.max_tokens, r.sampling, r.eos_id)
    await self._on_one(self.prefill, r, "/fleet/prefill", job, prefilled)
    if state["ticket"] is not None:  # else it ended at its first token
      body = {"ticket": state["ticket"]}
      await self._on_one(self.decode, r, "/fleet/decode", body, decoded)

  async def _on_one(self, servers: list[Server], r: Remote, path: str, body: dict, handle) -> None:
    """Streams `body` to one of `servers` and hands each event to `handle(server, event)` until
    it returns True. A server that does not take the request before its first event (no
    connection, 503) is marked down and the next one is tried; one that fails or closes the
    stream after that fails the request."""
    tried = set()
    while True:
      s = self._pick(servers, r, tried)
      got = []
      try:
        async with self._holding(s, r):
          async with contextlib.aclosing(self._stream(s, path, body, got)) as events:
            async for event in events:
              if handle(s, event):
                return
        raise RuntimeError(f"the {s} closed the stream before the request finished")
      except Unreachable:
        if got:  # it had begun: its events were passed on
          raise
        s.up = False

  async def _score(self, prompt: list[int], top: int) -> list:
    servers = sorted((s for s in self.replicas or self.prefill if s.up), key=lambda s: s.load)
    errors = []
    for s in servers:
      try:
        got = await self.client.post(
            s.url + "/fleet/score", json={"prompt": prompt, "top_logprobs": top}, timeout=10.0
        )
      except httpx.HTTPError as e:
        errors.append(f"{s}: {e}")
        continue
      if got.status_code != 200:
        errors.append(f"{s} answered {got.status_code}: {_message(got.text)}")
        continue
      scores = got.json()["logprobs"]
      return [None if x is None else (x[0], [tuple(p) for p in x[1]]) for x in scores]
    raise RuntimeError(f"no server scored the prompt ({'; '.join(errors) or 'none is up'})")

  def _forward(self, r: Remote, event: dict) -> bool:
    """Passes a server's event on (checked here: a malformed one fails this request, not the
    router); True when it finished the request."""
    tokens, logprobs = event.get("tokens") or [], event.get("logprobs")
    if not all(isinstance(t, int) for t in tokens):
      raise RuntimeError(f"a server sent tokens {tokens!r}, not token ids")
    if tokens and logprobs is not None:
      try:
        logprobs = [(float(lp), [(int(i), float(x)) for i, x in top]) for lp, top in logprobs]
      except (TypeError, ValueError) as e:
        raise RuntimeError(f"a server sent malformed logprobs: {e}") from None
      if len(logprobs) != len(tokens):
        raise RuntimeError(f"a server sent {len(logprobs)} logprobs for {len(tokens)} tokens")
    if tokens:
      self._emit(r, tokens, logprobs)
    if "finish" in event:
      self._emit(r, finish=event["finish"], error=event.get("error"))
      return True
    return False

  @contextlib.asynccontextmanager
  async def _holding(self, s: Server, r: Remote):
    """Counts r's pages in s's load while it is there."""
    s.load += r.pages
    r.servers.append(s.url)
    try:
      yield
    finally:
      s.load -= r.pages

  async def _stream(self, s: Server, path: str, body: dict, got: list) -> AsyncIterator[dict]:
    """A server's NDJSON events; `got` gains each. Unreachable: not taken (no connection, 503)."""
    try:
      async with self.client.stream("POST", s.url + path, json=body) as answer:
        if answer.status_code == 503:
          raise Unreachable(f"the {s} is not taking work")
        if answer.status_code != 200:
          text = (await answer.aread()).decode(errors="replace")
          raise RuntimeError(f"the {s} answered {answer.status_code}: {_message(text)}")
        async for line in answer.aiter_lines():
          if line:
            event = json.loads(line)
            got.append(event)
            yield event
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
      raise Unreachable(f"the {s} cannot be reached: {e}") from None
    except httpx.HTTPError as e:
      if not got:
        raise Unreachable(f"the {s} failed before answering: {e}") from None
      raise RuntimeError(f"the {s} failed mid-stream: {type(e).__name__}: {e}") from None

  def _release(self, p: Server, uuid: int) -> None:
    """Frees an offer's pages on the prefill server (in the background; an offer that is never
    released lapses there)."""

    async def release():
      try:
        await self.client.post(p.url + "/fleet/release", json={"uuid": uuid}, timeout=5.0)
        self.releases += 1
      except httpx.HTTPError as e:
        log.warning("releasing offer %d on %s failed: %s", uuid, p, e)

    task = asyncio.get_running_loop().create_task(release())
    self._tasks.add(task)  # held until done (the loop keeps only weak references)
    task.add_done_callback(self._tasks.discard)


def _message(text: str) -> str:
  try:
    return json.loads(text)["error"]["message"]
  except (ValueError, KeyError, TypeError):
    return text.strip().splitlines()[0] if text.strip() else "(no body)"
