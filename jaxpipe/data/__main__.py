"""A corpus into a token store for `data.source=tokens:DIR` (`jaxpipe.data.prepare`).

  python -m jaxpipe.data prepare --tokenizer WORKDIR|bytes --input FILE [--input FILE ...]
      --out DIR [--workers N] [--eval_fraction F]

--tokenizer is the model's: a workdir converted by `python -m jaxpipe.convert hf-to-orbax` (its
hf/tokenizer.json), a directory holding tokenizer.json, or `bytes` for jaxpipe's byte-level
models. Prints one line at the end: documents, tokens, what was skipped, tokens/s.
"""

import sys

from absl import app, flags

from jaxpipe.data import prepare as prepare_lib
from jaxpipe.runtime import cli

COMMANDS = ("prepare",)

FLAGS = cli.flag_values(__name__)
flags.DEFINE_string(
    "tokenizer",
    None,
    "The model's tokenizer: a workdir with hf/tokenizer.json, a directory with tokenizer.json, "
    "or 'bytes'.",
    flag_values=FLAGS,
)
flags.DEFINE_multi_string(
    "input",
    [],
    "A corpus file: .jsonl ('text' or 'messages'), .parquet ('text' column) or text (.txt, .md, "
    ".py, ...: one document a file), or a directory of them; repeat for more.",
    flag_values=FLAGS,
)
flags.DEFINE_string("out", None, "The store's directory (must not exist yet).", flag_values=FLAGS)
flags.DEFINE_integer(
    "workers", None, "Tokenizing processes; default min(CPU count, 8).", flag_values=FLAGS
)
flags.DEFINE_float(
    "eval_fraction",
    0.02,
    "Reports how many documents data.eval_fraction=F holds out of training (the store is the "
    "same whatever F).",
    flag_values=FLAGS,
)
flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.", flag_values=FLAGS)


def main(argv: list[str]) -> int | None:
  """Runs the command described in the module docstring.

  Args:
    argv: the program name and the sub-command (`prepare`).

  Returns:
    0 once the store is written (its summary printed), or 1 after printing a one-line error when
    `prepare` refuses the inputs or fails to read or write a file.

  Raises:
    app.UsageError: no or an unknown sub-command, `--tokenizer` or `--out` missing, or no
      `--input`.
  """
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(
        f"give the sub-command prepare{'; got ' + repr(argv[1:]) if len(argv) > 1 else ''}, "
        "e.g. python -m jaxpipe.data prepare --tokenizer bytes --input corpus.jsonl --out DIR"
    )
  for name in ("tokenizer", "out"):
    if FLAGS[name].value is None:
      raise app.UsageError(f"--{name} is required")
  if not FLAGS.input:
    raise app.UsageError("give at least one --input FILE")
  try:
    result = prepare_lib.prepare(
        FLAGS.tokenizer,
        list(FLAGS.input),
        FLAGS.out,
        workers=FLAGS.workers,
        eval_fraction=FLAGS.eval_fraction,
        progress=FLAGS.progress,
    )
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(prepare_lib.summary(FLAGS.out, result))
  return 0


if __name__ == "__main__":
  cli.run(main)
