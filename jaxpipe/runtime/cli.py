"""The runners' command lines: absl flags, parsed and refused the same way by every command.

Every runner (`python -m jaxpipe.<command>`, `python -m experiments.<name>`) defines its flags at
module level, snake_case (`--max_batch`, `--devices_per_process`), on a FlagValues of its own,
and hands its `main` to `run`:

  FLAGS = cli.flag_values(__name__)
  _PP = flags.DEFINE_integer("pp", 4, "Pipeline ranks.", flag_values=FLAGS)

  def main(argv: list[str]) -> int | None:  # argv: the program name, then positional arguments
    ...

  if __name__ == "__main__":
    cli.run(main)

Run as the program, the runner's FlagValues is absl's global FLAGS, so `--help`, `--helpfull`
and absl's own flags work as in any absl program. Imported, it gets one of its own: tests and
notebooks import many runners into one process, one runner reads another's flags (pd_plan
predicts serve_bench's deployments from serve_bench's flags), and absl refuses a flag name
(`--pp`, `--out`) that a second module defines in the same FlagValues. `call` runs a `main` in
this process from a list of arguments, as `python -m` would.

A bad flag (unknown, misspelt, a value of the wrong type, a required one missing) ends the
command with one line, `error: ...` naming the flag and the value, and status 2; so does an
`app.UsageError` raised by `main` (absl itself would print the whole usage text first). A `--`
ends the flags: what follows goes to `main` as arguments (`python -m jaxpipe.launch --processes
2 -- python -m jaxpipe.train ...`). Imports no JAX: `python -m jaxpipe.schedule` runs without it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import app, flags, logging

from jaxpipe.runtime import process

USAGE = 2  # exit status of a command line that cannot run: a bad flag or argument


def flag_values(module: str) -> flags.FlagValues:
  """Where the runner `module` defines its flags.

  Args:
    module: the runner's `__name__`.

  Returns:
    absl's global `FLAGS` when the runner runs as the program (`"__main__"`), else a
    `FlagValues` of its own.
  """
  return flags.FLAGS if module == "__main__" else flags.FlagValues()


def parse(
    flag_values: flags.FlagValues, argv: Sequence[str], known_only: bool = False
) -> list[str]:
  """Parses `argv` into `flag_values`, every flag back to its default first.

  Resetting the flags first keeps one call's flags from leaking into the next.

  Args:
    flag_values: the runner's flags.
    argv: the command line as `sys.argv` holds it: the program name first.
    known_only: leave unknown flags among the returned arguments (a runner that hands
      `--config.key=value` overrides on to the processes it starts).

  Returns:
    The program name and the arguments that are not flags.

  Raises:
    app.UsageError: a bad flag, with absl's one-line message.
  """
  if flag_values.is_parsed():
    flag_values.unparse_flags()
  # ml_collections reads `--config.key=value` overrides from sys.argv, not from the list parsed
  saved, sys.argv = sys.argv, list(argv)
  try:
    return flag_values(list(argv), known_only=known_only)
  except flags.Error as e:
    raise app.UsageError(f"{e} (--help lists the flags)") from None
  finally:
    sys.argv = saved


def values(flag_values: flags.FlagValues) -> types.SimpleNamespace:
  """The parsed flags' values as attributes (`args.max_batch`).

  A copy, which the runner's functions take and may add derived fields to without touching the
  flags.

  Args:
    flag_values: the runner's parsed flags.

  Returns:
    A `SimpleNamespace` with one attribute per flag.
  """
  return types.SimpleNamespace(**flag_values.flag_values_dict())


def no_arguments(argv: Sequence[str]) -> None:
  """Refuses positional arguments: for a runner that takes flags only.

  Args:
    argv: the program name, then the positional arguments.

  Raises:
    app.UsageError: `argv` holds more than the program name.
  """
  if len(argv) > 1:
    raise app.UsageError(
        f"unexpected arguments {list(argv[1:])}: this command takes flags only, "
        "--name=value (--help lists them)"
    )


def pool_host_memory() -> None:
  """`runtime.process.pool_host_memory` for a benchmark's `--pool_host_memory` flag.

  Raises:
    app.UsageError: one line naming `--nopool_host_memory`, where libc refuses glibc's settings.
  """
  if not process.pool_host_memory():
    raise app.UsageError(
        "--pool_host_memory: this C library refuses glibc's mallopt settings; pass "
        "--nopool_host_memory"
    )


def _refuse(error: app.UsageError) -> NoReturn:
  print(f"error: {error}", file=sys.stderr)
  sys.exit(USAGE)


def run(main: Callable[[list[str]], int | None], known_only: bool = False) -> NoReturn:
  """Runs `main` as the program: `app.run(main)` over absl's `FLAGS`, with one-line usage errors.

  A bad flag, or an `app.UsageError` raised by `main`, prints `error: ...` and exits with status
  `USAGE`. absl's log shows warnings and errors only (not the INFO lines of JAX probing for
  backends) unless `--verbosity` is given.

  Args:
    main: takes the program name and the positional arguments; its return value is the exit
      status (None: 0).
    known_only: leave unknown flags among `main`'s arguments.
  """

  def parse_or_refuse(argv: list[str]) -> list[str]:
    try:
      return parse(flags.FLAGS, argv, known_only)
    except app.UsageError as e:
      _refuse(e)

  def main_or_refuse(argv: list[str]) -> int | None:
    if not flags.FLAGS["verbosity"].present:  # app.run has set INFO
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except app.UsageError as e:
      _refuse(e)

  app.run(main_or_refuse, flags_parser=parse_or_refuse)


def call(
    main: Callable[[list[str]], int | None],
    flag_values: flags.FlagValues,
    args: Sequence[str],
    known_only: bool = False,
) -> int | None:
  """Runs `main` in this process as `python -m <runner> ARGS` runs it (tests, notebooks).

  `args` are parsed into the runner's `flag_values`, then `main` runs on the rest.

  Args:
    main: the runner's `main`.
    flag_values: the runner's flags.
    args: the arguments after the program name.
    known_only: leave unknown flags among `main`'s arguments.

  Returns:
    `main`'s return value, or `USAGE` after printing the one-line error the command would.
  """
  try:
    return main(parse(flag_values, ["main", *args], known_only))
  except app.UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return USAGE
