"""The model shapes the benches run at: a toy Llama and real Llamas' sizes.

Random weights of these shapes stand in for the checkpoints: speed depends on the shapes alone.
smollm2-135m and smollm2-360m are SmolLM2-135M's and SmolLM2-360M's (tied embeddings,
vocabulary 49,152); llama3.2-1b is Llama 3.2 1B's (vocabulary 128,256, tied) without its rope
scaling, which changes no cost. `gemms`: the weight GEMMs a step of a shape runs, as the benches
time them.
"""

from __future__ import annotations

from jaxpipe.models import transformer

SHAPES = {
    "toy": transformer.TransformerConfig(
        vocab=1024,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        d_ff=1024,
        norm_eps=1e-5,
        tied_embeddings=False,
    ),
    "smollm2-135m": transformer.TransformerConfig(
        vocab=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        norm_eps=1e-5,
        rope_theta=100_000.0,
        tied_embeddings=True,
    ),
    "smollm2-360m": transformer.TransformerConfig(
        vocab=49152,
        d_model=960,
        n_layers=32,
        n_heads=15,
        n_kv_heads=5,
        head_dim=64,
        d_ff=2560,
        norm_eps=1e-5,
        rope_theta=100_000.0,
        tied_embeddings=True,
    ),
    "llama3.2-1b": transformer.TransformerConfig(
        vocab=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        tied_embeddings=True,
    ),
}


def gemms(cfg: transformer.TransformerConfig, m: int) -> dict[str, tuple[int, int, int]]:
  """The model's weight GEMMs for m tokens, as (M, K, N), as an engine's prepacked layers run
  them: q, k and v one product, gate and up one (`layers.dense_group`).

  Args:
    cfg: the model's shape.
    m: tokens in the step.

  Returns:
    {name: (M, K, N)}, each once per layer but the head.
  """
  d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  return {
      "q+k+v": (m, d, (h + 2 * g) * k),
      "attention out": (m, h * k, d),
      "gate+up": (m, d, 2 * f),
      "down": (m, f, d),
      "lm head": (m, d, cfg.vocab),
  }
