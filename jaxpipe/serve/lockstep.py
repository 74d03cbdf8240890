"""One engine over the devices of several processes: process 0 leads, the others follow.

In a multi-process run (`jax.distributed`, started by `python -m jaxpipe.launch`) an `Engine`
whose devices span the processes is one program per process, and every process must make the
same calls in the same order: each step's compiled program runs its collectives across them. The
engine's scheduling is deterministic given its calls, so it is enough that every process calls
`add_request`, `cancel`, `step`, `finished`, `score`, ... with the same arguments, as vLLM's and
SGLang's multi-node tensor parallelism broadcast the scheduler's decisions.

`Leader` wraps process 0's engine: each call that changes the engine or runs device work is sent
to the followers before it runs here; reads (`requests`, `limits`, `kv_usage`, ...) stay local.
Any other engine method is refused on the leader (it would run on process 0 alone).
`follow` runs on every other process: it replays the leader's calls on its own engine until the
leader stops (`Leader.close`) or goes away (then it exits with one line); a replayed call that
raises is logged and passed (the leader met the same error and handles it). The calls travel over
TCP: the leader listens on its host at a port, broadcasts its address once through JAX's
collectives, accepts exactly one connection per follower, and closes the listener.
A request with structured output (a grammar object) is refused: it cannot be sent.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import socket
import struct

import jax
import numpy as np

log = logging.getLogger(__name__)

# the engine's calls that change it or run device work: every process makes them
REPLAYED = ("add_request", "cancel", "step", "finished", "score", "precompile", "drain", "release")
# the engine's methods that only read it: process 0 alone calls them
READS = ("check_request", "has_work", "kv_usage", "rings_note", "step_program", "max_programs")


def _host() -> str:
  """Process 0's address as the others reach it: the coordinator's host when
  $JAX_COORDINATOR_ADDRESS names it (jaxpipe.launch), else this host's name resolved (SLURM,
  Open MPI)."""
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    return socket.gethostbyname(address.rsplit(":", 1)[0])
  return socket.gethostbyname(socket.gethostname())


def _send(sock: socket.socket, obj) -> None:
  data = pickle.dumps(obj)
  sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
  chunks = []
  while n:
    chunk = sock.recv(min(n, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    n -= len(chunk)
  return b"".join(chunks)


def _recv(sock: socket.socket):
  head = _recv_exactly(sock, 8)
  if head is None:
    return None
  body = _recv_exactly(sock, struct.unpack("!Q", head)[0])
  return None if body is None else pickle.loads(body)  # noqa: S301 -- the leader's own calls


def connect(engine) -> Leader | None:
  """Joins process 0's engine to the others' (call it on every process, after the engine).

  Args:
    engine: this process's `Engine`, over devices of every process.

  Returns:
    On process 0 a `Leader` over the engine (drive it as the engine); on the others None, after
    `follow` has replayed every call until the leader closed.

  Raises:
    SystemExit: one line, on a follower whose leader went away.
  """
  from jax.experimental import multihost_utils

  leader = jax.process_index() == 0
  listener = None
  address = np.zeros(5, np.int32)  # process 0's IPv4 address and port
  if leader:
    listener = socket.create_server(("", 0))
    host = [int(x) for x in _host().split(".")]
    address = np.asarray([*host, listener.getsockname()[1]], np.int32)
  address = np.asarray(multihost_utils.broadcast_one_to_all(address))
  host, port = ".".join(str(int(x)) for x in address[:4]), int(address[4])
  if leader:
    followers = []
    listener.settimeout(120)
    for _ in range(jax.process_count() - 1):
      conn, _ = listener.accept()
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      followers.append(conn)
    listener.close()
    return Leader(engine, followers)
  try:
    sock = socket.create_connection((host, port), timeout=120)
  except OSError as e:
    raise SystemExit(
        f"error: process {jax.process_index()} cannot reach process 0 at {host}:{port} ({e})"
    ) from None
  sock.settimeout(None)
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  follow(engine, sock)
  return None


def follow(engine, sock: socket.socket) -> None:
  """Replays the leader's calls on this process's engine until it closes.

  Args:
    engine: this process's `Engine`.
    sock: the connection to the leader.

  Raises:
    SystemExit: one line: the leader went away without closing.
  """
  while True:
    call = _recv(sock)
    if call is None:
      raise SystemExit(
          f"error: process {jax.process_index()} lost its leader (process 0) mid-run; it exits"
      )
    name, args, kwargs = call
    if name == "close":
      return
    try:
      getattr(engine, name)(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- process 0 met the same error and handles it
      log.exception("a replayed %s raised (as on process 0)", name)


class Leader:
  """Process 0's engine, its changing calls sent to the followers first (module docstring)."""

  def __init__(self, engine, followers: list[socket.socket]):
    """Args:
    engine: process 0's `Engine`.
    followers: a connection to each other process (`connect`).
    """
    self.engine, self._followers = engine, followers

  def __getattr__(self, name: str):
    value = getattr(self.engine, name)
    if name in REPLAYED:

      def replayed(*args, **kwargs):
        for sock in self._followers:
          _send(sock, (name, args, kwargs))
        return value(*args, **kwargs)

      return replayed
    if inspect.ismethod(value) and name not in READS:  # it would run on process 0 alone
      raise AttributeError(
          f"Engine.{name} is not replayed on the other processes of a multi-process engine; "
          "drive it through add_request, cancel, step, finished and score"
      )
    return value

  def check_request(self, prompt, max_tokens, sampling, eos_id="engine"):
    """The engine's check, and a grammar refused (it cannot be sent to the followers).

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: its sampling values.
      eos_id: as `Engine.add_request` takes it.

    Returns:
      None, or a `Refusal` naming the fix.
    """
    from jaxpipe.serve.refusal import Refusal

    if sampling.guide is not None:
      return Refusal(
          "structured output is not served by an engine over several processes (its grammar "
          "cannot be sent to them); serve it from one process",
          "response_format",
      )
    return self.engine.check_request(prompt, max_tokens, sampling, eos_id)

  def close(self) -> None:
    """Tells the followers to stop; their `follow` returns."""
    for sock in self._followers:
      try:
        _send(sock, ("close", (), {}))
        sock.close()
      except OSError:
        pass
    self._followers = []
