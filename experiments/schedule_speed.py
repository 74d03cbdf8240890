"""How long building, validating and simulating a large schedule takes (pure Python, no JAX).

  python -m experiments.schedule_speed [--pp 64] [--microbatches 512] [--repeat 3]

Per schedule: generator + validator (make_schedule), asynchronous simulation, lock-step
simulation; best of --repeat runs, seconds on one CPU core.
"""
from __future__ import annotations

import argparse
import time

from jaxpipe.pipeline import make_schedule

NAMES = ("1f1b", "zb-h1", "dualpipe")


def measure(name: str, pp: int, microbatches: int) -> tuple[float, float, float, int]:
  t0 = time.perf_counter()
  s = make_schedule(name, pp=pp, microbatches=microbatches)
  t1 = time.perf_counter()
  s.simulate()
  t2 = time.perf_counter()
  s.simulate(lockstep=True)
  t3 = time.perf_counter()
  return t1 - t0, t2 - t1, t3 - t2, sum(len(ops) for ops in s.ranks)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pp", type=int, default=64)
  parser.add_argument("--microbatches", type=int, default=512)
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--names", default=",".join(NAMES))
  args = parser.parse_args(argv)
  print(f"p={args.pp}, m={args.microbatches}, best of {args.repeat}")
  print(f"{'schedule':10}{'ops':>9}{'build+validate':>16}{'async sim':>11}{'lock-step':>11}"
        f"{'total':>8}")
  for name in args.names.split(","):
    runs = [measure(name, args.pp, args.microbatches) for _ in range(args.repeat)]
    build, sim, lock, ops = min(runs, key=lambda r: r[0] + r[1] + r[2])
    print(f"{name:10}{ops:>9}{build:>15.2f}s{sim:>10.2f}s{lock:>10.2f}s"
          f"{build + sim + lock:>7.2f}s")


if __name__ == "__main__":
  main()
