"""Wall-clock timing shared by the benchmark runners."""

import statistics
import time

import jax


def median_time(fn, *args, repeats: int) -> float:
  """Median seconds of `fn(*args)` over `repeats` runs, after one run that compiles and warms up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
