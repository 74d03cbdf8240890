"""Hugging Face checkpoints to training workdirs and back.

  python -m jaxpipe.convert hf-to-orbax SRC_DIR WORKDIR [--pp P] [--ep E] [--fp8 RECIPE]
  python -m jaxpipe.train --workdir WORKDIR [--config.key=value ...]
  python -m jaxpipe.convert orbax-to-hf WORKDIR DST_DIR [--step S] [--dtype D] [--pp P] [--ep E]

What each writes and reads: `jaxpipe.training.hf_workdir`. The sub-command and its directories are
the positional arguments; --fp8 belongs to hf-to-orbax, --step and --dtype to orbax-to-hf.
"""

import sys
import warnings

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()  # the model goes on the first --pp x --ep of them

from absl import app, flags  # noqa: E402

from jaxpipe.models import hf  # noqa: E402
from jaxpipe.ops import fp8 as fp8_lib  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

# Workdirs converted before the library moved to jaxpipe.training name it here in their config.py.
from jaxpipe.training.hf_workdir import (  # noqa: E402
    finetune_config,  # noqa: E402, F401
    hf_to_orbax,
    orbax_to_hf,
)

# sub-command -> its positional arguments and the flags only it takes
COMMANDS = {
    "hf-to-orbax": (("SRC_DIR", "WORKDIR"), ("fp8",)),
    "orbax-to-hf": (("WORKDIR", "DST_DIR"), ("step", "dtype")),
}

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("pp", 1, "Split the layers over this many devices.", flag_values=FLAGS)
flags.DEFINE_integer("ep", 1, "Split the experts over this many devices.", flag_values=FLAGS)
flags.DEFINE_enum(
    "fp8",
    "none",
    fp8_lib.RECIPES,
    "hf-to-orbax: FP8 recipe of the fine-tuning run "
    "(model.fp8); delayed adds its scales and amax histories to checkpoint 0.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "step",
    None,
    "orbax-to-hf: the checkpoint to export; default the newest committed.",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "dtype",
    None,
    ("float32", "bfloat16", "float16"),
    "orbax-to-hf: of the written weights; default the source's (else float32).",
    flag_values=FLAGS,
)


def main(argv: list[str]) -> None:
  """Runs the command (module docstring).

  Args:
    argv: the program name, the sub-command (`hf-to-orbax` or `orbax-to-hf`) and its two
      directories.

  Raises:
    app.UsageError: no known sub-command, the wrong number of directories, or a flag of the
      other sub-command.
  """
  command = argv[1] if len(argv) > 1 else None
  if command not in COMMANDS:
    raise app.UsageError(
        f"give a sub-command, {' or '.join(COMMANDS)}"
        + (f"; {command!r} is neither" if command else "")
        + ", e.g. python -m jaxpipe.convert hf-to-orbax SRC_DIR WORKDIR"
    )
  if len(argv) != 2 + len(COMMANDS[command][0]):
    raise app.UsageError(f"{command} takes {' '.join(COMMANDS[command][0])}; got {argv[2:]}")
  for other, (_, theirs) in COMMANDS.items():
    for name in theirs:
      if other != command and FLAGS[name].present:
        raise app.UsageError(f"--{name} is a flag of {other}, not of {command}")
  f = FLAGS
  try:
    with warnings.catch_warnings():
      # config.json fields that change nothing: named on one line, not refused
      warnings.showwarning = _one_line
      if command == "hf-to-orbax":
        src, workdir = argv[2:]
        plan = hf_to_orbax(src, workdir, f.pp, f.ep, f.fp8)
        print(
            f"{plan.hf_config['model_type']} ({len(plan.files) - len(plan.ignored)} tensors, "
            f"{plan.dtype}) -> {workdir}/checkpoints/0"
            + "".join(f"\n  not read: {n} ({why})" for n, why in sorted(plan.ignored.items()))
        )
        print(f"fine-tune: python -m jaxpipe.train --workdir {workdir}")
      else:
        workdir, dst = argv[2:]
        written = orbax_to_hf(workdir, dst, f.step, f.dtype, f.pp, f.ep)
        print(f"{written['model_type']} ({written['dtype']}) -> {dst}")
  except (hf.CheckpointError, ValueError, OSError) as e:
    sys.exit(f"error: {e}")


def _one_line(message, category, *_, **__) -> None:
  print(f"warning: {message}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
