"""`experiments.shapes`: each real shape has its checkpoint's published parameter count."""

import jax
import numpy as np
import pytest

from experiments.shapes import SHAPES
from jaxpipe.models import transformer

# transformers' `num_parameters()` of each published checkpoint (tied embeddings counted once)
PUBLISHED = {"smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "llama3.2-1b": 1_235_814_400}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_real_shape_has_its_checkpoints_parameter_count(name):
  shapes = jax.eval_shape(lambda: transformer.init_params(SHAPES[name], jax.random.key(0)))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == PUBLISHED[name]
