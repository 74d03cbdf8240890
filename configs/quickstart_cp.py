"""Quickstart with context parallelism: the sequence split over cp = 2 ranks (Ulysses attention).

  python -m jaxpipe.train --config configs/quickstart_cp.py --workdir /tmp/qs_cp

The same as `--config configs/quickstart.py --config.mesh.cp=2`; on a CPU-only machine the
runner's 8 host devices become dp = 4 x cp = 2. Add `--config.model.cp_overlap=True` to fuse
the attention projections with the all-to-alls (a chunked ppermute ring, same parameters and
checkpoints).
"""

from configs import quickstart


def get_config(arg=None):
  c = quickstart.get_config(arg)
  c.mesh.cp = 2
  return c
