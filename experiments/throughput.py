"""Training throughput of a config: tokens/s, step time and analytic model FLOPs per step.

  python -m experiments.throughput [--config configs/quickstart.py] [--steps 20] \
      [--config.key=value]

Times `--steps` optimizer steps after `--warmup` untimed ones (compilation), on the same Trainer
the training runner uses, with no workdir (no checkpoint or metric I/O in the timed loop).
"""

from jaxpipe.runtime import process

if __name__ == "__main__":
  process.use_host_devices()

import os  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Config file.", flag_values=FLAGS
)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.", flag_values=FLAGS)
_WARMUP = flags.DEFINE_integer(
    "warmup", 2, "Untimed steps first (the first one compiles).", flag_values=FLAGS
)


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  import jax

  from jaxpipe.models import flops
  from jaxpipe.training.trainer import Trainer

  config = _CONFIG.value
  trainer = Trainer(config)
  trainer.init()
  d, cfg = config.data, trainer.model_cfg
  batches = [trainer.batch(i) for i in range(_WARMUP.value + _STEPS.value)]
  t0 = time.perf_counter()
  for b in batches[: _WARMUP.value]:
    jax.block_until_ready(trainer.step(b))
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for b in batches[_WARMUP.value :]:
    metrics = trainer.step(b)
  jax.block_until_ready((metrics, trainer.state))
  step_s = (time.perf_counter() - t0) / _STEPS.value
  model_flops = flops.training_flops_per_step(cfg, d.batch, d.seq_len)
  n_params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
  print(
      f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
      f"mesh {dict(trainer.mesh.shape)}; "
      f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
  )
  print(
      f"model: {n_params:,} parameters; batch {d.batch} x {d.seq_len} = {d.batch * d.seq_len} "
      f"tokens/step"
  )
  print(f"first {_WARMUP.value} steps (with compilation): {compile_s:.1f} s")
  print(f"step time: {1e3 * step_s:.1f} ms over {_STEPS.value} steps")
  print(f"tokens/s: {d.batch * d.seq_len / step_s:,.0f}")
  print(
      f"model FLOPs/step (analytic, fwd+bwd): {model_flops / 1e9:.2f} GFLOP; achieved "
      f"{model_flops / step_s / 1e9:.1f} GFLOP/s"
  )


if __name__ == "__main__":
  cli.run(main)
