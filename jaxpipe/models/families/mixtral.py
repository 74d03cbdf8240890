"""Mixtral (`MixtralForCausalLM`): Mistral's attention with an MoE FFN in every layer (softmax
router, top-k renormalised), experts stored one tensor each as w1 (gate), w3 (up), w2 (down)."""

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_dropout=0.0,
    num_key_value_heads=8,
    num_experts_per_tok=2,
    num_local_experts=8,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    router_jitter_noise=0.0,
    sliding_window=None,
    max_position_embeddings=4096 * 32,
)
EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}


def aux_loss_coef(f: base.Fields) -> float:
  """The load-balancing loss coefficient transformers trains with.

  transformers adds the pooled load-balancing loss only with output_router_logits.

  Args:
    f: the config.json fields.

  Returns:
    `router_aux_loss_coef` with `output_router_logits`, else 0.0.
  """
  coef = float(f.get("router_aux_loss_coef"))
  return coef if f.get("output_router_logits") else 0.0


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Mixtral config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  f.require("router_jitter_noise", lambda v: not v, "the LM's router takes no jitter", 0.0)
  theta, scaling = base.whole_rope(f, "Mixtral")
  moe = moe_lib.MoEConfig(
      num_experts=f.get("num_local_experts"),
      top_k=f.get("num_experts_per_tok"),
      router="softmax",
      d_ff=f.get("intermediate_size"),
      norm_topk_prob=True,
      norm_top1=True,
      lb_loss_coef=aux_loss_coef(f),
      lb_loss_form="pooled",
      z_loss_coef=0.0,
  )
  return transformer.TransformerConfig(
      **base.common(f),
      **base.windows(f.get("sliding_window"), None),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      moe=moe,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Mixtral config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  m = cfg.moe
  hf.update(
      intermediate_size=m.d_ff,
      num_experts_per_tok=m.top_k,
      num_local_experts=m.num_experts,
      sliding_window=cfg.sliding_window or None,
      hidden_act=base.act_name(cfg),
  )


def tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """Every parameter leaf of a Mixtral model with its checkpoint tensors.

  Args:
    cfg: the model.

  Returns:
    The `Tensor`s of every leaf.
  """
  return base.moe_tensors(cfg, "block_sparse_moe.", EXPERTS)


FAMILY = base.Family("mixtral", "MixtralForCausalLM", DEFAULTS, read, write, tensors, moe=True)
