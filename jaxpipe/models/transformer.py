"""Decoder-only Transformer LM: a Flax layer, exposed as pure functions over a parameter dict.

Parameters are a plain dict pytree:

  {'embed': [vocab, d_model],
   'layers': per-layer params stacked on a leading [n_layers] axis,
   'final_norm': {'scale': [d_model]},
   'head': [d_model, vocab],              # absent when cfg.tied_embeddings
   'first_layers': dense layers stacked on a leading [first_dense] axis,  # with cfg.first_dense
   'mtp': multi-token prediction modules on a leading [mtp_depth] axis}  # `jaxpipe.models.mtp`

The model is `embed -> apply_first -> apply_layers -> head_loss` (`embed_first` is the first
two; `apply_first` is the identity without `cfg.first_dense`). `apply_layers` is a `lax.scan`
over whatever leading layer axis it is given, so any contiguous slice of `params['layers']` is a
valid block:
reshaping every leaf to `[num_stages, layers_per_stage, ...]` and indexing a stage gives that
pipeline stage's `(params, x) -> x` function.

With `cfg.moe` (an MoE FFN every `moe.every` = k layers) the scanned unit is a group of k
layers, k-1 dense then one MoE, so the leading axis of `params['layers']` counts groups,
n_layers / k of them: `{'dense': [groups, k-1, ...], 'moe': [groups, ...]}` ('dense' absent for
k = 1). DeepSeek's first dense layers (`cfg.first_dense`, of width d_ff) sit apart in
`params['first_layers']`, before that stack: pipelined, they run with the embedding on the first
stage, as DeepSeek-V3's first stage holds them. `apply_layers_aux` also returns the MoE layers'
auxiliary losses and routing statistics; `apply_layers` folds the auxiliary losses into the
gradient instead (`attach_aux_loss`).

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

from jaxpipe.models import mla as mla_lib
from jaxpipe.models import moe as moe_lib
from jaxpipe.models import rope as rope_lib
from jaxpipe.models.attention import attention, context_axis, context_parallel, point_to_point
from jaxpipe.models.layers import Dense, Kernel, RMSNorm, dense_group, rms_norm
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.ops.vma import vary_like
from jaxpipe.parallel import overlap
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.parallel.ulysses import check_divisible

REMAT = (False, True, "selective")  # TransformerConfig.remat's values
ACTIVATIONS = ("silu", "gelu_tanh")  # TransformerConfig.activation's values
LAYER_TYPES = ("full", "sliding")  # TransformerConfig.layer_types' values


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
  # -- what the model families vary (jaxpipe.models.families reads them from config.json) --
  rope_scaling: Any = None  # rotary variant (rope.RopeScaling or its dict); None: the default
  rope_fraction: float = 1.0  # share of head_dim that rotates (partial_rotary_factor: Phi)
  rope_local_theta: float = 0.0  # sliding layers' own unscaled rotary base (Gemma 3); 0: same
  qkv_bias: bool = False  # q, k and v projections carry biases (Qwen2)
  o_bias: bool = False  # the attention output projection carries a bias
  mlp_bias: bool = False  # the FFN's three projections carry biases
  activation: str = "silu"  # the gated FFN's: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU: Gemma)
  norm_plus_one: bool = False  # RMSNorms scale by 1 + w, w stored from 0 (Gemma)
  sandwich_norm: bool = False  # a norm on each sublayer's output too, before the add (Gemma 2/3)
  embed_scale: bool = False  # embeddings times sqrt(d_model), in the compute dtype (Gemma)
  attn_scale_dim: float = 0.0  # scores scaled by this^-1/2; 0: head_dim (query_pre_attn_scalar)
  attn_softcap: float = 0.0  # scores -> c·tanh(s / c) before the softmax (Gemma 2); 0: off
  final_softcap: float = 0.0  # logits -> c·tanh(l / c) (Gemma 2); 0: off
  sliding_window: int = 0  # a sliding layer's query sees the keys of its last this many positions
  # per layer 'full' or 'sliding' (LAYER_TYPES); (): every layer sliding when sliding_window > 0
  layer_types: tuple = ()
  # multi-head latent attention (mla.MLAConfig, or its dict; DeepSeek-V2/V3) in place of
  # grouped-query attention; None: grouped-query. n_heads counts its heads; head_dim,
  # n_kv_heads and the q/k/v settings above do not apply.
  mla: Any = None
  # the first this many layers have a dense FFN (d_ff) and come before the stack of MoE groups,
  # stored apart as params['first_layers'] (DeepSeek's first_k_dense_replace); needs moe
  first_dense: int = 0
  # multi-token prediction (DeepSeek-V3 §2.2, `jaxpipe.models.mtp`): this many sequential
  # modules after the model, in params['mtp'], their losses weighted by mtp_weight (λ) / depth
  mtp_depth: int = 0
  mtp_weight: float = 0.3  # λ: DeepSeek-V3's for its first 10T tokens (0.1 after)

  def __post_init__(self):
    fp8_lib.check_recipe(self.fp8)
    self._check_family_fields()
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
    if self.cp_overlap and (self.qkv_bias or self.o_bias):
      raise ValueError(
          "cp_overlap=True fuses the projections into Ulysses' all-to-alls without biases, but "
          "qkv_bias or o_bias is set; set cp_overlap=False"
      )
    if self.fp8 != "none" and self.cp_overlap:
      raise ValueError(
          f"fp8={self.fp8!r} with cp_overlap=True: the projections fused with "
          "Ulysses' all-to-alls run in the compute dtype only; set cp_overlap=False"
      )
    self._check_mla()
    if isinstance(self.moe, dict):  # from an ml_collections config
      object.__setattr__(self, "moe", moe_lib.MoEConfig(**self.moe))
    self._check_first_dense()
    self._check_mtp()
    if self.moe is not None and (self.n_layers - self.first_dense) % self.moe.every:
      after = f" after first_dense={self.first_dense}" if self.first_dense else ""
      raise ValueError(
          f"n_layers={self.n_layers} leaves {self.n_layers - self.first_dense} layers{after}, "
          f"not a multiple of moe.every={self.moe.every}; layers come in groups of moe.every "
          "(the last of each is MoE)"
      )

  def _check_mtp(self):
    d = self.mtp_depth
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
      raise ValueError(f"mtp_depth={d!r} must be an integer >= 0 (0: no multi-token prediction)")
    if self.mtp_weight < 0:
      raise ValueError(f"mtp_weight={self.mtp_weight} must be >= 0 (DeepSeek-V3: 0.3, then 0.1)")

  def _check_first_dense(self):
    k = self.first_dense
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"first_dense={k!r} must be an integer >= 0 (0: no dense first layers)")
    if k and self.moe is None:
      raise ValueError(
          f"first_dense={k} places dense layers before the MoE ones, but moe is None (every "
          "layer dense); set moe, or first_dense=0"
      )
    if k and k >= self.n_layers:
      raise ValueError(
          f"first_dense={k} leaves none of the n_layers={self.n_layers} layers for the MoE "
          "stack; lower first_dense or raise n_layers"
      )

  def _check_mla(self):
    if isinstance(self.mla, dict):  # from an ml_collections config
      object.__setattr__(self, "mla", mla_lib.MLAConfig(**self.mla))
    if self.mla is None:
      return
    if not isinstance(self.mla, mla_lib.MLAConfig):
      raise ValueError(f"mla={self.mla!r} must be an mla.MLAConfig, its dict, or None")
    refused = {
        "qk_norm": self.qk_norm,
        "qkv_bias": self.qkv_bias,
        "o_bias": self.o_bias,
        "cp_overlap": self.cp_overlap,
        "attn_softcap": self.attn_softcap,
        "attn_scale_dim": self.attn_scale_dim,
        "sliding_window": self.sliding_window,
        "rope_local_theta": self.rope_local_theta,
    }
    if self.rope_fraction != 1.0:
      refused["rope_fraction"] = self.rope_fraction
    on = [f"{name}={value!r}" for name, value in refused.items() if value]
    if on:
      raise ValueError(
          f"mla is set (latent attention) with {', '.join(on)}, which only grouped-query "
          "attention computes; leave them at their defaults"
      )

  def _check_family_fields(self):
    scaling = rope_lib.scaling_of(self.rope_scaling)
    object.__setattr__(self, "rope_scaling", None if scaling == rope_lib.RopeScaling() else scaling)
    object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} is unknown; use one of {ACTIVATIONS}")
    if not 0 < self.rope_fraction <= 1 or self.rotary_dim % 2:
      raise ValueError(
          f"rope_fraction={self.rope_fraction} must lie in (0, 1] and rotate an even number "
          f"of head_dim={self.head_dim}'s channels (it rotates {self.rotary_dim})"
      )
    for name in ("attn_scale_dim", "attn_softcap", "final_softcap", "rope_local_theta"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: off)")
    w = self.sliding_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"sliding_window={w!r} must be an integer >= 0 (0: full attention)")
    types = self.layer_types
    if types and (len(types) != self.n_layers or set(types) - set(LAYER_TYPES)):
      raise ValueError(
          f"layer_types={types!r} must name each of the {self.n_layers} layers one of "
          f"{LAYER_TYPES}, or be empty"
      )
    if "sliding" in types and not w:
      raise ValueError(
          "layer_types names sliding layers but sliding_window=0; set the window's width"
      )

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def rotary_dim(self) -> int:
    """Channels of a head that rotate (the first ones; the rest pass as they are)."""
    return int(self.head_dim * self.rope_fraction)

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention)."""
    types = self.layer_types or ("sliding" if self.sliding_window else "full",) * self.n_layers
    return tuple(self.sliding_window if t == "sliding" else 0 for t in types)

  @property
  def stack_units(self) -> int:
    """Entries of params['layers'] leading axis: the layers after the first dense ones, or
    their groups of moe.every."""
    every = 1 if self.moe is None else self.moe.every
    return (self.n_layers - self.first_dense) // every

  @property
  def mixed_layers(self) -> bool:
    """Whether layers differ (sliding and full ones): each then needs its index to run."""
    return len(set(self.layer_windows)) > 1


def layer_window(cfg: TransformerConfig, layer: jax.Array | None) -> int | jax.Array:
  """A layer's sliding window (0: full attention).

  Args:
    cfg: the model.
    layer: the layer's index in the model (traced); needed only where layers differ
      (`cfg.mixed_layers`).

  Returns:
    A Python int when every layer has the same window, else the traced entry of `layer`.

  Raises:
    ValueError: the model mixes sliding and full layers and `layer` is None.
  """
  windows = cfg.layer_windows
  if not cfg.mixed_layers:
    return windows[0]
  if layer is None:
    raise ValueError(
        "this model mixes sliding-window and full-attention layers, so each layer must be "
        "given its index in the model (apply_unit's `index`)"
    )
  return jnp.asarray(windows, jnp.int32)[layer]


def rotary(
    cfg: TransformerConfig,
    x_BxLxHxK: jax.Array,
    positions: jax.Array,
    window: int | jax.Array,
    seq_len: jax.Array | int | None,
) -> jax.Array:
  """Queries or keys rotated as the layer of `window` rotates them (`layer_window`).

  Sliding layers rotate by rope_local_theta when it is set (unscaled), every other layer by
  rope_theta and rope_scaling (`jaxpipe.models.rope`).

  Args:
    cfg: the model.
    x_BxLxHxK: queries or keys, [B, L, H, K].
    positions: [L] or [B, L].
    window: the layer's sliding window (0: full), a Python int or traced.
    seq_len: for length-dependent variants, the sequence length of the call or of each position;
      None: max(positions) + 1.

  Returns:
    `x_BxLxHxK` rotated, in its dtype.
  """
  full = (cfg.rope_theta, rope_lib.scaling_of(cfg.rope_scaling))
  local = (cfg.rope_local_theta, rope_lib.RopeScaling()) if cfg.rope_local_theta else full
  if local == full or isinstance(window, int):
    theta, scaling = local if local != full and window else full
    return rope_lib.apply(x_BxLxHxK, positions, theta, scaling, cfg.rotary_dim, seq_len)
  (theta_f, scaling_f), (theta_l, scaling_l) = full, local
  inv_f, att_f = rope_lib.inverse_frequencies(theta_f, cfg.rotary_dim, scaling_f, seq_len)
  inv_l, att_l = rope_lib.inverse_frequencies(theta_l, cfg.rotary_dim, scaling_l, seq_len)
  sliding = window > 0
  inv = jnp.where(sliding, inv_l, inv_f)
  return rope_lib.rotate(x_BxLxHxK, positions, inv, jnp.where(sliding, att_l, att_f))


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary positions.

  positions: [L] or [B, L]; segment_ids_BxL (packed rows: 1, 2, ... per document, 0 padding)
  lets a token attend only to earlier tokens of its own segment, None to every earlier token.
  layer: the layer's index in the model (traced), needed where layers differ
  (`cfg.mixed_layers`). seq_lens: each position's sequence length for length-dependent rotary
  variants (the serving engine's); None: the whole sequence the call holds.
  """

  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD, positions_L, segment_ids_BxL=None, layer=None, seq_lens=None):
    """Causal grouped-query self-attention of `x_BxLxD`.

    With `cfg.cp_overlap` inside `context_parallel`, the projections run fused with Ulysses'
    all-to-alls.

    Args:
      x_BxLxD: the normalised residual stream, [B, L, D]: this rank's tokens inside
        `context_parallel` or with sequence parallelism.
      positions_L: [L] or [B, L].
      segment_ids_BxL: packed rows' segment ids (1, 2, ... per document, 0 padding): a token
        attends only to earlier tokens of its own segment; None: to every earlier token.
      layer: the layer's index in the model (traced), needed where layers differ
        (`cfg.mixed_layers`).
      seq_lens: each position's sequence length for length-dependent rotary variants (the serving
        engine's); None: the whole sequence the call holds.

    Returns:
      The attention output projected back to the residual stream, shaped as `x_BxLxD`.
    """
    c = self.cfg
    axis_name = context_axis()
    window = layer_window(c, layer)
    if c.cp_overlap and axis_name is not None:
      return self._overlapped(x_BxLxD, positions_L, axis_name, segment_ids_BxL, window)
    # Under tensor parallelism: this rank's heads of the whole sequence (tp_lib)
    x_BxLxD = tp_lib.gather_tokens(x_BxLxD)
    heads, kv_heads = tp_lib.local_heads(c.n_heads, c.n_kv_heads)
    outs = (
        ("q", (heads, c.head_dim)),
        ("k", (kv_heads, c.head_dim)),
        ("v", (kv_heads, c.head_dim)),
    )
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = dense_group(self, x_BxLxD, outs, c, c.qkv_bias)
    k_BxLxGxK = tp_lib.kv_group(k_BxLxGxK, c.n_heads, c.n_kv_heads)
    v_BxLxGxK = tp_lib.kv_group(v_BxLxGxK, c.n_heads, c.n_kv_heads)
    q_BxLxHxK, k_BxLxGxK = self._qk_norm(q_BxLxHxK, k_BxLxGxK)
    if seq_lens is None and rope_lib.scaling_of(c.rope_scaling).length_dependent:
      seq_lens = x_BxLxD.shape[1] * (1 if axis_name is None else jax.lax.axis_size(axis_name))
    q_BxLxHxK = rotary(c, q_BxLxHxK, positions_L, window, seq_lens)
    k_BxLxGxK = rotary(c, k_BxLxGxK, positions_L, window, seq_lens)
    core = functools.partial(
        attention,
        causal=True,
        backend=c.attention,
        segment_ids=segment_ids_BxL,
        **self._score_args(window),
    )
    if c.remat == "selective":  # keep q, k, v; recompute the scores in the backward
      core = jax.checkpoint(core)
    o_BxLxHxK = core(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    out = Dense((c.d_model,), c, 2, c.o_bias, tp_lib.reduce_tokens, name="o")
    return out(o_BxLxHxK)

  def _score_args(self, window) -> dict:
    """attention()'s sm_scale, window and softcap for this layer."""
    c = self.cfg
    sm_scale = c.attn_scale_dim**-0.5 if c.attn_scale_dim else None
    return dict(sm_scale=sm_scale, window=window, softcap=c.attn_softcap)

  def _qk_norm(self, q_BxLxHxK, k_BxLxGxK):
    """Per-head RMSNorm of queries and keys with `cfg.qk_norm`
    (one scale per channel, all heads)."""
    if not self.cfg.qk_norm:
      return q_BxLxHxK, k_BxLxGxK
    c = self.cfg
    norm = lambda name: RMSNorm(c.norm_eps, c.norm_plus_one, name=name)
    return norm("q_norm")(q_BxLxHxK), norm("k_norm")(k_BxLxGxK)

  def _overlapped(self, x_BxSxD, positions_S, axis_name, segment_ids_BxS=None, window=0):
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
    seq_len = (
        positions_L.shape[-1] if rope_lib.scaling_of(c.rope_scaling).length_dependent else None
    )
    q_BxLxHpxK = rotary(c, q_BxLxHpxK, positions_L, window, seq_len)
    k_BxLxGpxK = rotary(c, k_BxLxGpxK, positions_L, window, seq_len)
    with context_parallel(None):  # head shards of the full sequence: a plain attention core
      o_BxLxHpxK = attention(
          q_BxLxHpxK,
          k_BxLxGpxK,
          v_BxLxGpxK,
          causal=True,
          backend=c.attention,
          segment_ids=segment_ids_BxL,
          **self._score_args(window),
      )
    return tp_lib.reduce_tokens(a2a_proj(o_BxLxHpxK, w_o_HxKxD, axis_name=axis_name))


ACTIVATION_FNS = {"silu": nn.silu, "gelu_tanh": functools.partial(nn.gelu, approximate=True)}


class Mlp(nn.Module):
  """Gated feed-forward: down(act(gate(x)) * up(x)); act silu (SwiGLU) or GELU-tanh (GeGLU)."""

  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    """The gated feed-forward `down(act(gate(x)) * up(x))`.

    Args:
      x_BxLxD: the normalised residual stream, [B, L, D] (this rank's tokens with sequence
        parallelism).

    Returns:
      The FFN's output, shaped as `x_BxLxD`.
    """
    c = self.cfg
    x_BxLxD = tp_lib.gather_tokens(x_BxLxD)  # tensor parallel: d_ff / tp of the whole sequence
    d_ff = c.d_ff // tp_lib.size()
    act = ACTIVATION_FNS[c.activation]
    outs = (("gate", (d_ff,)), ("up", (d_ff,)))
    g_BxLxF, u_BxLxF = dense_group(self, x_BxLxD, outs, c, c.mlp_bias)
    # computed in float32 and rounded once, as torch's kernels compute a bfloat16 activation
    # (bit-equal to them; rounded after each of its ops it was not, and 2x slower on XLA:CPU)
    h_BxLxF = act(g_BxLxF.astype(jnp.float32)).astype(g_BxLxF.dtype) * u_BxLxF
    down = Dense((c.d_model,), c, 1, c.mlp_bias, tp_lib.reduce_tokens, name="down")
    return down(h_BxLxF)


class Block(nn.Module):
  """One pre-norm decoder layer; with `moe` its FFN is `cfg.moe` and it returns (x, moe aux).

  With `cfg.sandwich_norm` each sublayer's output is normalised too before it joins the
  residual stream (Gemma 2 and 3). layer, seq_lens: as `Attention` takes them.
  """

  cfg: TransformerConfig
  moe: bool = False

  @nn.compact
  def __call__(self, x_BxLxD, positions_L, segment_ids_BxL=None, layer=None, seq_lens=None):
    """One pre-norm decoder layer on the residual stream.

    Args:
      x_BxLxD: the residual stream, [B, L, D].
      positions_L: [L] or [B, L].
      segment_ids_BxL: packed rows' segment ids, as `Attention` takes them.
      layer: the layer's index, as `Attention` takes it.
      seq_lens: as `Attention` takes them.

    Returns:
      The new residual stream [B, L, D]; with `moe`, `(x, aux)` with the MoE FFN's aux.
    """
    c = self.cfg
    norm = lambda name: RMSNorm(c.norm_eps, c.norm_plus_one, name=name)
    post = lambda name, y: norm(name)(y) if c.sandwich_norm else y
    attn = mla_lib.LatentAttention(c, c.mla, name="attn") if c.mla else Attention(c, name="attn")
    y_BxLxD = attn(norm("attn_norm")(x_BxLxD), positions_L, segment_ids_BxL, layer, seq_lens)
    x_BxLxD = x_BxLxD + post("attn_post_norm", y_BxLxD)
    if self.moe:
      y_BxLxD, aux = moe_lib.MoEFFN(c.moe, c.compute_dtype, c.fp8, name="moe")(
          norm("mlp_norm")(x_BxLxD)
      )
      return x_BxLxD + post("mlp_post_norm", y_BxLxD), aux
    return x_BxLxD + post("mlp_post_norm", Mlp(c, name="mlp")(norm("mlp_norm")(x_BxLxD)))


def block_variables(layer_params: dict) -> dict:
  """A layer's flax variables: its params, and the kernels it holds prepacked, if any.

  Args:
    layer_params: one layer's (or MoE group's layer's) parameters; a serving engine's may hold
      its projections prepacked under `ops.matmul.PREPACKED` (`serve.model.prepack_params`).

  Returns:
    The variables `Block.apply` takes.
  """
  if matmul_lib.PREPACKED not in layer_params:
    return {"params": layer_params}
  params = {k: v for k, v in layer_params.items() if k != matmul_lib.PREPACKED}
  return {"params": params, matmul_lib.PREPACKED: layer_params[matmul_lib.PREPACKED]}


def init_params(cfg: TransformerConfig, rng: jax.Array) -> dict:
  """Fresh float32 parameters.

  Args:
    cfg: the model.
    rng: a PRNG key.

  Returns:
    The parameter dict (module docstring); `layers` leaves carry a leading [n_layers] axis
    ([cfg.stack_units] groups with `cfg.moe`), `first_layers` ones [cfg.first_dense].
  """
  k_embed, k_layers, k_head = jax.random.split(rng, 3)
  k_first = jax.random.fold_in(k_layers, 1)
  x_1x1xD = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
  block = Block(cfg)
  # any layer's parameters have the same shapes: initialise as layer 0
  init_dense = lambda k: block.init(k, x_1x1xD, jnp.arange(1), None, 0)["params"]
  if cfg.moe is None:
    layers = jax.vmap(init_dense)(jax.random.split(k_layers, cfg.n_layers))
  else:
    every = cfg.moe.every

    def init_group(k):
      k_dense, k_moe = jax.random.split(k)
      moe_block = Block(cfg, moe=True)
      group = {"moe": moe_block.init(k_moe, x_1x1xD, jnp.arange(1), None, 0)["params"]}
      if every > 1:
        group["dense"] = jax.vmap(init_dense)(jax.random.split(k_dense, every - 1))
      return group

    layers = jax.vmap(init_group)(jax.random.split(k_layers, cfg.stack_units))
  # Unit-variance logits at init: normalised x (entries ~1) times entries of scale d_model^-1/2.
  scale = cfg.d_model**-0.5
  params = {
      "embed": scale * jax.random.normal(k_embed, (cfg.vocab, cfg.d_model), jnp.float32),
      "layers": layers,
      "final_norm": {
          "scale": jnp.full((cfg.d_model,), 0.0 if cfg.norm_plus_one else 1.0, jnp.float32)
      },
  }
  if cfg.first_dense:
    params["first_layers"] = jax.vmap(init_dense)(jax.random.split(k_first, cfg.first_dense))
  if cfg.mtp_depth:
    params["mtp"] = _init_mtp(cfg, jax.random.fold_in(k_layers, 2))
  if not cfg.tied_embeddings:
    params["head"] = scale * jax.random.normal(k_head, (cfg.d_model, cfg.vocab), jnp.float32)
  return params


def _init_mtp(cfg: TransformerConfig, rng: jax.Array) -> dict:
  """Fresh parameters of the `cfg.mtp_depth` multi-token prediction modules, stacked
  (`jaxpipe.models.mtp`, which runs them)."""
  d = cfg.d_model
  x_1x1xD = jnp.zeros((1, 1, d), cfg.compute_dtype)
  block = Block(cfg, moe=cfg.moe is not None)

  def one(k):
    k_block, k_proj = jax.random.split(k)
    ones = lambda: {"scale": jnp.full((d,), 0.0 if cfg.norm_plus_one else 1.0, jnp.float32)}
    return {
        "enorm": ones(),
        "hnorm": ones(),
        "final_norm": ones(),
        "eh_proj": {"kernel": jax.random.normal(k_proj, (2 * d, d), jnp.float32) * (2 * d) ** -0.5},
        "block": block.init(k_block, x_1x1xD, jnp.arange(1))["params"],
    }

  return jax.vmap(one)(jax.random.split(rng, cfg.mtp_depth))


def embed(cfg: TransformerConfig, params: dict, tokens_BxL: jax.Array) -> jax.Array:
  """Token embedding lookup, in the compute dtype.

  Vocabulary-parallel under `tp_lib`; times sqrt(d_model) rounded to the compute dtype with
  `cfg.embed_scale`, as transformers' Gemma.

  Args:
    cfg: the model.
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].

  Returns:
    [B, L, D], or [B, L/tp, D] with sequence parallelism.
  """
  x_BxLxD = tp_lib.vocab_embed(params["embed"], tokens_BxL).astype(cfg.compute_dtype)
  if cfg.embed_scale:
    x_BxLxD = x_BxLxD * np.float32(math.sqrt(cfg.d_model)).astype(cfg.compute_dtype)
  return x_BxLxD


def check_packed(
    tokens_BxL: Any, segment_ids_BxL: Any = None, positions_BxL: Any = None, where: str = "batch"
) -> None:
  """Checks that packed-sequence keys are integer arrays shaped like the tokens.

  Packed rows hold several documents: `segment_ids` numbers them 1, 2, ... along the row (0 for
  padding) and `positions` restart at 0 at each document's first token.

  Args:
    tokens_BxL: the tokens, [B, L].
    segment_ids_BxL: the segment ids, or None.
    positions_BxL: the positions, or None.
    where: what holds them, for the message.

  Raises:
    ValueError: a key of another shape or a non-integer dtype.
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
  """A batch dict's packed-sequence keys that are present, checked (`check_packed`).

  `segment_ids` number a row's documents 1, 2, ... (0: padding) and keep attention inside each;
  `positions` restart at 0 at each document (rotary). Absent keys keep the plain behaviour: one
  sequence per row at positions 0..L-1.

  Args:
    batch: a batch dict with `tokens` [B, L] and optionally `segment_ids` and `positions`.

  Returns:
    The present keys (`PACKED_KEYS`) and their arrays; {} for unpacked rows.

  Raises:
    ValueError: a key of another shape than the tokens, or a non-integer dtype.
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
  """Runs the stacked layers in order (a scan over their leading axis).

  MoE layers' auxiliary losses join the gradient through `attach_aux_loss`, weighted by the
  tokens of `x`, as if `aux * tokens` were added to a summed loss.

  Args:
    cfg: the model.
    layers: the layers' parameters, with a leading layer (MoE: group) axis, or a list of one
      tree per layer (group), run in a loop.
    x_BxLxD: the residual stream, [B, L, D].
    positions_L: [L] or [B, L] (packed rows restart them at each document); default 0..L-1 of the
      whole sequence.
    segment_ids_BxL: keeps attention within each document (`Attention`).

  Returns:
    The residual stream after the layers, [B, L, D].

  Raises:
    ValueError: an MoE model with the pooled load-balancing loss, which cannot ride on each
      layer's gradient.
  """
  return _apply_layers(cfg, layers, x_BxLxD, positions_L, segment_ids_BxL, attach=True)[0]


def apply_first(
    cfg: TransformerConfig,
    params: dict,
    x_BxLxD: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
  """Runs the first dense layers (`cfg.first_dense`), which come before the stack; x without.

  Args:
    cfg: the model.
    params: the model's parameters (`first_layers` is read).
    x_BxLxD: the embedded tokens, [B, L, D].
    positions_L: [L] or [B, L]; default 0..L-1 of the whole sequence.
    segment_ids_BxL: keeps attention within each document (`Attention`).

  Returns:
    The residual stream after those layers, [B, L, D].
  """
  k = cfg.first_dense
  if not k:
    return x_BxLxD
  if positions_L is None:
    positions_L = jnp.arange(x_BxLxD.shape[1] * tp_lib.token_split())

  def body(x_BxLxD, layer_j):
    layer, j = layer_j
    block = Block(cfg).apply(block_variables(layer), x_BxLxD, positions_L, segment_ids_BxL, j)
    return block, None

  if cfg.remat is True:
    body = jax.checkpoint(body)
  xs = (params["first_layers"], jnp.arange(k) if cfg.mixed_layers else None)
  return _stack_scan(body, x_BxLxD, xs, stack_unroll(cfg, k))[0]


def embed_first(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
  """The stack's input: the tokens embedded, then the first dense layers (`apply_first`).

  Args:
    cfg: the model.
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].
    positions_L: [L] or [B, L]; default 0..L-1 of the whole sequence.
    segment_ids_BxL: keeps attention within each document.

  Returns:
    [B, L, D] (this rank's tokens with sequence parallelism).
  """
  x_BxLxD = embed(cfg, params, tokens_BxL)
  return apply_first(cfg, params, x_BxLxD, positions_L, segment_ids_BxL)


def apply_layers_aux(
    cfg: TransformerConfig,
    layers: Any,
    x_BxLxD: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """`apply_layers` without attachment, plus the MoE layers' aux.

  `moe.aux_objective` of the aux is for the caller to add.

  Args:
    cfg: the model.
    layers: the layers' parameters, with a leading layer (MoE: group) axis, or a list of one
      tree per layer (group), run in a loop.
    x_BxLxD: the residual stream, [B, L, D].
    positions_L: [L] or [B, L]; default 0..L-1 of the whole sequence.
    segment_ids_BxL: keeps attention within each document.

  Returns:
    `(x, aux)`: the residual stream [B, L, D], and `moe.moe_layer`'s aux dict with a leading axis
    of MoE layers ({} for a dense model).
  """
  return _apply_layers(cfg, layers, x_BxLxD, positions_L, segment_ids_BxL, attach=False)


def attach_aux_loss(x: jax.Array, aux_loss: jax.Array) -> jax.Array:
  """Identity on `x` whose backward also sends cotangent 1 to `aux_loss`.

  Megatron's aux-loss scaler. Inside a `shard_map` the loss is first cast to vary like x, so that
  the cotangents of every shard's copy are summed on the way back.

  Args:
    x: any array.
    aux_loss: a scalar loss to put on the gradient.

  Returns:
    `x`.
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
    index: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
):
  """One element of the layers' leading axis: a layer, or with `cfg.moe` a group ending in MoE.

  Args:
    cfg: the model.
    unit: the unit's parameters (no leading layer axis).
    x_BxLxD: the residual stream, [B, L, D].
    positions_L: [L] or [B, L].
    attach: put an MoE group's auxiliary loss on x's gradient (`attach_aux_loss`) instead of
      returning it.
    segment_ids_BxL: packed rows' segment ids, as `Attention` takes them.
    index: the unit's place in the model's stack (traced), which a model whose layers differ
      (`cfg.mixed_layers`: sliding and full attention) needs.
    seq_lens: as `Attention` takes them.

  Returns:
    x [B, L, D], or `(x, aux)` for an MoE group with attach=False.

  Raises:
    ValueError: attach=True with the pooled load-balancing loss, or layers that differ without
      `index`.
  """
  seg = segment_ids_BxL
  every = 1 if cfg.moe is None else cfg.moe.every
  layer = lambda j: None if index is None else cfg.first_dense + index * every + j
  if cfg.moe is None:
    return Block(cfg).apply(block_variables(unit), x_BxLxD, positions_L, seg, layer(0), seq_lens)
  if "dense" in unit:

    def dense(x, layer_j):
      params, j = layer_j
      return Block(cfg).apply({"params": params}, x, positions_L, seg, layer(j), seq_lens), None

    x_BxLxD, _ = jax.lax.scan(dense, x_BxLxD, (unit["dense"], jnp.arange(every - 1)))
  x_BxLxD, aux = Block(cfg, moe=True).apply(
      block_variables(unit["moe"]), x_BxLxD, positions_L, seg, layer(every - 1), seq_lens
  )
  if not attach:
    return x_BxLxD, aux
  return _attach_unit_aux(cfg, x_BxLxD, aux)


def unit_indices(cfg: TransformerConfig, units: int, first: int = 0) -> jax.Array | None:
  """The indices `apply_unit` takes for `units` consecutive units from `first`.

  Args:
    cfg: the model.
    units: the number of units.
    first: the first unit's index in the model's stack.

  Returns:
    `first + arange(units)` where the model's layers differ, else None (every layer runs alike
    and needs none).
  """
  return first + jnp.arange(units) if cfg.mixed_layers else None


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

  def body(x_BxLxD, unit_index):
    unit, index = unit_index
    out = apply_unit(cfg, unit, x_BxLxD, positions_L, attach, segment_ids_BxL, index)
    return out if isinstance(out, tuple) else (out, None)

  if cfg.remat is True:  # 'selective' is the attention core's own (Attention)
    body = jax.checkpoint(body)
  listed = isinstance(layers, (list, tuple))
  units = len(layers) if listed else jax.tree.leaves(layers)[0].shape[0]
  xs = (layers, unit_indices(cfg, units))
  x_BxLxD, aux = _stack_scan(body, x_BxLxD, xs, stack_unroll(cfg, units))
  return x_BxLxD, {} if aux is None else aux


def _stack_scan(body, x, xs, unroll: int):
  """`lax.scan` of body over (layers, indices); layers given as a list of one tree per layer (a
  serving engine's, `serve.model.unstack_layers`) run in a Python loop, each read in place."""
  layers, indices = xs
  if not isinstance(layers, (list, tuple)):
    return jax.lax.scan(body, x, xs, unroll=unroll)
  ys = []
  for i, layer in enumerate(layers):
    x, y = body(x, (layer, None if indices is None else indices[i]))
    ys.append(y)
  return x, None if not ys or ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)


def stack_unroll(cfg: TransformerConfig, units: int) -> int:
  """The `unroll` of a `lax.scan` over a stack of `units` layers (MoE: groups).

  Unrolled, each residual stays where its layer made it; a scan stacks them in buffers it fills,
  writes slice by slice and the backward reads back. Not under remat: unrolled, XLA schedules the
  recomputation beside the forward and keeps what remat would free.

  Args:
    cfg: the model.
    units: the stack's layers (MoE: groups).

  Returns:
    `units` (all of them) where `cfg.unroll_layers` allows, else 1 (a loop).
  """
  return units if 0 < units <= cfg.unroll_layers and cfg.remat is False else 1


def logits(cfg: TransformerConfig, params: dict, x_BxLxD: jax.Array) -> jax.Array:
  """Final norm and output head.

  Args:
    cfg: the model.
    params: the model's parameters.
    x_BxLxD: the residual stream after the layers, [B, L, D].

  Returns:
    Float32 logits [B, L, V] (under `tp_lib`: this rank's vocabulary slice [B, L, V/tp], of the
    whole sequence), soft-capped with `cfg.final_softcap`.
  """
  scale_D = params["final_norm"]["scale"]
  return project(cfg, params, rms_norm(x_BxLxD, scale_D, cfg.norm_eps, cfg.norm_plus_one))


def project(cfg: TransformerConfig, params: dict, x_BxLxD: jax.Array) -> jax.Array:
  """The output head alone, over states already normed (`logits` norms, then projects).

  Args:
    cfg: the model.
    params: the model's parameters (`embed`, and `head` unless tied; or the head prepacked, as
      `ops.matmul.PREPACKED`'s `head`).
    x_BxLxD: normed hidden states, [B, L, D].

  Returns:
    Float32 logits [B, L, V] (under `tp_lib`: this rank's vocabulary slice), soft-capped with
    `cfg.final_softcap`.
  """
  x_BxLxD = tp_lib.gather_tokens(x_BxLxD)
  prepacked = params.get(matmul_lib.PREPACKED, {})
  if "head" in prepacked:  # the head in oneDNN's layout (a serving engine's, `ops.matmul`)
    logits = matmul_lib.dot(x_BxLxD, prepacked["head"], out_dtype=jnp.float32)
  else:
    tied = cfg.tied_embeddings  # the embedding [V, D] read as the head's transpose
    w = (params["embed"] if tied else params["head"]).astype(cfg.compute_dtype)
    logits = matmul_lib.dot(x_BxLxD, w, out_dtype=jnp.float32, transpose_w=tied)
  if cfg.final_softcap:
    logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
  return logits


def head_loss(
    cfg: TransformerConfig,
    params: dict,
    x_BxLxD: jax.Array,
    targets_BxL: jax.Array,
    mask_BxL: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The masked next-token cross-entropy, summed; the caller divides.

  Args:
    cfg: the model.
    params: the model's parameters.
    x_BxLxD: the residual stream after the layers, [B, L, D].
    targets_BxL: the next tokens, [B, L].
    mask_BxL: 1 where a target counts, [B, L].

  Returns:
    `(sum of masked cross-entropy, number of valid tokens)`, float32 scalars.
  """
  return logits_loss(logits(cfg, params, x_BxLxD), targets_BxL, mask_BxL)


def logits_loss(
    logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`head_loss` from the logits (under `tp_lib`: this rank's vocabulary slice).

  Args:
    logits_BxLxV: float32 logits.
    targets_BxL: the tokens to score.
    mask_BxL: the weight of each position (1 where a target counts).

  Returns:
    `(sum of weighted cross-entropy, sum of weights)`, float32 scalars.
  """
  logz_BxL, target_BxL = tp_lib.vocab_cross_entropy(logits_BxLxV, targets_BxL)
  mask_BxL = mask_BxL.astype(jnp.float32)
  return jnp.sum((logz_BxL - target_BxL) * mask_BxL), jnp.sum(mask_BxL)


def mean_weights(mask_BxL: jax.Array) -> jax.Array:
  """Loss weights `mask · N / (valid tokens)`: a weighted sum over all N tokens is the valid mean.

  For paths whose MoE auxiliary losses ride on the gradient (`apply_layers` weighs each with the
  tokens it saw, N/m per micro-batch): weighted cross-entropy plus attached aux, divided by the
  static N, is the mean cross-entropy over valid tokens plus the mean over micro-batches of the
  aux losses (the trainer's objective), with no data-dependent scale inside the layers.

  Args:
    mask_BxL: 1 where a target counts, [B, L].

  Returns:
    Float32 weights, [B, L].
  """
  mask_BxL = mask_BxL.astype(jnp.float32)
  return mask_BxL * (mask_BxL.size / jnp.maximum(jnp.sum(mask_BxL), 1.0))


def hidden_and_aux(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    positions_BxL: jax.Array | None = None,
    where: str = "hidden_and_aux",
) -> tuple[jax.Array, dict]:
  """The last layer's output (before the final norm) and the MoE layers' aux, on one device.

  Args:
    cfg: the model.
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].
    segment_ids_BxL: packed rows' segment ids (see `check_packed`); None: one sequence per row.
    positions_BxL: packed rows' positions; None: 0..L-1.
    where: the caller's name, for the packed keys' message.

  Returns:
    `(x [B, L, D], aux)`, aux as `apply_layers_aux` gives it.

  Raises:
    ValueError: packed keys of another shape than the tokens, or not integers.
  """
  check_packed(tokens_BxL, segment_ids_BxL, positions_BxL, where)
  x_BxLxD = embed_first(cfg, params, tokens_BxL, positions_BxL, segment_ids_BxL)
  return apply_layers_aux(cfg, params["layers"], x_BxLxD, positions_BxL, segment_ids_BxL)


def forward(
    cfg: TransformerConfig,
    params: dict,
    tokens_BxL: jax.Array,
    *,
    segment_ids_BxL: jax.Array | None = None,
    positions_BxL: jax.Array | None = None,
) -> jax.Array:
  """Next-token logits; their gradient is theirs alone (no MoE aux loss).

  Args:
    cfg: the model.
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].
    segment_ids_BxL: packed rows' segment ids (see `check_packed`); None: one sequence per row.
    positions_BxL: packed rows' positions; None: 0..L-1.

  Returns:
    Float32 logits, [B, L, vocab].

  Raises:
    ValueError: packed keys of another shape than the tokens, or not integers.
  """
  x_BxLxD, _ = hidden_and_aux(
      cfg, params, tokens_BxL, segment_ids_BxL, positions_BxL, where="forward"
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
  """Summed masked cross-entropy and valid-token count of a dense model; MoE: `loss_and_aux`.

  Args:
    cfg: the model; dense (no `cfg.moe`).
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].
    targets_BxL: the next tokens, [B, L].
    mask_BxL: 1 where a target counts, [B, L].
    segment_ids_BxL: packed rows' segment ids (`check_packed`), as `forward` takes them.
    positions_BxL: packed rows' positions, as `forward` takes them.

  Returns:
    `(sum of masked cross-entropy, number of valid tokens)`, float32 scalars.

  Raises:
    ValueError: an MoE model, or bad packed keys.
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
  x_BxLxD = embed_first(cfg, params, tokens_BxL, positions_BxL, segment_ids_BxL)
  x_BxLxD = apply_layers(cfg, params["layers"], x_BxLxD, positions_BxL, segment_ids_BxL)
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

  Args:
    cfg: the model.
    params: the model's parameters.
    tokens_BxL: token ids, [B, L].
    targets_BxL: the next tokens, [B, L].
    mask_BxL: 1 where a target counts, [B, L].
    segment_ids_BxL: packed rows' segment ids, as `forward` takes them.
    positions_BxL: packed rows' positions, as `forward` takes them.

  Returns:
    `(sum of masked cross-entropy, number of valid tokens, aux)`; aux {} for a dense model.

  Raises:
    ValueError: bad packed keys.
  """
  x_BxLxD, aux = hidden_and_aux(
      cfg, params, tokens_BxL, segment_ids_BxL, positions_BxL, where="loss_and_aux"
  )
  return (*head_loss(cfg, params, x_BxLxD, targets_BxL, mask_BxL), aux)


def moe_unit(
    cfg: TransformerConfig,
    unit,
    x_BxLxD,
    positions_L,
    segment_ids_BxL=None,
    tokens=None,
    index=None,
):
  """MoE group (`apply_unit`, at `index`) with its auxiliary loss attached to x.

  Args:
    cfg: the model, with `cfg.moe`.
    unit: the group's parameters.
    x_BxLxD: the residual stream, [B, L, D].
    positions_L: [L] or [B, L].
    segment_ids_BxL: packed rows' segment ids.
    tokens: the weight of the attached loss; default the tokens of x (`_attach_unit_aux`).
    index: the group's place in the model's stack, where layers differ.

  Returns:
    `(x, stats)`: the residual stream [B, L, D] and the group's routing statistics (`AUX_KEYS`).

  Raises:
    ValueError: the pooled load-balancing loss, which cannot ride on the gradient.
  """
  x_BxLxD, aux = apply_unit(cfg, unit, x_BxLxD, positions_L, False, segment_ids_BxL, index)
  return _attach_unit_aux(cfg, x_BxLxD, aux, tokens), {k: aux[k] for k in moe_lib.AUX_KEYS}
