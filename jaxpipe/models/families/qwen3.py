"""Qwen3 dense (`Qwen3ForCausalLM`): Llama's layers with a per-head RMSNorm of queries and keys
before rotary (`qk_norm`), `attention_bias` on q, k, v and o, and Qwen2's sliding windows."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base, qwen2

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    num_key_value_heads=32,
    head_dim=128,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    max_position_embeddings=32768,
)


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Qwen3 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  theta, scaling = base.whole_rope(f, "Qwen3")
  fields = base.common(f)
  bias = bool(f.get("attention_bias"))
  return transformer.TransformerConfig(
      **fields,
      **qwen2.sliding(f, fields["n_layers"]),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      qk_norm=True,
      qkv_bias=bias,
      o_bias=bias,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Qwen3 config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  qwen2.write_sliding(hf, cfg)
  hf.update(
      attention_bias=cfg.qkv_bias,
      hidden_act=base.act_name(cfg),
  )


FAMILY = base.Family("qwen3", "Qwen3ForCausalLM", DEFAULTS, read, write, base.dense_tensors)
