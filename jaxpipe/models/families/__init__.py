"""Hugging Face model families, one module each: its config.json reader and tensor names.

  FAMILIES["llama"].read(fields) -> TransformerConfig
  FAMILIES["phi3"].tensors(cfg)  -> every parameter leaf with its checkpoint tensors

Adding a family is adding a module here (a `FAMILY = base.Family(...)`) and its name below;
`jaxpipe.models.hf` reads and writes any of them.
"""

from jaxpipe.models.families import (
    deepseek_v2,
    deepseek_v3,
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from jaxpipe.models.families.base import CheckpointError, Family, Fields, Tensor

# in the order an export without a source config tries them: the first that computes the model
FAMILIES: dict[str, Family] = {
    m.FAMILY.model_type: m.FAMILY
    for m in (
        *(llama, qwen3, mistral, qwen2, phi3, gemma2, gemma3),
        *(mixtral, qwen3_moe, deepseek_v3, deepseek_v2),
    )
}

__all__ = ["FAMILIES", "CheckpointError", "Family", "Fields", "Tensor"]
