"""Decoder-only Transformer LM: a Flax layer, exposed as pure functions over a parameter dict.

Parameters are a plain dict pytree:

  {'embed': [vocab, d_model],
   'layers': per-layer params stacked on a leading [n_layers] axis,
   'final_norm': {'scale': [d_model]},
   'head': [d_model, vocab]}              # absent when cfg.tied_embeddings

The model is `embed -> apply_layers -> head_loss`. `apply_layers` is a `lax.scan` over whatever
leading layer axis it is given, so any contiguous slice of `params['layers']` is a valid block:
reshaping every leaf to `[num_stages, layers_per_stage, ...]` and indexing a stage gives that
pipeline stage's `(params, x) -> x` function.

With `cfg.moe` (an MoE FFN every `moe.every` = k layers) the scanned unit is a group of k
layers, k-1 dense then one MoE, so the leading axis of `params['layers']` counts groups,
n_layers / k of them: `{'dense': [groups, k-1, ...], 'moe': [groups, ...]}` ('dense' absent for
k = 1). `apply_layers_aux` also returns the MoE layers' auxiliary losses and routing statistics;
`apply_layers` folds the auxiliary losses into the gradient instead (`attach_aux_loss`).

Every projection (QKV, attention output, MLP) is a `Dense`, whose matmul runs in `cfg.fp8`
(`jaxpipe.ops.fp8`: none, or Transformer Engine's delayed, current or block recipe); MoE
experts take the same recipe in their grouped GEMM. With 'delayed' each projection also holds
an `fp8_scale` leaf [3] (see fp8.py). Embedding, head, norms, router and attention core stay in
the compute dtype.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.models import moe as moe_lib
from jaxpipe.models.attention import attention, context_axis, context_parallel, point_to_point
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.ops.vma import vary_like
from jaxpipe.parallel import overlap
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.parallel.ulysses import check_divisible

REMAT = (False, True, "selective")  # TransformerConfig.remat's values


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Model hyper-parameters; hashable, so it can be a static jit argument."""

  vocab: int = 256  # vocabulary size; 256 = raw bytes
  d_model: int = 128  # residual stream width
  n_layers: int = 4  # decoder layers
  n_heads: int = 4  # query heads
  n_kv_heads: int = 2  # key/value heads; divides n_heads (grouped-query attention)
  head_dim: int = 32  # width of one head; even
  d_ff: int = 512  # SwiGLU hidden width
  rope_theta: float = 10_000.0  # rotary embedding base
  qk_norm: bool = False  # RMSNorm of each query and key head over head_dim before rotary (Qwen3)
  norm_eps: float = 1e-6  # RMSNorm epsilon
  tied_embeddings: bool = True  # head reuses the embedding matrix
  attention: str = "xla"  # backend name passed to jaxpipe.models.attention.attention
  dtype: str = "float32"  # compute dtype; parameters stay float32
  # recompute in the backward: False (keep every activation), True (each layer's), or
  # 'selective' (the attention core's only, Megatron's: its [L, L] scores are not kept)
  remat: bool | str = False
  cp_overlap: bool = False  # cp > 1: fuse projections with Ulysses' all-to-alls (ppermute ring)
  sequence_parallel: bool = False  # tp > 1: norms and residuals split along the sequence over tp
  moe: Any = (
      None  # MoE FFN sub-config (moe.MoEConfig, or its dict); None = dense FFN in every layer
  )
  fp8: str = "none"  # FP8 GEMM recipe of the projections and experts: none, delayed, current, block
  fp8_history: int = 1024  # delayed: amax history length, in steps
  fp8_margin: int = 0  # delayed: scale = fp8_max / amax / 2^margin
  fp8_amax: str = "max"  # delayed: amax from the history's 'max' or its 'most_recent' entry
  # a stack of at most this many layers (MoE: groups) runs unrolled, no residual stacked and
  # copied; a longer one, any under remat, or under fsdp (one layer gathered at a time), as a
  # lax.scan loop (0: always the loop). Pipelined stages run their layers their own way.
  unroll_layers: int = 0

  def __post_init__(self):
    fp8_lib.check_recipe(self.fp8)
    if self.remat not in REMAT:
      raise ValueError(
          f"remat={self.remat!r} is unknown; use False (keep activations), True (recompute "
          "each layer) or 'selective' (recompute the attention core)"
      )
    u = self.unroll_layers
    if isinstance(u, bool) or not isinstance(u, int) or u < 0:
      raise ValueError(
          f"unroll_layers={u!r} must be an integer >= 0 (0: the layers always in a lax.scan loop)"
      )
    if self.fp8 != "none" and self.cp_overlap:
      raise ValueError(
          f"fp8={self.fp8!r} with cp_overlap=True: the projections fused with "
          "Ulysses' all-to-alls run in the compute dtype only; set cp_overlap=False"
      )
    if isinstance(self.moe, dict):  # from an ml_collections config
      object.__setattr__(self, "moe", moe_lib.MoEConfig(**self.moe))
    if self.moe is not None and self.n_layers % self.moe.every:
      raise ValueError(
          f"n_layers={self.n_layers} is not a multiple of moe.every={self.moe.every}; "
          "layers come in groups of moe.every (the last of each is MoE)"
      )

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)


def rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * scale, computed in float32."""
  x = x_BxLxD.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return (y * scale_D).astype(x_BxLxD.dtype)


def rope(x_BxLxHxK: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, channels i and i + K/2 forming a pair (the GPT-NeoX / Llama layout).

  positions: [L] (the same for every row) or [B, L] (per row: packed sequences).
  """
  half = x_BxLxHxK.shape[-1] // 2
  freq_K2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None] * freq_K2  # [L, K/2] or [B, L, K/2]
  angle_BxLxK2 = angle[None] if angle.ndim == 2 else angle
  sin, cos = jnp.sin(angle_BxLxK2)[:, :, None, :], jnp.cos(angle_BxLxK2)[:, :, None, :]
  x = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxLxHxK.dtype)


# Normal, not Flax's default truncated normal: same scale, and XLA compiles it several times faster.
_KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x_BxLxD):
    scale_D = self.param("scale", nn.initializers.ones, (x_BxLxD.shape[-1],), jnp.float32)
    return rms_norm(x_BxLxD, scale_D, self.eps)


def _kernel_init(in_dims: int):
  def init(rng, shape, dtype):  # DenseGeneral's: fan-in over all contracted axes together
    flat = (int(np.prod(shape[:in_dims])), int(np.prod(shape[in_dims:])))
    return _KERNEL_INIT(rng, flat, dtype).reshape(shape)

  return init


class Kernel(nn.Module):
  """A bias-free DenseGeneral's kernel alone (same name, shape and init), for fused callers."""

  shape: tuple[int, ...]
  in_dims: int  # leading axes of `shape` that the projection contracts

  @nn.compact
  def __call__(self) -> jax.Array:
    return self.param("kernel", _kernel_init(self.in_dims), self.shape, jnp.float32)


class Dense(nn.Module):
  """x's last `in_dims` axes projected to `features`: a bias-free DenseGeneral (same kernel name,
  shape and init) whose matmul runs in `cfg.fp8` (`fp8.dot`); every projection of the model."""

  features: tuple[int, ...]
  cfg: TransformerConfig
  in_dims: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = x.shape[x.ndim - self.in_dims :] + tuple(self.features)
    w = self.param("kernel", _kernel_init(self.in_dims), shape, jnp.float32)
    scale_3 = None
    if self.cfg.fp8 == "delayed":  # dequantisation scales of (x, w, g); see fp8.py
      scale_3 = self.param("fp8_scale", nn.initializers.ones, (3,), jnp.float32)
    return fp8_lib.dot(x, w, self.in_dims, self.cfg.fp8, scale_3, self.cfg.compute_dtype)


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary positions.

  positions: [L] or [B, L]; segment_ids_BxL (packed rows: 1, 2, ... per document, 0 padding)
  lets a token attend only to earlier tokens of its own segment, None to every earlier token.
  """

  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD, positions_L, segment_ids_BxL=None):
    c = self.cfg
    axis_name = context_axis()
    if c.cp_overlap and axis_name is not None:
      return self._overlapped(x_BxLxD, positions_L, axis_name, segment_ids_BxL)
    # Under tensor parallelism: this rank's heads of the whole sequence (tp_lib)
    x_BxLxD = tp_lib.gather_tokens(x_BxLxD)
    heads, kv_heads = tp_lib.local_heads(c.n_heads, c.n_kv_heads)
    q_BxLxHxK = Dense((heads, c.head_dim), c, name="q")(x_BxLxD)
    k_BxLxGxK = Dense((kv_heads, c.head_dim), c, name="k")(x_BxLxD)
    v_BxLxGxK = Dense((kv_heads, c.head_dim), c, name="v")(x_BxLxD)
    k_BxLxGxK = tp_lib.kv_group(k_BxLxGxK, c.n_heads, c.n_kv_heads)
    v_BxLxGxK = tp_lib.kv_group(v_BxLxGxK, c.n_heads, c.n_kv_heads)
    q_BxLxHxK, k_BxLxGxK = self._qk_norm(q_BxLxHxK, k_BxLxGxK)
    q_BxLxHxK = rope(q_BxLxHxK, positions_L, c.rope_theta)
    k_BxLxGxK = rope(k_BxLxGxK, positions_L, c.rope_theta)
    core = functools.partial(
        attention, causal=True, backend=c.attention, segment_ids=segment_ids_BxL
    )
    if c.remat == "selective":  # keep q, k, v; recompute the scores in the backward
      core = jax.checkpoint(core)
    o_BxLxHxK = core(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    return tp_lib.reduce_tokens(Dense((c.d_model,), c, in_dims=2, name="o")(o_BxLxHxK))

  def _qk_norm(self, q_BxLxHxK, k_BxLxGxK):
    """Per-head RMSNorm of queries and keys with `cfg.qk_norm`
    (one scale per channel, all heads)."""
    if not self.cfg.qk_norm:
      return q_BxLxHxK, k_BxLxGxK
    eps = self.cfg.norm_eps
    return RMSNorm(eps, name="q_norm")(q_BxLxHxK), RMSNorm(eps, name="k_norm")(k_BxLxGxK)

  def _overlapped(self, x_BxSxD, positions_S, axis_name, segment_ids_BxS=None):
    """Ulysses with each projection fused into its all-to-all (`jaxpipe.parallel.overlap`).

    x holds this rank's L/P tokens; between the two fused steps every rank holds all L tokens
    of H/P heads. Parameters are the DenseGeneral path's, so either path reads a checkpoint.
    positions_S ([S] or [B, S]) and segment_ids_BxS are this rank's slices; both are gathered.

    Under tensor parallelism the same on this tp rank's heads (H/tp; `tp_lib.check` makes the
    KV heads split over tp whenever cp > 1): the sequence is gathered over tp first with
    sequence parallelism, and the output projection's partial sum reduced over tp after.
    """
    c = self.cfg
    cp = jax.lax.axis_size(axis_name)
    x_BxSxD = tp_lib.gather_tokens(x_BxSxD)
    heads, kv_heads = tp_lib.local_heads(c.n_heads, c.n_kv_heads)
    check_divisible(x_BxSxD.shape[1] * cp, heads, kv_heads, cp, axis_name)
    dt = c.compute_dtype
    x_BxSxD = x_BxSxD.astype(dt)
    w = {
        name: Kernel(shape, 1, name=name)().astype(dt)
        for name, shape in (
            ("q", (c.d_model, heads, c.head_dim)),
            ("k", (c.d_model, kv_heads, c.head_dim)),
            ("v", (c.d_model, kv_heads, c.head_dim)),
        )
    }
    w_o_HxKxD = Kernel((heads, c.head_dim, c.d_model), 2, name="o")().astype(dt)
    # Rotary angles are per token, so they commute with the all-to-all: rotate after it, at the
    # positions of the whole (gathered) sequence.
    positions_L = jax.lax.all_gather(positions_S, axis_name, axis=positions_S.ndim - 1, tiled=True)
    segment_ids_BxL = None
    if segment_ids_BxS is not None:
      segment_ids_BxL = jax.lax.all_gather(segment_ids_BxS, axis_name, axis=1, tiled=True)
    if point_to_point():  # a ppermute ring
      proj_a2a, a2a_proj = overlap.proj_a2a_local, overlap.a2a_proj_local
    else:  # chunks of tokens, each its own all_to_all
      chunks = math.gcd(x_BxSxD.shape[1], cp)
      proj_a2a = functools.partial(overlap.proj_a2a_chunked_local, chunks=chunks)
      a2a_proj = functools.partial(overlap.a2a_proj_chunked_local, chunks=chunks)
    q_BxLxHpxK, k_BxLxGpxK, v_BxLxGpxK = (
        proj_a2a(x_BxSxD, w[name], axis_name=axis_name) for name in "qkv"
    )
    q_BxLxHpxK, k_BxLxGpxK = self._qk_norm(
        q_BxLxHpxK, k_BxLxGpxK
    )  # per token and head: after the a2a
    q_BxLxHpxK = rope(q_BxLxHpxK, positions_L, c.rope_theta)
    k_BxLxGpxK = rope(k_BxLxGpxK, positions_L, c.rope_theta)
    with context_parallel(None):  # head shards of the full sequence: a plain attention core
      o_BxLxHpxK = attention(
          q_BxLxHpxK,
          k_BxLxGpxK,
          v_BxLxGpxK,
          causal=True,
          backend=c.attention,
          segment_ids=segment_ids_BxL,
      )
    return tp_lib.reduce_tokens(a2a_proj(o_BxLxHpxK, w_o_HxKxD, axis_name=axis_name))


class Mlp(nn.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    c = self.cfg
    dense = lambda width, name: Dense((width,), c, name=name)
    x_BxLxD = tp_lib.gather_tokens(x_BxLxD)  # tensor parallel: d_ff / tp of the whole sequence
    d_ff = c.d_ff // tp_lib.size()
    h_BxLxF = nn.silu(dense(d_ff, "gate")(x_BxLxD)) * dense(d_ff, "up")(x_BxLxD)
    return tp_lib.reduce_tokens(dense(c.d_model, "down")(h_BxLxF))


class Block(nn.Module):
  """One pre-norm decoder layer; with `moe` its FFN is `cfg.moe` and it returns (x, moe aux)."""

  cfg: TransformerConfig
  moe: bool = False

  @nn.compact
  def __call__(self, x_BxLxD, positions_L, segment_ids_BxL=None):
    c = self.cfg
    x_BxLxD = x_BxLxD + Attention(c, name="attn")(
        RMSNorm(c.norm_eps, name="attn_norm")(x_BxLxD), positions_L, segment_ids_BxL
    )
    if self.moe:
      y_BxLxD, aux = moe_lib.MoEFFN(c.moe, c.compute_dtype, c.fp8, name="moe")(
          RMSNorm(c.norm_eps, name="mlp_norm")(x_BxLxD)
      )
      return x_BxLxD + y_BxLxD, aux
    return x_BxLxD + Mlp(c, name="mlp")(RMSNorm(c.norm_eps, name="mlp_norm")(x_BxLxD))


def init_params(cfg: TransformerConfig, rng: jax.Array) -> dict:
  """Fresh float32 parameters; `layers` leaves carry a leading [n_layers] axis."""
  k_embed, k_layers, k_head = jax.random.split(rng, 3)
  x_1x1xD = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
  block = Block(cfg)
  init_dense = lambda k: block.init(k, x_1x1xD, jnp.arange(1))["params"]
  if cfg.moe is None:
    layers = jax.vmap(init_dense)(jax.random.split(k_layers, cfg.n_layers))
  else:
    every = cfg.moe.every

    def init_group(k):
      k_dense, k_moe = jax.random.split(k)
      group = {"moe": Block(cfg, moe=True).init(k_moe, x_1x1xD, jnp.arange(1))["params"]}
      if every > 1:
        group["dense"] = jax.vmap(init_dense)(jax.random.split(k_dense, every - 1))
      return group

    layers = jax.vmap(init_group)(jax.random.split(k_layers, cfg.n_layers // every))
  # Unit-variance logits at init: normalised x (entries ~1) times entries of scale d_model^-1/2.
  scale = cfg.d_model**-0.5
  params = {
      "embed": scale * jax.random.normal(k_embed, (cfg.vocab, cfg.d_model), jnp.float32),
      "layers": layers,
      "final_norm": {"scale": jnp.ones((cfg.d_model,), jnp.float32)},
  }
  if not cfg.tied_embeddings:
    params["head"] = scale * jax.random.normal(k_head, (cfg.d_model, cfg.vocab), jnp.float32)
  return params


def embed(cfg: TransformerConfig, params: dict, tokens_BxL: jax.Array) -> jax.Array:
  """Token embedding lookup, in the compute dtype (vocabulary-parallel under `tp_lib`)."""
  return tp_lib.vocab_embed(params["embed"], tokens_BxL).astype(cfg.compute_dtype)


def check_packed(
    tokens_BxL: Any, segment_ids_BxL: Any = None, positions_BxL: Any = None, where: str = "batch"
) -> None:
  """Raises ValueError unless packed-sequence keys are integer arrays shaped like the tokens.

  Packed rows hold several documents: `segment_ids` numbers them 1, 2, ... along the row (0 for
  padding) and `positions` restart at 0 at each document's first token.
  """
  for name, a in (("segment_ids", segment_ids_BxL), ("positions", positions_BxL)):
    if a is None:
      continue
    if tuple(np.shape(a)) != tuple(np.shape(tokens_BxL)):
      raise ValueError(
          f"{where}[{name!r}] has shape {tuple(np.shape(a))} but tokens have "
          f"{tuple(np.shape(tokens_BxL))}; give one {name} entry per token, [batch, seq]"
      )
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{where}[{name!r}] has dtype {a.dtype}; pass integers (int32)")


PACKED_KEYS = ("segment_ids", "positions")  # optional int32 [batch, seq] keys of packed rows


def packed_keys(batch: dict) -> dict:
  """A batch dict's packed-sequence keys present ({} for unpacked rows), checked (`check_packed`).

  `segment_ids` number a row's documents 1, 2, ... (0: padding) and keep attention inside each;
  `positions` restart at 0 at each document (rotary). Absent keys keep the plain behaviour: one
  sequence per row at positions 0..L-1.
  """
  keys = {k: batch[k] for k in PACKED_KEYS if batch.get(k) is not None}
  check_packed(batch["tokens"], keys.get("segment_ids"), keys.get("positions"))
  return keys


def apply_layers(
    cfg: TransformerConfig,
    layers: Any,
    x_BxLxD: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
  """Runs the stacked layers in order (a scan over their leading axis); positions default to 0..L-1.

  positions: [L] or [B, L] (packed rows restart them at each document); segment_ids_BxL keeps
  attention within each document (`Attention`). MoE layers' auxiliary losses join the gradient
  through `attach_aux_loss`, weighted by the tokens of `x`, as if `aux * tokens` were added to a
  summed loss.
  """
  return _apply_layers(cfg, layers, x_BxLxD, positions_L, segment_ids_BxL, attach=True)[0]


def apply_layers_aux(
    cfg: TransformerConfig,
    layers: Any,
    x_BxLxD: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """`apply_layers` without attachment, plus the MoE layers' aux (leading axis: MoE layers).

  aux is `moe.moe_layer`'s dict ({} for a dense model); `moe.aux_objective` of it is for the
  caller to add.
  """
  return _apply_layers(cfg, layers, x_BxLxD, positions_L, segment_ids_BxL, attach=False)


def attach_aux_loss(x: jax.Array, aux_loss: jax.Array) -> jax.Array:
  """Identity on x whose backward also sends cotangent 1 to `aux_loss` (Megatron's aux-loss scaler).

  Inside a `shard_map` the loss is first cast to vary like x, so that the cotangents of every
  shard's copy are summed on the way back.
  """
  return _attach(x, vary_like(aux_loss, x))


@jax.custom_vjp
def _attach(x, aux_loss):
  return x


_attach.defvjp(lambda x, a: (x, a), lambda a, g: (g, jnp.ones_like(a)))


def apply_unit(
    cfg: TransformerConfig,
    unit: Any,
    x_BxLxD: jax.Array,
    positions_L: jax.Array,
    attach: bool = True,
    segment_ids_BxL: jax.Array | None = None,
):
  """One element of the layers' leading axis: a layer, or with `cfg.moe` a group ending in MoE.

  Returns x, or (x, aux) for an MoE group with attach=False; with attach=True the group's
  auxiliary loss rides on x's gradient (`attach_aux_loss`). positions: [L] or [B, L].
  """
  seg = segment_ids_BxL
  if cfg.moe is None:
    return Block(cfg).apply({"params": unit}, x_BxLxD, positions_L, seg)
  if "dense" in unit:
    dense = lambda x, layer: (Block(cfg).apply({"params": layer}, x, positions_L, seg), None)
    x_BxLxD, _ = jax.lax.scan(dense, x_BxLxD, unit["dense"])
  x_BxLxD, aux = Block(cfg, moe=True).apply({"params": unit["moe"]}, x_BxLxD, positions_L, seg)
  if not attach:
    return x_BxLxD, aux
  return _attach_unit_aux(cfg, x_BxLxD, aux)


def _attach_unit_aux(
    cfg: TransformerConfig, x_BxLxD: jax.Array, aux: dict, tokens: int | None = None
) -> jax.Array:
  """x with the MoE group's auxiliary loss on its gradient, weighted by `tokens` (default the
  tokens of x)."""
  if cfg.moe.lb_loss_form == "pooled" and cfg.moe.lb_loss_coef:
    raise ValueError(
        "moe.lb_loss_form='pooled' couples all MoE layers, so it cannot ride on each "
        "layer's gradient (pipeline, context- and tensor-parallel paths, fsdp); use "
        "loss_and_aux with moe.aux_objective, or moe.lb_loss_form='per_layer'"
    )
  tokens = x_BxLxD.shape[0] * x_BxLxD.shape[1] if tokens is None else tokens
  return attach_aux_loss(x_BxLxD, aux["loss"] * tokens)


def _apply_layers(cfg, layers, x_BxLxD, positions_L, segment_ids_BxL, attach):
  if positions_L is None:  # the whole sequence's, also where the stream holds a slice of it
    positions_L = jnp.arange(x_BxLxD.shape[1] * tp_lib.token_split())

  def body(x_BxLxD, unit):
    out = apply_unit(cfg, unit, x_BxLxD, positions_L, attach, segment_ids_BxL)
    return out if isinstance(out, tuple) else (out, None)

  if cfg.remat is True:  # 'selective' is the attention core's own (Attention)
    body = jax.checkpoint(body)
  units = jax.tree.leaves(layers)[0].shape[0]
  x_BxLxD, aux = jax.lax.scan(body, x_BxLxD, layers, unroll=stack_unroll(cfg, units))
  return x_BxLxD, {} if aux is None else aux


def stack_unroll(cfg: TransformerConfig, units: int) -> int:
  """The `unroll` of a `lax.scan` over a stack of `units` layers (MoE: groups): all of them
  where `cfg.unroll_layers` allows, else 1 (a loop).

  Unrolled, each residual stays where its layer made it; a scan stacks them in buffers it
  fills, writes slice by slice and the backward reads back. Not under remat: unrolled, XLA
  schedules the recomputation beside the forward and keeps what remat would free."""
  return units if 0 < units <= cfg.unroll_layers and cfg.remat is False else 1


def logits(cfg: TransformerConfig, params: dict, x_BxLxD: jax.Array) -> jax.Array:
  """Final norm and output head; float32 logits (under `tp_lib`: this rank's vocabulary
  slice, of the whole sequence)."""
  x_BxLxD = tp_lib.gather_tokens(rms_norm(x_BxLxD, params["final_norm"]["scale"], cfg.norm_eps))
  w_DxV = params["embed"].T if cfg.tied_embeddings else params["head"]
  return jnp.dot(x_BxLxD, w_DxV.astype(cfg.compute_dtype), preferred_element_type=jnp.float32)


def head_loss(
    cfg: TransformerConfig,
    params: dict,
    x_BxLxD: jax.Array,
    targets_BxL: jax.Array,
    mask_BxL: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """(sum of masked next-token cross-entropy, number of valid tokens); the caller divides."""
  logz_BxL, target_BxL = tp_lib.vocab_cross_entropy(logits(cfg, params, x_BxLxD), targets_BxL)
  mask_BxL = mask_BxL.astype(jnp.float32)
  return jnp.sum((logz_BxL - target_BxL) * mask_BxL), jnp.sum(mask_BxL)


def mean_weights(mask_BxL: jax.Array) -> jax.Array:
  """Loss weights mask · N / (valid tokens): a weighted sum over all N tokens is the valid mean.

  For paths whose MoE auxiliary losses ride on the gradient (`apply_layers` weighs each with the
  tokens it saw, N/m per micro-batch): weighted cross-entropy plus attached aux, divided by the
  static N, is the mean cross-entropy over valid tokens plus the mean over micro-batches of the
  aux losses (the trainer's objective), with no data-dependent scale inside the layers.
  """
  mask_BxL = mask_BxL.astype(jnp.float32)
  return mask_BxL * (mask_BxL.size / jnp.maximum(jnp.sum(mask_BxL), 1.0))


def forward(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None = None,
    positions_BxL: jax.Array | None = None,
) -> jax.Array:
  """Next-token logits [B, L, vocab], float32; their gradient is theirs alone (no MoE aux loss).

  Packed rows pass `segment_ids_BxL` and `positions_BxL` (see `check_packed`); without them
  every row is one sequence at positions 0..L-1.
  """
  check_packed(tokens_BxL, segment_ids_BxL, positions_BxL, "forward")
  x_BxLxD, _ = apply_layers_aux(
      cfg, params["layers"], embed(cfg, params, tokens_BxL), positions_BxL, segment_ids_BxL
  )
  return logits(cfg, params, x_BxLxD)


def loss(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    targets_BxL: jax.Array,
    mask_BxL: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None = None,
    positions_BxL: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(summed masked cross-entropy, valid-token count) of a dense model; MoE: `loss_and_aux`.

  Packed rows pass `segment_ids_BxL` and `positions_BxL` (`check_packed`), as `forward` does.
  """
  if cfg.moe is not None:
    # Attached aux losses would make the gradient that of CE sum + B·L·aux while the value is the
    # CE sum alone, so jax.grad(loss / n) would not scale the aux term by 1/n.
    raise ValueError(
        "transformer.loss takes dense models; with cfg.moe use loss_and_aux, which "
        "returns the MoE layers' aux, and add moe.aux_objective(cfg.moe, aux) to the "
        "mean cross-entropy"
    )
  check_packed(tokens_BxL, segment_ids_BxL, positions_BxL, "loss")
  x_BxLxD = apply_layers(
      cfg, params["layers"], embed(cfg, params, tokens_BxL), positions_BxL, segment_ids_BxL
  )
  return head_loss(cfg, params, x_BxLxD, targets_BxL, mask_BxL)


def loss_and_aux(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    targets_BxL: jax.Array,
    mask_BxL: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None = None,
    positions_BxL: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict]:
  """`loss` and the MoE layers' aux (`apply_layers_aux`), none of it on the gradient.

  The training objective adds `moe.aux_objective(cfg.moe, aux)` to the mean cross-entropy.
  """
  check_packed(tokens_BxL, segment_ids_BxL, positions_BxL, "loss_and_aux")
  x_BxLxD, aux = apply_layers_aux(
      cfg, params["layers"], embed(cfg, params, tokens_BxL), positions_BxL, segment_ids_BxL
  )
  return (*head_loss(cfg, params, x_BxLxD, targets_BxL, mask_BxL), aux)


def moe_unit(cfg: TransformerConfig, unit, x_BxLxD, positions_L, segment_ids_BxL=None, tokens=None):
  """MoE group (`apply_unit`) with its auxiliary loss attached to x -> (x, routing statistics);
  the loss weighted by `tokens` (default the tokens of x, `_attach_unit_aux`)."""
  x_BxLxD, aux = apply_unit(cfg, unit, x_BxLxD, positions_L, False, segment_ids_BxL)
  return _attach_unit_aux(cfg, x_BxLxD, aux, tokens), {k: aux[k] for k in moe_lib.AUX_KEYS}
