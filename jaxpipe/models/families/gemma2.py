"""Gemma 2 (`Gemma2ForCausalLM`): embeddings times sqrt(d_model), RMSNorm scaling by 1 + w, a
norm before and after each sublayer, GELU-tanh gated FFN, scores scaled by
query_pre_attn_scalar^-1/2 and soft-capped, final logits soft-capped, sliding-window layers
alternating with global ones (`layer_types`; layer 0 slides)."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
    attention_bias=False,
    attention_dropout=0.0,
    num_key_value_heads=4,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
    use_bidirectional_attention=None,
    max_position_embeddings=8192,
)
NAMES = base.Names(
    attn_norm="input_layernorm",
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
)
# transformers' Gemma reads hidden_activation; checkpoints often carry hidden_act beside it
IGNORED = frozenset({"hidden_act"})


def gemma_fields(f: base.Fields, pattern: int) -> dict:
  """What Gemma 2 and 3 share beside the rotary fields.

  When config.json lists no layer_types, layer i slides unless (i + 1) is a multiple of
  `pattern`.

  Args:
    f: the config.json fields.
    pattern: one global layer in every `pattern` layers.

  Returns:
    TransformerConfig keyword arguments (all but the rotary ones).

  Raises:
    CheckpointError: dropout, bidirectional attention, bad layer_types, an activation jaxpipe
      does not compute, or a missing field without a default.
  """
  base.no_dropout(f)
  f.require("use_bidirectional_attention", lambda v: not v, "attention is causal", False)
  fields = base.common(f)
  n = fields["n_layers"]
  types = base.layer_types(f, n)
  if types is None:
    types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))
  bias = bool(f.get("attention_bias"))
  return dict(
      **fields,
      **base.windows(f.get("sliding_window"), types),
      activation=base.activation(f, "hidden_activation"),
      norm_plus_one=True,
      sandwich_norm=True,
      embed_scale=True,
      attn_scale_dim=float(f.get("query_pre_attn_scalar")),
      attn_softcap=float(f.get("attn_logit_softcapping") or 0.0),
      final_softcap=float(f.get("final_logit_softcapping") or 0.0),
      qkv_bias=bias,
      o_bias=bias,
  )


def write_gemma(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Gemma 2 config.json to cfg's.

  Also used by Gemma 3. Leaves one activation field, `hidden_activation`.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  base.write_common(hf, cfg)
  base.write_layer_types(hf, cfg)
  hf.update(
      hidden_activation=base.act_name(cfg),
      query_pre_attn_scalar=_number(cfg.attn_scale_dim or cfg.head_dim),
      attn_logit_softcapping=cfg.attn_softcap or None,
      final_logit_softcapping=cfg.final_softcap or None,
      attention_bias=cfg.qkv_bias,
  )
  hf.pop("hidden_act", None)  # ignored by transformers' Gemma; one activation field, not two


def _number(x: float) -> int | float:
  """x as config.json spells it: transformers' Gemma configs type query_pre_attn_scalar int."""
  return int(x) if float(x).is_integer() else x


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Gemma 2 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  theta, scaling = base.whole_rope(f, "Gemma 2")
  return transformer.TransformerConfig(
      **gemma_fields(f, pattern=2), rope_theta=theta, rope_scaling=scaling
  )


def tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """Every parameter leaf of a Gemma 2 model with its checkpoint tensors.

  Names its norms as Gemma does (a norm before and after each sublayer).

  Args:
    cfg: the model.

  Returns:
    The `Tensor`s of every leaf.
  """
  return base.dense_tensors(cfg, NAMES)


FAMILY = base.Family("gemma2", "Gemma2ForCausalLM", DEFAULTS, read, write_gemma, tensors, IGNORED)
