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

import os
import signal
import sys
import tempfile
import threading
import time

from absl import app, flags

from jaxpipe.runtime import cli
from jaxpipe.runtime.ranks import Rank, describe_status, free_port

FLAGS = cli.flag_values(__name__)
FLAGS.set_gnu_getopt(False)  # the flags end where the command starts: its flags are its own
flags.DEFINE_integer("processes", None, "Ranks to start (emulated hosts).", flag_values=FLAGS)
flags.mark_flag_as_required("processes", flag_values=FLAGS)
flags.DEFINE_integer(
    "devices_per_process",
    None,
    "CPU devices per rank (sets JAX_NUM_CPU_DEVICES and JAX_PLATFORMS=cpu).",
    flag_values=FLAGS,
)
# (absl's logging owns --log_dir)
flags.DEFINE_string(
    "rank_log_dir",
    None,
    "Where rank<i>.log go (default: a new temporary directory).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "grace",
    10.0,
    "Seconds the other ranks get to stop by themselves after one fails, before they are killed.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "heartbeat_timeout",
    None,
    "Seconds after which JAX counts a silent rank as "
    "dead (JAXPIPE_HEARTBEAT_TIMEOUT; JAX's default is 100).",
    flag_values=FLAGS,
)


def main(argv: list[str]) -> int:
  """Runs the command (module docstring): starts the ranks and waits for them.

  Args:
    argv: the program name and the command to run.

  Returns:
    The exit status: 0 when every rank exits 0, else that of the rank that failed first
    (128 + signal number for a signal).

  Raises:
    app.UsageError: no command to run, --log_dir given (the ranks' logs go to --rank_log_dir), or
      --processes or --devices_per_process below 1.
  """
  command = argv[1:]
  if not command:
    raise app.UsageError(
        "no command to run: put it after `--`, e.g. -- python -m jaxpipe.train "
        "--config configs/quickstart.py"
    )
  if (
      "log_dir" in FLAGS and FLAGS["log_dir"].present
  ):  # absl's logging flag, when run as the program
    raise app.UsageError("--log_dir is absl's log directory; the ranks' logs go to --rank_log_dir")
  args = cli.values(FLAGS)
  if args.processes < 1:
    raise app.UsageError(f"--processes={args.processes} must be at least 1")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    raise app.UsageError(f"--devices_per_process={args.devices_per_process} must be at least 1")
  log_dir = args.rank_log_dir or tempfile.mkdtemp(prefix="jaxpipe-launch-")
  os.makedirs(log_dir, exist_ok=True)
  address = f"127.0.0.1:{free_port()}"
  base = {
      **os.environ,
      "JAX_COORDINATOR_ADDRESS": address,
      "JAX_NUM_PROCESSES": str(args.processes),
      "PYTHONUNBUFFERED": "1",
  }
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
      print(
          f"launch: {args.processes} processes{devices} (pids "
          f"{', '.join(str(r.proc.pid) for r in ranks)}), coordinator {address}, logs in "
          f"{log_dir}",
          file=sys.stderr,
          flush=True,
      )
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
  others = ", ".join(
      f"rank {r.index} "
      + (
          "killed after the grace period"
          if r.index in killed
          else describe_status(r.proc.returncode)
      )
      for r in ranks
      if r is not failed
  )
  lines = "\n".join(f"  {line}" for line in failed.last_lines) or "  (none)"
  print(
      f"error: rank {failed.index} failed first ({describe_status(code)}); "
      f"{others or 'no other rank'}. Its last lines ({failed.log_path}):\n{lines}",
      file=sys.stderr,
      flush=True,
  )
  return code if code > 0 else 128 - code


if __name__ == "__main__":
  cli.run(main)
