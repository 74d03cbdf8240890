"""How long building, validating and simulating a large schedule takes (pure Python, no JAX).

  python -m experiments.schedule_speed [--pp 64] [--microbatches 512] [--repeat 3]

Per schedule: generator + validator (make_schedule), asynchronous simulation, lock-step
simulation; best of --repeat runs, seconds on one CPU core.
"""

from __future__ import annotations

import time

from absl import flags

from jaxpipe.pipeline import make_schedule
from jaxpipe.runtime import cli

NAMES = ("1f1b", "zb-h1", "dualpipe")

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("pp", 64, "Pipeline ranks.", flag_values=FLAGS)
flags.DEFINE_integer("microbatches", 512, "Micro-batches.", flag_values=FLAGS)
flags.DEFINE_integer("repeat", 3, "Runs of each schedule; the best is kept.", flag_values=FLAGS)
flags.DEFINE_list("names", list(NAMES), "Schedules to time.", flag_values=FLAGS)


def measure(name: str, pp: int, microbatches: int) -> tuple[float, float, float, int]:
  t0 = time.perf_counter()
  s = make_schedule(name, pp=pp, microbatches=microbatches)
  t1 = time.perf_counter()
  s.simulate()
  t2 = time.perf_counter()
  s.simulate(lockstep=True)
  t3 = time.perf_counter()
  return t1 - t0, t2 - t1, t3 - t2, sum(len(ops) for ops in s.ranks)


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  print(f"p={args.pp}, m={args.microbatches}, best of {args.repeat}")
  print(
      f"{'schedule':10}{'ops':>9}{'build+validate':>16}{'async sim':>11}{'lock-step':>11}"
      f"{'total':>8}"
  )
  for name in args.names:
    runs = [measure(name, args.pp, args.microbatches) for _ in range(args.repeat)]
    build, sim, lock, ops = min(runs, key=lambda r: r[0] + r[1] + r[2])
    print(
        f"{name:10}{ops:>9}{build:>15.2f}s{sim:>10.2f}s{lock:>10.2f}s"
        f"{build + sim + lock:>7.2f}s"
    )


if __name__ == "__main__":
  cli.run(main)
