"""Schedule generators by name.

Each is `fn(pp, microbatches, chunks=None, **options) -> Schedule`.
"""

from __future__ import annotations

import difflib
import importlib

from jaxpipe.pipeline.ir.schedule import Schedule

# name -> "module:function" under jaxpipe.pipeline.ir.schedules, imported on first use.
GENERATORS = {
    "gpipe": "simple:gpipe",
    "1f1b": "simple:one_f_one_b",
    "interleaved-1f1b": "simple:interleaved_1f1b",
    "chimera": "chimera:chimera",
    "zb-h1": "zero_bubble:zb_h1",
    "zb-h2": "zero_bubble:zb_h2",
    "zb-v": "zero_bubble:zb_v",
    "dualpipe": "dualpipe:dualpipe",
    "dualpipev": "dualpipe:dualpipev",
}
SCHEDULE_NAMES = tuple(GENERATORS)


def make_schedule(
    name: str, *, pp: int, microbatches: int, chunks: int | None = None, **options
) -> Schedule:
  """Builds and validates a published schedule.

  Args:
    name: one of SCHEDULE_NAMES ('gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1', 'dualpipe', ...).
    pp: pipeline ranks.
    microbatches: micro-batches per step.
    chunks: virtual stages per rank where the schedule takes a count (interleaved 1F1B); None:
      the schedule's own.
    **options: the generator's own options.

  Returns:
    The validated `Schedule`.

  Raises:
    ValueError: an unknown name (with the closest known one) or a bad count.
  """
  if name not in GENERATORS:
    close = difflib.get_close_matches(name, SCHEDULE_NAMES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown schedule {name!r}{hint} Known: {', '.join(SCHEDULE_NAMES)}")
  for arg, value in (("pp", pp), ("microbatches", microbatches)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{arg}={value!r}: must be a positive integer")
  if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
    raise ValueError(f"chunks={chunks!r}: must be a positive integer or None")
  module, fn = GENERATORS[name].split(":")
  gen = getattr(importlib.import_module(f"jaxpipe.pipeline.ir.schedules.{module}"), fn)
  return gen(pp, microbatches, chunks, **options).validate()
