"""`experiments.step_profile`: its FLOP count of a decode step agrees with the model's analytic
forward FLOPs (`jaxpipe.models.flops`), and its GEMM timing covers every weight matmul."""

from experiments import step_profile
from experiments.shapes import SHAPES
from jaxpipe.models import flops


def test_a_decode_step_counts_the_forward_flops_of_its_tokens():
  cfg = SHAPES["smollm2-135m"]
  # one token attending itself: the forward pass of a one-token sequence, attention not halved
  assert step_profile.decode_flops(cfg, 1, 1) == flops.forward_flops_per_sequence(cfg, 1, False)
  # each more token of context adds its scores and values: 2 x 2 x heads x head_dim a layer
  extra = step_profile.decode_flops(cfg, 1, 101) - step_profile.decode_flops(cfg, 1, 1)
  assert extra == 100 * 4 * cfg.n_heads * cfg.head_dim * cfg.n_layers
  assert step_profile.decode_flops(cfg, 64, 1) == 64 * step_profile.decode_flops(cfg, 1, 1)


def test_the_gemms_are_the_models_weight_matmuls():
  cfg = SHAPES["toy"]
  shapes = step_profile.gemms(cfg, 8)
  layer = sum(k * n for name, (_, k, n) in shapes.items() if name != "lm head")
  # every weight of a layer's attention and MLP, once
  d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  assert layer == d * (h + 2 * g) * k + h * k * d + 3 * d * f
  assert shapes["lm head"] == (8, d, cfg.vocab) and all(m == 8 for m, _, _ in shapes.values())
