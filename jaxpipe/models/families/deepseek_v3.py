"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention in every layer, a dense FFN
in the first `first_k_dense_replace` layers and an MoE FFN in the rest (the sigmoid router with
its score-correction bias, group-limited top-k, `routed_scaling_factor`, shared experts),
experts stored one tensor each.

Multi-token prediction modules (`num_nextn_predict_layers`) are read where the checkpoint holds
them, as DeepSeek's does: module k's layer `model.layers.{num_hidden_layers + k - 1}.*` (an MoE
layer) with its `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` beside it, and copies of the
shared embedding and head (`embed_tokens`, `shared_head.head`), which are written but not read,
as transformers' `MtpModel` takes the main model's. A checkpoint without them (transformers'
`save_pretrained` writes none) gives a model without modules (`model.mtp_depth` 0).
"""

import dataclasses

import numpy as np

from jaxpipe.models import mla as mla_lib
from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.models.families import base

DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    attention_bias=False,
    attention_dropout=0.0,
    num_nextn_predict_layers=1,
    output_router_logits=False,
)
# what transformers derives in __post_init__ whatever config.json says: head_dim (the rotary
# width, qk_rope_head_dim) and qk_head_dim (nope + rope)
IGNORED = frozenset({"head_dim", "qk_head_dim"})
EXPERTS = {n: f"{n}_proj" for n in ("gate", "up", "down")}
BIAS = "e_score_correction_bias"  # the router's choice-only bias (a buffer in transformers)


def read(f: base.Fields) -> transformer.TransformerConfig:
  """The `TransformerConfig` of a DeepSeek-V3 config.json.

  Args:
    f: the config.json fields.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  moe = moe_lib.MoEConfig(
      **routed_experts(f),
      router="sigmoid",
      norm_topk_prob=bool(f.get("norm_topk_prob")),
      n_groups=f.get("n_group") or 1,
      topk_groups=f.get("topk_group") or 1,
  )
  f.get("num_nextn_predict_layers")  # the modules' count, if the tensors are there (mtp_depth)
  return latent_model(f, "DeepSeek-V3", bool(f.get("rope_interleave")), moe)


def routed_experts(f: base.Fields) -> dict:
  """The `MoEConfig` fields DeepSeek-V2 and V3 spell alike: experts, shared experts, scaling,
  and no auxiliary loss (neither transformers class computes one).

  Args:
    f: the config.json fields.

  Returns:
    `MoEConfig` keyword arguments.
  """
  f.get("output_router_logits")  # adds no loss: neither causal LM computes one
  top_k = f.get("num_experts_per_tok")
  if top_k is None:  # DeepSeek-V2's default: a config must name it
    raise base.CheckpointError(
        f"config.json: field 'num_experts_per_tok' is missing; model_type {f.model_type!r} "
        "needs the experts each token uses"
    )
  return dict(
      num_experts=f.get("n_routed_experts"),
      top_k=top_k,
      d_ff=f.get("moe_intermediate_size"),
      num_shared_experts=f.get("n_shared_experts") or 0,
      routed_scaling=float(f.get("routed_scaling_factor")),
      lb_loss_coef=0.0,
      z_loss_coef=0.0,
  )


def latent_model(
    f: base.Fields, family: str, rope_interleave: bool, moe: moe_lib.MoEConfig
) -> transformer.TransformerConfig:
  """A DeepSeek model: latent attention in every layer, `first_k_dense_replace` dense layers,
  then `moe`'s FFN.

  Args:
    f: the config.json fields.
    family: the family's name, for messages.
    rope_interleave: whether the rotary channels come in interleaved pairs.
    moe: the MoE FFN.

  Returns:
    The model's `TransformerConfig`.

  Raises:
    CheckpointError: a field jaxpipe does not compute, or a missing one without a default.
  """
  base.no_dropout(f)
  f.require("attention_bias", lambda v: not v, "the latent attention has no biases", False)
  f.require("mlp_bias", lambda v: not v, "the FFNs have no biases", False)
  heads = f.get("num_attention_heads")
  f.require(
      "num_key_value_heads",
      lambda v: v is None or v == heads,
      "latent attention expands keys and values for every query head",
      heads,
  )
  theta, scaling = base.whole_rope(f, family)
  mla = mla_lib.MLAConfig(
      kv_lora_rank=f.get("kv_lora_rank"),
      qk_nope_head_dim=f.get("qk_nope_head_dim"),
      qk_rope_head_dim=f.get("qk_rope_head_dim"),
      v_head_dim=f.get("v_head_dim"),
      q_lora_rank=f.get("q_lora_rank"),
      rope_interleave=rope_interleave,
  )
  common = base.common(f)
  common.update(head_dim=mla.qk_rope_head_dim, n_kv_heads=heads)
  return transformer.TransformerConfig(
      **common,
      rope_theta=theta,
      rope_scaling=scaling,
      activation=base.activation(f),
      mla=mla,
      moe=moe,
      first_dense=f.get("first_k_dense_replace") or 0,
  )


def write(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields of a DeepSeek-V3 config.json to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  if not write_latent(hf, cfg):
    return  # not a DeepSeek model: the caller's check names the difference
  hf.update(
      rope_interleave=cfg.mla.rope_interleave,
      norm_topk_prob=cfg.moe.norm_topk_prob,
      n_group=cfg.moe.n_groups,
      topk_group=cfg.moe.topk_groups,
  )
  if cfg.mtp_depth or "num_nextn_predict_layers" not in hf:
    hf["num_nextn_predict_layers"] = cfg.mtp_depth


def write_latent(hf: dict, cfg: transformer.TransformerConfig) -> bool:
  """Sets the fields DeepSeek-V2 and V3 spell alike to cfg's.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.

  Returns:
    Whether cfg has latent attention and experts (else only the common fields are set).
  """
  base.write_common(hf, cfg)
  m, e = cfg.mla, cfg.moe
  if m is None or e is None:
    return False
  hf.update(
      num_key_value_heads=cfg.n_heads,
      head_dim=m.qk_rope_head_dim,
      qk_head_dim=m.qk_head_dim,
      kv_lora_rank=m.kv_lora_rank,
      q_lora_rank=m.q_lora_rank,
      qk_rope_head_dim=m.qk_rope_head_dim,
      qk_nope_head_dim=m.qk_nope_head_dim,
      v_head_dim=m.v_head_dim,
      n_routed_experts=e.num_experts,
      num_experts_per_tok=e.top_k,
      moe_intermediate_size=e.d_ff,
      n_shared_experts=e.num_shared_experts,
      routed_scaling_factor=e.routed_scaling,
      first_k_dense_replace=cfg.first_dense,
      hidden_act=base.act_name(cfg),
  )
  return True


def mtp_depth(hf: dict, names: set) -> int:
  """The MTP modules a checkpoint holds: config.json's count where module 1's projection is
  among its tensors, else 0.

  Args:
    hf: config.json.
    names: the checkpoint's tensor names.

  Returns:
    The modules to read (`model.mtp_depth`).
  """
  n = hf.get("num_hidden_layers", DEFAULTS["num_hidden_layers"])
  if f"model.layers.{n}.eh_proj.weight" not in names:
    return 0
  return hf.get("num_nextn_predict_layers", DEFAULTS["num_nextn_predict_layers"]) or 0


def attention_tensors(cfg, prefix, layers) -> list[base.Tensor]:
  """One decoder layer's norms and latent attention.

  Args:
    cfg: the model, with `cfg.mla`.
    prefix: keys of the layer's leaves in the params dict.
    layers: the layer index at each position of the leaves' stack axes.

  Returns:
    Their `Tensor`s.
  """
  d, h, m = cfg.d_model, cfg.n_heads, cfg.mla
  p, a = "model.layers.{i}.", "model.layers.{i}.self_attn."
  at = lambda *keys: prefix + ("attn",) + keys
  linear = lambda leaf, name, out, inp: base.linear(at(leaf, "kernel"), a + name, layers, out, inp)
  norm = lambda path, name, width: base.vector(path, name + ".weight", layers, (width,))
  out = [
      norm(prefix + ("attn_norm", "scale"), p + "input_layernorm", d),
      norm(prefix + ("mlp_norm", "scale"), p + "post_attention_layernorm", d),
      linear("kv_a", "kv_a_proj_with_mqa.weight", (m.cache_width,), (d,)),
      norm(at("kv_a_norm", "scale"), a + "kv_a_layernorm", m.kv_lora_rank),
      linear("kv_b", "kv_b_proj.weight", (h, m.qk_nope_head_dim + m.v_head_dim), (m.kv_lora_rank,)),
      linear("o", "o_proj.weight", (d,), (h, m.v_head_dim)),
  ]
  if m.q_lora_rank is None:
    return out + [linear("q", "q_proj.weight", (h, m.qk_head_dim), (d,))]
  return out + [
      linear("q_a", "q_a_proj.weight", (m.q_lora_rank,), (d,)),
      norm(at("q_a_norm", "scale"), a + "q_a_layernorm", m.q_lora_rank),
      linear("q_b", "q_b_proj.weight", (h, m.qk_head_dim), (m.q_lora_rank,)),
  ]


def moe_layer_tensors(cfg, prefix, layers) -> list[base.Tensor]:
  """MoE decoder layers: norms, latent attention, router with its bias, experts, shared experts.

  Args:
    cfg: the model, with `cfg.mla` and `cfg.moe`.
    prefix: keys of the layer's leaves in the params dict (a `Block(moe=True)`'s).
    layers: the layer index at each position of the leaves' stack axes.

  Returns:
    Their `Tensor`s.
  """
  e, d = cfg.moe, cfg.d_model
  w, at = prefix + ("moe",), "model.layers.{i}.mlp."
  s = e.num_shared_experts * e.d_ff
  expert = lambda leaf, name, shape: base.Tensor(
      w + (leaf,), at + "experts.{e}." + EXPERTS[name] + ".weight", layers, e.num_experts, shape, 1
  )
  shared = lambda leaf, name, out, inp: base.linear(
      w + (leaf,), at + f"shared_experts.{name}_proj.weight", layers, out, inp
  )
  out = attention_tensors(cfg, prefix, layers) + [
      base.linear(w + ("router_DxE",), at + "gate.weight", layers, (e.num_experts,), (d,)),
      expert("wi_gate_ExDxF", "gate", (d, e.d_ff)),
      expert("wi_up_ExDxF", "up", (d, e.d_ff)),
      expert("wo_ExFxD", "down", (e.d_ff, d)),
  ]
  if e.router == "sigmoid":  # V3's choice-only bias
    out.append(base.vector(w + ("expert_bias_E",), at + "gate." + BIAS, layers, (e.num_experts,)))
  if s:
    out += [
        shared("shared_gate_DxS", "gate", (s,), (d,)),
        shared("shared_up_DxS", "up", (s,), (d,)),
        shared("shared_down_SxD", "down", (d,), (s,)),
    ]
  return out


def mtp_tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """The multi-token prediction modules (`jaxpipe.models.mtp`), one layer index each after the
  model's, and their copies of the shared embedding and head.

  Args:
    cfg: the model, with `mtp_depth` > 0.

  Returns:
    Their `Tensor`s.
  """
  d, v = cfg.d_model, cfg.vocab
  layers = cfg.n_layers + np.arange(cfg.mtp_depth)
  p = "model.layers.{i}."
  norm = lambda leaf, name: base.vector(("mtp", leaf, "scale"), p + name + ".weight", layers, (d,))
  out = [
      norm("enorm", "enorm"),
      norm("hnorm", "hnorm"),
      norm("final_norm", "shared_head.norm"),
      base.linear(("mtp", "eh_proj", "kernel"), p + "eh_proj.weight", layers, (d,), (2 * d,)),
      *moe_layer_tensors(cfg, ("mtp", "block"), layers),
  ]
  for k in range(cfg.mtp_depth):
    layer = np.array(cfg.n_layers + k)
    embed = base.Tensor(("embed",), p + "embed_tokens.weight", layer, 0, (v, d), 0, copy=True)
    out.append(embed)
    head = ("embed",) if cfg.tied_embeddings else ("head",)
    if cfg.tied_embeddings:
      out.append(dataclasses.replace(embed, pattern=p + "shared_head.head.weight"))
    else:
      out.append(
          dataclasses.replace(
              base.linear(head, p + "shared_head.head.weight", layer, (v,), (d,)), copy=True
          )
      )
  return out


def tensors(cfg: transformer.TransformerConfig) -> list[base.Tensor]:
  """Every parameter leaf of a DeepSeek-V2 or V3 model with its checkpoint tensors.

  Args:
    cfg: the model.

  Returns:
    The `Tensor`s of every leaf.

  Raises:
    CheckpointError: a model DeepseekV3ForCausalLM does not compute (no latent attention or
      experts, or MoE groups of more than one layer).
  """
  if cfg.mla is None or cfg.moe is None or cfg.moe.every != 1:
    raise base.CheckpointError(
        "a DeepSeek checkpoint holds latent attention (model.mla) and an MoE FFN in every "
        "layer after model.first_dense (model.moe with every=1)"
    )
  k = cfg.first_dense
  first, stack = np.arange(k), k + np.arange(cfg.stack_units)
  out = base.top_tensors(cfg) + moe_layer_tensors(cfg, ("layers", "moe"), stack)
  if k:
    out += attention_tensors(cfg, ("first_layers",), first)
    out += base.mlp_tensors(cfg, ("first_layers",), first)
  if cfg.mtp_depth:
    out += mtp_tensors(cfg)
  return out


FAMILY = base.Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    DEFAULTS,
    read,
    write,
    tensors,
    ignored=IGNORED,
    moe=True,
    mtp_depth=mtp_depth,
)
