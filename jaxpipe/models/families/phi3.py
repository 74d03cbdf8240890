"""Phi-3 and Phi-3.5 (`Phi3ForCausalLM`): Llama's layers with q, k and v fused into one
`qkv_proj` and gate and up into one `gate_up_proj` (split into jaxpipe's leaves on import, fused
again on export), a sliding window on every layer when `sliding_window` is set (Phi-3-mini-4k:
2047), `longrope` (Phi-3.5, the 128k models) and partial rotary (`partial_rotary_factor`)."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-5,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    sliding_window=None,
    max_position_embeddings=4096,
    original_max_position_embeddings=4096,
)
NAMES = base.Names(qkv="qkv_proj", gate_up="gate_up_proj")


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Phi-3 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f, "attention_dropout", "resid_pdrop", "embd_pdrop")
  theta, scaling, fraction = base.rope(f)
  f.used.add("original_max_position_embeddings")  # read by the rotary variants that use it
  return transformer.TransformerConfig(
      **base.common(f),
      **base.windows(f.get("sliding_window"), None),
      rope_theta=theta,
      rope_scaling=scaling,
      rope_fraction=fraction,
      activation=base.activation(f),
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Phi-3 config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  hf.update(
      hidden_act=base.act_name(cfg),
      sliding_window=cfg.sliding_window or None,
  )


def tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """Every parameter leaf of a Phi-3 model with its checkpoint tensors.

  q, k, v and gate, up are rows of the fused `qkv_proj` and `gate_up_proj`.

  Args:
    cfg: the model.

  Returns:
    The `Tensor`s of every leaf.
  """
  return base.dense_tensors(cfg, NAMES)


FAMILY = base.Family("phi3", "Phi3ForCausalLM", DEFAULTS, read, write, tensors)
