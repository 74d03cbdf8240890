"""A seconds-long smoke run on synthetic data (the test suite's model).

  python -m jaxpipe.train --config configs/tiny.py --workdir /tmp/tiny

Tests shrink it further through overrides; on its own it trains in seconds on CPU.
"""

from jaxpipe.training.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  c.model.vocab = 64
  c.model.d_model = 32
  c.model.n_layers = 2
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 8
  c.model.d_ff = 64
  c.data.source = "synthetic"
  c.data.seq_len = 16
  c.data.batch = 16
  c.optimizer.lr = 1e-2
  c.optimizer.warmup_steps = 2
  c.train.steps = 20
  c.train.log_every = 5
  c.train.eval_every = 10
  c.train.eval_batches = 2
  c.checkpoint.every = 10
  return c
