"""`experiments.step_profile`: its FLOP count of a decode step agrees with the model's analytic
forward FLOPs (`jaxpipe.models.flops`)."""

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
