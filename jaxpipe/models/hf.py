"""Hugging Face checkpoints in and out, for every family of `jaxpipe.models.families`.

  plan = hf.check(src_dir)                      # config.json + safetensors headers, no tensor data
  cfg, params = hf.load(src_dir, shardings)     # tensor by tensor onto the mesh
  hf.save(cfg, params, dst_dir, hf_config)      # back, loadable by transformers and vLLM

A checkpoint directory is transformers' `save_pretrained` layout: `config.json` and one
`model.safetensors`, or shards listed in `model.safetensors.index.json`, each tensor named after
its PyTorch module (`model.layers.3.self_attn.q_proj.weight`, Linear weights `[out, in]`, MoE
experts one tensor each: `...block_sparse_moe.experts.5.w1.weight`).

`check` maps config.json onto `TransformerConfig` through the family its model_type names and
reads the safetensors headers. It refuses, naming the field or tensor, what the model would not
compute as transformers does (another model_type, a value of a field that changes the math and
is not implemented, a tensor missing, unknown or of the wrong shape), and names in one warning
line the fields it does not know, which transformers' class would not read either. `load` then
reads each device's block of each parameter, tensor by tensor, and puts it straight on that
device (layers split over pp and experts over ep when the shardings say so), so the host holds
one block at a time. Weights become float32 (exact from bf16, fp16 and fp32); `save` writes them
back in the source's dtype unless told otherwise, so a round trip is bit-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jaxpipe.models import rope as rope_lib
from jaxpipe.models import transformer
from jaxpipe.models.families import FAMILIES, CheckpointError, Fields, Tensor
from jaxpipe.ops import fp8

ARCHITECTURES = {name: f.architecture for name, f in FAMILIES.items()}
CONFIG_FILE = "config.json"
# WORKDIR/hf: where `python -m jaxpipe.convert hf-to-orbax` puts the source's config.json,
# tokenizer and other files that are not weights (read by the tokenizer, carried by the export)
HF_DIR = "hf"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors -> numpy names

# Tensors a checkpoint may carry that the model recomputes: (pattern, why).
_DERIVED = (
    (
        re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
        "rotary frequencies, recomputed from rope_theta",
    ),
)

__all__ = ["CheckpointError", "Tensor", "check", "load", "save", "hf_tensors"]


class UnknownFieldsWarning(UserWarning):
  """config.json holds fields jaxpipe does not know; transformers' class does not read them."""


# -- config.json <-> TransformerConfig ------------------------------------------------------------


def _family(model_type: Any, where: str = "config.json"):
  if model_type not in FAMILIES:
    hint = ""
    if model_type == "gemma3":
      hint = (
          " (a Gemma 3 vision-language checkpoint; jaxpipe reads Gemma 3's text model, gemma3_text)"
      )
    raise CheckpointError(
        f"{where}: model_type={model_type!r} is not supported{hint}; jaxpipe reads "
        f"{sorted(FAMILIES)}"
    )
  return FAMILIES[model_type]


def config_from_hf(hf: dict, warn: bool = True) -> transformer.TransformerConfig:
  """The TransformerConfig of a transformers config.json (a dict); CheckpointError if none fits.

  Args:
    hf: config.json as read.
    warn: say in one warning line (`UnknownFieldsWarning`) which fields no family reads.

  Returns:
    The model config.json describes.
  """
  family = _family(hf.get("model_type"))
  archs = hf.get("architectures") or [family.architecture]
  if archs != [family.architecture]:
    raise CheckpointError(
        f"config.json: architectures={archs!r}; jaxpipe reads a causal LM, "
        f"{[family.architecture]}"
    )
  if hf.get("quantization_config"):
    raise CheckpointError(
        "config.json: quantization_config is set: the weights are quantized, which jaxpipe "
        "does not read; convert a checkpoint in float32, bfloat16 or float16"
    )
  fields = Fields(hf, family.model_type, family.defaults, family.ignored)
  try:
    cfg = family.read(fields)
  except CheckpointError:
    raise
  except ValueError as e:
    raise CheckpointError(f"config.json: {e}") from e
  unknown = fields.unknown()
  if unknown and warn:
    warnings.warn(
        f"config.json: ignoring fields jaxpipe does not know for model_type "
        f"{family.model_type!r} (transformers' {family.architecture} reads none of them): "
        + ", ".join(unknown),
        UnknownFieldsWarning,
        stacklevel=2,
    )
  return cfg


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
    "rope_fraction",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "activation",
    "norm_plus_one",
    "sandwich_norm",
    "embed_scale",
    "attn_softcap",
    "final_softcap",
    "layer_windows",
    "mla",
    "first_dense",
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
  fields["rope_scaling"] = rope_lib.scaling_of(cfg.rope_scaling)
  fields["attn_scale_dim"] = cfg.attn_scale_dim or cfg.head_dim
  if cfg.mla is not None:  # latent attention: its own widths; every head its own keys
    fields.update(n_kv_heads=None, head_dim=None, attn_scale_dim=None)
  if any(cfg.layer_windows):  # the sliding layers' rotary, which full layers do not use
    fields["rope_local"] = (
        (cfg.rope_local_theta, rope_lib.RopeScaling())
        if cfg.rope_local_theta
        else (cfg.rope_theta, fields["rope_scaling"])
    )
  if cfg.moe is not None:
    m = cfg.moe
    fields.update({f"moe.{f}": getattr(m, f) for f in _MOE_FIELDS})
    renorms_top1 = m.norm_topk_prob and (m.norm_top1 or m.router == "sigmoid")
    fields["moe.norm_top1"] = renorms_top1 if m.top_k == 1 else None  # moot at K > 1
    if m.every == 1:
      fields["d_ff"] = None  # no dense FFN
  return fields


def _computes(family, cfg, hf: dict) -> str | None:
  """Why config.json `hf` (written by `family`) computes another model than cfg, or None."""
  try:
    back = config_from_hf(hf, warn=False)
  except CheckpointError as e:
    return f"no {family.model_type} config.json computes this model: {e}"
  want, got = _function_fields(cfg), _function_fields(back)
  for field in sorted(want, key=lambda f: f != "mla"):  # the attention's kind decides the rest
    if want[field] != got.get(field):
      return (
          f"model.{field}={want[field]!r} has no counterpart in {family.model_type} (which would "
          f"compute {got.get(field)!r}); export needs a model that {family.architecture} computes"
      )
  return None


def config_to_hf(cfg: transformer.TransformerConfig, base: dict | None = None) -> dict:
  """config.json for `cfg`: `base` (the source's) with the model's fields set, or a new one.

  Without a base, the first family (in `FAMILIES` order: Llama first) that computes cfg.

  Args:
    cfg: the model.
    base: the source checkpoint's config.json, whose other fields are kept.

  Returns:
    The config.json dict.

  Raises:
    CheckpointError: naming the field, when no supported architecture computes cfg.
  """
  if base is not None:
    family = _family(base.get("model_type"), "base config.json")
    hf = json.loads(json.dumps(base))
    family.write(hf, cfg)
    if (why := _computes(family, cfg, hf)) is not None:
      raise CheckpointError(why)
    return hf
  reasons = []
  for family in FAMILIES.values():
    if family.moe != (cfg.moe is not None):
      continue
    hf = {"architectures": [family.architecture], "model_type": family.model_type}
    family.write(hf, cfg)
    if cfg.moe is not None:  # the training objective, as transformers spells it
      hf.update(
          output_router_logits=cfg.moe.lb_loss_coef > 0,
          router_aux_loss_coef=cfg.moe.lb_loss_coef,
      )
    why = _computes(family, cfg, hf)
    if why is None:
      return hf
    reasons.append(why)
  raise CheckpointError(reasons[0])  # the first family's: Llama's, or Mixtral's for MoE


def tensors(cfg: transformer.TransformerConfig, model_type: str) -> list[Tensor]:
  """Every parameter leaf of `cfg`'s model with the checkpoint tensors it is made of.

  Args:
    cfg: the model.
    model_type: the family's transformers `model_type` (its names and fused tensors).

  Returns:
    The `Tensor`s of every leaf.

  Raises:
    CheckpointError: an unsupported `model_type`.
  """
  return _family(model_type).tensors(cfg)


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
  """Reads config.json and the safetensors headers, before any device work.

  Args:
    directory: a checkpoint directory written by transformers' `save_pretrained`.

  Returns:
    The plan: the model config and where each tensor is (`load` takes it).

  Raises:
    CheckpointError: naming what does not fit (a refused field, a missing or misshapen tensor).
  """
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(
        f"{directory} has no {CONFIG_FILE}; point to a directory written by save_pretrained"
    )
  with open(path) as f:
    hf = json.load(f)
  cfg = config_from_hf(hf)
  where, meta = _headers(directory)
  depth = _family(hf["model_type"]).mtp_depth(hf, set(where))
  if depth:  # the multi-token prediction modules the checkpoint holds
    cfg = dataclasses.replace(cfg, mtp_depth=depth)
  plan = tensors(cfg, hf["model_type"])
  _check_leaves(cfg, plan)
  want = {name: t for t in plan if not t.copy for _, name in t.names()}
  ignored = {name: why for name in where for pattern, why in _DERIVED if pattern.fullmatch(name)}
  for t in plan:
    if t.copy:  # not read: the leaf is read from its own tensor
      ignored.update({n: f"a copy of parameter {'/'.join(t.path)}" for _, n in t.names()})
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
    if shape != want[name].file_shape:
      raise CheckpointError(
          f"tensor {name} has shape {list(shape)}, but config.json implies "
          f"{list(want[name].file_shape)}"
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
  mapped = {t.path: t.leaf_shape for t in plan if not t.copy}
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

    self._last = (None, None)  # the fused tensors' parts read one tensor in turn

  def get(self, name: str) -> np.ndarray:
    if self._last[0] == name:
      return self._last[1]
    with jax.default_device(self._cpu):  # bfloat16 needs the flax reader; keep it off accelerators
      tensor = np.asarray(self._files[self._plan.files[name]].get_tensor(name), np.float32)
    self._last = (name, tensor)
    return tensor


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


def _place(t: Tensor, reader: _Reader, sharding: jax.sharding.Sharding, dtype) -> jax.Array:
  """t's leaf on `sharding` in `dtype`: each distinct block read once, cast, and put on the
  devices that hold it."""
  shape = t.leaf_shape
  blocks: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple(s.indices(n) for s, n in zip(index, shape))
    blocks.setdefault(key, []).append(device)
  arrays = []
  for key, devices in blocks.items():
    block = _read_block(t, reader, tuple(slice(*k) for k in key)).astype(dtype, copy=False)
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
    directory: str | Plan, shardings: Any = None, dtype: str = "float32"
) -> tuple[transformer.TransformerConfig, dict]:
  """Reads a checkpoint's weights onto the devices, one tensor at a time.

  Args:
    directory: a checkpoint directory, or the `Plan` that `check` made of it.
    shardings: a pytree of Shardings shaped like the params (e.g.
      `jaxpipe.training.state.state_shardings` of their shapes on a mesh), one Sharding for all,
      or None for the first device.
    dtype: the params' dtype; each block is cast as it is read (e.g. 'bfloat16' to serve in:
      the weights are never held whole in float32).

  Returns:
    (the model config, its params in `dtype`), each leaf placed on its sharding.
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
  dtype = jnp.dtype(dtype)
  read = [t for t in plan.tensors if not t.copy]
  nbytes = lambda t: math.prod(t.leaf_shape) * dtype.itemsize
  # a bar on a terminal only (disable=None): a large checkpoint reads for minutes
  bar = tqdm.tqdm(
      total=sum(map(nbytes, read)),
      unit="B",
      unit_scale=True,
      desc="reading weights",
      disable=None,
      file=sys.stderr,
  )
  leaves = []
  with contextlib.ExitStack() as stack, bar:
    reader = _Reader(plan, stack)
    for t in read:
      leaves.append((t.path, _place(t, reader, shard_of(t.path), dtype)))
      bar.update(nbytes(t))
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
  """Every tensor of `params` as the checkpoint names and lays it out.

  Args:
    cfg: the model config.
    params: the params, or any tree shaped like them (gradients too).
    model_type: the family's transformers `model_type` (its names and fused tensors).
    dtype: the arrays' dtype.

  Returns:
    An iterator of (checkpoint name, numpy array); the host holds one block at a time (a fused
    tensor's parts until its last part).
  """
  plan = tensors(cfg, model_type)
  _check_leaves(cfg, plan)
  dtype = np.dtype(dtype)
  parts = {}  # fused tensors: name -> the number of leaves it is made of
  for t in plan:
    if t.rows:
      parts[t.pattern] = parts.get(t.pattern, 0) + 1
  pending: dict[str, dict[int, np.ndarray]] = {}
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
        array = t.to_hf(block[local]).astype(dtype)
        if t.rows:  # one part of a fused tensor: whole once every part is in
          got = pending.setdefault(name, {})
          got[t.rows[0]] = array
          if len(got) < parts[t.pattern]:
            continue
          array = np.concatenate([got[k] for k in sorted(got)])
          del pending[name]
        yield name, np.ascontiguousarray(array)


def save(
    cfg: transformer.TransformerConfig,
    params: dict,
    directory: str,
    hf_config: dict | None = None,
    dtype: Any = None,
    max_shard_bytes: int = 4 << 30,
) -> dict:
  """Writes `params` as a transformers checkpoint directory.

  Files hold at most `max_shard_bytes` each (but one tensor each at least), listed in an index
  when there are several. Existing weights in `directory` are replaced.

  Args:
    cfg: the model.
    params: the model's parameters.
    directory: the checkpoint directory, made if missing.
    hf_config: the source's config.json, kept but for the model's fields (`config_to_hf`).
    dtype: of the written weights; default the one hf_config names, else float32.
    max_shard_bytes: the most bytes of one safetensors file.

  Returns:
    The config.json written.

  Raises:
    CheckpointError: no supported architecture computes `cfg`.
    ValueError: a dtype other than float32, bfloat16 or float16, or parameters split in a way the
      export does not read.
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
