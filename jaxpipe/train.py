"""Train a language model.

  python -m jaxpipe.train --config configs/quickstart.py [--config.key=value ...] [--workdir DIR]
  python -m jaxpipe.train --workdir DIR [--config.key=value ...]   # DIR/config.py as --config
      [--gin_file F.gin ...] [--gin_param 'model.d_model = 256' ...]
      [--resume_changed | --restart] [--debug]

Gin bindings are applied after the config file and its --config overrides. Without an
accelerator the run gets 8 CPU host devices ($JAXPIPE_HOST_DEVICES to change). With
--config.pipeline.schedule=auto the schedule is chosen from measured stage costs first (the
ranking is printed; auto.json and costs.json go to the workdir).

Across processes (one per host), each runs the same command and joins the run through
`jax.distributed`: --coordinator_address/--num_processes/--process_id, or $JAX_COORDINATOR_ADDRESS
and friends, or SLURM/Open MPI detected (`jaxpipe.runtime.process.initialize`);
`python -m jaxpipe.launch` starts such a run on one machine. Process 0 prints, logs metrics and
holds the workdir; every process reads its own rows of each batch and writes its shards of each
checkpoint.

Rerunning the same command resumes from the workdir's newest checkpoint; a config that changes
what is trained is refused unless --resume_changed or --restart says what to do
(`jaxpipe.training.workdir`). SIGTERM or Ctrl-C saves after the current step and exits with
status 0; a second Ctrl-C aborts without saving (status 130). Across processes, a signal to any
of them stops every one after the same step. Anything else that stops the run ends with one
`error:` line (--debug adds the traceback): status 2 for usage and config errors, 1 for faults
at run time (a non-finite loss, a failed checkpoint save, a workdir in use).
"""

import ast
import logging as std_logging
import os
import sys
import traceback

from jaxpipe.runtime import process

USAGE, FAULT, INTERRUPTED = 2, 1, 130

if __name__ == "__main__":
  try:
    process.use_host_devices()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(USAGE)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)  # absl's FLAGS when run, else its own (`jaxpipe.runtime.cli`)
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "ml_collections config file (get_config).", lock_config=True, flag_values=FLAGS
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Checkpoints, metrics.jsonl and TensorBoard go "
    "here; a run resumes from the latest checkpoint found in it.",
    flag_values=FLAGS,
)
_GIN_FILE = flags.DEFINE_multi_string(
    "gin_file", [], "Gin files binding config fields.", flag_values=FLAGS
)
_GIN_PARAM = flags.DEFINE_multi_string(
    "gin_param", [], "Gin bindings, e.g. 'optimizer.lr = 1e-3'.", flag_values=FLAGS
)
_RESUME_CHANGED = flags.DEFINE_bool(
    "resume_changed",
    False,
    "Resume the workdir's run although the config changes what it trains "
    "(recorded in config_history.jsonl).",
    flag_values=FLAGS,
)
_RESTART = flags.DEFINE_bool(
    "restart",
    False,
    "Move the workdir's run to previous-<n>/ and start over.",
    flag_values=FLAGS,
)
_DEBUG = flags.DEFINE_bool(
    "debug",
    False,
    "On an error, show the traceback (and orbax's log of a failed save) instead of one line.",
    flag_values=FLAGS,
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "host:port of process 0 in a multi-process run ($JAX_COORDINATOR_ADDRESS).",
    flag_values=FLAGS,
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    None,
    "Processes in a multi-process run, one per host ($JAX_NUM_PROCESSES).",
    flag_values=FLAGS,
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    None,
    "This process's index, 0..num_processes-1 ($JAX_PROCESS_ID).",
    flag_values=FLAGS,
)
# What a failed collective says when another process of the run has gone.
_PEER_GONE = (
    "Gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "heartbeat",
    "coordination service",
    "Barrier",
)


def _one_line(e: BaseException, argv: list[str] = ()) -> str:
  """An exception's message on one line: a quoted KeyError text undone, a config file's traceback
  cut to its last line, the misspelt --config override named."""
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a KeyError's repr, re-raised
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      pass
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if not lines:
    return type(e).__name__
  if len(lines) > 1 and lines[1].startswith("Did you mean"):  # ml_collections: "'dmodel'\nDid..."
    key = lines[0].strip("'\"")
    flag = next(
        (
            a.split("=")[0]
            for a in argv
            if a.startswith("--config.") and a.split("=")[0].endswith("." + key)
        ),
        None,
    )
    return f"{flag or key}: no such config field; {' '.join(lines[1:])}"
  if any(line.startswith("Traceback") for line in lines):
    return f"{lines[0]} {lines[-1]}"
  return " ".join(lines)


def _check_config_file(filename: str) -> None:
  """UsageError unless `filename` (a config_flags path, maybe with a ':arg' suffix) is a file."""
  path = filename.split(":", 1)[0]
  if not os.path.isfile(path):
    raise app.UsageError(
        f"--config {path}: no such file (relative paths start at {os.getcwd()}); "
        "pass a config file, e.g. --config configs/quickstart.py"
    )


def _workdir_config(argv: list[str]) -> list[str]:
  """argv with `--config WORKDIR/config.py` added when it names no --config and the workdir holds
  one (`python -m jaxpipe.convert hf-to-orbax` writes it), so `--workdir` alone fine-tunes."""
  if any(a == "--config" or a.startswith("--config=") for a in argv):
    return argv
  workdir = next(
      (
          argv[i + 1] if a == "--workdir" else a.split("=", 1)[1]
          for i, a in enumerate(argv)
          if (a == "--workdir" and i + 1 < len(argv)) or a.startswith("--workdir=")
      ),
      None,
  )
  if workdir is None or not os.path.isfile(os.path.join(workdir, "config.py")):
    return argv
  return argv[:1] + ["--config", os.path.join(workdir, "config.py")] + argv[1:]


def _parse(argv: list[str]) -> list[str]:
  """absl parsing, with errors (a misspelt key, a bad type) as one line instead of a trace."""
  argv = _workdir_config(argv)
  try:
    for i, arg in enumerate(argv):  # first, or its --config.x overrides are "unknown flags"
      if arg == "--config" and i + 1 < len(argv) or arg.startswith("--config="):
        _check_config_file(argv[i + 1] if arg == "--config" else arg.split("=", 1)[1])
    return FLAGS(argv)
  except Exception as e:  # noqa: BLE001 -- flags and config files raise anything
    if "--debug" in argv:
      raise
    print(f"error: {_one_line(e, argv)}", file=sys.stderr)
    sys.exit(USAGE)


class _DropOrbaxErrors(std_logging.Filter):
  """Orbax (and asyncio, for orbax's tasks) log a failed background save with a traceback per
  writer thread; the runner reports it once."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.ERROR:
      return True
    orbax = f"{os.sep}orbax{os.sep}"
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:  # asyncio's "exception never retrieved"
      text += "".join(traceback.format_exception(*record.exc_info))
    return not (orbax in record.pathname or orbax in text or ".orbax-checkpoint-tmp" in text)


def _drop_closed_loop_errors(hook):
  """sys.unraisablehook without the 'Event loop is closed' errors that tensorstore's threads
  raise when the writes of a failed save finish after orbax has closed their event loop."""

  def unraisablehook(unraisable):
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
      hook(unraisable)

  return unraisablehook


def _load_config():
  """The --config file's config (with overrides) and gin bindings; UsageError/ConfigError if bad."""
  from jaxpipe.training import config as config_lib

  if _CONFIG.value is None:
    raise app.UsageError(
        "--config is required, e.g. --config configs/quickstart.py (a workdir "
        "that holds a config.py, as `jaxpipe.convert` writes, needs none)"
    )
  filename = config_flags.get_config_filename(FLAGS["config"])
  _check_config_file(filename)
  try:
    config = _CONFIG.value
    config.lock()
  except OSError as e:
    cause = e.__cause__ or e
    raise app.UsageError(f"--config {filename} does not load: {_one_line(cause)}") from e
  return config_lib.apply_gin(config, _GIN_FILE.value, _GIN_PARAM.value)


def _train(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  if _RESUME_CHANGED.value and _RESTART.value:
    raise app.UsageError(
        "--resume_changed and --restart exclude each other: continue the "
        "workdir's run, or move it aside and start over"
    )
  if (_RESUME_CHANGED.value or _RESTART.value) and not _WORKDIR.value:
    raise app.UsageError("--resume_changed and --restart act on a --workdir; pass one")
  config = _load_config()
  try:
    process.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  import jax

  if config.train.pool_host_memory and jax.default_backend() == "cpu":
    # glibc unmaps freed blocks over 32 MB: a step whose temporaries pass that would fault
    # them in again every step (docs/benchmarks.md#against-maxtext); False off glibc, harmless
    process.pool_host_memory()

  from jaxpipe.training.mesh import describe
  from jaxpipe.training.resolve import resolve
  from jaxpipe.training.trainer import Trainer

  existing = (
      "resume_changed" if _RESUME_CHANGED.value else "restart" if _RESTART.value else "resume"
  )
  say = print if jax.process_index() == 0 else lambda *args: None  # process 0 speaks
  run = resolve(config, _WORKDIR.value, existing_run=existing)  # checked before any device work
  if run.auto_report:
    say(run.auto_report)
  with Trainer(run) as trainer:
    d = config.data
    order = f" (order {config.mesh.order})" if jax.process_count() > 1 else ""
    say(
        f"mesh {describe(trainer.mesh)}{order}; batch {d.batch} x {d.seq_len} tokens, "
        f"{config.train.steps} steps"
    )
    trainer.init()
    if trainer.resumed_from is not None:
      say(f"resumed from step {trainer.resumed_from} in {trainer.checkpointer.directory}")
    summary = trainer.train()
  if summary["preempted"]:  # every process: each saved its shards of this step
    rank = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
    print(
        f"{rank}{summary['stop_signal']}: saved step {summary['step']} and stopped; rerun the "
        "same command to resume"
    )
    return
  if summary["first_loss"] is None:
    say(
        f"nothing to train: the run in {_WORKDIR.value} is at step {summary['step']} = "
        "train.steps; raise train.steps (with --resume_changed) to train on"
    )
    return
  evaluated = f"; eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
  say(
      f"loss: first {summary['first_loss']:.4f} (step {summary['start'] + 1}) -> last "
      f"{summary['last_loss']:.4f} (step {summary['step']}){evaluated}"
  )
  if _WORKDIR.value:
    say(f"checkpoints, metrics.jsonl, tensorboard/ in {_WORKDIR.value}")


def _status(e: BaseException) -> int:
  """USAGE for what the command line or config got wrong, FAULT for what went wrong at run time."""
  from jaxpipe.runtime.checkpoint import CheckpointMismatchError
  from jaxpipe.training.config import ConfigError

  return USAGE if isinstance(e, (app.UsageError, ConfigError, CheckpointMismatchError)) else FAULT


def _multiprocess() -> bool:
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized()


def _exit(status: int, shared: bool = False) -> None:
  """sys.exit; in a multi-process run os._exit, since JAX's shutdown would wait (minutes) for the
  other processes, which may be stuck in a collective with this one: gone, this process makes
  that collective fail at once on them. A failure every process `shared` (a failed checkpoint
  write, which all raise at the same step) waits for the others first, so that none is aborted
  by process 0's exit before printing its own line."""
  if _multiprocess():
    sys.stdout.flush()
    sys.stderr.flush()
    if shared:
      from jaxpipe.runtime import multihost

      multihost.leave_together(timeout_s=30.0)
    os._exit(status)
  sys.exit(status)


def main(argv: list[str]) -> None:
  """Runs the command (module docstring): trains, and ends any failure with one `error:` line.

  Without --debug, an interrupt (Ctrl-C) that stops the run without saving exits with
  INTERRUPTED (130), a usage, config or checkpoint-mismatch error with USAGE (2), any other
  failure with FAULT (1); --debug re-raises the exception instead.

  Args:
    argv: the program name (any other positional argument is a usage error).
  """
  logging.set_verbosity(logging.WARNING)
  if not _DEBUG.value:
    for handler in std_logging.getLogger().handlers:  # absl's, which every logger reaches
      handler.addFilter(_DropOrbaxErrors())
    sys.unraisablehook = _drop_closed_loop_errors(sys.unraisablehook)
  try:
    _train(argv)
  except KeyboardInterrupt:
    if _DEBUG.value:
      raise
    print(
        "\nerror: interrupted (Ctrl-C): stopped without saving; rerun the same command to resume "
        "from the last checkpoint",
        file=sys.stderr,
    )
    _exit(INTERRUPTED)
  except Exception as e:  # noqa: BLE001 -- every failure ends with one line
    if _DEBUG.value:
      raise
    status = _status(e)
    known = status == USAGE or type(e).__module__.startswith("jaxpipe")
    if _multiprocess() and any(p in str(e) for p in _PEER_GONE):
      print(
          f"error: another process of this run has stopped or failed ({_one_line(e)[:300]}); "
          "this one stops too. The first process to fail has the cause in its output",
          file=sys.stderr,
      )
    else:
      print(
          f"error: {_one_line(e)}"
          if known
          else f"error: {type(e).__name__}: {_one_line(e)} (--debug shows the traceback)",
          file=sys.stderr,
      )
    from jaxpipe.runtime.checkpoint import CheckpointSaveError

    _exit(status, shared=isinstance(e, CheckpointSaveError))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
