"""What every model family shares: reading config.json, and naming checkpoint tensors.

A family (`Family`) is one transformers architecture: how its `config.json` becomes a
`TransformerConfig` (`read`), how a `TransformerConfig` is written back (`write`), and which
checkpoint tensor each parameter leaf is made of (`tensors`). The reader (`Fields`) knows three
kinds of field:

- metadata that changes nothing the model computes (`METADATA`, any field with a leading
  underscore, the family's own `ignored` ones): read by no one;
- fields the family reads: each value either implemented or refused by name (`Fields.refuse`);
- anything else: a field transformers' class would keep as an attribute and never use; it
  changes nothing either, so it is named in one warning line (`unknown`) and left.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxpipe.models import rope as rope_lib
from jaxpipe.models import transformer

CONFIG = "config.json"


class CheckpointError(ValueError):
  """A checkpoint jaxpipe cannot reproduce; the message names the field or tensor and the fix."""


# Fields of a transformers config.json that never change the function the model computes:
# bookkeeping, token ids, inference and export settings, other tools' keys.
METADATA = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "sep_token_id",
        "cls_token_id",
        "mask_token_id",
        "decoder_start_token_id",
        "initializer_range",
        "use_cache",
        "max_position_embeddings",  # read where a rope variant needs it
        "tokenizer_class",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "use_return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "prefix",
        "pretraining_tp",  # Llama: splits its matmuls into slices, the same function
        "is_llama_config",
        "transformers.js_config",
        "cache_implementation",
        "rope_interleaved",  # transformers' classes read no such field
        "auto_map",
        "num_logits_to_keep",
        "use_sliding_window",  # read where a family has it
    }
)


class Fields:
  """config.json as read, remembering which fields a family used.

  `get` reads a field (or its default); `refuse` names a value jaxpipe does not compute;
  `unknown` lists the fields nobody read that are not metadata.
  """

  def __init__(self, hf: dict, model_type: str, defaults: dict, ignored=frozenset()):
    self.hf, self.model_type, self.defaults = hf, model_type, defaults
    self.used: set[str] = set()
    self.ignored = METADATA | set(ignored)

  def __contains__(self, key: str) -> bool:
    return key in self.hf

  def get(self, key: str, default: Any = ...) -> Any:
    """The field's value, marked as read.

    Args:
      key: the config.json field.
      default: the value when the field is absent; left out: the family's default.

    Returns:
      The field's value; absent: `default`, else the family's default.

    Raises:
      CheckpointError: the field is absent, with no `default` and no family default.
    """
    self.used.add(key)
    if key in self.hf:
      return self.hf[key]
    if default is not ...:
      return default
    if key in self.defaults:
      return self.defaults[key]
    raise CheckpointError(
        f"config.json: field {key!r} is missing; model_type {self.model_type!r} needs it"
    )

  def given(self, key: str, default: Any = None) -> Any:
    """The field's value, or `default` when absent or null.

    The family's default is not used (for fields whose absence means 'off').

    Args:
      key: the config.json field.
      default: the value when the field is absent or null.

    Returns:
      The field's value, or `default`.
    """
    value = self.get(key, None)
    return default if value is None else value

  def refuse(self, key: str, why: str, want: Any = ...) -> CheckpointError:
    """The error for a value of `key` jaxpipe does not compute.

    Args:
      key: the config.json field.
      why: what jaxpipe computes instead.
      want: the value jaxpipe reads, named in the message; left out: none named.

    Returns:
      The `CheckpointError` (for the caller to raise), naming the field's value.
    """
    value = self.get(key, None)
    also = "" if want is ... else f"; jaxpipe reads {key}={want!r}"
    return CheckpointError(f"config.json: {key}={value!r} is not implemented ({why}){also}")

  def require(self, key: str, allowed: Callable[[Any], bool], why: str, want: Any = ...):
    """Refuses the field's value (or its default) unless `allowed(value)`.

    A field that is absent and has no family default passes.

    Args:
      key: the config.json field.
      allowed: whether jaxpipe computes a value.
      why: what jaxpipe computes, for the message.
      want: the value jaxpipe reads, for the message.

    Raises:
      CheckpointError: `allowed` is false for the field's value.
    """
    if key in self.hf or key in self.defaults:
      if not allowed(self.get(key)):
        raise self.refuse(key, why, want)

  def unknown(self) -> list[str]:
    """Fields read by no one that are not metadata, in file order."""
    return [
        k for k in self.hf if k not in self.used and k not in self.ignored and not k.startswith("_")
    ]


# -- shared readers -------------------------------------------------------------------------------

ACTIVATIONS = {  # transformers' ACT2FN names -> TransformerConfig.activation
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def activation(f: Fields, key: str = "hidden_act") -> str:
  """The FFN's activation as `TransformerConfig.activation` names it.

  Args:
    f: the config.json fields.
    key: the field naming transformers' activation (its ACT2FN name).

  Returns:
    `'silu'` or `'gelu_tanh'`.

  Raises:
    CheckpointError: an activation jaxpipe does not compute.
  """
  value = f.get(key)
  if value not in ACTIVATIONS:
    raise f.refuse(key, f"the FFN's activation is one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[value]


def no_dropout(f: Fields, *keys: str) -> None:
  """Refuses nonzero dropout.

  Dropout only changes training, but there it does: jaxpipe has none, so it must be 0.

  Args:
    f: the config.json fields.
    *keys: the dropout fields to check; none given: `attention_dropout`.

  Raises:
    CheckpointError: a dropout field is nonzero.
  """
  for key in keys or ("attention_dropout",):
    f.require(key, lambda v: not v, "jaxpipe trains without dropout", 0.0)


_ROPE_KEYS = {  # transformers' rope_parameters key -> RopeScaling field
    "factor": "factor",
    "original_max_position_embeddings": "original_max_position",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
    "short_factor": "short_factor",
    "long_factor": "long_factor",
}


def _scaling(f: Fields, params: dict, where: str) -> rope_lib.RopeScaling | None:
  """A RopeScaling from a rope_parameters / rope_scaling dict (None for the default)."""
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "su":  # Phi-3's old name
    kind = "longrope"
  if kind not in rope_lib.ROPE_TYPES:
    raise CheckpointError(
        f"config.json: {where}={params!r}: rope_type {kind!r} is not implemented; jaxpipe "
        f"reads {list(rope_lib.ROPE_TYPES)}"
    )
  if params.get("mrope_section"):
    raise CheckpointError(
        f"config.json: {where}: mrope_section (multimodal rotary) is not implemented"
    )
  if kind == "default":
    return None
  fields = {_ROPE_KEYS[k]: v for k, v in params.items() if k in _ROPE_KEYS and v is not None}
  # transformers takes a top-level original_max_position_embeddings over the dict's (Phi-3)
  if "original_max_position_embeddings" in f and kind in ("llama3", "yarn", "longrope"):
    fields["original_max_position"] = f.get("original_max_position_embeddings")
  if kind in ("llama3", "yarn", "longrope"):
    fields.setdefault("original_max_position", f.get("max_position_embeddings"))
  if kind in ("dynamic", "yarn", "longrope"):
    fields["max_position"] = f.get("max_position_embeddings")
  try:
    return rope_lib.RopeScaling(kind, **fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"config.json: {where}={params!r}: {e}") from e


LAYER_KINDS = ("full_attention", "sliding_attention")  # transformers' layer_types names


def rope(f: Fields, default_theta: float = 10_000.0, layer_type: str = "full_attention"):
  """The rotary settings, from either layout of config.json.

  Reads `rope_parameters` (transformers 5; nested by layer type in Gemma 3, `layer_type` picking
  one) or `rope_theta` with `rope_scaling`; `partial_rotary_factor` at the top or inside.

  Args:
    f: the config.json fields.
    default_theta: rope_theta when config.json gives none.
    layer_type: which layer type's parameters to read when they are nested by layer type.

  Returns:
    `(rope_theta, RopeScaling or None, rotary fraction)`; None for the default variant.

  Raises:
    CheckpointError: a rotary variant jaxpipe does not compute, or bad parameters for one.
  """
  params, where = f.given("rope_parameters"), "rope_parameters"
  if params is not None and set(params) & set(LAYER_KINDS):
    params, where = params.get(layer_type) or {}, f"rope_parameters[{layer_type!r}]"
  if params is None:
    params, where = f.given("rope_scaling") or {}, "rope_scaling"
  theta = params.get("rope_theta", f.get("rope_theta", default_theta))
  fraction = params.get("partial_rotary_factor", f.given("partial_rotary_factor", 1.0))
  return float(theta), _scaling(f, dict(params), where), float(fraction)


def whole_rope(f: Fields, family: str, default_theta: float = 10_000.0, layer_type=LAYER_KINDS[0]):
  """The rotary settings of a family whose transformers class rotates every channel of a head.

  Args:
    f: the config.json fields.
    family: the family's name, for the message.
    default_theta: rope_theta when config.json gives none.
    layer_type: which layer type's parameters to read when they are nested by layer type.

  Returns:
    `(rope_theta, RopeScaling or None)`.

  Raises:
    CheckpointError: a partial_rotary_factor other than 1 (refused by name), or what `rope`
      raises.
  """
  theta, scaling, fraction = rope(f, default_theta, layer_type)
  if fraction != 1.0:
    raise f.refuse("partial_rotary_factor", f"transformers' {family} rotates every channel", 1.0)
  return theta, scaling


def act_name(cfg: transformer.TransformerConfig) -> str:
  """transformers' name of cfg's FFN activation.

  Args:
    cfg: the model.

  Returns:
    `'gelu_pytorch_tanh'` for `gelu_tanh`, else `'silu'`.
  """
  return "gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else "silu"


def write_rope(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the rotary fields of config.json `hf` to cfg's, in the layout `hf` already uses.

  `rope_parameters` when `hf` has it or has no `rope_theta`, else `rope_theta` with
  `rope_scaling`.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  scaling = rope_lib.scaling_of(cfg.rope_scaling)
  params = {"rope_type": scaling.type, "rope_theta": cfg.rope_theta}
  inverse = {v: k for k, v in _ROPE_KEYS.items()}
  for field in dataclasses.fields(scaling):
    value = getattr(scaling, field.name)
    if field.name in inverse and value is not None and value != field.default:
      params[inverse[field.name]] = list(value) if isinstance(value, tuple) else value
  if cfg.rope_fraction != 1.0:
    params["partial_rotary_factor"] = cfg.rope_fraction
    if "partial_rotary_factor" in hf:
      hf["partial_rotary_factor"] = cfg.rope_fraction
  if scaling.max_position is not None:  # dynamic, yarn and longrope read it from here
    hf["max_position_embeddings"] = scaling.max_position
  if "original_max_position_embeddings" in hf and scaling.original_max_position is not None:
    hf["original_max_position_embeddings"] = scaling.original_max_position
  if "rope_parameters" in hf or "rope_theta" not in hf:
    hf["rope_parameters"] = params
    hf.pop("rope_scaling", None)
  else:
    hf["rope_theta"] = cfg.rope_theta
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    hf["rope_scaling"] = None if scaling.type == "default" else rest


def common(f: Fields, **extra) -> dict:
  """The TransformerConfig fields every decoder family reads alike, plus `extra`.

  Args:
    f: the config.json fields.
    **extra: more TransformerConfig fields, added as they are.

  Returns:
    TransformerConfig keyword arguments: vocab, widths, layers, heads, norm eps, tied embeddings.

  Raises:
    CheckpointError: a needed field is missing.
  """
  heads = f.get("num_attention_heads")
  hidden = f.get("hidden_size")
  return dict(
      vocab=f.get("vocab_size"),
      d_model=hidden,
      n_layers=f.get("num_hidden_layers"),
      n_heads=heads,
      n_kv_heads=f.get("num_key_value_heads", f.defaults.get("num_key_value_heads")) or heads,
      head_dim=f.get("head_dim", f.defaults.get("head_dim")) or hidden // heads,
      d_ff=f.get("intermediate_size"),
      norm_eps=float(f.get("rms_norm_eps")),
      tied_embeddings=bool(f.get("tie_word_embeddings")),
      **extra,
  )


def write_common(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets the fields `common` reads, and the rotary ones.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  hf.update(
      vocab_size=cfg.vocab,
      hidden_size=cfg.d_model,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      intermediate_size=cfg.d_ff,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tied_embeddings,
  )
  write_rope(hf, cfg)


def layer_types(f: Fields, n_layers: int) -> tuple | None:
  """transformers' `layer_types` as TransformerConfig names.

  Args:
    f: the config.json fields.
    n_layers: the model's layers.

  Returns:
    A tuple of `'sliding'` / `'full'`, one per layer; None when config.json has none.

  Raises:
    CheckpointError: `layer_types` does not name each layer `sliding_attention` or
      `full_attention`.
  """
  given = f.given("layer_types")
  if given is None:
    return None
  names = {"full_attention": "full", "sliding_attention": "sliding"}
  if len(given) != n_layers or set(given) - set(names):
    raise CheckpointError(
        f"config.json: layer_types={given!r} must name each of the {n_layers} layers "
        f"one of {sorted(names)}"
    )
  return tuple(names[t] for t in given)


def windows(window: int | None, types: tuple | None) -> dict:
  """TransformerConfig's `sliding_window` and `layer_types` for sliding layers of `window`.

  Args:
    window: the sliding window; None or 0: none, so that every layer attends to every earlier
      key.
    types: the layer kinds (`layer_types`'s result); None: all sliding.

  Returns:
    `dict(sliding_window=..., layer_types=...)`; `layer_types` is empty unless the layers mix
    sliding and full attention.
  """
  kinds = set(types or ("sliding",))
  if not window or kinds == {"full"}:
    return dict(sliding_window=0, layer_types=())
  return dict(sliding_window=window, layer_types=() if kinds == {"sliding"} else types)


def write_layer_types(hf: dict, cfg: transformer.TransformerConfig) -> None:
  """Sets config.json's `layer_types` (and `sliding_window`, if any) from cfg's layer windows.

  Args:
    hf: the config.json dict, changed in place.
    cfg: the model.
  """
  windows = cfg.layer_windows
  hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
  if cfg.sliding_window:
    hf["sliding_window"] = cfg.sliding_window


# -- tensors --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter leaf and the checkpoint tensors stacked into it.

  A leaf may be a run of rows of a fused tensor (Phi-3's qkv_proj and gate_up_proj): `rows`
  (start, stop) of `total` rows along the checkpoint tensor's first axis.
  """

  path: tuple[str, ...]  # keys of the leaf in the params dict
  pattern: str  # checkpoint name; {i} the layer, {e} the expert
  layers: np.ndarray  # the layer index at each position of the leaf's leading stack axes
  experts: int  # E for an expert axis after the stack axes (one tensor per expert), else 0
  shape: tuple[int, ...]  # one tensor in jaxpipe's layout
  in_dims: int  # leading axes of `shape` that a Linear contracts ([out, in] on disk); 0: as is
  rows: tuple[int, int] | None = None  # this leaf's rows of a fused checkpoint tensor
  total: int = 0  # the fused tensor's rows
  flat: bool = False  # stored as one axis (a bias of several heads: [H * K] on disk)
  copy: bool = False  # another leaf's tensor stored again under this name: written, not read

  @property
  def leaf_shape(self) -> tuple[int, ...]:
    return self.layers.shape + ((self.experts,) if self.experts else ()) + self.shape

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """This leaf's tensor (or rows) as stored: [out, in] for a Linear."""
    if not self.in_dims:
      return (math.prod(self.shape),) if self.flat else self.shape
    return (math.prod(self.shape[self.in_dims :]), math.prod(self.shape[: self.in_dims]))

  @property
  def file_shape(self) -> tuple[int, ...]:
    """The whole checkpoint tensor's shape (fused: all its rows)."""
    return (self.total,) + self.hf_shape[1:] if self.rows else self.hf_shape

  def names(self) -> Iterator[tuple[tuple[int, ...], str]]:
    """(position in the leaf's stack and expert axes, checkpoint name) of every tensor."""
    for pos in np.ndindex(self.layers.shape):
      for e in range(self.experts) if self.experts else (None,):
        yield pos + (() if e is None else (e,)), self.pattern.format(i=self.layers[pos], e=e)

  def to_jax(self, w: np.ndarray) -> np.ndarray:
    """The leaf's entry from the whole checkpoint tensor.

    Args:
      w: the checkpoint tensor, `file_shape`.

    Returns:
      The leaf's entry (its rows of a fused tensor), in jaxpipe's layout, `shape`.
    """
    if self.rows:
      w = w[self.rows[0] : self.rows[1]]
    return w.T.reshape(self.shape) if self.in_dims else w.reshape(self.shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    """The checkpoint tensor (or this leaf's rows of it) from the leaf's entry.

    Args:
      a: the leaf's entry, `shape`.

    Returns:
      The tensor as stored, `hf_shape`.
    """
    return a.reshape(self.hf_shape[::-1]).T if self.in_dims else a.reshape(self.hf_shape)


def linear(path, pattern, layers, out_shape, in_shape, rows=None, total=0) -> Tensor:
  """A Linear weight [out, in] stored as a kernel [*in_shape, *out_shape].

  Args:
    path: keys of the leaf in the params dict.
    pattern: checkpoint name; {i} the layer.
    layers: the layer index at each position of the leaf's stack axes.
    out_shape: the output axes.
    in_shape: the input (contracted) axes.
    rows: this leaf's (start, stop) rows of a fused checkpoint tensor; None: the whole tensor.
    total: the fused tensor's rows.

  Returns:
    The `Tensor`.
  """
  shape = tuple(in_shape) + tuple(out_shape)
  return Tensor(tuple(path), pattern, layers, 0, shape, len(in_shape), rows, total)


def vector(path, pattern, layers, shape) -> Tensor:
  """A norm scale or bias, stored flat (a bias of heads [H, K] as [H * K]).

  Args:
    path: keys of the leaf in the params dict.
    pattern: checkpoint name; {i} the layer.
    layers: the layer index at each position of the leaf's stack axes.
    shape: one tensor's shape in jaxpipe's layout.

  Returns:
    The `Tensor`.
  """
  return Tensor(tuple(path), pattern, layers, 0, tuple(shape), 0, flat=len(shape) > 1)


@dataclasses.dataclass(frozen=True)
class Names:
  """Checkpoint names of one decoder layer's parts (patterns with {i}), by jaxpipe leaf."""

  attn_norm: str = "input_layernorm"
  mlp_norm: str = "post_attention_layernorm"
  attn_post_norm: str | None = None  # Gemma: post_attention_layernorm
  mlp_post_norm: str | None = None  # Gemma: post_feedforward_layernorm
  qkv: str | None = None  # one fused projection (Phi-3's qkv_proj), else q_proj, k_proj, v_proj
  gate_up: str | None = None  # one fused projection (Phi-3's gate_up_proj), else gate_proj, up_proj


def top_tensors(cfg: transformer.TransformerConfig) -> list[Tensor]:
  """Embedding, final norm and (untied) head.

  Args:
    cfg: the model.

  Returns:
    Their `Tensor`s.
  """
  d, v = cfg.d_model, cfg.vocab
  top = np.zeros((), int)
  out = [
      Tensor(("embed",), "model.embed_tokens.weight", top, 0, (v, d), 0),
      vector(("final_norm", "scale"), "model.norm.weight", top, (d,)),
  ]
  if not cfg.tied_embeddings:
    out.append(linear(("head",), "lm_head.weight", top, (v,), (d,)))
  return out


def attention_tensors(cfg, prefix, layers, names: Names = Names()) -> list[Tensor]:
  """One decoder layer's norms and attention (and its q/k norms) as `names` spells them.

  Args:
    cfg: the model.
    prefix: keys of the layer's leaves in the params dict.
    layers: the layer index at each position of the leaves' stack axes.
    names: the checkpoint's names of the layer's parts.

  Returns:
    Their `Tensor`s.

  Raises:
    CheckpointError: a fused qkv projection with biases (not read).
  """
  d, h, g, k = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  p, a = "model.layers.{i}.", "model.layers.{i}.self_attn."
  at = lambda *keys: prefix + ("attn",) + keys
  out = [
      vector(prefix + ("attn_norm", "scale"), p + names.attn_norm + ".weight", layers, (d,)),
      vector(prefix + ("mlp_norm", "scale"), p + names.mlp_norm + ".weight", layers, (d,)),
      linear(at("o", "kernel"), a + "o_proj.weight", layers, (d,), (h, k)),
  ]
  for leaf, name in (
      ("attn_post_norm", names.attn_post_norm),
      ("mlp_post_norm", names.mlp_post_norm),
  ):
    if cfg.sandwich_norm:
      out.append(vector(prefix + (leaf, "scale"), p + name + ".weight", layers, (d,)))
  heads = {"q": h, "k": g, "v": g}
  if names.qkv:  # rows q, then k, then v of one fused tensor
    total, start = (h + 2 * g) * k, 0
    for n, count in heads.items():
      rows = (start, start + count * k)
      out.append(
          linear(at(n, "kernel"), a + names.qkv + ".weight", layers, (count, k), (d,), rows, total)
      )
      start += count * k
    if cfg.qkv_bias:
      raise CheckpointError("a fused qkv projection with biases is not read")
  else:
    for n, count in heads.items():
      out.append(linear(at(n, "kernel"), a + f"{n}_proj.weight", layers, (count, k), (d,)))
      if cfg.qkv_bias:
        out.append(vector(at(n, "bias"), a + f"{n}_proj.bias", layers, (count, k)))
  if cfg.o_bias:
    out.append(vector(at("o", "bias"), a + "o_proj.bias", layers, (d,)))
  if cfg.qk_norm:
    out += [vector(at(f"{n}_norm", "scale"), a + f"{n}_norm.weight", layers, (k,)) for n in "qk"]
  return out


def mlp_tensors(cfg, prefix, layers, names: Names = Names()) -> list[Tensor]:
  """One dense layer's FFN, gate and up fused when `names.gate_up` says so.

  Args:
    cfg: the model.
    prefix: keys of the layer's leaves in the params dict.
    layers: the layer index at each position of the leaves' stack axes.
    names: the checkpoint's names of the layer's parts.

  Returns:
    Their `Tensor`s.

  Raises:
    CheckpointError: a fused gate_up projection with biases (not read).
  """
  d, f = cfg.d_model, cfg.d_ff
  m = "model.layers.{i}.mlp."
  at = lambda *keys: prefix + ("mlp",) + keys
  out = [linear(at("down", "kernel"), m + "down_proj.weight", layers, (d,), (f,))]
  for i, n in enumerate(("gate", "up")):
    if names.gate_up:
      rows = (i * f, (i + 1) * f)
      out.append(
          linear(at(n, "kernel"), m + names.gate_up + ".weight", layers, (f,), (d,), rows, 2 * f)
      )
    else:
      out.append(linear(at(n, "kernel"), m + f"{n}_proj.weight", layers, (f,), (d,)))
  if cfg.mlp_bias:
    if names.gate_up:
      raise CheckpointError("a fused gate_up projection with biases is not read")
    out += [vector(at(n, "bias"), m + f"{n}_proj.bias", layers, (f,)) for n in ("gate", "up")]
    out.append(vector(at("down", "bias"), m + "down_proj.bias", layers, (d,)))
  return out


def dense_tensors(cfg: transformer.TransformerConfig, names: Names = Names()) -> list[Tensor]:
  """Every parameter of a dense decoder (every layer alike) with its checkpoint tensors.

  Args:
    cfg: the model.
    names: the checkpoint's names of a layer's parts.

  Returns:
    The `Tensor`s of every leaf.
  """
  layers = np.arange(cfg.n_layers)
  return (
      top_tensors(cfg)
      + attention_tensors(cfg, ("layers",), layers, names)
      + mlp_tensors(cfg, ("layers",), layers, names)
  )


@dataclasses.dataclass(frozen=True)
class Family:
  """One transformers architecture (a module of `jaxpipe.models.families`)."""

  model_type: str  # config.json's model_type
  architecture: str  # its causal LM class, config.json's architectures
  defaults: dict  # transformers' values of fields config.json may leave out
  read: Callable[[Fields], transformer.TransformerConfig]  # config.json -> the model
  write: Callable[[dict, transformer.TransformerConfig], None]  # the model's fields into hf
  tensors: Callable[[transformer.TransformerConfig], list[Tensor]]  # every leaf's tensors
  ignored: frozenset = frozenset()  # fields its transformers class never reads
  moe: bool = False  # an MoE architecture (what an export without a source config tries)
  # the multi-token prediction modules a checkpoint holds, from config.json and its tensor names
  mtp_depth: Callable[[dict, set], int] = lambda hf, names: 0


def moe_tensors(
    cfg: transformer.TransformerConfig, block: str, experts: dict[str, str]
) -> list[Tensor]:
  """Every parameter of an MoE decoder: groups of `moe.every` layers, the last of each MoE.

  Args:
    cfg: the model, with `cfg.moe` set.
    block: the MoE FFN's prefix under a layer ("block_sparse_moe." in Mixtral, "mlp.").
    experts: jaxpipe's gate/up/down -> the expert's projection names (Mixtral: w1, w3, w2).

  Returns:
    The `Tensor`s of every leaf.
  """
  m, d = cfg.moe, cfg.d_model
  e, f = m.num_experts, m.d_ff
  every = m.every
  groups = np.arange(cfg.n_layers // every) * every
  moe_layers = groups + every - 1
  w, at = ("layers", "moe", "moe"), "model.layers.{i}." + block
  expert = lambda leaf, name, shape: Tensor(
      w + (leaf,), at + "experts.{e}." + experts[name] + ".weight", moe_layers, e, shape, 1
  )
  out = top_tensors(cfg) + attention_tensors(cfg, ("layers", "moe"), moe_layers)
  out += [
      linear(w + ("router_DxE",), at + "gate.weight", moe_layers, (e,), (d,)),
      expert("wi_gate_ExDxF", "gate", (d, f)),
      expert("wi_up_ExDxF", "up", (d, f)),
      expert("wo_ExFxD", "down", (f, d)),
  ]
  if every > 1:
    dense = groups[:, None] + np.arange(every - 1)
    out += attention_tensors(cfg, ("layers", "dense"), dense)
    out += mlp_tensors(cfg, ("layers", "dense"), dense)
  return out
