"""Quickstart with mixture-of-experts FFNs and expert parallelism: 8 experts over ep = 4 ranks.

  python -m jaxpipe.train --config configs/moe_quickstart.py --workdir /tmp/qs_moe

The quickstart model with an MoE FFN (8 SwiGLU experts, top-2, softmax router) in every second
layer; on 8 host devices the mesh is dp = 2 x ep = 4 and the batch is split over all 8. Metrics
add the routing statistics (moe_imbalance, moe_dropped_frac, moe_lb_loss, ...). Other routers:
--config.model.moe.router=sigmoid --config.model.moe.bias_update_rate=0.001 (DeepSeek-V3).
"""

import dataclasses

import ml_collections

from configs import quickstart
from jaxpipe.models.moe import MoEConfig


def get_config(arg=None):
  c = quickstart.get_config(arg)
  c.model.moe = ml_collections.ConfigDict(
      dataclasses.asdict(
          MoEConfig(
              num_experts=8, top_k=2, d_ff=192, every=2, dispatch="capacity", capacity_factor=1.25
          )
      )
  )
  c.mesh.ep = 4
  # Its layer groups in a loop: unrolled, the MoE step's temporaries are not what the layout
  # planner's fit predicts (docs/layout_planner.md).
  c.model.unroll_layers = 0
  return c
