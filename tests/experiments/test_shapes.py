"""`experiments.shapes`: each real shape has its checkpoint's published parameter count, and its
GEMMs (what step_profile and train_bench time) cover every weight matmul."""

import jax
import numpy as np
import pytest

from experiments import shapes
from experiments.shapes import SHAPES
from jaxpipe.models import transformer

# transformers' `num_parameters()` of each published checkpoint (tied embeddings counted once)
PUBLISHED = {"smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "llama3.2-1b": 1_235_814_400}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_real_shape_has_its_checkpoints_parameter_count(name):
  params = jax.eval_shape(lambda: transformer.init_params(SHAPES[name], jax.random.key(0)))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == PUBLISHED[name]


def test_the_gemms_are_the_models_weight_matmuls():
  cfg = SHAPES["toy"]
  got = shapes.gemms(cfg, 8)
  layer = sum(k * n for name, (_, k, n) in got.items() if name != "lm head")
  # every weight of a layer's attention and MLP, once
  d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  assert layer == d * (h + 2 * g) * k + h * k * d + 3 * d * f
  assert got["lm head"] == (8, d, cfg.vocab) and all(m == 8 for m, _, _ in got.values())
