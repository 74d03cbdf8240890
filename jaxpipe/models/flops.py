"""Analytic model FLOPs, counted the way MaxText counts them (matmuls only, 2 FLOPs per MAC)."""

from jaxpipe.models.transformer import TransformerConfig


def forward_flops_per_sequence(cfg: TransformerConfig, seq_len: int, causal: bool = True) -> int:
  """Forward-pass FLOPs of one sequence.

  Matmuls only, 2 FLOPs per multiply-accumulate: the QKV and output projections, attention scores
  and values, the gated MLP of every dense layer, the router and the `top_k` routed plus the
  shared experts of every MoE layer (the FLOPs a token activates), and the output head. Causal
  attention counts only the unmasked half of the scores and values.

  Args:
    cfg: the model's shape (layers, widths, heads, vocabulary).
    seq_len: tokens in the sequence.
    causal: whether attention is causal (half the score and value FLOPs).

  Returns:
    The forward FLOPs of one sequence, as an int.
  """
  d, h, g, k, f, l = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, seq_len
  qkv = 2 * l * d * (h + 2 * g) * k
  out = 2 * l * h * k * d
  scores_and_values = 2 * 2 * l * l * h * k // (2 if causal else 1)
  if cfg.mla is not None:  # latent attention: its own projections and widths
    m = cfg.mla
    q = m.q_lora_rank
    qkv = 2 * l * (d * h * m.qk_head_dim if q is None else d * q + q * h * m.qk_head_dim)
    qkv += 2 * l * (d * m.cache_width + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim))
    out = 2 * l * h * m.v_head_dim * d
    scores_and_values = 2 * l * l * h * (m.qk_head_dim + m.v_head_dim) // (2 if causal else 1)
  mlp = 2 * l * d * f * 3
  head = 2 * l * d * cfg.vocab
  total = cfg.n_layers * (qkv + out + scores_and_values + mlp) + head
  if cfg.moe is not None:  # an MoE layer's FFN: the router, its top_k experts, the shared ones
    e = cfg.moe
    moe_mlp = 2 * l * d * e.num_experts + 2 * l * d * e.d_ff * 3 * (e.top_k + e.num_shared_experts)
    total += cfg.stack_units * (moe_mlp - mlp)
  return total


def training_flops_per_step(cfg: TransformerConfig, batch: int, seq_len: int) -> int:
  """FLOPs of one optimizer step: forward plus backward (twice the forward).

  Counts no recomputation; attention is causal.

  Args:
    cfg: the model's shape.
    batch: sequences in the step's global batch.
    seq_len: tokens per sequence.

  Returns:
    `3 * batch` times the forward FLOPs of one sequence, as an int.
  """
  return 3 * batch * forward_flops_per_sequence(cfg, seq_len)
