"""Every dense family of `jaxpipe.models.families` against transformers itself.

For each family a tiny random model written by transformers' `save_pretrained` (config as
written, tokenizer beside it; `helpers.TINY_FAMILIES`: llama3 rope, q/k/v biases, q/k norms,
sliding windows alone and mixed with full layers, Gemma's norms, caps and scale, fused Phi-3
projections with longrope and partial rotary) converts, and then:

- its logits, loss and every gradient equal transformers' forward and backward (CPU torch,
  float32) on sequences longer than any sliding window and past the rotary variants' original
  context, before and after changed weights are exported and read back by transformers;
- export and import round-trip bit for bit;
- three AdamW steps at pp 2 x tp 2 (sequence parallel, 1F1B) from the converted workdir equal
  the same steps on one device (Llama, Qwen3 and Mistral with `-m slow`).

Greedy text through `python -m jaxpipe.serve --http` is checked against `generate` in
tests/serve/http/test_families.py.
"""

import functools
import shutil

import jax
import numpy as np
import optax
import pytest

from jaxpipe.models import hf, transformer
from jaxpipe.training import hf_workdir as convert_lib
from jaxpipe.training.state import make_optimizer
from jaxpipe.training.trainer import Trainer
from tests import helpers

FAMILIES = list(helpers.TINY_FAMILIES)
BATCH, SEQ = 8, 24  # longer than the windows (5) and the rotary variants' context (16)

torch = transformers = None  # the oracle (dev extra), imported on first use


def _import_oracle():
  global torch, transformers
  import torch
  import transformers


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (transformers' checkpoint directory, its model)."""
  _import_oracle()
  root = tmp_path_factory.mktemp("families")
  out = {}
  for i, family in enumerate(FAMILIES):
    src = helpers.write_tiny_model(root / family, family, seed=i)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    out[family] = (src, model.eval())
  return out


def _ids(seed=0):
  return np.random.default_rng(seed).integers(0, 384, (BATCH, SEQ))


@functools.cache
def _step(cfg):
  def objective(params, batch):
    x = transformer.embed(cfg, params, batch["tokens"])
    x = transformer.apply_layers(cfg, params["layers"], x)
    total, count = transformer.head_loss(cfg, params, x, batch["targets"], batch["mask"])
    return total / count, transformer.logits(cfg, params, x)

  return jax.jit(jax.value_and_grad(objective, has_aux=True))


def _check(cfg, family, model_type, params, model, ids, tmp):
  (loss, logits), grads = _step(cfg)(params, helpers.lm_batch(ids))
  want_loss, want_logits, want_grads = helpers.hf_oracle(model, ids, str(tmp))
  assert helpers.rel_f64(logits, want_logits) < 1e-5, family
  assert abs(float(loss) - want_loss) < 1e-5 * want_loss, family
  got = dict(hf.hf_tensors(cfg, grads, model_type))
  assert got.keys() == want_grads.keys(), family
  for name, g in want_grads.items():
    assert helpers.rel_f64(got[name], g) < 2e-5, (family, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_equal_transformers_before_and_after_export(
    family, checkpoints, tmp_path
):
  src, model = checkpoints[family]
  plan = hf.check(src)
  cfg, params = hf.load(plan)
  model_type = plan.hf_config["model_type"]
  _check(cfg, family, model_type, params, model, _ids(), tmp_path / "grads")
  # changed weights (as after training), exported and read by transformers: the same again
  rng = np.random.default_rng(7)
  params = jax.tree.map(lambda p: p * (1 + 0.1 * rng.standard_normal(p.shape, np.float32)), params)
  dst = tmp_path / "out"
  hf.save(cfg, params, str(dst), hf_config=plan.hf_config)
  changed = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager")
  assert type(changed) is type(model)
  _check(cfg, family, model_type, params, changed, _ids(1), tmp_path / "grads2")


@pytest.mark.parametrize("family", FAMILIES)
def test_export_and_import_round_trip_bit_for_bit(family, checkpoints, tmp_path):
  helpers.check_round_trip(checkpoints[family][0], str(tmp_path / family))


def _trainer_steps(workdir, batches):
  """(losses, model-order parameters) after one step per batch at pp 2 x tp 2 (dp 2), sequence
  parallel, 1F1B over 2 micro-batches, resumed from the converted checkpoint."""
  config = convert_lib.finetune_config(workdir)
  config.mesh.pp, config.mesh.tp = 2, 2
  config.model.sequence_parallel = True
  config.pipeline.schedule, config.pipeline.microbatches = "1f1b", 2
  config.data.batch, config.data.seq_len = BATCH, SEQ
  config.optimizer.lr, config.optimizer.warmup_steps = 1e-2, 0
  # Adam's g / (|g| + eps) turns the rounding of a gradient near zero into a step of up to lr
  # with eps 1e-8; with 1e-3 such a step stays as small as its gradient, elsewhere it is Adam's
  config.optimizer.eps = 1e-3
  config.train.steps = len(batches)
  with Trainer(config, workdir) as trainer:
    trainer.init()
    assert trainer.resumed_from == 0
    losses = [float(trainer.step(batch)["loss"]) for batch in batches]
    return losses, jax.device_get(trainer.model_params()), config


def _one_device_steps(cfg, params, batches, config):
  """The same steps on one device: transformer.loss's gradient, the trainer's optimizer."""
  opt = make_optimizer(config.optimizer, config.train.steps)
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  state = opt.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: helpers.one_device_loss(cfg, p, batch)[0])(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for batch in batches:
    params, state, loss = step(params, state, jax.device_put(batch, device))
    losses.append(float(loss))
  return losses, jax.device_get(params)


# Kinds of piece that Llama's, Qwen3's and Mistral's steps add (a rotary variant, q/k norms,
# every layer sliding) run in Gemma 3's and Phi-3's: theirs with `-m slow`, to keep CI short.
_SLOW_STEPS = ("llama", "qwen3", "mistral")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in _SLOW_STEPS else f for f in FAMILIES]
)
def test_three_steps_at_pp2_tp2_equal_the_one_device_steps(family, checkpoints, tmp_path):
  src, _ = checkpoints[family]
  workdir = str(tmp_path / "run")
  convert_lib.hf_to_orbax(src, workdir)
  cfg, params = hf.load(src)
  batches = [helpers.lm_batch(_ids(seed)) for seed in range(3)]
  losses, got, config = _trainer_steps(workdir, batches)
  want_losses, want = _one_device_steps(cfg, params, batches, config)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want)
  for path, p in helpers.flat(got).items():
    helpers.close(p, want[path], f"{family}: {jax.tree_util.keystr(path)}", rtol=1e-5)
  assert not np.allclose(want_losses[0], want_losses[-1])  # the steps moved the model
  shutil.rmtree(workdir)
