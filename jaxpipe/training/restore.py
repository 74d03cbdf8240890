"""Parameters to serve: the newest checkpoint of a `python -m jaxpipe.train` run,
or a fresh init."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections

from jaxpipe.models import transformer
from jaxpipe.runtime.checkpoint import Checkpointer
from jaxpipe.training import config as config_lib


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a training run wrote to `workdir/config.json`.

  Args:
    workdir: the directory a `python -m jaxpipe.train --workdir` run wrote.

  Returns:
    The config.

  Raises:
    FileNotFoundError: the workdir has no config.json.
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"{path} does not exist: --workdir must be the directory a "
        "`python -m jaxpipe.train --workdir` run wrote"
    )
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def restore_params(
    workdir: str,
    config: ml_collections.ConfigDict,
    device: jax.Device | None = None,
    dtype: str | None = None,
) -> tuple[int, dict]:
  """(step, model parameters) of the newest checkpoint under `workdir`, on one device.

  Checkpoints hold the whole TrainState with the layers in the model's order, whatever the
  schedule; only its parameters are read (the optimizer's moments, twice their bytes, are not).
  The checkpoints are only read: the run may be saving into the directory at the same time.

  Args:
    workdir: the training run's directory.
    config: the run's config (`run_config`).
    device: where the parameters go; None: the first device.
    dtype: e.g. 'bfloat16': floating-point parameters are cast to it as they are read, never
      held in their saved dtype; None: as saved.

  Returns:
    (step, params) of the newest committed checkpoint.

  Raises:
    FileNotFoundError: no committed checkpoint.
  """
  from jaxpipe.training.state import (  # the trainer's own state and optimizer
      fresh_state,
      make_optimizer,
  )

  cfg = config_lib.model_config(config)
  optimizer = make_optimizer(config.optimizer, config.train.steps)

  def fresh(rng):
    return fresh_state(cfg, optimizer, transformer.init_params(cfg, rng))

  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  abstract = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      jax.eval_shape(fresh, jax.random.key(0)),
  )
  floating = lambda s: dtype is not None and jnp.issubdtype(s.dtype, jnp.floating)
  params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, dtype if floating(s) else s.dtype, sharding=sharding),
      abstract.params,
  )
  # a reader: the run may be saving into this directory right now, so nothing is renamed
  checkpointer = Checkpointer(
      os.path.join(workdir, "checkpoints"), config.checkpoint.keep, async_save=False, read_only=True
  )
  try:
    restored = checkpointer.restore_latest(abstract, part=("params", params))
  finally:
    checkpointer.close()
  if restored is None:
    raise FileNotFoundError(
        f"no committed checkpoint in {checkpointer.directory}; train longer "
        "(checkpoint.every) or serve fresh parameters with --config"
    )
  return restored


def fresh_params(config: ml_collections.ConfigDict) -> dict:
  """The parameters training would start from (train.seed).

  Args:
    config: the run's config.

  Returns:
    The initialized params tree.
  """
  cfg = config_lib.model_config(config)
  return jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(config.train.seed))
