"""Train a language model.

  python -m jaxpipe.train --config configs/quickstart.py [--config.key=value ...] [--workdir DIR]
      [--gin_file F.gin ...] [--gin_param 'model.d_model = 256' ...]

Gin bindings are applied after the config file and its --config overrides. Without an
accelerator the run gets 8 CPU host devices ($JAXPIPE_HOST_DEVICES to change). With
--config.pipeline.schedule=auto the schedule is chosen from measured stage costs first (the
ranking is printed; auto.json and costs.json go to the workdir).
"""
import sys

from jaxpipe import runtime

if __name__ == "__main__":
  runtime.use_host_devices()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (get_config).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl and TensorBoard go here; "
                               "a run resumes from the latest checkpoint found in it.")
_GIN_FILE = flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields.")
_GIN_PARAM = flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'optimizer.lr = 1e-3'.")


def _parse(argv: list[str]) -> list[str]:
  """absl parsing, with config errors (a misspelt key, a bad type) as one line instead of a trace."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    sys.exit(f"error: {e}".replace("\\n", "\n"))


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config configs/quickstart.py")
  logging.set_verbosity(logging.WARNING)
  import jax

  from jaxpipe import config as config_lib
  from jaxpipe.trainer import NonFiniteLossError, Trainer
  config = config_lib.apply_gin(_CONFIG.value, _GIN_FILE.value, _GIN_PARAM.value)
  try:
    trainer = Trainer(config, _WORKDIR.value)
  except config_lib.ConfigError as e:
    sys.exit(f"config error: {e}")
  if trainer.auto_report:
    print(trainer.auto_report)
  d = config.data
  print(f"mesh {dict(trainer.mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} "
        f"devices; batch {d.batch} x {d.seq_len} tokens, {config.train.steps} steps")
  trainer.init()
  if trainer.resumed_from is not None:
    print(f"resumed from step {trainer.resumed_from} in {trainer.checkpointer.directory}")
  try:
    summary = trainer.train()
  except NonFiniteLossError as e:
    sys.exit(f"stopped: {e}")
  if summary["preempted"]:
    print(f"SIGTERM: saved step {summary['step']} and stopped; rerun the same command to resume")
    return
  if summary["first_loss"] is not None:
    print(f"loss: first {summary['first_loss']:.4f} (step {summary['start'] + 1}) -> last "
          f"{summary['last_loss']:.4f} (step {summary['step']}); eval loss {summary['eval_loss']:.4f}")
  if _WORKDIR.value:
    print(f"checkpoints, metrics.jsonl, tensorboard/ in {_WORKDIR.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
