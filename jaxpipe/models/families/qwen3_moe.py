"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms) with an MoE FFN every
`decoder_sparse_step` layers (the others dense), top-k renormalised when `norm_topk_prob`."""

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.models.families import base, mixtral

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    num_key_value_heads=4,
    use_sliding_window=False,
    sliding_window=4096,
    decoder_sparse_step=1,
    norm_topk_prob=False,
    mlp_only_layers=[],
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    max_position_embeddings=32768,
)
EXPERTS = {n: f"{n}_proj" for n in ("gate", "up", "down")}


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Qwen3-MoE config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  f.require(
      "mlp_only_layers",
      lambda v: not v,
      "dense layers are placed by decoder_sparse_step alone (moe.every)",
      [],
  )
  theta, scaling = base.whole_rope(f, "Qwen3-MoE")
  renorm = bool(f.get("norm_topk_prob"))
  moe = moe_lib.MoEConfig(
      # transformers maps num_experts onto num_local_experts and writes the latter
      num_experts=f.get("num_local_experts", None) or f.get("num_experts"),
      top_k=f.get("num_experts_per_tok"),
      router="softmax",
      d_ff=f.get("moe_intermediate_size"),
      norm_topk_prob=renorm,
      norm_top1=renorm,
      lb_loss_coef=mixtral.aux_loss_coef(f),
      lb_loss_form="pooled",
      z_loss_coef=0.0,
      every=f.get("decoder_sparse_step"),
  )
  window = f.get("sliding_window")  # read either way: without use_sliding_window it is moot
  window = window if f.get("use_sliding_window") else None
  f.used.add("max_window_layers")  # older configs; transformers' Qwen3-MoE slides every layer
  bias = bool(f.get("attention_bias"))
  return transformer.TransformerConfig(
      **base.common(f),
      **base.windows(window, None),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      qk_norm=True,
      qkv_bias=bias,
      o_bias=bias,
      moe=moe,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Qwen3-MoE config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  m = cfg.moe
  hf.update(
      num_experts_per_tok=m.top_k,
      moe_intermediate_size=m.d_ff,
      norm_topk_prob=m.norm_topk_prob,
      decoder_sparse_step=m.every,
      use_sliding_window=bool(cfg.sliding_window),
      attention_bias=cfg.qkv_bias,
      hidden_act=base.act_name(cfg),
  )
  hf["num_experts" if "num_experts" in hf else "num_local_experts"] = m.num_experts
  if cfg.sliding_window:
    hf["sliding_window"] = cfg.sliding_window


def tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """Every parameter leaf of a Qwen3-MoE model with its checkpoint tensors.

  Args:
    cfg: the model.

  Returns:
    The `Tensor`s of every leaf.
  """
  return base.moe_tensors(cfg, "mlp.", EXPERTS)


FAMILY = base.Family("qwen3_moe", "Qwen3MoeForCausalLM", DEFAULTS, read, write, tensors, moe=True)
