"""uvicorn for jaxpipe's servers: SIGTERM / SIGINT drain the app before the process exits, and
streamed responses report however they end.

An app served here is `Drainable`: `drain()` stops it taking work and lets what runs finish (or
cancels it after the app's own deadline); `drained` says nothing is left, and the server then
exits. The listening socket stays open while it drains, so that health checks can answer.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import Protocol

import uvicorn
from starlette.requests import Request
from starlette.responses import StreamingResponse


class Drainable(Protocol):
  """What `DrainingServer` drains: an app that can stop taking work and say when it is done."""

  app: object  # the ASGI app

  def drain(self) -> None:
    """Stops taking work; what runs goes on until the app's own deadline."""
    ...

  @property
  def drained(self) -> bool:
    """Draining, and nothing is in flight any more."""
    ...


def draining_server(
    app: Drainable, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
) -> uvicorn.Server:
  """A uvicorn server for an app whose signals drain it.

  Args:
    app: the app and its drain.
    host: the address to listen on.
    port: the port to listen on.
    log_level: uvicorn's log level.

  Returns:
    The server (not started).
  """
  config = uvicorn.Config(
      app.app,
      host=host,
      port=port,
      log_level=log_level,
      access_log=False,
      timeout_graceful_shutdown=5,
      lifespan="on",
  )
  return DrainingServer(config, app)


def run(app: Drainable, host: str, port: int, log_level: str = "warning") -> None:
  """Serves an app on host:port until SIGTERM/SIGINT, then drains it and returns.

  Args:
    app: the app and its drain.
    host: the address to listen on (IPv6 if it holds a ':').
    port: the port to listen on.
    log_level: uvicorn's log level.

  Raises:
    OSError: the address cannot be listened on.
  """
  try:
    sock = socket.create_server(
        (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
    )
  except OSError as e:
    raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
  draining_server(app, host, port, log_level).run(sockets=[sock])


class DrainingServer(uvicorn.Server):
  """uvicorn, with SIGTERM/SIGINT draining the app before it exits (the socket still open, so
  that /health says "draining" and new requests get 503), and no signal re-raised after."""

  def __init__(self, config: uvicorn.Config, app: Drainable):
    super().__init__(config)
    self._app = app
    self._drain_requested = False

  async def on_tick(self, counter: int) -> bool:
    """uvicorn's tick: exits once the app has drained.

    Args:
      counter: uvicorn's tick count.

    Returns:
      Whether to exit (uvicorn's).
    """
    if self._drain_requested and self._app.drained:
      self.should_exit = True
    return await super().on_tick(counter)

  @contextlib.contextmanager
  def capture_signals(self):
    if threading.current_thread() is not threading.main_thread():
      yield
      return

    def handle(sig, frame):
      if self._drain_requested and sig == signal.SIGINT:  # a second Ctrl-C: now
        self.should_exit = self.force_exit = True
      self._app.drain()
      self._drain_requested = True

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)


class Stream(StreamingResponse):
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


async def disconnected(request: Request) -> None:
  """Returns when the client disconnects (the body must have been read).

  Args:
    request: the HTTP request whose client is watched.
  """
  while (await request.receive())["type"] != "http.disconnect":
    pass
