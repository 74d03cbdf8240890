"""Analytic model FLOPs, counted the way MaxText counts them (matmuls only, 2 FLOPs per MAC)."""

from jaxpipe.models.transformer import TransformerConfig


def forward_flops_per_sequence(cfg: TransformerConfig, seq_len: int, causal: bool = True) -> int:
  """Forward-pass FLOPs of one sequence; causal attention counts only the unmasked half."""
  d, h, g, k, f, l = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, seq_len
  qkv = 2 * l * d * (h + 2 * g) * k
  out = 2 * l * h * k * d
  scores_and_values = 2 * 2 * l * l * h * k // (2 if causal else 1)
  mlp = 2 * l * d * f * 3
  head = 2 * l * d * cfg.vocab
  return cfg.n_layers * (qkv + out + scores_and_values + mlp) + head


def training_flops_per_step(cfg: TransformerConfig, batch: int, seq_len: int) -> int:
  """Forward + backward (twice the forward) FLOPs of one optimizer step, without recomputation."""
  return 3 * batch * forward_flops_per_sequence(cfg, seq_len)
