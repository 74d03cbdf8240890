"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2's layers with
q/k norms (1 + w) instead of score soft-capping, five sliding-window layers to each global one
by default, and a rotary base of their own for the sliding layers (rope_local_base_freq,
unscaled) while the global ones take rope_theta with its scaling (linear 8 in 4B and up)."""

from jaxpipe.models import transformer
from jaxpipe.models.families import base, gemma2

DEFAULTS = dict(
    gemma2.DEFAULTS,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    use_bidirectional_attention=False,
    max_position_embeddings=131_072,
)


def _local_theta(f: base.Fields) -> float:
  """The sliding layers' rotary base: rope_parameters['sliding_attention'] (transformers 5),
  else rope_local_base_freq; refused if it is scaled."""
  params = f.given("rope_parameters") or {}
  local = params.get("sliding_attention") if "sliding_attention" in params else None
  if local is None:
    return float(f.get("rope_local_base_freq"))
  kind = local.get("rope_type", local.get("type", "default"))
  if kind != "default":
    raise base.CheckpointError(
        f"config.json: rope_parameters['sliding_attention']={local!r} is not implemented "
        "(the sliding layers' rotary is unscaled); jaxpipe reads rope_type 'default'"
    )
  return float(local.get("rope_theta", f.get("rope_local_base_freq")))


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a Gemma 3 text config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  theta, scaling = base.whole_rope(f, "Gemma 3", DEFAULTS["rope_theta"], "full_attention")
  pattern = f.get("sliding_window_pattern")
  return transformer.TransformerConfig(
      **gemma2.gemma_fields(f, pattern=pattern),
      rope_theta=theta,
      rope_scaling=scaling,
      rope_local_theta=_local_theta(f),
      qk_norm=True,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a Gemma 3 text config.json to cfg's.

  The sliding layers' rotary base goes to `rope_parameters['sliding_attention']` in
  transformers 5's layout, else to `rope_local_base_freq`.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  nested = "rope_parameters" in hf or "rope_theta" not in hf  # transformers 5's layout
  gemma2.write_gemma(hf, cfg)
  local = cfg.rope_local_theta or cfg.rope_theta
  if nested:
    hf["rope_parameters"] = {
        "full_attention": hf["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
  else:
    hf["rope_local_base_freq"] = local


FAMILY = base.Family(
    "gemma3_text", "Gemma3ForCausalLM", DEFAULTS, read, write, gemma2.tensors, gemma2.IGNORED
)
