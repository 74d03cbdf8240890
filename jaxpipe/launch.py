"""Start the processes of a multi-process run on this machine, one per emulated host.

  python -m jaxpipe.launch --processes 2 --devices_per_process 4 -- \\
      python -m jaxpipe.train --config configs/quickstart.py --workdir /tmp/qs2

Each rank runs the command after `--` (the launcher's flags end at the first argument that is
not one of them) with $JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), $JAX_NUM_PROCESSES
and $JAX_PROCESS_ID set (`jaxpipe.runtime.process.initialize` reads them) and, with
--devices_per_process, that many CPU devices ($JAX_NUM_CPU_DEVICES, JAX_PLATFORMS=cpu). Its
output goes whole to <rank_log_dir>/rank<i>.log and, each line prefixed with `[i] `, to this
terminal.
SIGTERM and SIGINT are forwarded to every rank (a third Ctrl-C kills them). When a rank fails
(a non-zero status, or killed), the others get --grace seconds to stop by themselves, then their
process groups are killed, and the launcher exits with that rank's status (128 + signal number
for a signal) after naming it and showing its last lines. It exits 0 when every rank does.
"""
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from jaxpipe.runtime import cli

FLAGS = cli.flag_values(__name__)
FLAGS.set_gnu_getopt(False)  # the flags end where the command starts: its flags are its own
flags.DEFINE_integer("processes", None, "Ranks to start (emulated hosts).", flag_values=FLAGS)
flags.mark_flag_as_required("processes", flag_values=FLAGS)
flags.DEFINE_integer("devices_per_process", None, "CPU devices per rank (sets "
                     "JAX_NUM_CPU_DEVICES and JAX_PLATFORMS=cpu).", flag_values=FLAGS)
# (absl's logging owns --log_dir)
flags.DEFINE_string("rank_log_dir", None, "Where rank<i>.log go (default: a new temporary "
                    "directory).", flag_values=FLAGS)
flags.DEFINE_float("grace", 10.0, "Seconds the other ranks get to stop by themselves after one "
                   "fails, before they are killed.", flag_values=FLAGS)
flags.DEFINE_integer("heartbeat_timeout", None, "Seconds after which JAX counts a silent rank as "
                     "dead (JAXPIPE_HEARTBEAT_TIMEOUT; JAX's default is 100).", flag_values=FLAGS)

# gloo's notice for every new communicator (kept in the rank's log) goes whole where it is whole
# (after a progress bar's \r it is not at a line's start); several threads write it in pieces that
# land inside one another: the fixed pieces go, then the lines left with only the numbers.
_GLOO_NOTICE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?Expected number of "
                          rb"connected peer ranks is : \d+\n?")
_GLOO_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. ?|Expected number of "
                          rb"connected peer ranks is : ")
_NUMBERS_LINE = re.compile(rb"(?m)^[\d ]+(\n|$)")

# Lines of a crash's stack dumps (Python's faulthandler, absl's check failures): in the log, not in
# the summary of a failed rank, where they would push out the message that says why.
_STACK_DUMP = re.compile(r'^\s*(File "|Thread 0x|Current thread 0x|Extension modules:|@ +0x|'
                         r'\*\*\* Check failure|Fatal Python error)')


def without_gloo_notices(text: bytes) -> bytes:
  """`text` without gloo's notices, whole or in pieces."""
  if b"peer ranks" not in text:
    return text
  return _NUMBERS_LINE.sub(b"", _GLOO_PIECES.sub(b"", _GLOO_NOTICE.sub(b"", text)))


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def describe_status(code: int) -> str:
  """'status 3' or 'killed by SIGKILL' for a Popen return code."""
  if code >= 0:
    return f"status {code}"
  try:
    return f"killed by {signal.Signals(-code).name}"
  except ValueError:
    return f"killed by signal {-code}"


class Rank:
  """One process of the run: its own process group, its output copied to a log and the console."""

  def __init__(self, index: int, command: list[str], env: dict[str, str], log_dir: str,
               console_lock: threading.Lock, tail: int = 20):
    self.index, self.log_path = index, os.path.join(log_dir, f"rank{index}.log")
    self.last_lines: collections.deque[str] = collections.deque(maxlen=tail)
    self._lock = console_lock
    self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
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
      if decoded.strip() and not (b"\r" in line or _GLOO_PIECES.search(line)
                                  or _STACK_DUMP.match(decoded)):
        self.last_lines.append(decoded)
    out = [prefix + line for line in without_gloo_notices(text).replace(b"\r", b"\r\0")
           .replace(b"\n", b"\n\0").split(b"\0") if line.strip()]
    with self._lock:
      sys.stdout.buffer.write(b"".join(out))
      sys.stdout.buffer.flush()

  def signal(self, signum: int) -> None:
    """Sends `signum` to the rank's process group (the command and whatever it started)."""
    if self.ended_at is None:
      try:
        os.killpg(self.proc.pid, signum)
      except ProcessLookupError:
        pass

  def join(self) -> None:
    self._waiter.join()
    self._reader.join(timeout=10)


def main(argv: list[str]) -> int:
  """The command (module docstring): argv is the program name and the command to run."""
  command = argv[1:]
  if not command:
    raise app.UsageError("no command to run: put it after `--`, e.g. -- python -m jaxpipe.train "
                         "--config configs/quickstart.py")
  args = cli.values(FLAGS)
  if args.processes < 1:
    raise app.UsageError(f"--processes={args.processes} must be at least 1")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    raise app.UsageError(f"--devices_per_process={args.devices_per_process} must be at least 1")
  log_dir = args.rank_log_dir or tempfile.mkdtemp(prefix="jaxpipe-launch-")
  os.makedirs(log_dir, exist_ok=True)
  address = f"127.0.0.1:{free_port()}"
  base = {**os.environ, "JAX_COORDINATOR_ADDRESS": address,
          "JAX_NUM_PROCESSES": str(args.processes), "PYTHONUNBUFFERED": "1"}
  if args.devices_per_process is not None:
    base.update(JAX_NUM_CPU_DEVICES=str(args.devices_per_process), JAX_PLATFORMS="cpu")
  if args.heartbeat_timeout is not None:
    base["JAXPIPE_HEARTBEAT_TIMEOUT"] = str(args.heartbeat_timeout)

  lock, ranks, stops = threading.Lock(), [], []

  def forward(signum, frame):
    del frame
    stops.append(signum)
    # a third Ctrl-C: the ranks did not stop on the first two
    sent = signal.SIGKILL if stops.count(signal.SIGINT) >= 3 else signum
    for rank in ranks:
      rank.signal(sent)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for i in range(args.processes):
      ranks.append(Rank(i, command, {**base, "JAX_PROCESS_ID": str(i)}, log_dir, lock))
    devices = f" x {args.devices_per_process} CPU devices" if args.devices_per_process else ""
    with lock:
      print(f"launch: {args.processes} processes{devices} (pids "
            f"{', '.join(str(r.proc.pid) for r in ranks)}), coordinator {address}, logs in "
            f"{log_dir}", file=sys.stderr, flush=True)
    failed_at, killed = None, set()
    while any(r.ended_at is None for r in ranks):
      if failed_at is None:
        failed_at = time.monotonic() if any(r.failed for r in ranks) else None
      elif time.monotonic() - failed_at > args.grace:
        for rank in ranks:
          if rank.ended_at is None:
            killed.add(rank.index)
            rank.signal(signal.SIGKILL)
      time.sleep(0.05)
    for rank in ranks:
      rank.join()
    failed = min((r for r in ranks if r.failed), key=lambda r: r.ended_at, default=None)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for rank in ranks:  # an exception here (or a failed start) leaves no rank behind
      rank.signal(signal.SIGKILL)
  if failed is None:
    return 0
  code = failed.proc.returncode
  others = ", ".join(f"rank {r.index} " + ("killed after the grace period" if r.index in killed
                                            else describe_status(r.proc.returncode))
                     for r in ranks if r is not failed)
  lines = "\n".join(f"  {line}" for line in failed.last_lines) or "  (none)"
  print(f"error: rank {failed.index} failed first ({describe_status(code)}); "
        f"{others or 'no other rank'}. Its last lines ({failed.log_path}):\n{lines}",
        file=sys.stderr, flush=True)
  return code if code > 0 else 128 - code


if __name__ == "__main__":
  cli.run(main)
