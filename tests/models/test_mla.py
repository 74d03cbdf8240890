"""Multi-head latent attention (jaxpipe.models.mla) against transformers' DeepseekV3Attention:
outputs and input gradients on random weights, with and without the query's low rank, in both
rotary layouts, under plain and yarn rotary positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import mla as mla_lib
from jaxpipe.models import rope as rope_lib
from jaxpipe.models.transformer import TransformerConfig

torch = pytest.importorskip("torch")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config  # noqa: E402

D, H, B, L = 64, 4, 2, 12
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=8,
    mscale=0.9,
    mscale_all_dim=1.1,
    beta_fast=32,
    beta_slow=1,
)


def _hf_config(q_lora_rank, interleave, yarn):
  rope = dict(rope_theta=500.0, **(YARN if yarn else {"rope_type": "default"}))
  return DeepseekV3Config(
      hidden_size=D,
      num_attention_heads=H,
      num_key_value_heads=H,
      q_lora_rank=q_lora_rank,
      kv_lora_rank=24,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=12,
      rope_interleave=interleave,
      rope_parameters=rope,
      max_position_embeddings=64,
      rms_norm_eps=1e-6,
      attn_implementation="eager",
  )


def _ours(hf, yarn):
  scaling = None
  if yarn:
    scaling = rope_lib.RopeScaling(
        type="yarn",
        factor=YARN["factor"],
        original_max_position=YARN["original_max_position_embeddings"],
        mscale=YARN["mscale"],
        mscale_all_dim=YARN["mscale_all_dim"],
        beta_fast=YARN["beta_fast"],
        beta_slow=YARN["beta_slow"],
    )
  cfg = TransformerConfig(
      vocab=32, d_model=D, n_heads=H, n_kv_heads=H, head_dim=16, norm_eps=1e-6, rope_theta=500.0,
      rope_scaling=scaling, attention="xla",
  )  # fmt: skip
  mla = mla_lib.MLAConfig(
      kv_lora_rank=24,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=12,
      q_lora_rank=hf.q_lora_rank,
      rope_interleave=hf.rope_interleave,
  )
  return mla_lib.LatentAttention(cfg, mla)


def _params(attn, q_lora_rank):
  """Our parameter tree from the torch module's weights (Linear: [out, in])."""
  w = lambda lin, *shape: jnp.asarray(lin.weight.detach().numpy().T.reshape(shape))
  p = {
      "kv_a": {"kernel": w(attn.kv_a_proj_with_mqa, D, 24 + 8)},
      "kv_a_norm": {"scale": jnp.asarray(attn.kv_a_layernorm.weight.detach().numpy())},
      "kv_b": {"kernel": w(attn.kv_b_proj, 24, H, 16 + 12)},
      "o": {"kernel": w(attn.o_proj, H, 12, D)},
  }
  if q_lora_rank is None:
    p["q"] = {"kernel": w(attn.q_proj, D, H, 24)}
  else:
    p["q_a"] = {"kernel": w(attn.q_a_proj, D, q_lora_rank)}
    p["q_a_norm"] = {"scale": jnp.asarray(attn.q_a_layernorm.weight.detach().numpy())}
    p["q_b"] = {"kernel": w(attn.q_b_proj, q_lora_rank, H, 24)}
  return {"params": p}


@pytest.mark.parametrize(
    "q_lora_rank, interleave, yarn",
    [(None, True, True), (20, False, False), (20, True, True)],  # each setting both ways
    ids=["q-plain-interleaved-yarn", "q-lora-halves-rope", "q-lora-interleaved-yarn"],
)
def test_latent_attention_equals_transformers(q_lora_rank, interleave, yarn):
  torch.manual_seed(0)
  hf = _hf_config(q_lora_rank, interleave, yarn)
  attn = deepseek.DeepseekV3Attention(hf, layer_idx=0).eval()
  with torch.no_grad():  # norms away from 1, so that a norm left out shows
    for norm in (attn.kv_a_layernorm, attn.q_a_layernorm):
      if norm is not None:
        norm.weight.uniform_(0.5, 1.5)
  rotary = deepseek.DeepseekV3RotaryEmbedding(hf)
  x = torch.randn(B, L, D, requires_grad=True)
  positions = torch.arange(L)[None].expand(B, L)
  causal = torch.full((L, L), float("-inf")).triu(1)[None, None].expand(B, 1, L, L)
  want, _ = attn(x, rotary(x, positions), causal)
  want.sum().backward()

  ours = _ours(hf, yarn)
  params = _params(attn, q_lora_rank)
  x_j = jnp.asarray(x.detach().numpy())
  f = lambda x: ours.apply(params, x, jnp.arange(L))
  got, vjp = jax.vjp(f, x_j)
  (dx,) = vjp(jnp.ones_like(got))
  np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(dx, x.grad.numpy(), rtol=2e-5, atol=2e-6)


def test_yarn_scales_the_scores_by_mscale_all_dim_squared():
  """transformers' yarn_apply_mscale: (0.1 · mscale_all_dim · ln(factor) + 1)^2 on
  qk_head_dim^-1/2; none without yarn's factor above 1."""
  m = mla_lib.MLAConfig(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
  yarn = rope_lib.RopeScaling(type="yarn", factor=40.0, original_max_position=4096,
                              mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
  assert mla_lib.score_scale(m, None) == pytest.approx(192**-0.5)
  assert mla_lib.score_scale(m, yarn) == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(kv_lora_rank=0), r"MLAConfig.kv_lora_rank=0 must be a positive integer"),
        (dict(q_lora_rank=0), r"MLAConfig.q_lora_rank=0 must be a positive integer or None"),
        (dict(qk_rope_head_dim=7), r"qk_rope_head_dim=7 must be even"),
        (dict(v_head_dim=64), r"v_head_dim=64 exceeds qk_nope_head_dim \+ qk_rope_head_dim = 24"),
    ],
)
def test_bad_widths_are_one_line(fields, match):
  with pytest.raises(ValueError, match=match):
    mla_lib.MLAConfig(**fields)


def test_the_latent_cache_holds_576_values_per_token_for_deepseek_v3():
  v3 = mla_lib.MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, q_lora_rank=1536)  # fmt: skip
  assert v3.cache_width == 576 and v3.qk_head_dim == 192


MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)


def _tiny_mla(**mesh):
  """configs/mla_tiny.py (DualPipe at pp = 2, MLA's widths as `MLA`), its mesh updated."""
  from configs import mla_tiny

  c = mla_tiny.get_config()
  assert c.model.mla.to_dict() == {**MLA, "rope_interleave": True}
  c.mesh.update(mesh)
  return c


def test_a_latent_attention_model_under_dualpipe_equals_the_unpipelined_step():
  """DeepSeek-V3's schedule on its attention: loss and every gradient of a DualPipe step at
  pp = 2 equal jax.value_and_grad of the unpipelined model."""
  from jaxpipe.models import transformer
  from jaxpipe.training.losses import data_parallel_loss_and_grads
  from jaxpipe.training.trainer import Trainer

  c = _tiny_mla()
  assert (c.mesh.pp, c.pipeline.schedule, c.pipeline.microbatches) == (2, "dualpipe", 4)
  trainer = Trainer(c)
  cfg = trainer.model_cfg
  assert isinstance(cfg.mla, mla_lib.MLAConfig)
  params = transformer.init_params(cfg, jax.random.key(0))
  assert "kv_b" in params["layers"]["attn"] and "k" not in params["layers"]["attn"]
  batch = trainer.batch(0)
  loss, grads, _ = jax.jit(trainer.loss_and_grads)(trainer.stored_params(params), batch)
  grads = trainer.model_params(grads)
  want_loss, want_grads, _ = jax.jit(data_parallel_loss_and_grads(cfg))(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    w = np.asarray(want[path])
    np.testing.assert_allclose(
        g, w, rtol=0, atol=1e-5 * np.max(np.abs(w)), err_msg=jax.tree_util.keystr(path)
    )


def test_what_does_not_run_latent_attention_yet_says_so_in_one_line():
  from jaxpipe.models import hf, transformer
  from jaxpipe.serve import Engine, EngineConfig
  from jaxpipe.training import config as config_lib
  from jaxpipe.training import plan

  with pytest.raises(config_lib.ConfigError, match=r"model.mla .* mesh.cp=1 and mesh.tp=2"):
    config_lib.validate(_tiny_mla(pp=1, tp=2), 8)
  with pytest.raises(ValueError, match=r"mla is set \(latent attention\) with qk_norm=True"):
    TransformerConfig(mla=MLA, qk_norm=True)
  cfg = config_lib.model_config(_tiny_mla())
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params)
  with pytest.raises(ValueError, match="not split over tensor-parallel devices; serve it on one"):
    Engine(cfg, params, devices=jax.devices()[:2], num_pages=8, page_size=4, max_seq_len=16)
  with pytest.raises(ValueError, match=r"mla_cache='compressed' is unknown; use one of"):
    EngineConfig(mla_cache="compressed")
  with pytest.raises(hf.CheckpointError, match=r"model.mla=MLAConfig\(.*has no counterpart"):
    hf.config_to_hf(cfg)
  with pytest.raises(config_lib.ConfigError, match="the layout planner models grouped-query"):
    plan.model_of(_tiny_mla())


def test_flops_count_the_latent_projections():
  """One layer, no MLP or head: q_a + q_b, kv_a, kv_b, o, and the causal half of the scores
  (q·k over 12 channels) and values (8 channels), 2 FLOPs per multiply-add, by hand."""
  from jaxpipe.models import flops

  cfg = TransformerConfig(vocab=1, d_model=32, n_layers=1, n_heads=2, d_ff=0, mla=MLA)
  l = 10
  q = 2 * l * (32 * 12 + 12 * 2 * 12)  # q_a, q_b
  kv = 2 * l * (32 * 20 + 16 * 2 * 16)  # kv_a (latent + rope key), kv_b (nope + v per head)
  o = 2 * l * 2 * 8 * 32
  attn = 2 * l * l * 2 * (12 + 8) // 2
  head = 2 * l * 32 * 1
  assert flops.forward_flops_per_sequence(cfg, l) == q + kv + o + attn + head


def test_latent_attention_with_experts_over_ep_and_zero1_follows_the_replicated_trajectory():
  """Three steps at ep = 2 x dp = 4 with ZeRO-1 and MoE FFNs give the losses of the replicated
  run (dp = 8, optimizer whole on every rank)."""
  import dataclasses

  import ml_collections

  from jaxpipe.models.moe import MoEConfig
  from jaxpipe.training.trainer import Trainer

  def losses(**changes):
    c = _tiny_mla(pp=1)
    c.pipeline.schedule, c.pipeline.microbatches = "1f1b", 1
    moe = MoEConfig(num_experts=4, top_k=2, d_ff=32, every=1)
    c.model.moe = ml_collections.ConfigDict(dataclasses.asdict(moe))
    c.update_from_flattened_dict(changes)
    trainer = Trainer(c)
    trainer.init()
    return [float(trainer.step()["loss"]) for _ in range(3)]

  want = losses()
  got = losses(**{"mesh.ep": 2, "optimizer.shard": "zero1"})
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  assert want[0] != want[2]  # it trained
