"""Llama 1 to 3.3 (`LlamaForCausalLM`): RMSNorm, SwiGLU, grouped-query attention, any rotary
variant (Llama 3.1+ set `llama3`); `attention_bias` puts biases on q, k, v and o, `mlp_bias` on
the FFN. Also the family a dense model trained from scratch exports as."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
    max_position_embeddings=2048,
)


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Llama config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  theta, scaling = base.whole_rope(f, "Llama")
  bias = bool(f.get("attention_bias"))
  return transformer.TransformerConfig(
      **base.common(f),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      qkv_bias=bias,
      o_bias=bias,
      mlp_bias=bool(f.get("mlp_bias")),
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Llama config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  hf.update(
      attention_bias=cfg.qkv_bias,
      mlp_bias=cfg.mlp_bias,
      hidden_act=base.act_name(cfg),
  )


FAMILY = base.Family("llama", "LlamaForCausalLM", DEFAULTS, read, write, base.dense_tensors)
