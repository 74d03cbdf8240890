"""Multi-head Latent Attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1), as transformers'
`DeepseekV3Attention` computes it.

Keys and values come from one compressed latent per token, `c_kv = norm(x W_dkv)` of
`kv_lora_rank` channels, expanded per head by `W_ukv` into a no-rope key part
(`qk_nope_head_dim`) and a value (`v_head_dim`). Position enters through a separate rotary key
of `qk_rope_head_dim` channels, computed from x and shared by every head. Queries take the same
two parts, through a low-rank down-projection with its own norm (`q_lora_rank`) or one plain
projection (`q_lora_rank=None`). A serving cache need hold only `c_kv` and the rotary key:
`kv_lora_rank + qk_rope_head_dim` values per token and layer (576 for DeepSeek-V3, against
2 × 128 heads × 128 for its expanded keys and values).

Parameters (flax names; DenseGeneral kernels as `jaxpipe.models.layers.Dense` holds them):

  q_a: [D, q_lora_rank], q_a_norm: [q_lora_rank] (eps 1e-6, as transformers'),
  q_b: [q_lora_rank, H, nope + rope]
    (or q: [D, H, nope + rope] without q_lora_rank)
  kv_a: [D, kv_lora_rank + rope], kv_a_norm: [kv_lora_rank] (eps 1e-6),
  kv_b: [kv_lora_rank, H, nope + v]
  o: [H, v, D]

The rotary channels are rotated as DeepSeek's checkpoints lay them out: in interleaved pairs
(`rope_interleave`, transformers' default for DeepSeek-V3), or as halves (rotate_half). Scores
are scaled by `(nope + rope)^-1/2`, times yarn's `mscale_all_dim` factor squared when the rope
is yarn (transformers' `yarn_apply_mscale`). Values are zero-padded to the query width for the
attention core and the padding dropped after, so every core that takes equal widths serves.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpipe.models import rope as rope_lib
from jaxpipe.models.attention import attention, caches_latents, latent_attention
from jaxpipe.models.layers import Dense, Kernel, RMSNorm

# the latent norms' epsilon: transformers' DeepseekV3RMSNorm default, which q_a_layernorm and
# kv_a_layernorm keep whatever the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """The latent attention's widths (transformers' DeepseekV3Config names)."""

  kv_lora_rank: int = 32  # width of the compressed key-value latent c_kv
  qk_nope_head_dim: int = 16  # per-head query and key channels without rotary positions
  qk_rope_head_dim: int = 8  # rotary channels: per head for queries, one shared key
  v_head_dim: int = 16  # per-head value width
  q_lora_rank: int | None = None  # the queries' low-rank width; None: one plain projection
  rope_interleave: bool = True  # rotary channels in interleaved pairs (DeepSeek's layout)

  def __post_init__(self):
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"MLAConfig.{name}={value!r} must be a positive integer")
    if self.q_lora_rank is not None and (
        not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1
    ):
      raise ValueError(
          f"MLAConfig.q_lora_rank={self.q_lora_rank!r} must be a positive integer or None "
          "(one plain query projection)"
      )
    if self.v_head_dim > self.qk_head_dim:
      raise ValueError(
          f"MLAConfig.v_head_dim={self.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim "
          f"= {self.qk_head_dim}: the attention core takes values no wider than the queries"
      )
    if self.qk_rope_head_dim % 2:
      raise ValueError(
          f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even: rotary channels "
          "turn in pairs"
      )

  @property
  def qk_head_dim(self) -> int:
    """Query and key width per head: the no-rope part, then the rotary part."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def cache_width(self) -> int:
    """Values a latent cache holds per token and layer: c_kv and the rotary key."""
    return self.kv_lora_rank + self.qk_rope_head_dim


def score_scale(mla: MLAConfig, rope_scaling: Any) -> float:
  """The attention scores' scale: `qk_head_dim^-1/2`, times yarn's all-dimension mscale squared.

  Args:
    mla: the latent attention's widths.
    rope_scaling: the model's rotary variant (`rope.RopeScaling`, its dict, or None).

  Returns:
    The scale the scores are multiplied by before the softmax.
  """
  scale = mla.qk_head_dim**-0.5
  s = rope_lib.scaling_of(rope_scaling)
  if s.type != "default" and s.mscale_all_dim and s.factor:
    scale *= rope_lib.yarn_mscale(s.factor, s.mscale_all_dim) ** 2
  return scale


def deinterleave(x_BxLxHxR: jax.Array) -> jax.Array:
  """Rotary channels in interleaved pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ..., x1,
  x3, ...), the layout rotate_half turns: the two rotations then give the same result.

  Args:
    x_BxLxHxR: the rotary channels, [..., R].

  Returns:
    The even channels, then the odd ones, [..., R].
  """
  return jnp.concatenate([x_BxLxHxR[..., 0::2], x_BxLxHxR[..., 1::2]], axis=-1)


class LatentAttention(nn.Module):
  """Causal multi-head latent attention with a decoupled rotary key.

  One device or data parallelism: tensor and context parallelism do not split it yet.
  """

  cfg: Any  # the model's config: d_model, n_heads, norm_eps, rope_theta, rope_scaling, ...
  mla: MLAConfig

  @nn.compact
  def __call__(self, x_BxLxD, positions_L, segment_ids_BxL=None, layer=None, seq_lens=None):
    """Causal latent attention of `x_BxLxD`.

    Args:
      x_BxLxD: the normalised residual stream, [B, L, D].
      positions_L: [L] or [B, L].
      segment_ids_BxL: packed rows' segment ids (a token attends only to earlier tokens of its
        own segment); None: to every earlier token.
      layer: the layer's index in the model; unused (every layer attends alike).
      seq_lens: each position's sequence length for length-dependent rotary variants; None:
        the whole sequence the call holds.

    Returns:
      The attention output projected back to the residual stream, shaped as `x_BxLxD`.
    """
    del layer
    c, m = self.cfg, self.mla
    h, nope, rope, v_dim = c.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
      q_BxLxHxQ = Dense((h, m.qk_head_dim), c, name="q")(x_BxLxD)
    else:
      q_BxLxR = Dense((m.q_lora_rank,), c, name="q_a")(x_BxLxD)
      q_BxLxR = RMSNorm(LATENT_NORM_EPS, name="q_a_norm")(q_BxLxR)
      q_BxLxHxQ = Dense((h, m.qk_head_dim), c, name="q_b")(q_BxLxR)
    kv_BxLxC = Dense((m.cache_width,), c, name="kv_a")(x_BxLxD)
    c_kv_BxLxR = RMSNorm(LATENT_NORM_EPS, name="kv_a_norm")(kv_BxLxC[..., : m.kv_lora_rank])
    k_rope_BxLx1xP = kv_BxLxC[..., None, m.kv_lora_rank :]
    q_nope_BxLxHxN, q_rope_BxLxHxP = q_BxLxHxQ[..., :nope], q_BxLxHxQ[..., nope:]
    if m.rope_interleave:
      q_rope_BxLxHxP, k_rope_BxLx1xP = deinterleave(q_rope_BxLxHxP), deinterleave(k_rope_BxLx1xP)
    scaling = rope_lib.scaling_of(c.rope_scaling)
    if seq_lens is None and scaling.length_dependent:
      seq_lens = x_BxLxD.shape[1]
    turn = lambda x: rope_lib.apply(x, positions_L, c.rope_theta, scaling, rope, seq_lens)
    q_rope_BxLxHxP, k_rope_BxLx1xP = turn(q_rope_BxLxHxP), turn(k_rope_BxLx1xP)
    if caches_latents():  # a serving cache of latents: attend in the latent's space
      o_BxLxHxV = self._absorbed(q_nope_BxLxHxN, q_rope_BxLxHxP, c_kv_BxLxR, k_rope_BxLx1xP)
      return Dense((c.d_model,), c, 2, name="o")(o_BxLxHxV)
    kv_BxLxHxW = Dense((h, nope + v_dim), c, name="kv_b")(c_kv_BxLxR)
    k_nope_BxLxHxN, v_BxLxHxV = kv_BxLxHxW[..., :nope], kv_BxLxHxW[..., nope:]
    k_rope_BxLxHxP = jnp.broadcast_to(k_rope_BxLx1xP, k_rope_BxLx1xP.shape[:2] + (h, rope))
    q_BxLxHxQ = jnp.concatenate([q_nope_BxLxHxN, q_rope_BxLxHxP], axis=-1)
    k_BxLxHxQ = jnp.concatenate([k_nope_BxLxHxN, k_rope_BxLxHxP.astype(k_nope_BxLxHxN.dtype)], -1)
    v_BxLxHxQ = jnp.pad(v_BxLxHxV, [(0, 0)] * 3 + [(0, m.qk_head_dim - v_dim)])
    o_BxLxHxQ = attention(
        q_BxLxHxQ.astype(c.compute_dtype),
        k_BxLxHxQ.astype(c.compute_dtype),
        v_BxLxHxQ.astype(c.compute_dtype),
        causal=True,
        backend=c.attention,
        segment_ids=segment_ids_BxL,
        sm_scale=score_scale(m, c.rope_scaling),
    )
    return Dense((c.d_model,), c, 2, name="o")(o_BxLxHxQ[..., :v_dim])

  def _absorbed(self, q_nope_BxLxHxN, q_rope_BxLxHxP, c_kv_BxLxR, k_rope_BxLx1xP):
    """The heads' outputs [B, L, H, v_head_dim], attending over latents.

    A head's score of a key is q_nope · (W_uk c) + q_rope · k_rope = [W_ukᵀ q_nope, q_rope] ·
    [c, k_rope], and its output W_uv Σ p c: one multi-query attention over each token's latent
    [c_kv, k_rope] (`attention.latent_attention`), the key up-projection absorbed into the
    query and the value up-projection applied after.
    """
    c, m = self.cfg, self.mla
    dt = c.compute_dtype
    w_RxHxW = Kernel((m.kv_lora_rank, c.n_heads, m.qk_nope_head_dim + m.v_head_dim), 1, name="kv_b")
    w_RxHxW = w_RxHxW().astype(dt)
    w_uk_RxHxN, w_uv_RxHxV = w_RxHxW[..., : m.qk_nope_head_dim], w_RxHxW[..., m.qk_nope_head_dim :]
    q_lat_BxLxHxR = jnp.einsum("blhn,rhn->blhr", q_nope_BxLxHxN.astype(dt), w_uk_RxHxN)
    q_BxLxHxC = jnp.concatenate([q_lat_BxLxHxR, q_rope_BxLxHxP.astype(dt)], axis=-1)
    latent_BxLxC = jnp.concatenate([c_kv_BxLxR, k_rope_BxLx1xP[:, :, 0]], axis=-1).astype(dt)
    o_BxLxHxR = latent_attention(
        q_BxLxHxC,
        latent_BxLxC,
        values=m.kv_lora_rank,
        sm_scale=score_scale(m, c.rope_scaling),
        backend=c.attention,
    )
    return jnp.einsum("blhr,rhv->blhv", o_BxLxHxR.astype(dt), w_uv_RxHxV)
