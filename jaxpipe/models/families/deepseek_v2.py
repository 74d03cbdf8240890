"""DeepSeek-V2 (`DeepseekV2ForCausalLM`, V2-Lite's shape too): DeepSeek-V3's latent attention,
dense first layers and experts stored one tensor each (`deepseek_v3`), with DeepSeek-V2's
router: a softmax over the experts, the top-k by score (`topk_method: greedy`) or within the
`topk_group` groups whose best expert scores highest (`group_limited_greedy`), the weights
times `routed_scaling_factor` and never renormalised (transformers' router drops
`norm_topk_prob`). Rotary channels come in interleaved pairs, as transformers rotates them.
"""

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.models.families import base, deepseek_v3

DEFAULTS = dict(
    vocab_size=102400,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    first_k_dense_replace=0,
    kv_lora_rank=512,
    q_lora_rank=1536,
    n_group=None,
    n_routed_experts=64,
    output_router_logits=False,
    n_shared_experts=2,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    routed_scaling_factor=1.0,
    topk_group=None,
    topk_method="greedy",
    v_head_dim=128,
    num_experts_per_tok=None,
    moe_intermediate_size=1407,
)
# what transformers derives whatever config.json says (head_dim, qk_head_dim), and what its
# router never reads (norm_topk_prob: the routed weights are not renormalised)
IGNORED = frozenset({"head_dim", "qk_head_dim", "norm_topk_prob"})
TOPK_METHODS = ("greedy", "group_limited_greedy")


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a DeepSeek-V2 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  method = f.get("topk_method")
  if method not in TOPK_METHODS:
    raise f.refuse("topk_method", f"DeepseekV2ForCausalLM routes by one of {TOPK_METHODS}")
  grouped = method == "group_limited_greedy"
  moe = moe_lib.MoEConfig(
      **deepseek_v3.routed_experts(f),
      router="softmax",
      norm_topk_prob=False,
      # the group's best expert scores it: the softmax router's group rule (`router.group_mask`)
      n_groups=(f.get("n_group") or 1) if grouped else 1,
      topk_groups=(f.get("topk_group") or 1) if grouped else 1,
  )
  if not grouped:  # read by the grouped method only
    f.get("n_group"), f.get("topk_group")
  return deepseek_v3.latent_model(f, "DeepSeek-V2", True, moe)


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a DeepSeek-V2 config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  if not deepseek_v3.write_latent(hf, cfg):
    return  # not a DeepSeek model: the caller's check names the difference
  e = cfg.moe
  if e.n_groups > 1:
    hf.update(topk_method="group_limited_greedy", n_group=e.n_groups, topk_group=e.topk_groups)
  else:
    hf["topk_method"] = "greedy"


FAMILY = base.Family(
    "deepseek_v2",
    "DeepseekV2ForCausalLM",
    DEFAULTS,
    read,
    write,
    deepseek_v3.tensors,
    ignored=IGNORED,
    moe=True,
)
