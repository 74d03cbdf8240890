"""A request's K/V pages between processes, over JAX's transfer server.

The sender (a prefill server) `offer`s a request it holds: its pages are gathered on its
devices (`KVTransfer.kv_of`: chunks of a power of two pages, exactly the request's) and
scheduled for pulling under one id on its transfer server (`jax.experimental.transfer`,
`await_pull`). The offer is a `Ticket`: the request's tokens and sampling values and each
chunk's shapes and dtypes, as JSON, for whatever channel the two servers speak (the sender
keeps the request's pages until it is told the request moved: `Engine.release`). The receiver
(a decode server) `receive`s the ticket: it reserves pages and a batch slot
(`KVTransfer.reserve_request`), pulls exactly the ticket's chunks from the sender's transfer
server into its first device, writes them into its pool (`write_kv`) and admits the request
(`admit_request`). A pull that fails or outlasts its timeout cancels the reservation: no page
is kept, and the error names the sender.

The values arrive bit for bit, whatever the pool's dtype (float, int8, fp8 with their scales);
an empty array (a latent cache's V pool) is not sent but made by the receiver.
Positions and times do not cross: the request's token times restart at the receiver's clock.
A grammar-constrained request does not move between processes (its grammar is an object of the
sender's). JAX's transfer server has no authentication of its own: it listens only on the
address given, which should be one the fleet's network alone can reach.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import time

import jax
import numpy as np
from jax.experimental import transfer

from jaxpipe.serve.request import KVState
from jaxpipe.serve.sampling import SamplingParams

_PARTS = ("k", "v")  # each chunk: K and V (8-bit pools: each a (values, scales) pair)


@dataclasses.dataclass(frozen=True)
class Ticket:
  """What a receiver needs to pull one request's K/V (`KVWire.offer`)."""

  uuid: int  # the transfer's id on the sender's server
  address: str  # the sender's transfer server
  request: dict  # the request's tokens, sampling values and computed tokens (JSON)
  # per chunk: its first page in the request's block table and each array's [shape, dtype],
  # in the order the sender offered them (K then V; values then scales)
  chunks: list[dict]

  def to_dict(self) -> dict:
    """The ticket as a JSON object (what `to_json` writes).

    Returns:
      Its fields.
    """
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    """The ticket as one line of JSON.

    Returns:
      The JSON text.
    """
    return json.dumps(self.to_dict())

  @classmethod
  def from_dict(cls, d) -> Ticket:
    """A ticket from `to_dict`'s object.

    Args:
      d: the parsed JSON.

    Returns:
      The ticket.

    Raises:
      ValueError: one line: it is not a ticket's.
    """
    try:
      ticket = cls(**d)
      fields = (int(ticket.uuid), str(ticket.address), dict(ticket.request), list(ticket.chunks))
      if not all(k in ticket.request for k in ("prompt", "output", "sampling", "computed")):
        raise ValueError("its request lacks prompt, output, sampling or computed")
    except (TypeError, ValueError, AttributeError) as e:
      error = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ValueError(f"not a K/V ticket ({error}); send what KVWire.offer returns") from None
    return cls(*fields)

  @classmethod
  def from_json(cls, text: str) -> Ticket:
    """A ticket from `to_json`'s text.

    Args:
      text: the JSON.

    Returns:
      The ticket.

    Raises:
      ValueError: one line: the text is not a ticket's JSON.
    """
    try:
      d = json.loads(text)
    except ValueError as e:
      raise ValueError(f"not a K/V ticket ({e}); send what KVWire.offer returns") from None
    return cls.from_dict(d)


def _spec(x) -> list:
  return [list(x.shape), np.dtype(x.dtype).name]


class KVWire:
  """One process's end of K/V transfers: its transfer server and its connections."""

  def __init__(self, address: str = "127.0.0.1:0", device: jax.Device | None = None):
    """Args:
    address: where the transfer server listens (host:port; port 0 picks one).
    device: the device pulled arrays land on (default the first).
    """
    self.device = device or jax.devices()[0]
    host = address.rsplit(":", 1)[0]
    self.server = transfer.start_transfer_server(self.device.client, address, [f"{host}:0"])
    self._connections: dict[str, transfer.TransferConnection] = {}
    # transfer ids unique to this process: its pid in the high bits
    self._ids = itertools.count((os.getpid() & 0xFFFFF) << 32 | 1)

  @property
  def address(self) -> str:
    """The transfer server's address, which tickets carry."""
    return self.server.address()

  def offer(self, engine, rid: int, timeout_s: float | None = None) -> Ticket:
    """Schedules a request's K/V for pulling.

    Args:
      engine: the sender's `Engine`.
      rid: a running or prefilled request there.
      timeout_s: drop the offer if no one pulls it within this long (None: never).

    Returns:
      The ticket a receiver pulls it with.

    Raises:
      ValueError: one line: the request cannot move (a grammar, not running or prefilled).
    """
    r = engine.requests[rid]
    if r.sampling.guide is not None:
      raise ValueError(
          f"request {rid} follows a grammar, which does not move between processes; serve it "
          "where it was prefilled"
      )
    state = engine.transfer.export_request(rid, with_kv=False)
    arrays, chunks = [], []
    for first, k, v in engine.transfer.kv_of(rid):
      parts = [jax.device_put(x, self.device) for x in jax.tree.leaves((k, v))]
      arrays += [x for x in parts if x.size]  # a latent cache's V is empty: nothing to send
      chunks.append({"first": first, "arrays": [_spec(x) for x in parts]})
    uuid = next(self._ids)
    if timeout_s is None:
      self.server.await_pull(uuid, arrays)
    else:
      self.server.await_pull(uuid, arrays, timeout=_deadline(timeout_s))
    request = dict(
        prompt=state.prompt,
        output=state.output,
        max_tokens=state.max_tokens,
        sampling=state.sampling.to_dict(),
        eos_id=state.eos_id,
        computed=state.computed,
        logprobs=state.logprobs,
    )
    return Ticket(uuid, self.address, request, chunks)

  def receive(self, engine, ticket: Ticket, timeout_s: float = 60.0) -> int:
    """Pulls a ticket's request into an engine, pages and all, and admits it (`pull`, waiting).

    Args:
      engine: the receiver's `Engine`.
      ticket: the sender's offer.
      timeout_s: how long the pull may take.

    Returns:
      The request's id on the receiver.

    Raises:
      ValueError: one line: the engine cannot take the request (`reserve_request`'s reasons),
        or the pull failed or timed out (the reservation cancelled, its pages back).
    """
    pull = self.pull(engine, ticket, timeout_s)
    pause = 1e-4
    while not pull.ready():
      time.sleep(pause)
      pause = min(2 * pause, 0.01)
    return pull.land()

  def fits(self, engine, ticket: Ticket) -> bool:
    """Whether the engine has a batch slot and the pages for the ticket's request now.

    Args:
      engine: the receiver's `Engine`.
      ticket: the sender's offer.

    Returns:
      True if `pull` would find room (a full engine: wait for its requests to finish).
    """
    pages = sum(c["arrays"][0][0][2] for c in ticket.chunks)  # [G, L, pages, page, ...]
    return engine.scheduler.has_slot() and engine.allocator.can_alloc(pages)

  def pull(self, engine, ticket: Ticket, timeout_s: float = 60.0) -> Pull:
    """Reserves a ticket's request in an engine and starts pulling its K/V, without waiting.

    The caller polls `Pull.ready` (the engine may step meanwhile: the request holds its pages
    and a batch slot, and is not scheduled) and then `Pull.land`s it.

    Args:
      engine: the receiver's `Engine`.
      ticket: the sender's offer.
      timeout_s: how long the pull may take.

    Returns:
      The pull in flight.

    Raises:
      ValueError: one line: the engine cannot take the request (`reserve_request`'s reasons),
        or the sender cannot be reached (nothing reserved).
    """
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    try:  # a malformed ticket is refused before anything is reserved
      specs = [
          jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
          for c in ticket.chunks
          for shape, dtype in c["arrays"]
      ]
      state = _state(ticket.request)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"a malformed ticket: {type(e).__name__}: {e}") from None
    rid = engine.transfer.reserve_request(state)
    sent = [x for x in specs if np.prod(x.shape)]  # empty arrays are made here, not pulled
    pull = Pull(self, engine, ticket, rid, time.perf_counter() + timeout_s)
    try:
      conn = self._connections.get(ticket.address)
      if conn is None:
        conn = self._connections[ticket.address] = self.server.connect(ticket.address)
      pulled = iter(conn.pull(ticket.uuid, sent) if sent else [])
      pull.arrays = [next(pulled) if np.prod(x.shape) else _empty(x) for x in specs]
    except Exception as e:  # noqa: BLE001 -- reported in one line, the reservation cancelled
      pull.fail(e)
    return pull


class Pull:
  """One ticket's K/V on its way into an engine (`KVWire.pull`): its request reserved there
  (pages, a batch slot), its arrays arriving."""

  def __init__(self, wire: KVWire, engine, ticket: Ticket, rid: int, deadline: float):
    self.wire, self.engine, self.ticket = wire, engine, ticket
    self.rid = rid  # the request's id on the receiver
    self.deadline = deadline  # time.perf_counter() by which the arrays must be here
    self.start = time.perf_counter()
    self.arrays: list[jax.Array] = []
    self.nbytes = 0  # what arrived, once landed
    self.seconds = 0.0  # from `KVWire.pull` until written and admitted
    self.open = True  # the reservation is held (False once landed or cancelled)

  def ready(self) -> bool:
    """Whether every array has arrived (then `land` it).

    Returns:
      True once all are here; False while some are on their way.

    Raises:
      ValueError: one line: the deadline passed (the reservation cancelled, its pages back).
    """
    if all(x.is_ready() for x in self.arrays):
      return True
    if time.perf_counter() > self.deadline:
      self.fail(TimeoutError("no K/V arrived before the timeout"))
    return False

  def land(self) -> int:
    """Writes the arrived K/V into the request's pages and admits it to the batch.

    Returns:
      The request's id on the receiver.

    Raises:
      ValueError: one line: the transfer failed (a failed pull's arrays raise when read) or the
        K/V do not fit (the reservation cancelled, its pages back).
    """
    try:
      jax.block_until_ready(self.arrays)
      at = 0
      for c in self.ticket.chunks:
        n = len(c["arrays"]) // len(_PARTS)
        k, v = (self.arrays[at : at + n], self.arrays[at + n : at + 2 * n])
        k, v = (tuple(x) if n == 2 else x[0] for x in (k, v))
        self.engine.transfer.write_kv(self.rid, k, v, first=c["first"])
        at += 2 * n
      self.engine.transfer.admit_request(self.rid)
      self.open = False
      self.nbytes = sum(x.nbytes for x in self.arrays)
      self.seconds = time.perf_counter() - self.start
    except Exception as e:  # noqa: BLE001 -- the pull, or K/V that do not fit: nothing is kept
      self.fail(e)
    return self.rid

  def cancel(self) -> None:
    """Gives the reservation back (its pages, its slot): nobody waits for the request now."""
    self.arrays = []
    if self.open:
      self.open = False
      self.engine.release(self.rid)

  def fail(self, e: BaseException) -> None:
    """Cancels the reservation and raises the failure as one line naming the sender.

    Args:
      e: what went wrong.

    Raises:
      ValueError: always.
    """
    self.cancel()  # its pages back; the engine's other finished requests stay
    # a connection to a sender that died is not kept: a server restarted there gets a new one
    self.wire._connections.pop(self.ticket.address, None)
    error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(
        f"pulling request K/V {self.ticket.uuid} from {self.ticket.address} failed: {error}"
    ) from None


def _state(q: dict) -> KVState:
  """A ticket's request as `reserve_request` takes it; its times restart at this clock."""
  now = time.perf_counter()
  eos = q["eos_id"]
  return KVState(
      list(q["prompt"]),
      list(q["output"]),
      q["max_tokens"],
      SamplingParams.from_dict(q["sampling"]),
      tuple(eos) if isinstance(eos, list) else eos,
      q["computed"],
      None,
      None,
      now,
      now if q["output"] else None,
      [now] * len(q["output"]),
      [(lp[0], [tuple(pair) for pair in lp[1]]) for lp in q["logprobs"]],
  )


def _empty(spec: jax.ShapeDtypeStruct) -> jax.Array:
  """An array of no elements, where the spec says."""
  return jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)


def _deadline(seconds: float) -> datetime.datetime:
  return datetime.datetime.now() + datetime.timedelta(seconds=seconds)
