"""Measure a model's stage costs on the real devices and write the cost file the simulators read.

  python -m jaxpipe.measure --config configs/quickstart.py --config.mesh.pp=4 \
      --config.model.n_layers=8 --config.data.batch=32 --microbatches 8,16 --stages 4,8 \
      --out costs.json
  python -m jaxpipe.schedule auto --pp 4 --microbatches 8 --costs costs.json

What is timed and how (every part on every rank, idle and ppermute ticks subtracted, medians
over rounds): `jaxpipe.training.stage_timing`. `--paired` also times the config's own train step in
the same rounds.
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import flags  # noqa: E402

from jaxpipe.planning import costs as costs_lib  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402
from jaxpipe.training import config as config_lib  # noqa: E402
from jaxpipe.training.stage_timing import measure, seconds  # noqa: E402
from jaxpipe.training.trainer import Trainer  # noqa: E402

FLAGS = cli.flag_values(__name__)  # absl's FLAGS when run, else its own (`jaxpipe.runtime.cli`)
config_lib.define_runner_flags(FLAGS)
flags.DEFINE_string("out", "costs.json", "Cost file to write.", flag_values=FLAGS)
flags.DEFINE_string(
    "microbatches", "", "Micro-batch counts, e.g. 8,16 (default: the config's).", flag_values=FLAGS
)
flags.DEFINE_string(
    "stages",
    "",
    "Model stage counts, e.g. 4,8 (default: the config schedule's).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("repeats", 5, "Timed rounds; each part's median is kept.", flag_values=FLAGS)
flags.DEFINE_bool(
    "paired",
    False,
    "Also time the config's own train step in the same "
    "rounds, for a prediction against a step measured under the same load.",
    flag_values=FLAGS,
)


def step_timer(config: ml_collections.ConfigDict) -> Callable[[], tuple[float, float]]:
  """A call timing one train step of the config (its schedule) on a batch already on the mesh.

  Args:
    config: the run's config; the trainer is built and compiled here and the step run once
      before the call is returned.

  Returns:
    A call without arguments that runs one step and returns its (wall, process CPU) seconds.
  """
  trainer = Trainer(config)
  trainer.compile()
  batch = trainer.batch(0)
  seconds(trainer.step, batch)
  return lambda: seconds(trainer.step, batch)


def main(argv: list[str]) -> None:
  """Runs the command (module docstring): measures the stage costs and writes the cost file.

  Args:
    argv: the program name; `config_lib.runner_config` exits on any other argument.
  """
  f = FLAGS
  config = config_lib.runner_config(argv, FLAGS)
  try:
    mesh_shape = config_lib.mesh_shape(config.mesh, jax.device_count())
    if f.microbatches or f.stages:
      ms = (
          [int(x) for x in f.microbatches.split(",")]
          if f.microbatches
          else [config.pipeline.microbatches]
      )
      if f.stages:
        ss = [int(x) for x in f.stages.split(",")]
      else:
        ss = [config_lib.pipeline_schedule(config.pipeline, mesh_shape["pp"]).num_stages]
      pairs = [(m, s) for m in ms for s in ss]
    elif config.pipeline.schedule == "auto":
      pairs = config_lib.auto_pairs(config, mesh_shape)
    else:
      config_lib.validate(config, jax.device_count())
      sched = config_lib.pipeline_schedule(config.pipeline, mesh_shape["pp"])
      pairs = [(sched.num_microbatches, sched.num_stages)]
    step = step_timer(config) if f.paired else None
    out = measure(config, pairs, f.repeats, log=print, step=step)
  except (config_lib.ConfigError, ValueError) as e:
    sys.exit(f"error: {e}")
  costs_lib.dump(out, f.out)
  paired = out["setup"].get("paired")
  print(
      f"wrote {f.out}: {len(out['entries'])} entries, update "
      f"{1e3 * out['step']['update_s']:.2f} ms"
      + (
          f", train step {1e3 * paired['step_s']:.2f} ms ({paired['step_cpu_s']:.3f} s CPU)"
          if paired
          else ""
      )
      + f"; load {out['setup']['load_average']}"
  )


if __name__ == "__main__":
  cli.run(main)
