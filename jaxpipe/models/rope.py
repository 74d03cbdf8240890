"""Rotary position embeddings and their scaled variants, computed as transformers computes them.

A variant (transformers' `rope_type`, `modeling_rope_utils.ROPE_INIT_FUNCTIONS`) gives the
inverse frequencies of the rotary channel pairs and a factor on cos and sin (its "attention
scaling"):

  default   theta^(-2i/d)
  linear    default / factor (position interpolation)
  dynamic   default with theta grown by the sequence length past max_position (NTK-aware)
  yarn      default blended with default / factor by a ramp over the channels; cos and sin
            times 0.1 ln(factor) + 1 (or the mscale ratio, or attention_factor)
  longrope  theta^(-2i/d) / short_factor[i], or long_factor[i] once the sequence is longer than
            original_max_position; cos and sin times sqrt(1 + ln(factor) / ln(original))
  llama3    low frequencies / factor, high ones kept, a smooth blend between (Llama 3.1+)

d is the rotary width, `int(head_dim * fraction)` channels (transformers' partial_rotary_factor):
channel i and i + d/2 form a pair (the GPT-NeoX / Llama layout) and the rest pass unrotated.

`dynamic` and `longrope` depend on the length of the sequence being computed, which
transformers takes as the largest position in the call, plus one. Training's forward does the
same over its batch; the serving engine takes each token's own sequence as far as the step
writes it, which is what transformers' `generate` computes one sequence at a time.

The frequencies are computed in float32 in transformers' order of operations, so that angles
match its own to the last bit or two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# what each variant reads beside theta; a value left None takes transformers' default
_NEEDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position"),
    "yarn": ("original_max_position",),
    "longrope": ("original_max_position", "short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A rotary variant and its parameters (transformers' `rope_parameters` without rope_theta)."""

  type: str = "default"  # one of ROPE_TYPES
  factor: float | None = None  # context extension factor (yarn, longrope: default from lengths)
  original_max_position: int | None = None  # pre-training context (yarn, longrope, llama3)
  max_position: int | None = None  # the checkpoint's max_position_embeddings (dynamic, defaults)
  low_freq_factor: float | None = None  # llama3
  high_freq_factor: float | None = None  # llama3
  beta_fast: float | None = None  # yarn: ramp bounds in rotations (default 32 and 1)
  beta_slow: float | None = None
  mscale: float | None = None  # yarn: attention factor mscale / mscale_all_dim (DeepSeek)
  mscale_all_dim: float | None = None
  attention_factor: float | None = None  # yarn, longrope: cos and sin times this, if given
  truncate: bool = True  # yarn: round the ramp's bounds to whole channels
  short_factor: tuple[float, ...] | None = None  # longrope: per channel pair, short contexts
  long_factor: tuple[float, ...] | None = None  # longrope: past original_max_position

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(f"rope type {self.type!r} is not implemented; jaxpipe reads {ROPE_TYPES}")
    for name in ("short_factor", "long_factor"):
      value = getattr(self, name)
      if value is not None:  # lists from config files; the config must stay hashable
        object.__setattr__(self, name, tuple(float(v) for v in value))
    missing = [n for n in _NEEDS[self.type] if getattr(self, n) is None]
    if self.type in ("yarn", "longrope") and self.factor is None and self.max_position is None:
      missing.append("factor (or max_position)")
    if missing:
      raise ValueError(f"rope type {self.type!r} needs {', '.join(missing)}")
    if self.type == "longrope" and len(self.short_factor) != len(self.long_factor):
      raise ValueError(
          f"longrope short_factor ({len(self.short_factor)}) and long_factor "
          f"({len(self.long_factor)}) must have one entry per rotary channel pair each"
      )

  @property
  def length_dependent(self) -> bool:
    """Whether the frequencies depend on the sequence length (dynamic, longrope)."""
    return self.type in ("dynamic", "longrope")


def scaling_of(value: Any) -> RopeScaling:
  """A `RopeScaling` from itself, a dict of its fields (config files) or None (the default).

  Args:
    value: a `RopeScaling`, a mapping of its fields, or None.

  Returns:
    The `RopeScaling`.

  Raises:
    ValueError: the fields describe no valid variant (see `RopeScaling`).
  """
  if value is None:
    return RopeScaling()
  if isinstance(value, RopeScaling):
    return value
  return RopeScaling(**dict(value))


def _default(theta: float, dim: int) -> np.ndarray:
  """theta^(-2i/d) in float32, as `1 / theta ** (arange(0, d, 2) / d)` in torch."""
  exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def _yarn_factor(s: RopeScaling) -> float:
  return s.factor if s.factor is not None else s.max_position / s.original_max_position


def yarn_mscale(scale: float, m: float = 1.0) -> float:
  """Yarn's attention factor for a context `scale` times the original: 0.1 m ln(scale) + 1.

  Args:
    scale: the context extension factor.
    m: the multiplier (DeepSeek's `mscale` or `mscale_all_dim`).

  Returns:
    The factor; 1 when `scale` <= 1.
  """
  return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[np.ndarray, float]:
  factor = _yarn_factor(s)
  attention = s.attention_factor
  if attention is None:
    if s.mscale and s.mscale_all_dim:
      attention = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
    else:
      attention = yarn_mscale(factor)
  fast, slow = s.beta_fast or 32, s.beta_slow or 1

  def correction_dim(rotations):
    return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (
        2 * math.log(theta)
    )

  low, high = correction_dim(fast), correction_dim(slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # no singular ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  pos_freqs = np.power(np.float32(theta), np.arange(0, dim, 2).astype(np.float32) / dim)
  extrapolation = (1.0 / pos_freqs).astype(np.float32)
  interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
  keep = (1 - ramp).astype(np.float32)
  return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32), float(attention)


def _llama3(theta: float, dim: int, s: RopeScaling) -> np.ndarray:
  inv = _default(theta, dim)
  old = s.original_max_position
  low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
  wavelen = (2 * math.pi / inv).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv / np.float32(s.factor), inv).astype(np.float32)
  smooth = ((old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).astype(
      np.float32
  )
  smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _longrope(theta: float, dim: int, s: RopeScaling, long: bool) -> np.ndarray:
  factors = np.asarray(s.long_factor if long else s.short_factor, np.float32)
  if factors.shape != (dim // 2,):
    raise ValueError(
        f"longrope {'long' if long else 'short'}_factor has {factors.size} entries; the rotary "
        f"width {dim} needs {dim // 2}"
    )
  shape = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  return (np.float32(1.0) / (factors * np.power(np.float32(theta), shape))).astype(np.float32)


def _longrope_attention(s: RopeScaling) -> float:
  if s.attention_factor is not None:
    return float(s.attention_factor)
  factor = s.factor if s.factor is not None else s.max_position / s.original_max_position
  if factor <= 1.0:
    return 1.0
  return math.sqrt(1 + math.log(factor) / math.log(s.original_max_position))


def frequencies(theta: float, dim: int, scaling: RopeScaling) -> tuple[np.ndarray, float]:
  """The inverse frequencies and the cos/sin factor at short lengths.

  For `dynamic` and `longrope` these are the frequencies up to max_position and
  original_max_position; `inverse_frequencies` gives them at any length.

  Args:
    theta: the rotary base.
    dim: d, the rotary width in channels.
    scaling: the variant.

  Returns:
    `(inv, factor)`: inverse frequencies [dim/2] float32, and the factor on cos and sin.

  Raises:
    ValueError: a longrope factor list whose length is not dim/2.
  """
  t = scaling.type
  if t in ("default", "dynamic"):
    return _default(theta, dim), 1.0
  if t == "linear":
    return (_default(theta, dim) / np.float32(scaling.factor)).astype(np.float32), 1.0
  if t == "llama3":
    return _llama3(theta, dim, scaling), 1.0
  if t == "yarn":
    return _yarn(theta, dim, scaling)
  return _longrope(theta, dim, scaling, long=False), _longrope_attention(scaling)


def inverse_frequencies(
    theta: float, dim: int, scaling: RopeScaling, seq_len: jax.Array | None = None
) -> tuple[jax.Array, float]:
  """The inverse frequencies and the cos/sin factor for sequences of `seq_len`.

  Args:
    theta: the rotary base.
    dim: d, the rotary width in channels.
    scaling: the variant.
    seq_len: the sequence length each call or token computes (any shape, integers), as
      transformers takes max(position_ids) + 1; used by the length-dependent variants only, whose
      frequencies then carry its shape in front. None: the short-length frequencies.

  Returns:
    `(inv, factor)`: inverse frequencies [..., dim/2] float32, and the factor on cos and sin.
  """
  inv, attention = frequencies(theta, dim, scaling)
  if not scaling.length_dependent or seq_len is None:
    return jnp.asarray(inv), attention
  seq_len = jnp.asarray(seq_len)
  if scaling.type == "longrope":
    long = jnp.asarray(_longrope(theta, dim, scaling, long=True))
    past = (seq_len > scaling.original_max_position)[..., None]
    return jnp.where(past, long, jnp.asarray(inv)), attention
  # dynamic: theta * (factor * L / max - (factor - 1)) ^ (d / (d - 2)), L at least max
  top = scaling.max_position
  length = jnp.maximum(seq_len, top).astype(jnp.float32)
  grown = theta * ((scaling.factor * length / top) - (scaling.factor - 1)) ** (dim / (dim - 2))
  exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  return 1.0 / (grown[..., None] ** exponent), attention


def apply(
    x_BxLxHxK: jax.Array,
    positions: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
    rotary_dim: int | None = None,
    seq_len: jax.Array | None = None,
) -> jax.Array:
  """x with its first `rotary_dim` channels (default all) rotated by position.

  Args:
    x_BxLxHxK: queries or keys.
    positions: [L] (the same for every row) or [B, L] (per row: packed sequences, or the tokens
      of a serving step).
    theta: the rotary base.
    scaling: the variant (default: none).
    rotary_dim: channels that rotate, from the first (default: all).
    seq_len: for the length-dependent variants, the sequence length of the call (a scalar) or
      of each position (shaped like `positions`); default max(positions) + 1.

  Returns:
    x rotated, in its dtype.
  """
  scaling = scaling or RopeScaling()
  dim = x_BxLxHxK.shape[-1] if rotary_dim is None else rotary_dim
  if scaling.length_dependent and seq_len is None:
    seq_len = jnp.max(positions) + 1
  inv, attention = inverse_frequencies(theta, dim, scaling, seq_len)
  return rotate(x_BxLxHxK, positions, inv, attention)


def cos_sin(angle: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin of `angle`, each computed once per value.

  On the CPU they are computed inside a conditional (both branches alike): fused into the
  rotation, XLA:CPU recomputed them for every head and channel that reads them, 10x the cost of
  the rotation itself (a 1,024-token step of 9 query heads at head dim 64: 1.6 against 0.17 ms a
  layer). Other platforms compute them as they are.

  Args:
    angle: the angles, any shape.

  Returns:
    (cos, sin) of `angle`, float32.
  """
  both = lambda a: (jnp.cos(a), jnp.sin(a))
  if angle.size == 0:
    return both(angle)
  # a conditional XLA cannot resolve at compile time keeps its results out of the consumers'
  # fusions; which branch runs does not matter
  held = lambda a: jax.lax.cond(a.reshape(-1)[0] > 0, both, both, a)
  return jax.lax.platform_dependent(angle, cpu=held, default=both)


def rotate(
    x_BxLxHxK: jax.Array, positions: jax.Array, inv: jax.Array, attention: float | jax.Array = 1.0
) -> jax.Array:
  """`x`'s first `2·len(inv)` channels rotated by positions times `inv`.

  Channel i pairs with i + d/2 (d = 2·len(inv)); cos and sin are multiplied by `attention`; the
  other channels pass as they are.

  Args:
    x_BxLxHxK: queries or keys, [B, L, H, K].
    positions: [L] (the same for every row) or [B, L].
    inv: inverse frequencies, [d/2], or [L, d/2] / [B, L, d/2] per position (length-dependent
      variants).
    attention: the factor on cos and sin (the variant's attention scaling).

  Returns:
    `x` rotated, [B, L, H, K], in its dtype.
  """
  angle = positions.astype(jnp.float32)[..., None] * inv  # [L or B,L, d/2]
  angle_BxLxK2 = angle[None] if angle.ndim == 2 else angle
  cos, sin = cos_sin(angle_BxLxK2)
  cos = cos[:, :, None, :] * attention
  sin = sin[:, :, None, :] * attention
  x = x_BxLxHxK.astype(jnp.float32)
  half = inv.shape[-1]
  x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)
  return out.astype(x_BxLxHxK.dtype)
