"""Hugging Face checkpoints in and out: Llama, Mixtral and Qwen3-MoE as jaxpipe models.

  plan = hf.check(src_dir)                      # config.json + safetensors headers, no tensor data
  cfg, params = hf.load(src_dir, shardings)     # tensor by tensor onto the mesh
  hf.save(cfg, params, dst_dir, hf_config)      # back, loadable by transformers and vLLM

A checkpoint directory is transformers' `save_pretrained` layout: `config.json` and one
`model.safetensors`, or shards listed in `model.safetensors.index.json`, each tensor named after
its PyTorch module (`model.layers.3.self_attn.q_proj.weight`, Linear weights `[out, in]`, MoE
experts one tensor each: `...block_sparse_moe.experts.5.w1.weight`).

`check` maps config.json onto `TransformerConfig` and reads the safetensors headers; it refuses,
naming the field or tensor, whatever the model would not compute as transformers does: another
model_type, an unknown field or one whose value is not implemented (biases, sliding windows,
rope scaling, ...), a tensor missing, unknown or of the wrong shape. `load` then reads each
device's block of each parameter, tensor by tensor, and puts it straight on that device (layers
split over pp and experts over ep when the shardings say so), so the host holds one block at a
time. Weights become float32 (exact from bf16, fp16 and fp32); `save` writes them back in the
source's dtype unless told otherwise, so a round trip is bit-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxpipe.models import moe as moe_lib
from jaxpipe.models import transformer
from jaxpipe.ops import fp8

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
CONFIG_FILE = "config.json"
# WORKDIR/hf: where `python -m jaxpipe.convert hf-to-orbax` puts the source's config.json,
# tokenizer and other files that are not weights (read by the tokenizer, carried by the export)
HF_DIR = "hf"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors -> numpy names

# Fields that do not change the function the model computes (metadata, inference settings).
_METADATA = {
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "max_position_embeddings",
    "tokenizer_class",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "pretraining_tp",
}  # Llama: splits the matmuls into slices, same function
# Per model_type: the defaults transformers uses for a field that config.json leaves out.
_DEFAULTS = {
    "llama": dict(
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
    ),
    "mixtral": dict(
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_dropout=0.0,
        num_experts_per_tok=2,
        num_local_experts=8,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
        sliding_window=None,
    ),
    "qwen3_moe": dict(
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=None,
        decoder_sparse_step=1,
        norm_topk_prob=False,
        mlp_only_layers=[],
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    ),
}
# Values a field must have, because jaxpipe computes only that case; a dict value checks keys.
_REQUIRED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "use_sliding_window": False,
    "mlp_only_layers": [],
}
_WHY = {
    "hidden_act": "the FFNs are SwiGLU (silu)",
    "attention_bias": "projections have no bias",
    "mlp_bias": "projections have no bias",
    "attention_dropout": "there is no dropout",
    "router_jitter_noise": "the LM's router takes no jitter",
    "use_sliding_window": "attention is full causal",
    "mlp_only_layers": "dense layers are placed by decoder_sparse_step alone (moe.every)",
    "sliding_window": "attention is full causal",
}
# Tensors a checkpoint may carry that the model recomputes: (pattern, why).
_DERIVED = (
    (
        re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
        "rotary frequencies, recomputed from rope_theta",
    ),
)


class CheckpointError(ValueError):
  """A checkpoint jaxpipe cannot reproduce; the message names the field or tensor and the fix."""


# -- config.json <-> TransformerConfig ------------------------------------------------------------


def _rope_theta(hf: dict) -> float:
  """rope_theta from either layout (`rope_theta` + `rope_scaling`, or `rope_parameters`)."""
  scaling = hf.get("rope_scaling")
  if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
    raise CheckpointError(
        f"config.json: rope_scaling={scaling!r} is not implemented (jaxpipe's "
        "rotary embedding is the default, unscaled one)"
    )
  params = hf.get("rope_parameters")
  if params is not None:
    extra = sorted(set(params) - {"rope_theta", "rope_type"})
    if params.get("rope_type", "default") != "default" or extra:
      raise CheckpointError(
          f"config.json: rope_parameters={params!r} is not implemented (only "
          "rope_type 'default' with rope_theta)"
      )
    if "rope_theta" in params:
      return float(params["rope_theta"])
  return float(hf.get("rope_theta", _DEFAULTS[hf["model_type"]]["rope_theta"]))


def config_from_hf(hf: dict) -> transformer.TransformerConfig:
  """The TransformerConfig of a transformers config.json (a dict); CheckpointError if none fits."""
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise CheckpointError(
        f"config.json: model_type={model_type!r} is not supported; jaxpipe reads "
        f"{sorted(ARCHITECTURES)}"
    )
  archs = hf.get("architectures") or [ARCHITECTURES[model_type]]
  if archs != [ARCHITECTURES[model_type]]:
    raise CheckpointError(
        f"config.json: architectures={archs!r}; jaxpipe reads a causal LM, "
        f"{[ARCHITECTURES[model_type]]}"
    )
  defaults = _DEFAULTS[model_type]
  moe_keys = {
      "mixtral": {
          "num_local_experts",
          "num_experts_per_tok",
          "output_router_logits",
          "router_aux_loss_coef",
          "router_jitter_noise",
          "sliding_window",
      },
      "qwen3_moe": {
          "num_experts",
          "num_local_experts",
          "num_experts_per_tok",
          "moe_intermediate_size",
          "norm_topk_prob",
          "decoder_sparse_step",
          "mlp_only_layers",
          "output_router_logits",
          "router_aux_loss_coef",
          "use_sliding_window",
          "sliding_window",
          "max_window_layers",
      },
  }
  known = (
      _METADATA
      | set(defaults)
      | moe_keys.get(model_type, set())
      | {
          "vocab_size",
          "hidden_size",
          "intermediate_size",
          "num_hidden_layers",
          "num_attention_heads",
          "num_key_value_heads",
          "head_dim",
          "rope_scaling",
          "rope_parameters",
          "layer_types",
      }
  )
  for key, value in hf.items():
    if key not in known:
      raise CheckpointError(
          f"config.json: field {key!r} (= {value!r}) is not understood for "
          f"model_type {model_type!r}; jaxpipe would ignore it and could compute "
          "another model, so it refuses the checkpoint"
      )

  def get(key):
    if key in hf:
      return hf[key]
    if key in defaults:
      return defaults[key]
    raise CheckpointError(
        f"config.json: field {key!r} is missing; model_type {model_type!r} needs it"
    )

  for key, want in _REQUIRED.items():
    if (key in hf or key in defaults) and get(key) != want:
      raise CheckpointError(
          f"config.json: {key}={get(key)!r} is not implemented ({_WHY[key]}); "
          f"jaxpipe reads {key}={want!r}"
      )
  kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
  if kinds != ["full_attention"]:
    raise CheckpointError(
        f"config.json: layer_types {kinds} are not implemented (attention is "
        "full causal); jaxpipe reads 'full_attention' layers only"
    )
  if model_type == "mixtral" and get("sliding_window") is not None:
    raise CheckpointError(
        f"config.json: sliding_window={get('sliding_window')!r} is not "
        f"implemented ({_WHY['sliding_window']}); jaxpipe reads null"
    )
  heads = get("num_attention_heads")
  kv_heads = hf.get("num_key_value_heads") or heads
  head_dim = hf.get("head_dim") or get("hidden_size") // heads
  moe = None
  if model_type != "llama":
    experts = hf.get("num_local_experts", hf.get("num_experts")) or get(
        "num_local_experts" if model_type == "mixtral" else "num_experts"
    )
    aux = get("output_router_logits")  # transformers adds the aux loss only then
    renorm = True if model_type == "mixtral" else bool(get("norm_topk_prob"))
    moe = moe_lib.MoEConfig(
        num_experts=experts,
        top_k=get("num_experts_per_tok"),
        router="softmax",
        d_ff=get("intermediate_size") if model_type == "mixtral" else get("moe_intermediate_size"),
        norm_topk_prob=renorm,
        norm_top1=renorm,
        lb_loss_coef=float(get("router_aux_loss_coef")) if aux else 0.0,
        lb_loss_form="pooled",
        z_loss_coef=0.0,
        every=get("decoder_sparse_step") if model_type == "qwen3_moe" else 1,
    )
  try:
    return transformer.TransformerConfig(
        vocab=get("vocab_size"),
        d_model=get("hidden_size"),
        n_layers=get("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        d_ff=get("intermediate_size"),
        rope_theta=_rope_theta(hf),
        qk_norm=model_type == "qwen3_moe",
        norm_eps=float(get("rms_norm_eps")),
        tied_embeddings=bool(get("tie_word_embeddings")),
        moe=moe,
    )
  except ValueError as e:
    raise CheckpointError(f"config.json: {e}") from e


# TransformerConfig fields that define the function (the rest are runtime choices).
_MODEL_FIELDS = (
    "vocab",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "rope_theta",
    "qk_norm",
    "norm_eps",
    "tied_embeddings",
)
_MOE_FIELDS = (
    "num_experts",
    "top_k",
    "d_ff",
    "num_shared_experts",
    "router",
    "norm_topk_prob",
    "norm_top1",
    "routed_scaling",
    "n_groups",
    "topk_groups",
    "every",
)


def _function_fields(cfg: transformer.TransformerConfig) -> dict[str, Any]:
  """The fields that decide what the model computes, with equivalent settings made equal."""
  fields = {f: getattr(cfg, f) for f in _MODEL_FIELDS}
  if cfg.moe is not None:
    m = cfg.moe
    fields.update({f"moe.{f}": getattr(m, f) for f in _MOE_FIELDS})
    renorms_top1 = m.norm_topk_prob and (m.norm_top1 or m.router == "sigmoid")
    fields["moe.norm_top1"] = renorms_top1 if m.top_k == 1 else None  # moot at K > 1
    if m.every == 1:
      fields["d_ff"] = None  # no dense FFN
  return fields


def config_to_hf(cfg: transformer.TransformerConfig, base: dict | None = None) -> dict:
  """config.json for `cfg`: `base` (the source's) with the model's fields set, or a new one.

  Without a base: dense models are Llama, MoE models Qwen3-MoE with qk_norm and Mixtral without.
  Raises CheckpointError, naming the field, when no supported architecture computes `cfg`.
  """
  if base is None:
    model_type = "llama" if cfg.moe is None else "qwen3_moe" if cfg.qk_norm else "mixtral"
    hf = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
  else:
    hf = json.loads(json.dumps(base))
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
      raise CheckpointError(f"base config.json: model_type={model_type!r} is not supported")
  hf.update(
      vocab_size=cfg.vocab,
      hidden_size=cfg.d_model,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tied_embeddings,
  )
  if "rope_parameters" in hf:
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": cfg.rope_theta}
  else:
    hf["rope_theta"] = cfg.rope_theta
  m = cfg.moe
  if m is None or model_type == "qwen3_moe":
    hf["intermediate_size"] = cfg.d_ff
  if m is not None:
    hf["num_experts_per_tok"] = m.top_k
    hf["num_local_experts" if "num_experts" not in hf else "num_experts"] = m.num_experts
    if model_type == "mixtral":
      hf["intermediate_size"] = m.d_ff
    else:
      hf.update(
          moe_intermediate_size=m.d_ff, norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=m.every
      )
    if base is None:  # the training objective, as transformers spells it
      hf.update(output_router_logits=m.lb_loss_coef > 0, router_aux_loss_coef=m.lb_loss_coef)
  try:
    back = config_from_hf(hf)
  except CheckpointError as e:
    raise CheckpointError(f"no {model_type} config.json computes this model: {e}") from e
  want, got = _function_fields(cfg), _function_fields(back)
  for field in want:
    if want[field] != got.get(field):
      raise CheckpointError(
          f"model.{field}={want[field]!r} has no counterpart in {model_type} (which would compute "
          f"{got.get(field)!r}); export needs a model that {ARCHITECTURES[model_type]} computes"
      )
  return hf


# -- tensors --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter leaf and the checkpoint tensors stacked into it."""

  path: tuple[str, ...]  # keys of the leaf in the params dict
  pattern: str  # checkpoint name; {i} the layer, {e} the expert
  layers: np.ndarray  # the layer index at each position of the leaf's leading stack axes
  experts: int  # E for an expert axis after the stack axes (one tensor per expert), else 0
  shape: tuple[int, ...]  # one tensor in jaxpipe's layout
  in_dims: int  # leading axes of `shape` that a Linear contracts ([out, in] on disk); 0: as is

  @property
  def leaf_shape(self) -> tuple[int, ...]:
    return self.layers.shape + ((self.experts,) if self.experts else ()) + self.shape

  @property
  def hf_shape(self) -> tuple[int, ...]:
    if not self.in_dims:
      return self.shape
    return (math.prod(self.shape[self.in_dims :]), math.prod(self.shape[: self.in_dims]))

  def names(self) -> Iterator[tuple[tuple[int, ...], str]]:
    """(position in the leaf's stack and expert axes, checkpoint name) of every tensor."""
    for pos in np.ndindex(self.layers.shape):
      for e in range(self.experts) if self.experts else (None,):
        yield pos + (() if e is None else (e,)), self.pattern.format(i=self.layers[pos], e=e)

  def to_jax(self, w: np.ndarray) -> np.ndarray:
    return w.T.reshape(self.shape) if self.in_dims else w.reshape(self.shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    return a.reshape(self.hf_shape[::-1]).T if self.in_dims else a


def tensors(cfg: transformer.TransformerConfig, model_type: str) -> list[Tensor]:
  """Every parameter leaf of `cfg`'s model with the checkpoint tensors it is made of."""
  d, h, g, k, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab
  top = np.zeros((), int)
  out = [
      Tensor(("embed",), "model.embed_tokens.weight", top, 0, (v, d), 0),
      Tensor(("final_norm", "scale"), "model.norm.weight", top, 0, (d,), 0),
  ]
  if not cfg.tied_embeddings:
    out.append(Tensor(("head",), "lm_head.weight", top, 0, (d, v), 1))

  def layer(prefix, layers, moe):
    p = "model.layers.{i}."
    a = p + "self_attn."
    t = [
        Tensor(prefix + ("attn_norm", "scale"), p + "input_layernorm.weight", layers, 0, (d,), 0),
        Tensor(prefix + ("attn", "q", "kernel"), a + "q_proj.weight", layers, 0, (d, h, k), 1),
        Tensor(prefix + ("attn", "k", "kernel"), a + "k_proj.weight", layers, 0, (d, g, k), 1),
        Tensor(prefix + ("attn", "v", "kernel"), a + "v_proj.weight", layers, 0, (d, g, k), 1),
        Tensor(prefix + ("attn", "o", "kernel"), a + "o_proj.weight", layers, 0, (h, k, d), 2),
        Tensor(
            prefix + ("mlp_norm", "scale"),
            p + "post_attention_layernorm.weight",
            layers,
            0,
            (d,),
            0,
        ),
    ]
    if cfg.qk_norm:
      t += [
          Tensor(
              prefix + ("attn", f"{n}_norm", "scale"), a + f"{n}_norm.weight", layers, 0, (k,), 0
          )
          for n in "qk"
      ]
    if not moe:
      f = cfg.d_ff
      return t + [
          Tensor(
              prefix + ("mlp", n, "kernel"),
              p + f"mlp.{n}_proj.weight",
              layers,
              0,
              (f, d) if n == "down" else (d, f),
              1,
          )
          for n in ("gate", "up", "down")
      ]
    m = cfg.moe
    e, f = m.num_experts, m.d_ff
    block = p + ("block_sparse_moe." if model_type == "mixtral" else "mlp.")
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if model_type == "mixtral"
        else {n: f"{n}_proj" for n in ("gate", "up", "down")}
    )
    w = prefix + ("moe",)
    return t + [
        Tensor(w + ("router_DxE",), block + "gate.weight", layers, 0, (d, e), 1),
        Tensor(
            w + ("wi_gate_ExDxF",),
            block + "experts.{e}." + names["gate"] + ".weight",
            layers,
            e,
            (d, f),
            1,
        ),
        Tensor(
            w + ("wi_up_ExDxF",),
            block + "experts.{e}." + names["up"] + ".weight",
            layers,
            e,
            (d, f),
            1,
        ),
        Tensor(
            w + ("wo_ExFxD",),
            block + "experts.{e}." + names["down"] + ".weight",
            layers,
            e,
            (f, d),
            1,
        ),
    ]

  if cfg.moe is None:
    return out + layer(("layers",), np.arange(cfg.n_layers), moe=False)
  every = cfg.moe.every
  groups = np.arange(cfg.n_layers // every) * every
  out += layer(("layers", "moe"), groups + every - 1, moe=True)
  if every > 1:
    out += layer(("layers", "dense"), groups[:, None] + np.arange(every - 1), moe=False)
  return out


# -- checking a directory -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """A checked checkpoint directory: what it holds and where, before any tensor is read."""

  directory: str
  hf_config: dict  # config.json as read
  cfg: transformer.TransformerConfig
  tensors: list[Tensor]
  files: dict[str, str]  # checkpoint name -> safetensors file
  dtypes: dict[str, str]  # checkpoint name -> numpy dtype name
  ignored: dict[str, str]  # tensors not read -> why

  @property
  def dtype(self) -> str:
    """The dtype of the weights (the most common one, by tensor count)."""
    counts = {}
    for name in self.files:
      if name not in self.ignored:
        counts[self.dtypes[name]] = counts.get(self.dtypes[name], 0) + 1
    return max(counts, key=counts.get)


def _headers(directory: str) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
  """(name -> file, name -> (shape, safetensors dtype)) from the index and file headers."""
  from safetensors import safe_open

  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  elif os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
    weight_map, files = None, [WEIGHTS_FILE]
  else:
    raise CheckpointError(
        f"{directory} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; point to a "
        "directory written by save_pretrained (safetensors weights)"
    )
  where, meta = {}, {}
  for file in files:
    path = os.path.join(directory, file)
    if not os.path.isfile(path):
      raise CheckpointError(f"{INDEX_FILE} names {file}, which is not in {directory}")
    with safe_open(path, framework="numpy") as f:
      for name in f.keys():
        if name in where:
          raise CheckpointError(f"tensor {name} is in both {where[name]} and {file}")
        s = f.get_slice(name)
        where[name], meta[name] = file, (tuple(s.get_shape()), s.get_dtype())
  if weight_map is not None:
    for name, file in weight_map.items():
      if where.get(name) != file:
        raise CheckpointError(
            f"{INDEX_FILE} puts tensor {name} in {file}, but "
            + (f"it is in {where[name]}" if name in where else "no file has it")
        )
  return where, meta


def check(directory: str) -> Plan:
  """Reads config.json and the safetensors headers; CheckpointError naming what does not fit."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(
        f"{directory} has no {CONFIG_FILE}; point to a directory written by save_pretrained"
    )
  with open(path) as f:
    hf = json.load(f)
  cfg = config_from_hf(hf)
  where, meta = _headers(directory)
  plan = tensors(cfg, hf["model_type"])
  _check_leaves(cfg, plan)
  want = {name: t for t in plan for _, name in t.names()}
  ignored = {name: why for name in where for pattern, why in _DERIVED if pattern.fullmatch(name)}
  missing = [name for name in want if name not in where]
  if missing:
    raise CheckpointError(
        f"tensor {missing[0]} is missing from {directory} ({len(missing)} "
        f"missing in all); a {hf['model_type']} model with this config.json "
        "needs it"
    )
  unknown = [name for name in where if name not in want and name not in ignored]
  if unknown:
    hint = (
        " (config.json ties the embeddings, so the head is the embedding matrix)"
        if unknown[0] == "lm_head.weight"
        else ""
    )
    raise CheckpointError(
        f"tensor {unknown[0]} in {where[unknown[0]]} is not part of a "
        f"{hf['model_type']} model with this config.json ({len(unknown)} unknown "
        f"in all){hint}; jaxpipe uses every tensor or refuses the checkpoint"
    )
  dtypes = {}
  for name, (shape, dtype) in meta.items():
    if name in ignored:
      continue
    if dtype not in _DTYPES:
      raise CheckpointError(f"tensor {name} has dtype {dtype}; jaxpipe reads {sorted(_DTYPES)}")
    dtypes[name] = _DTYPES[dtype]
    if shape != want[name].hf_shape:
      raise CheckpointError(
          f"tensor {name} has shape {list(shape)}, but config.json implies "
          f"{list(want[name].hf_shape)}"
      )
  return Plan(directory, hf, cfg, plan, where, dtypes, ignored)


def _check_leaves(cfg: transformer.TransformerConfig, plan: list[Tensor]) -> None:
  """Every parameter of the model has exactly one mapping, of its shape (FP8 delayed scales are
  training state, not weights: they are neither read nor written)."""
  shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  leaves = {
      tuple(k.key for k in p): s.shape
      for p, s in jax.tree_util.tree_leaves_with_path(shapes)
      if not fp8.is_state(p)
  }
  mapped = {t.path: t.leaf_shape for t in plan}
  if leaves != mapped:
    diff = sorted(set(leaves.items()) ^ set(mapped.items()))
    raise CheckpointError(
        f"parameter {'/'.join(diff[0][0])} {diff[0][1]} has no checkpoint "
        "counterpart of its shape; this model cannot be read from or written to "
        "a Hugging Face checkpoint"
    )


# -- load -----------------------------------------------------------------------------------------


class _Reader:
  """Open safetensors files; `get` reads one tensor as float32 through the host CPU device."""

  def __init__(self, plan: Plan, stack: contextlib.ExitStack):
    from safetensors import safe_open

    self._plan = plan
    self._files = {
        file: stack.enter_context(safe_open(os.path.join(plan.directory, file), framework="flax"))
        for file in sorted(set(plan.files.values()))
    }
    self._cpu = jax.devices("cpu")[0]

  def get(self, name: str) -> np.ndarray:
    with jax.default_device(self._cpu):  # bfloat16 needs the flax reader; keep it off accelerators
      return np.asarray(self._files[self._plan.files[name]].get_tensor(name), np.float32)


def _read_block(t: Tensor, reader: _Reader, index: tuple[slice, ...]) -> np.ndarray:
  """The block `index` of t's leaf, reading only the tensors it covers."""
  ns = t.layers.ndim + bool(t.experts)
  span = [range(*s.indices(n)) for s, n in zip(index, t.leaf_shape)]
  trailing = index[ns:]
  block = np.empty(tuple(len(r) for r in span), np.float32)
  span = span[:ns]
  for local in np.ndindex(*(len(r) for r in span)):
    pos = tuple(r[j] for r, j in zip(span, local))
    layer = t.layers[pos[: t.layers.ndim]]
    name = t.pattern.format(i=layer, e=pos[-1] if t.experts else None)
    block[local] = t.to_jax(reader.get(name))[trailing]
  return block


def _place(t: Tensor, reader: _Reader, sharding: jax.sharding.Sharding) -> jax.Array:
  """t's leaf on `sharding`: each distinct block read once and put on the devices that hold it."""
  shape = t.leaf_shape
  blocks: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple(s.indices(n) for s, n in zip(index, shape))
    blocks.setdefault(key, []).append(device)
  arrays = []
  for key, devices in blocks.items():
    block = _read_block(t, reader, tuple(slice(*k) for k in key))
    arrays += [jax.device_put(block, device) for device in devices]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict:
  tree: dict = {}
  for path, value in pairs:
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def load(
    directory: str | Plan, shardings: Any = None
) -> tuple[transformer.TransformerConfig, dict]:
  """(config, float32 params) of a checkpoint directory, each leaf placed on its sharding.

  `shardings`: a pytree of Shardings shaped like the params (e.g.
  `jaxpipe.training.state.state_shardings` of their shapes on a mesh), one Sharding for all, or None
  for the first device.
  """
  plan = directory if isinstance(directory, Plan) else check(directory)
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(shardings, jax.sharding.Sharding):
    shard_of = lambda path: shardings
  else:
    flat = {
        tuple(k.key for k in p): s
        for p, s in jax.tree_util.tree_leaves_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
    }
    shard_of = flat.__getitem__
  with contextlib.ExitStack() as stack:
    reader = _Reader(plan, stack)
    leaves = [(t.path, _place(t, reader, shard_of(t.path))) for t in plan.tensors]
  return plan.cfg, _nest(leaves)


# -- save -----------------------------------------------------------------------------------------


def _whole_weights(leaf: jax.Array, ns: int) -> jax.Array:
  """The leaf with any split of its weight axes (tensor parallelism's heads, d_ff, vocabulary)
  gathered on the devices, keeping its layer and expert splits (its first `ns` axes): one
  parameter at a time, so the host still takes whole weights of one block."""
  sharding = leaf.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return leaf
  spec = tuple(sharding.spec)
  if all(a is None for a in spec[ns:]):
    return leaf
  kept = jax.sharding.PartitionSpec(*spec[:ns])
  return jax.device_put(leaf, jax.sharding.NamedSharding(sharding.mesh, kept))


def _host_blocks(t: Tensor, leaf: jax.Array) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
  """(index, host copy) of each distinct block of a leaf, one at a time."""
  if not leaf.is_fully_addressable:
    raise ValueError(
        f"parameter {'/'.join(t.path)} spans other processes; export from a single-process run"
    )
  seen = set()
  for shard in leaf.addressable_shards:
    key = tuple(s.indices(n) for s, n in zip(shard.index, leaf.shape))
    if key not in seen:
      seen.add(key)
      yield tuple(slice(*k) for k in key), np.asarray(shard.data)


def hf_tensors(
    cfg: transformer.TransformerConfig, params: dict, model_type: str, dtype: Any = np.float32
) -> Iterator[tuple[str, np.ndarray]]:
  """(checkpoint name, array in checkpoint layout and `dtype`) of every tensor of `params`.

  Any tree shaped like the params works (gradients too); the host holds one block at a time.
  """
  plan = tensors(cfg, model_type)
  _check_leaves(cfg, plan)
  dtype = np.dtype(dtype)
  for t in plan:
    leaf = functools.reduce(lambda node, key: node[key], t.path, params)
    if not isinstance(leaf, jax.Array):
      leaf = jax.device_put(np.asarray(leaf))
    ns = t.layers.ndim + bool(t.experts)
    for index, block in _host_blocks(t, _whole_weights(leaf, ns)):
      if any(s != slice(0, n, 1) for s, n in zip(index[ns:], t.shape)):
        raise ValueError(
            f"parameter {'/'.join(t.path)} is split along a weight axis "
            f"({index}) by a sharding other than a NamedSharding; export params sharded on "
            "layers and experts only"
        )
      span = [range(*s.indices(n)) for s, n in zip(index[:ns], t.leaf_shape)]
      for local in np.ndindex(*(len(r) for r in span)):
        pos = tuple(r[j] for r, j in zip(span, local))
        name = t.pattern.format(i=t.layers[pos[: t.layers.ndim]], e=pos[-1] if t.experts else None)
        yield name, np.ascontiguousarray(t.to_hf(block[local]).astype(dtype))


def save(
    cfg: transformer.TransformerConfig,
    params: dict,
    directory: str,
    hf_config: dict | None = None,
    dtype: Any = None,
    max_shard_bytes: int = 4 << 30,
) -> dict:
  """Writes `params` as a transformers checkpoint directory; returns the config.json written.

  hf_config: the source's config.json, kept but for the model's fields (`config_to_hf`);
  dtype: of the written weights, default the one hf_config names, else float32.
  Files of at most `max_shard_bytes` (but one tensor each at least), listed in an index when
  there are several. Existing weights in `directory` are replaced.
  """
  from safetensors.numpy import save_file

  hf = config_to_hf(cfg, hf_config)
  dtype = np.dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32")
  if dtype.name not in _DTYPES.values():
    raise ValueError(f"dtype={dtype.name!r}: write one of {sorted(_DTYPES.values())}")
  hf["torch_dtype" if "torch_dtype" in hf and "dtype" not in hf else "dtype"] = dtype.name
  os.makedirs(directory, exist_ok=True)
  for name in os.listdir(directory):
    if name == INDEX_FILE or name.endswith(".safetensors"):
      os.remove(os.path.join(directory, name))
  files, weight_map, total = [], {}, 0
  shard: dict[str, np.ndarray] = {}

  def flush():
    nonlocal shard
    if shard:
      files.append(f"part-{len(files):05d}.tmp")
      save_file(shard, os.path.join(directory, files[-1]), metadata={"format": "pt"})
      weight_map.update({name: files[-1] for name in shard})
      shard = {}

  size = 0
  for name, array in hf_tensors(cfg, params, hf["model_type"], dtype):
    if shard and size + array.nbytes > max_shard_bytes:
      flush()
      size = 0
    shard[name] = array
    size += array.nbytes
    total += array.nbytes
  flush()
  final = (
      {files[0]: WEIGHTS_FILE}
      if len(files) == 1
      else {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
  )
  for tmp, name in final.items():
    os.replace(os.path.join(directory, tmp), os.path.join(directory, name))
  if len(files) > 1:
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
      json.dump(
          {
              "metadata": {"total_size": total},
              "weight_map": {n: final[f] for n, f in sorted(weight_map.items())},
          },
          f,
          indent=2,
      )
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")
  return hf
