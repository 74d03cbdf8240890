"""DeepSeek-V3 (`model_type: deepseek_v3`) against transformers' `DeepseekV3ForCausalLM`.

A tiny random model written by transformers' `save_pretrained`, config as written
(`helpers.TINY_DEEPSEEK_V3`): latent
attention with a low-rank query and yarn rope (its mscale on the scores), rms_norm_eps 1e-5
(the latent norms keep transformers' 1e-6), one dense first layer then MoE layers with the
sigmoid router, a nonzero score-correction bias, two expert groups of which each token uses one,
routed_scaling_factor and a shared expert. Its logits, loss and every gradient equal
transformers', before and after changed weights are exported and read back by transformers; the
round trip is bit for bit; training steps under DualPipeV at pp 2 x ep 2 with ZeRO-1 equal the
one-device steps.

A checkpoint holding two multi-token prediction modules as DeepSeek's does (each module's decoder
layer after the model's, named model.layers.{5,6}.*, with enorm, hnorm, eh_proj,
shared_head.norm and copies of the embedding and head) reads into `model.mtp_depth` 2; each
module's logits equal those of transformers' `MtpModel` (what `generate(use_mtp=True)` drafts
with) holding the same weights, and the round trip through a training workdir is bit for bit.
"""

import json
import runpy
import shutil

import jax
import numpy as np
import optax
import pytest

from jaxpipe.models import hf, mtp, transformer
from jaxpipe.training import hf_workdir as convert_lib
from jaxpipe.training.state import make_optimizer
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 384, 8, 24  # SEQ beyond yarn's original context (16)
FIELDS = helpers.TINY_DEEPSEEK_V3
BIAS = "e_score_correction_bias"  # a buffer in transformers: no gradient there


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(transformers' checkpoint directory, its model)."""
  src = helpers.write_tiny_model(tmp_path_factory.mktemp("deepseek_v3") / "src", "deepseek_v3")
  return src, _load(src)


def _load(directory):
  return helpers.load_hf_model(directory)


def _ids(seed=0, batch=BATCH):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ))


def _check(cfg, params, model, ids, tmp):
  helpers.check_against_transformers(cfg, params, model, ids, tmp, "deepseek_v3", BIAS)


def test_the_config_reads_as_deepseek_v3s_parts(checkpoint):
  cfg = hf.check(checkpoint[0]).cfg
  assert cfg.first_dense == 1 and cfg.stack_units == 4
  assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.cache_width) == (12, 20, 24)
  m = cfg.moe
  assert (m.router, m.n_groups, m.topk_groups, m.routed_scaling) == ("sigmoid", 2, 1, 2.5)
  assert (m.num_shared_experts, m.lb_loss_coef, m.z_loss_coef) == (1, 0.0, 0.0)
  assert cfg.rope_scaling.type == "yarn" and cfg.norm_eps == 1e-5


def test_logits_loss_and_gradients_equal_transformers_before_and_after_export(checkpoint, tmp_path):
  src, model = checkpoint
  plan = hf.check(src)
  cfg, params = hf.load(plan)
  _check(cfg, params, model, _ids(), tmp_path / "grads")
  rng = np.random.default_rng(7)
  params = jax.tree.map(lambda p: p * (1 + 0.1 * rng.standard_normal(p.shape, np.float32)), params)
  dst = tmp_path / "out"
  hf.save(cfg, params, str(dst), hf_config=plan.hf_config)
  changed = _load(dst)
  assert type(changed) is type(model)
  _check(cfg, params, changed, _ids(1), tmp_path / "grads2")


def test_export_and_import_round_trip_bit_for_bit(checkpoint, tmp_path):
  cfg = helpers.check_round_trip(checkpoint[0], str(tmp_path / "out"))
  # no source config: the first family that computes the model is DeepSeek-V3's
  fresh = hf.config_to_hf(cfg)
  assert fresh["model_type"] == "deepseek_v3" and fresh["first_k_dense_replace"] == 1


MTP_DEPTH = 2


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
  """(a DeepSeek-V3 checkpoint with MTP_DEPTH modules, transformers' main model, transformers'
  `MtpModel` holding the modules' weights: `helpers.write_deepseek_v3_mtp`)."""
  from transformers.modeling_layers import MtpModel

  n = FIELDS["num_hidden_layers"]
  src, deep, extra = helpers.write_deepseek_v3_mtp(tmp_path_factory.mktemp("mtp"), MTP_DEPTH)
  main = _load(src)
  layers = _load(deep).model.layers
  oracle = MtpModel(main, MTP_DEPTH).eval()
  with torch.no_grad():
    for k, layer in enumerate(oracle.layers):
      layer.mtp_block.load_state_dict(layers[n + k].state_dict())
      p = f"model.layers.{n + k}."
      layer.enorm.weight.copy_(extra[p + "enorm.weight"])
      layer.hnorm.weight.copy_(extra[p + "hnorm.weight"])
      layer.post_norm.weight.copy_(extra[p + "shared_head.norm.weight"])
      layer.eh_proj.weight.copy_(extra[p + "eh_proj.weight"])
  return str(src), main, oracle


def test_the_mtp_modules_logits_equal_transformers_mtp_model(mtp_checkpoint):
  src, main, oracle = mtp_checkpoint
  cfg, params = hf.load(src)
  assert cfg.mtp_depth == MTP_DEPTH and params["mtp"]["eh_proj"]["kernel"].shape[0] == MTP_DEPTH
  ids = _ids(3, 2)
  with torch.no_grad():  # module k: the states of positions 0..L-1-k, the tokens k ahead
    h = main(torch.tensor(ids), output_hidden_states=True).hidden_states[-1]
    want = []
    for k in range(1, MTP_DEPTH + 1):
      n = SEQ - k
      positions = torch.arange(k, k + n)[None].expand(len(ids), n)
      h = oracle.forward_layer(
          k - 1, h[:, :n], positions, None, input_ids=torch.tensor(ids[:, k : k + n])
      )
      want.append(oracle._project_to_logits(h).numpy())
  ahead = np.stack([np.pad(ids[:, k:], ((0, 0), (0, k))) for k in range(1, MTP_DEPTH + 1)])
  hidden, _ = transformer.hidden_and_aux(cfg, params, ids)
  got = np.asarray(jax.jit(mtp.logits, static_argnums=0)(cfg, params, hidden, ahead))
  for k in range(1, MTP_DEPTH + 1):
    assert helpers.rel_f64(got[k - 1][:, : SEQ - k], want[k - 1]) < 1e-5, k


def test_the_mtp_modules_round_trip_through_a_workdir_bit_for_bit(mtp_checkpoint, tmp_path):
  src = mtp_checkpoint[0]
  assert helpers.check_round_trip(src, str(tmp_path / "out")).mtp_depth == MTP_DEPTH
  workdir = str(tmp_path / "run")
  convert_lib.hf_to_orbax(src, workdir)
  config = runpy.run_path(f"{workdir}/config.py")["get_config"]()  # what the trainer reads
  assert config.model.mtp_depth == MTP_DEPTH
  convert_lib.orbax_to_hf(workdir, str(tmp_path / "back"))
  helpers.same_weights(src, str(tmp_path / "back"))


def test_a_checkpoint_without_the_modules_reads_without_them(checkpoint):
  plan = hf.check(checkpoint[0])  # transformers writes num_nextn_predict_layers 1, no modules
  assert plan.hf_config["num_nextn_predict_layers"] == 1 and plan.cfg.mtp_depth == 0


def test_steps_under_dualpipev_at_pp2_ep2_with_zero1_equal_the_one_device_steps(
    checkpoint, tmp_path
):
  from jaxpipe.training.trainer import Trainer

  src, _ = checkpoint
  workdir = str(tmp_path / "run")
  convert_lib.hf_to_orbax(src, workdir)
  cfg, params = hf.load(src)
  batches = [helpers.lm_batch(_ids(seed, 2 * BATCH)) for seed in range(3)]  # dp 2 x 4 mbs x 2
  config = convert_lib.finetune_config(workdir)
  config.mesh.pp, config.mesh.ep = 2, 2
  config.pipeline.schedule, config.pipeline.microbatches = "dualpipev", 4
  config.optimizer.shard = "zero1"
  config.data.batch, config.data.seq_len = 2 * BATCH, SEQ
  config.optimizer.lr, config.optimizer.warmup_steps, config.optimizer.eps = 1e-2, 0, 1e-3
  config.train.steps = len(batches)
  with Trainer(config, workdir) as trainer:
    trainer.init()
    assert trainer.resumed_from == 0 and trainer.model_cfg == cfg
    losses = [float(trainer.step(batch)["loss"]) for batch in batches]
    got = jax.device_get(trainer.model_params())
  want_losses, want = _one_device_steps(cfg, params, batches, config)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want)
  for path, p in helpers.flat(got).items():
    helpers.close(p, want[path], jax.tree_util.keystr(path), rtol=1e-5)
  assert not np.allclose(want_losses[0], want_losses[-1])  # the steps moved the model
  shutil.rmtree(workdir)


def _one_device_steps(cfg, params, batches, config):
  """The same steps on one device: the one-device objective's gradient, the trainer's
  optimizer, and the choice's biases kept as they are (moe.bias_update_rate is 0: they move by
  DeepSeek-V3's balancing rule only, never by the optimizer)."""
  opt = make_optimizer(config.optimizer, config.train.steps)
  params = jax.device_put(params, jax.devices()[0])
  state = opt.init(params)
  keep = lambda old, new: jax.tree_util.tree_map_with_path(
      lambda path, o, n: o if path[-1].key == "expert_bias_E" else n, old, new
  )

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: helpers.one_device_loss(cfg, p, batch)[0])(params)
    updates, state = opt.update(grads, state, params)
    return keep(params, optax.apply_updates(params, updates)), state, loss

  losses = []
  for batch in batches:
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return losses, jax.device_get(params)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(attention_bias=True), r"attention_bias=True.*the latent attention has no biases"),
        (dict(num_key_value_heads=2), r"num_key_value_heads=2.*for every query head"),
        (dict(attention_dropout=0.1), r"attention_dropout=0.1.*without dropout"),
    ],
)
def test_what_deepseek_v3_cannot_read_is_one_line(tmp_path, changes, match):
  hf_config = json.loads(json.dumps(transformers.DeepseekV3Config(**FIELDS).to_dict()))
  hf_config.update(changes, architectures=["DeepseekV3ForCausalLM"])
  with pytest.raises(hf.CheckpointError, match=match):
    hf.config_from_hf(hf_config)
