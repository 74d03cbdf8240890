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

  def to_json(self) -> str:
    """The ticket as one line of JSON.

    Returns:
      The JSON text.
    """
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> Ticket:
    """A ticket from `to_json`'s text.

    Args:
      text: the JSON.

    Returns:
      The ticket.
    """
    return cls(**json.loads(text))


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
    sampling = dataclasses.asdict(dataclasses.replace(state.sampling, guide=None))
    del sampling["guide"]
    request = dict(
        prompt=state.prompt,
        output=state.output,
        max_tokens=state.max_tokens,
        sampling=sampling,
        eos_id=state.eos_id,
        computed=state.computed,
        logprobs=state.logprobs,
    )
    return Ticket(uuid, self.address, request, chunks)

  def receive(self, engine, ticket: Ticket, timeout_s: float = 60.0) -> int:
    """Pulls a ticket's request into an engine, pages and all, and admits it.

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
    q = ticket.request
    s = dict(q["sampling"])
    s["stop_token_ids"] = tuple(s["stop_token_ids"])
    s["logit_bias"] = tuple(tuple(pair) for pair in s["logit_bias"])
    now = time.perf_counter()
    state = KVState(
        list(q["prompt"]),
        list(q["output"]),
        q["max_tokens"],
        SamplingParams(**s),
        q["eos_id"],
        q["computed"],
        None,
        None,
        now,
        now if q["output"] else None,
        [now] * len(q["output"]),
        [(lp[0], [tuple(pair) for pair in lp[1]]) for lp in q["logprobs"]],
    )
    rid = engine.transfer.reserve_request(state)
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    specs = [
        jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
        for c in ticket.chunks
        for shape, dtype in c["arrays"]
    ]
    sent = [x for x in specs if np.prod(x.shape)]  # empty arrays are made here, not pulled
    try:
      conn = self._connections.get(ticket.address)
      if conn is None:
        conn = self._connections[ticket.address] = self.server.connect(ticket.address)
      pulled = iter(conn.pull(ticket.uuid, sent) if sent else [])
      arrays = [next(pulled) if np.prod(x.shape) else _empty(x) for x in specs]
      _wait(arrays, time.perf_counter() + timeout_s)
      at = 0
      for c in ticket.chunks:
        n = len(c["arrays"]) // len(_PARTS)
        k, v = (arrays[at : at + n], arrays[at + n : at + 2 * n])
        k, v = (tuple(x) if n == 2 else x[0] for x in (k, v))
        engine.transfer.write_kv(rid, k, v, first=c["first"])
        at += 2 * n
      engine.transfer.admit_request(rid)
    except Exception as e:  # the pull, or K/V that do not fit: nothing is kept
      engine.release(rid)  # its pages back; the engine's other finished requests stay
      error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ValueError(
          f"pulling request K/V {ticket.uuid} from {ticket.address} failed: {error}"
      ) from None
    return rid


def _empty(spec: jax.ShapeDtypeStruct) -> jax.Array:
  """An array of no elements, where the spec says."""
  return jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)


def _deadline(seconds: float) -> datetime.datetime:
  return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


def _wait(arrays: list[jax.Array], deadline: float) -> None:
  """Waits for pulled arrays until `deadline` (`time.perf_counter`). The pull's own timeout
  does not end a pull the sender never serves (jax 0.10), so the receiver keeps time itself.

  Raises:
    TimeoutError: not all arrived by the deadline.
    Exception: the transfer's error, which a failed pull's arrays raise when read.
  """
  pause = 1e-4
  while not all(x.is_ready() for x in arrays):
    if time.perf_counter() > deadline:
      raise TimeoutError("no K/V arrived before the timeout")
    time.sleep(pause)
    pause = min(2 * pause, 0.01)
  jax.block_until_ready(arrays)
