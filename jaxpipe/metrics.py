"""Scalar metrics to `metrics.jsonl` (one JSON object per step) and TensorBoard."""
import json
import math
import os

import jax


class MetricWriter:
  """Appends `{"step": s, name: value, ...}` lines and TensorBoard scalars under `workdir`."""

  def __init__(self, workdir: str):
    # Only one process writes, so multi-host runs do not interleave lines.
    self.enabled = jax.process_index() == 0
    if not self.enabled:
      return
    from tensorboardX import SummaryWriter
    os.makedirs(workdir, exist_ok=True)
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: dict[str, float]) -> None:
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
