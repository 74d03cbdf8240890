"""The Trainer: data-parallel gradients against one device, the optimizer, the loop's outputs."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.training.losses import data_parallel_loss_and_grads
from jaxpipe.training.state import TrainState, learning_rate
from jaxpipe.training.trainer import NonFiniteLossError, Trainer


def _read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The tiny config trained for its 20 steps, with a workdir."""
  workdir = str(tmp_path_factory.mktemp("run"))
  trainer = Trainer(tiny.get_config(), workdir)
  summary = trainer.train(progress=False)
  return trainer, summary, workdir


@functools.partial(jax.jit, static_argnums=0)
def _mean_loss_and_grads(cfg, params, batch):
  def loss(p):
    logp = jax.nn.log_softmax(transformer.forward(cfg, p, batch["tokens"]), -1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])

  return jax.value_and_grad(loss)(params)


def _one_device_loss_and_grads(cfg, params, batch):
  """The oracle: the global masked mean of token cross-entropy, differentiated on one device."""
  return _mean_loss_and_grads(cfg, *jax.device_put((params, batch), jax.devices()[0]))


def _assert_tree_close(a, b, rtol):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    scale = float(np.max(np.abs(y)))
    np.testing.assert_allclose(
        np.asarray(x) / scale, np.asarray(y) / scale, atol=rtol, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize("microbatches", [1, 2])
def test_data_parallel_gradients_equal_one_device(trained, microbatches):
  trainer = trained[0]
  params = jax.tree.map(jnp.copy, trainer.state.params)
  host = trainer.source.batch("train", 123, 16, 16)
  assert len(set(host["mask"].sum(1))) > 1  # rows differ in valid tokens: normalisation matters
  batch = trainer.shard_batch(host)
  assert batch["tokens"].sharding.spec == jax.sharding.PartitionSpec(("dp", "ep"), "cp")
  fn = data_parallel_loss_and_grads(trainer.model_cfg, microbatches)
  loss, grads, metrics = jax.jit(fn)(params, batch)
  want_loss, want_grads = _one_device_loss_and_grads(trainer.model_cfg, params, host)
  assert float(metrics["tokens"]) == host["mask"].sum()
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  _assert_tree_close(grads, want_grads, 1e-5)


def test_evaluate_is_the_same_with_pipeline_and_context_parallelism(trained):
  """pp = 2 and cp = 2 evaluate the trained parameters to the one-device mean cross-entropy."""
  trainer, summary, _ = trained
  params = jax.device_get(trainer.state.params)
  c = tiny.get_config()
  hosts = [
      trainer.source.batch("eval", i, c.data.batch, c.data.seq_len)
      for i in range(c.train.eval_batches)
  ]
  sums = [
      _one_device_loss_and_grads(trainer.model_cfg, params, h)[0] * h["mask"].sum() for h in hosts
  ]
  want = float(np.sum(sums) / np.sum([h["mask"].sum() for h in hosts]))
  np.testing.assert_allclose(trainer.evaluate(), want, rtol=1e-5)
  for axis in ("pp", "cp"):
    c = tiny.get_config()
    c.mesh[axis] = 2
    other = Trainer(c)
    other.state = TrainState(
        jnp.zeros((), jnp.int32), jax.device_put(params, other.state_sharding.params), None
    )
    np.testing.assert_allclose(other.evaluate(), want, rtol=1e-5, err_msg=axis)
    if axis == "pp":  # the layers stay split over the pipeline: nothing gathers them
      hlo = other._eval_step.lower(other.state.params, other.batch(0, "eval")).compile().as_text()
      assert "all-gather" not in hlo


def test_learning_rate_schedule_formula():
  opt = tiny.get_config().optimizer
  opt.lr, opt.warmup_steps, opt.min_lr_ratio = 1e-3, 10, 0.1
  lr = learning_rate(opt, 100)
  cosine = lambda t: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + np.cos(np.pi * (t - 10) / 90))
  for t, want in [(0, 0.0), (5, 5e-4), (10, 1e-3), (55, cosine(55)), (80, cosine(80)), (100, 1e-4)]:
    np.testing.assert_allclose(float(lr(t)), want, rtol=1e-6, atol=1e-12)


def test_replaceable_loss_and_grads_and_decoupled_weight_decay():
  c = tiny.get_config()
  c.optimizer.lr, c.optimizer.warmup_steps, c.optimizer.weight_decay = 0.1, 0, 0.5
  trainer = Trainer(c)
  trainer.init()
  before = jax.device_get(trainer.state.params)
  # Zero gradients: Adam's update is 0, so only the decay moves parameters.
  trainer.loss_and_grads = lambda params, batch: (
      jnp.float32(0),
      jax.tree.map(jnp.zeros_like, params),
      {"tokens": jnp.sum(batch["mask"])},
  )
  metrics = trainer.step()
  assert float(metrics["lr"]) == pytest.approx(0.1)
  assert int(trainer.state.step) == 1
  after = jax.device_get(trainer.state.params)
  for (path, b), a in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
    decayed = path[-1].key != "scale"  # norm scales are not decayed
    np.testing.assert_allclose(
        a, b * (1 - 0.1 * 0.5) if decayed else b, rtol=1e-6, err_msg=jax.tree_util.keystr(path)
    )


def test_training_loop_outputs(trained):
  trainer, summary, workdir = trained
  assert summary["start"] == 0 and summary["step"] == 20 and not summary["preempted"]
  assert summary["last_loss"] < 0.75 * summary["first_loss"], summary
  rows = _read_metrics(workdir)
  steps = [r["step"] for r in rows if "loss" in r]
  assert steps == list(range(1, 21))
  assert rows[0]["loss"] == summary["first_loss"] and rows[0]["lr"] == 0.0
  assert all({"loss", "grad_norm", "lr", "tokens"} <= r.keys() for r in rows if "loss" in r)
  assert any("tokens_per_s" in r for r in rows)
  evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
  assert set(evals) == {10, 20} and evals[20] == summary["eval_loss"]
  assert trainer.checkpointer.steps() == [10, 20]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["d_model"] == 32


class _Poisoned:
  """A source whose train batch `index` has a NaN mask, as corrupt data would."""

  def __init__(self, source, index):
    self.source, self.index = source, index

  def batch(self, split, index, batch, seq_len):
    out = self.source.batch(split, index, batch, seq_len)
    if split == "train" and index == self.index:
      out["mask"] = out["mask"] * np.nan
    return out


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  c = tiny.get_config()
  c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every = 8, 3, 0, 4
  trainer = Trainer(c, str(tmp_path))
  trainer.source = _Poisoned(trainer.source, index=5)  # step 6 is the sixth update
  with pytest.raises(NonFiniteLossError) as e:
    trainer.train(progress=False)
  msg = str(e.value)
  assert "non-finite loss nan" in msg and "at step 6, found when checking steps 5..6" in msg
  assert f"last good checkpoint is step 4 in {tmp_path}" in msg
  assert trainer.checkpointer.steps() == [4]
  rows = _read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["loss"] == "nan"
