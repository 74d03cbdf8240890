"""Step CPU time of each parallel layout against the replicated one, on one model.

  python -m experiments.layout_bench [--rounds 5] [--steps 3] [--batch 32] [--seq_len 128]

Layouts (8 CPU host devices, the quickstart's model unless --d_model/--layers say otherwise):
the replicated one (dp 8, optimizer.shard=none), tp 2 and 4 with sequence parallelism on and
off, and each optimizer.shard mode (zero1, zero2, fsdp) at dp 8. Each is compiled and warmed
up, then each round runs every layout for `--steps` steps in turn (the order rotated by one per
round); per step the process's CPU time (`time.process_time()` around a blocked step: the 8
devices are threads on the machine's cores, so CPU time is the steadier measure). Columns: CPU
ms/step (median over rounds), its ratio to the replicated step's in the same round (median,
lowest-highest), per-device argument and temporary bytes from `compiled.memory_analysis()`.
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import quickstart  # noqa: E402
from jaxpipe.training.trainer import Trainer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 5, "rounds; each runs every layout in turn")
flags.DEFINE_integer("steps", 3, "timed steps per layout per round")
flags.DEFINE_integer("warmup", 2, "untimed steps after compiling")
flags.DEFINE_integer("batch", 32, "global batch (sequences)")
flags.DEFINE_integer("seq_len", 128, "tokens per sequence")

# name: (mesh.tp, model.sequence_parallel, optimizer.shard); the first is the reference
LAYOUTS = {
    "replicated": (1, False, "none"),
    "tp2": (2, False, "none"),
    "tp2 sp": (2, True, "none"),
    "tp4": (4, False, "none"),
    "tp4 sp": (4, True, "none"),
    "zero1": (1, False, "zero1"),
    "zero2": (1, False, "zero2"),
    "fsdp": (1, False, "fsdp"),
}


def make_trainer(tp: int, sp: bool, shard: str) -> Trainer:
  """A Trainer of the quickstart's model on synthetic data in one layout, compiled and warm."""
  c = quickstart.get_config()
  c.data.source, c.data.batch, c.data.seq_len = "synthetic", FLAGS.batch, FLAGS.seq_len
  c.mesh.tp, c.model.sequence_parallel, c.optimizer.shard = tp, sp, shard
  c.train.steps = 10_000
  trainer = Trainer(c)
  trainer.compile()
  for _ in range(FLAGS.warmup):
    jax.block_until_ready(trainer.step())
  return trainer


def cpu_per_step(trainer: Trainer, steps: int) -> float:
  batch = trainer.batch(0)
  t0 = time.process_time()
  for _ in range(steps):
    jax.block_until_ready(trainer.step(batch))
  return (time.process_time() - t0) / steps


def main(argv: list[str]) -> None:
  del argv
  trainers = {name: make_trainer(*layout) for name, layout in LAYOUTS.items()}
  names = list(trainers)
  samples: dict[str, list[float]] = {n: [] for n in names}
  for r in range(FLAGS.rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      samples[name].append(cpu_per_step(trainers[name], FLAGS.steps))
  ref = samples[names[0]]
  print(f"{'layout':<11} {'CPU ms/step':>11}  {'vs replicated':<20} {'args MB':>8} {'temp MB':>8}")
  for name in names:
    ratios = [s / q for s, q in zip(samples[name], ref)]
    stats = trainers[name].compile_stats
    print(
        f"{name:<11} {1e3 * statistics.median(samples[name]):>11.1f}  "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}){'':<7} "
        f"{stats.get('argument_bytes', 0) / 1e6:>8.2f} {stats.get('temp_bytes', 0) / 1e6:>8.2f}"
    )


if __name__ == "__main__":
  app.run(main)
