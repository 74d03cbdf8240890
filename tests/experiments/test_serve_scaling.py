"""serve_bench --scaling: a prompt prefilled in k chunks takes k steps and gives the first token
the whole prompt gives; the tables' figures from known times."""

import jax

from experiments import serve_scaling
from jaxpipe.models import transformer
from tests import helpers


def test_chunked_prefill_takes_one_step_per_chunk():
  cfg = helpers.DENSE
  params = jax.jit(transformer.init_params, static_argnums=0)(cfg, jax.random.key(0))
  rows = serve_scaling.chunk_rows(cfg, params, context=32, chunks=(1, 4), repeats=1)
  assert [(r["chunks"], r["tokens"], r["steps"]) for r in rows] == [(1, 32, 1), (4, 8, 4)]
  assert all(r["s"] > 0 for r in rows)
  assert rows[1]["programs"] == 2  # its chunks end at 1, 1, 2 and 2 pages of 16


def test_tables_from_known_times():
  rows = [
      {"chunks": 1, "tokens": 4096, "steps": 1, "s": 2.0, "programs": 1},
      {"chunks": 4, "tokens": 1024, "steps": 4, "s": 3.0, "programs": 3},
  ]
  lines = serve_scaling.chunk_table(rows, forward_s=0.5).splitlines()
  assert lines[2] == "| 1 | 4,096 | 2.000 | 2.000 | 1.00 | 4.0 |"
  assert lines[3] == "| 4 | 1,024 | 3.000 | 0.750 | 1.50 | 6.0 |"
  grid = [{"batch": 4, "context": 256, "prefill_s": 0.5, "forward_s": 0.25, "decode_s": 0.02}]
  assert serve_scaling.grid_table(grid).splitlines()[2] == (
      "| 4 | 256 | 0.500 | 2,048 | 0.250 | 2.0 | 20.0 | 200 |"
  )
