"""MaxText's pre-training loop, run by `experiments.train_bench` in MaxText's own interpreter.

  /path/to/maxtext-venv/bin/python experiments/maxtext_run.py BASE_YML key=value ...

Runs `maxtext.trainers.pre_train.train` as `python -m` would, with two hooks that leave its own
log lines as they are and add lines of their own after them:
- after each of MaxText's `completed step: N, ...` lines, `train_bench cpu: step N,
  process_time: S, minor_faults: F` (this process's CPU seconds and minor page faults so far,
  every thread: XLA's host devices are threads of it), so the bench takes CPU seconds and faults
  per step from consecutive lines as MaxText takes its `seconds` from consecutive steps;
- where MaxText logs `number parameters: 0.001 billion`, `train_bench parameters: N` (the exact
  count, from the same `max_utils.calculate_num_params_from_pytree` call).

Only the standard library and MaxText are imported: jaxpipe is not installed there.
"""

import resource
import runpy
import time

from absl import logging
from maxtext.utils import max_logging, max_utils

STEP = "completed step: "


def _log_with_cpu():
  def hooked(user_str):
    logging.info(user_str, stacklevel=2)  # MaxText's `log`: its caller's file and line
    text = str(user_str)
    at = text.find(STEP)
    if at >= 0:
      step = text[at + len(STEP) :].split(",", 1)[0].strip()
      faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      print(
          f"train_bench cpu: step {step}, process_time: {time.process_time():.4f}, "
          f"minor_faults: {faults}",
          flush=True,
      )

  return hooked


def _count_with_print(count):
  def hooked(params):
    n = count(params)
    print(f"train_bench parameters: {int(n)}", flush=True)
    return n

  return hooked


def main() -> None:
  max_logging.log = _log_with_cpu()
  max_utils.calculate_num_params_from_pytree = _count_with_print(
      max_utils.calculate_num_params_from_pytree
  )
  runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
