"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama's layers with biases on q, k and v; with
`use_sliding_window`, layers from `max_window_layers` on attend within `sliding_window`
(`layer_types` when config.json lists them)."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_dropout=0.0,
    num_key_value_heads=32,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    max_position_embeddings=32768,
)


def sliding(f: base.Fields, n_layers: int) -> dict:
  """sliding_window and layer_types as transformers' Qwen2 and Qwen3 derive them.

  With `use_sliding_window`, layers from `max_window_layers` on slide (unless config.json lists
  `layer_types`).

  Args:
    f: the config.json fields.
    n_layers: the model's layers.

  Returns:
    `dict(sliding_window=..., layer_types=...)` as `base.windows` gives it.

  Raises:
    CheckpointError: bad layer_types, or a missing field without a default.
  """
  window = f.get("sliding_window")  # read either way: without use_sliding_window it is moot
  window = window if f.get("use_sliding_window") else None
  first = f.get("max_window_layers")
  types = base.layer_types(f, n_layers)
  if types is None:
    types = tuple("sliding" if i >= first else "full" for i in range(n_layers))
  return base.windows(window, types)


def write_sliding(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets `layer_types`, `use_sliding_window` and `sliding_window` of config.json from cfg.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_layer_types(hf, cfg)
  hf["use_sliding_window"] = bool(cfg.sliding_window)
  if not cfg.sliding_window:
    hf["sliding_window"] = None


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Qwen2 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  theta, scaling = base.whole_rope(f, "Qwen2")
  fields = base.common(f)
  return transformer.TransformerConfig(
      **fields,
      **sliding(f, fields["n_layers"]),
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      qkv_bias=True,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Qwen2 config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  write_sliding(hf, cfg)
  hf["hidden_act"] = base.act_name(cfg)


FAMILY = base.Family("qwen2", "Qwen2ForCausalLM", DEFAULTS, read, write, base.dense_tensors)
