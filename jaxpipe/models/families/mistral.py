"""Mistral (`MistralForCausalLM`): Llama's layers with a sliding window on every layer when
`sliding_window` is set (Mistral 7B v0.1: 4096; v0.2 and later: null)."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_dropout=0.0,
    num_key_value_heads=8,
    sliding_window=4096,
    max_position_embeddings=4096 * 32,
)


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Mistral config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  theta, scaling = base.whole_rope(f, "Mistral")
  f.used.add("layer_types")  # transformers' Mistral warns and ignores them
  return transformer.TransformerConfig(
      **base.common(f),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      sliding_window=f.get("sliding_window") or 0,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Mistral config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  hf.update(
      hidden_act=base.act_name(cfg),
      sliding_window=cfg.sliding_window or None,
  )


FAMILY = base.Family("mistral", "MistralForCausalLM", DEFAULTS, read, write, base.dense_tensors)
