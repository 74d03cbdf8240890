"""DeepSeek-V3's MoE FFN (transformers' `DeepseekV3MoE`) computed by jaxpipe's MoE layer: the
sigmoid router with its score-correction bias steering the choice only, group-limited top-k
(groups scored by their two best experts), the chosen weights renormalised and scaled by
`routed_scaling_factor`, and the shared experts."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import moe as moe_lib

torch = pytest.importorskip("torch")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config  # noqa: E402

D, E, F, T = 32, 16, 24, 40


def _hf(n_group, topk_group, norm):
  return DeepseekV3Config(
      hidden_size=D,
      n_routed_experts=E,
      num_experts_per_tok=4,
      moe_intermediate_size=F,
      n_shared_experts=2,
      n_group=n_group,
      topk_group=topk_group,
      norm_topk_prob=norm,
      routed_scaling_factor=2.5,
  )


def _params(block):
  """jaxpipe's MoE params from the torch block (Linear weights are [out, in])."""
  t = lambda x: np.asarray(x.detach().numpy(), np.float32)
  gate_up_ExFxD = t(block.experts.gate_up_proj)  # [E, 2F, D]: gate rows, then up rows
  return {
      "router_DxE": jnp.asarray(t(block.gate.weight).T),
      "expert_bias_E": jnp.asarray(t(block.gate.e_score_correction_bias)),
      "wi_gate_ExDxF": jnp.asarray(gate_up_ExFxD[:, :F].transpose(0, 2, 1)),
      "wi_up_ExDxF": jnp.asarray(gate_up_ExFxD[:, F:].transpose(0, 2, 1)),
      "wo_ExFxD": jnp.asarray(t(block.experts.down_proj).transpose(0, 2, 1)),
      "shared_gate_DxS": jnp.asarray(t(block.shared_experts.gate_proj.weight).T),
      "shared_up_DxS": jnp.asarray(t(block.shared_experts.up_proj.weight).T),
      "shared_down_SxD": jnp.asarray(t(block.shared_experts.down_proj.weight).T),
  }


@pytest.mark.parametrize(
    "n_group, topk_group, norm", [(4, 2, True), (1, 1, False)], ids=["groups", "no-groups-raw"]
)
def test_the_moe_layer_equals_deepseek_v3s(n_group, topk_group, norm):
  torch.manual_seed(0)
  block = deepseek.DeepseekV3MoE(_hf(n_group, topk_group, norm)).eval()
  with torch.no_grad():
    for p in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
      p.normal_(0.0, 0.3)
    # a bias large enough to change choices: it steers which experts run, not their weights
    block.gate.e_score_correction_bias.normal_(0.0, 0.5)
  x = torch.randn(1, T, D)
  with torch.no_grad():
    want = block(x)[0].numpy()
    _, _, chosen = block.gate(x)
  cfg = moe_lib.MoEConfig(
      num_experts=E,
      top_k=4,
      d_ff=F,
      num_shared_experts=2,
      router="sigmoid",
      norm_topk_prob=norm,
      routed_scaling=2.5,
      n_groups=n_group,
      topk_groups=topk_group,
      lb_loss_coef=0.0,
      z_loss_coef=0.0,
  )
  params = _params(block)
  got, aux = moe_lib.moe_layer(cfg, params, jnp.asarray(x.numpy()), mesh=None)
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
  counts = np.bincount(chosen.numpy().ravel(), minlength=E)
  np.testing.assert_array_equal(aux["tokens_per_expert"], counts)
