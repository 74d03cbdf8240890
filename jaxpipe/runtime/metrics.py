"""Scalar metrics to `metrics.jsonl` (one JSON object per step) and TensorBoard.

A run that resumes from step s (after kill -9, or from an older checkpoint than its last step)
first drops what the earlier attempt logged past s: `metrics.jsonl` is rewritten without those
rows, and TensorBoard is told to purge them (`purge_step`), so every step appears once.
"""

import json
import math
import os

import jax

from jaxpipe.runtime import files


def _rows(lines: list[str]) -> list[dict]:
  rows = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:  # a line cut short by a killed writer
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int):
      rows.append(row)
  return rows


def read_rows(path: str) -> list[dict]:
  """The rows of a `metrics.jsonl` file.

  A line cut short by a killed writer is skipped, as is any line that is not a JSON object with
  an integer `step`.

  Args:
    path: the `metrics.jsonl` file.

  Returns:
    The rows, in file order, each a dict with an int `"step"`.
  """
  with open(path) as f:
    return _rows(f.readlines())


def drop_rows_after(path: str, step: int) -> int:
  """Rewrites `path` without the rows past `step`, atomically.

  Lines cut short (or not rows) go as well. A missing file, or one with nothing to drop, is left
  as it is.

  Args:
    path: the `metrics.jsonl` file.
    step: the last step to keep.

  Returns:
    How many lines went (0 when the file is missing or unchanged).
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  kept = [r for r in _rows(lines) if r["step"] <= step]
  if len(kept) == len(lines) and (not lines or lines[-1].endswith("\n")):
    return 0
  files.write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))
  return len(lines) - len(kept)


class MetricWriter:
  """Appends `{"step": s, name: value, ...}` lines and TensorBoard scalars under `workdir`.

  start_step: the step the run (re)starts from; anything logged past it is dropped first.
  """

  def __init__(self, workdir: str, start_step: int = 0):
    # Only one process writes, so multi-host runs do not interleave lines.
    self.enabled = jax.process_index() == 0
    if not self.enabled:
      return
    from tensorboardX import SummaryWriter

    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    drop_rows_after(path, start_step)
    self.jsonl = open(path, "a")
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step + 1)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Logs one step's scalars to `metrics.jsonl` and TensorBoard.

    Does nothing on processes other than 0. NaN and infinite values go to the JSON line as strings
    (JSON has no literal for them), so every line stays parseable.

    Args:
      step: the training step the scalars belong to.
      scalars: metric name to value.
    """
    if not self.enabled:
      return
    # JSON has no NaN/inf literals; write them as strings so every line stays parseable.
    row = {k: (float(v) if math.isfinite(v) else str(float(v))) for k, v in scalars.items()}
    self.jsonl.write(json.dumps({"step": step, **row}) + "\n")
    for name, value in scalars.items():
      self.tb.add_scalar(name, float(value), step)

  def flush(self) -> None:
    if self.enabled:
      self.jsonl.flush()
      self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()
      self.enabled = False
