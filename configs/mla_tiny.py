"""The tiny model with multi-head latent attention (DeepSeek-V3's), under DualPipe at pp = 2.

  python -m jaxpipe.train --config configs/mla_tiny.py --workdir /tmp/mla

Every layer attends through a 16-wide key-value latent and a 4-channel rotary key shared by the
heads (docs/deepseek.md); each width can be set, e.g. --config.model.mla.kv_lora_rank=32.
"""

import dataclasses

import ml_collections

from configs import tiny
from jaxpipe.models.mla import MLAConfig


def get_config(arg=None):
  c = tiny.get_config(arg)
  mla = MLAConfig(
      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12
  )
  c.model.mla = ml_collections.ConfigDict(dataclasses.asdict(mla))
  c.mesh.pp = 2
  c.pipeline.schedule, c.pipeline.microbatches = "dualpipe", 4
  return c
