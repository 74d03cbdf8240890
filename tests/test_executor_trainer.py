"""The trainer with mesh.pp > 1: one step of the real LM equals the unpipelined gradient."""
import jax
import numpy as np
import pytest

from jaxpipe import config as config_lib
from jaxpipe.models import transformer
from jaxpipe.trainer import Trainer, data_parallel_loss_and_grads


def tiny_config(pp, schedule, microbatches=4, n_layers=4):
  c = config_lib.default_config()
  c.model.vocab = 64
  c.model.d_model = 32
  c.model.n_layers = n_layers
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 8
  c.model.d_ff = 64
  c.data.source = "synthetic"
  c.data.seq_len = 16
  c.data.batch = 16
  c.mesh.pp = pp
  c.pipeline.schedule = schedule
  c.pipeline.microbatches = microbatches
  return c


@pytest.mark.parametrize("pp,schedule", [(2, "dualpipe"), (4, "1f1b")])
def test_pipelined_loss_and_grads_equal_unpipelined(pp, schedule):
  microbatches = 4 if schedule != "dualpipe" else 2 * pp
  trainer = Trainer(tiny_config(pp, schedule, microbatches))
  cfg = trainer.model_cfg
  params = transformer.init_params(cfg, jax.random.key(0))
  batch = trainer.batch(0)
  loss, grads, metrics = jax.jit(trainer.loss_and_grads)(params, batch)
  want_loss, want_grads, want_metrics = jax.jit(data_parallel_loss_and_grads(cfg))(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert float(metrics["tokens"]) == float(want_metrics["tokens"])
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  assert len(flat) == len(want)
  for path, g in flat:
    w = np.asarray(want[path])
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.max(np.abs(w)),
                               err_msg=jax.tree_util.keystr(path))


def test_trainer_steps_with_pipeline():
  # The quickstart's pp = 2 path: the first step's loss and gradient norm are the unpipelined ones.
  trainer = Trainer(tiny_config(2, "zb-h1"))
  state = trainer.init()
  batch = trainer.batch(0)
  want_loss, want_grads, _ = jax.jit(data_parallel_loss_and_grads(trainer.model_cfg))(
      state.params, batch)
  want_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want_grads)))
  first = trainer.step(batch)  # donates `state`
  np.testing.assert_allclose(first["loss"], want_loss, rtol=1e-5)
  np.testing.assert_allclose(first["grad_norm"], want_norm, rtol=1e-5)
  trainer.step(batch)  # warm-up starts at lr 0, so the second step is the first to move
  third = trainer.step(batch)  # the same batch: lower after a step down its gradient
  assert float(third["loss"]) < float(first["loss"])
  assert int(trainer.state.step) == 3


def test_layers_must_split_into_the_schedule_stages():
  # zb-v puts 2p model stages on p ranks: 4 stages do not split 6 layers (caught by validation)
  with pytest.raises(config_lib.ConfigError,
                     match="n_layers=6 .*does not split into the 4 model stages"):
    Trainer(tiny_config(2, "zb-v", n_layers=6))
