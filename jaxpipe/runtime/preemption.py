"""Stop requests: SIGTERM or a first Ctrl-C asks the training loop to save and stop; a second
Ctrl-C aborts at once.

The loop reads `StopRequest.agreed()` once per step and acts on it after that step. In one
process that is the local request. Several processes must act on the same step (each saves its
shards of one checkpoint), so a multi-process run passes `agree`, a reduction of the requests
over processes (any rank asked: all stop), which `agreed` calls at the same point of every step
on every process: `jaxpipe.runtime.multihost.OneStepLate`, which answers a step late.
"""

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType


class StopRequest:
  """`with StopRequest() as stop:` handles SIGTERM and SIGINT inside the block (main thread only;
  elsewhere signals keep their handlers and `requested` stays None)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, agree: Callable[[int], int] | None = None):
    """agree: the run's request from this process's (signal numbers, 0 for none; the maximum over
    processes); None in a single process."""
    self.requested: str | None = None  # the name of the first signal that asked to stop
    self._agree = agree
    self._previous: dict[int, object] = {}
    self._aborted = False  # a second Ctrl-C came: its KeyboardInterrupt may have been swallowed

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if self.requested is not None:
      if signum == signal.SIGINT:  # Ctrl-C while stopping: give up on the save
        self._aborted = True
        self.__exit__()
        raise self._interrupt()
      return  # a repeated SIGTERM changes nothing
    self.requested = name
    if signum == signal.SIGINT:
      message = (
          "\nSIGINT: finishing this step and saving before stopping; Ctrl-C again aborts "
          "without saving\n"
      )
      try:
        sys.stderr.write(message)
        sys.stderr.flush()
      except RuntimeError:  # the signal interrupted a write to stderr: "reentrant call"
        os.write(2, message.encode())

  def _interrupt(self) -> KeyboardInterrupt:
    return KeyboardInterrupt(f"SIGINT while stopping after {self.requested}")

  def agreed(self) -> str | None:
    """The stop decision every process acts on (one process: its own request).

    Raises KeyboardInterrupt after a second Ctrl-C whose own exception Python swallowed (one
    raised inside a gc callback or a finaliser is only reported), so the run still aborts."""
    if self._aborted:
      raise self._interrupt()
    if self._agree is None:
      return self.requested
    run = self._agree(signal.Signals[self.requested].value if self.requested else 0)
    return signal.Signals(run).name if run else None
