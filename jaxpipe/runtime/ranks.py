"""The ranks of a multi-process run on this machine: started, their output relayed, their ends
watched (`python -m jaxpipe.launch` is the command)."""

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

# gloo's notice for every new communicator (kept in the rank's log) goes whole where it is whole
# (after a progress bar's \r it is not at a line's start); several threads write it in pieces that
# land inside one another: the fixed pieces go, then the lines left with only the numbers.
_GLOO_NOTICE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?Expected number of "
    rb"connected peer ranks is : \d+\n?"
)
_GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank | is connected to | peer ranks\. ?|Expected number of "
    rb"connected peer ranks is : "
)
_NUMBERS_LINE = re.compile(rb"(?m)^[\d ]+(\n|$)")

# Lines of a crash's stack dumps (Python's faulthandler, absl's check failures): in the log, not in
# the summary of a failed rank, where they would push out the message that says why.
_STACK_DUMP = re.compile(
    r'^\s*(File "|Thread 0x|Current thread 0x|Extension modules:|@ +0x|'
    r"\*\*\* Check failure|Fatal Python error)"
)


def without_gloo_notices(text: bytes) -> bytes:
  """`text` without gloo's notices, whole or in pieces.

  Args:
    text: a rank's output.

  Returns:
    `text` with gloo's connection notices (and lines left with only their numbers) removed.
  """
  if b"peer ranks" not in text:
    return text
  return _NUMBERS_LINE.sub(b"", _GLOO_PIECES.sub(b"", _GLOO_NOTICE.sub(b"", text)))


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def describe_status(code: int) -> str:
  """Describes how a process ended, e.g. `'status 3'` or `'killed by SIGKILL'`.

  Args:
    code: a `Popen` return code (negative: killed by that signal).

  Returns:
    `'status N'`, `'killed by SIGNAME'`, or `'killed by signal N'` for an unknown signal.
  """
  if code >= 0:
    return f"status {code}"
  try:
    return f"killed by {signal.Signals(-code).name}"
  except ValueError:
    return f"killed by signal {-code}"


class Rank:
  """One process of the run: its own process group, its output copied to a log and the console."""

  def __init__(
      self,
      index: int,
      command: list[str],
      env: dict[str, str],
      log_dir: str,
      console_lock: threading.Lock,
      tail: int = 20,
  ):
    self.index, self.log_path = index, os.path.join(log_dir, f"rank{index}.log")
    self.last_lines: collections.deque[str] = collections.deque(maxlen=tail)
    self._lock = console_lock
    self.proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    # When it ended, taken as it ends: a poll loop that finds two ranks ended cannot say which
    # ended first, and the first is the cause (the others stop because it did)
    self.ended_at: float | None = None
    self._waiter = threading.Thread(target=self._wait, daemon=True)
    self._waiter.start()
    self._reader = threading.Thread(target=self._copy, daemon=True)
    self._reader.start()

  def _wait(self) -> None:
    self.proc.wait()
    self.ended_at = time.monotonic()

  @property
  def failed(self) -> bool:
    return self.ended_at is not None and self.proc.returncode != 0

  def _copy(self) -> None:
    prefix, pending = f"[{self.index}] ".encode(), b""
    with open(self.log_path, "wb") as log:
      while chunk := os.read(self.proc.stdout.fileno(), 65536):
        log.write(chunk)
        log.flush()
        pending += chunk
        # a line ends at \n, or at \r for a progress bar redrawing itself
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
          self._show(prefix, pending[:cut])
          pending = pending[cut:]
      if pending:
        self._show(prefix, pending + b"\n")

  def _show(self, prefix: bytes, text: bytes) -> None:
    for line in text.split(b"\n"):  # the summary's lines: whole ones, nothing of gloo's
      decoded = line.decode(errors="replace").rstrip()
      if decoded.strip() and not (
          b"\r" in line or _GLOO_PIECES.search(line) or _STACK_DUMP.match(decoded)
      ):
        self.last_lines.append(decoded)
    out = [
        prefix + line
        for line in without_gloo_notices(text)
        .replace(b"\r", b"\r\0")
        .replace(b"\n", b"\n\0")
        .split(b"\0")
        if line.strip()
    ]
    with self._lock:
      sys.stdout.buffer.write(b"".join(out))
      sys.stdout.buffer.flush()

  def signal(self, signum: int) -> None:
    """Sends `signum` to the rank's process group (the command and whatever it started).

    Does nothing once the rank has ended.

    Args:
      signum: the signal number, e.g. `signal.SIGTERM`.
    """
    if self.ended_at is None:
      try:
        os.killpg(self.proc.pid, signum)
      except ProcessLookupError:
        pass

  def join(self) -> None:
    self._waiter.join()
    self._reader.join(timeout=10)
