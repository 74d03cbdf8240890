"""Planned against measured ticks: one Perfetto file from a profile of the compiled train step.

  python -m jaxpipe.tick_trace --config configs/quickstart.py --config.mesh.pp=4 \
      --config.model.n_layers=8 --config.pipeline.schedule=zb-h1 --config.pipeline.microbatches=8 \
      --costs costs.json --out zb-h1.ticks.json      # open in ui.perfetto.dev

What the planned and the measured ticks are: `jaxpipe.planning.ticks`.
"""

from __future__ import annotations

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import flags  # noqa: E402

from jaxpipe.pipeline.api import lowered_for  # noqa: E402
from jaxpipe.planning import costs as costs_lib  # noqa: E402
from jaxpipe.planning.ticks import (  # noqa: E402
    TraceError,
    branch_of_table,
    perfetto_trace,
    profile_step,
    read_profile,
)
from jaxpipe.runtime import cli  # noqa: E402
from jaxpipe.training import config as config_lib  # noqa: E402
from jaxpipe.training.pipeline_lm import lm_schedule  # noqa: E402
from jaxpipe.training.stage_timing import measure  # noqa: E402
from jaxpipe.training.trainer import Trainer  # noqa: E402

FLAGS = cli.flag_values(__name__)  # absl's FLAGS when run, else its own (`jaxpipe.runtime.cli`)
config_lib.define_runner_flags(FLAGS)
flags.DEFINE_string(
    "costs", "", "Cost file (python -m jaxpipe.measure); empty: measure now.", flag_values=FLAGS
)
flags.DEFINE_string("out", "ticks.perfetto.json", "Perfetto file to write.", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  """Runs the command (module docstring): profiles one train step and writes the Perfetto file.

  Args:
    argv: the program name; `config_lib.runner_config` exits on any other argument.
  """
  f = FLAGS
  config = config_lib.runner_config(argv, FLAGS)
  try:
    trainer = Trainer(config)
    config = trainer.config
    if trainer.mesh_shape["pp"] == 1:
      raise config_lib.ConfigError(
          "there are no ticks without a pipeline: set --config.mesh.pp to 2 or more"
      )
    schedule = lm_schedule(config.pipeline, trainer.mesh_shape["pp"])
    lowered = lowered_for(schedule)
    key = (schedule.num_microbatches, schedule.num_stages)
    costs = (
        costs_lib.load(f.costs)
        if f.costs
        else costs_lib.parse(measure(config, [key], log=print), "<measured>")
    )
    prediction = costs.predict(lowered)
    with tempfile.TemporaryDirectory() as tmp:
      xspace, hlo = profile_step(trainer, tmp)
      measured = read_profile(xspace, hlo, trainer.mesh, lowered.num_ticks)
  except (config_lib.ConfigError, costs_lib.CostFileError, TraceError) as e:
    sys.exit(f"error: {e}")
  trace = perfetto_trace(lowered, prediction, measured)
  with open(f.out, "w") as out:
    json.dump(trace, out)
  meta = trace["otherData"]
  wrong = sum(
      m.branch != b
      for ticks, row in zip(measured, branch_of_table(lowered))
      for m, b in zip(ticks, row)
  )
  print(
      f"{schedule.name}: {lowered.num_ticks} ticks, planned {1e3 * meta['planned_s']:.2f} ms, "
      f"measured {1e3 * meta['measured_s']:.2f} ms in the traced step; branches that differ "
      f"from the tables: {wrong}; wrote {f.out}"
  )


if __name__ == "__main__":
  cli.run(main)
