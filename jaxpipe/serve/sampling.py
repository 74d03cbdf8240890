"""Next-token sampling, one row per request: greedy, temperature, top-k, top-p, min-p, logit
bias, presence, frequency and repetition penalties, a grammar's token mask; log-probabilities.

The order is vLLM's: a grammar's mask (`serve.grammar`: tokens it does not allow are -inf),
min_tokens bans and `logit_bias` first, then the penalties (repetition
over the prompt's and the output's tokens, frequency and presence over the output's), then the
argmax for greedy rows, else temperature, min-p (tokens whose probability is below min_p times
the most likely one's are dropped), top-k and top-p, and the draw.

Row r's randomness is `fold_in(key(seed_r), index_r)` with index_r the number of tokens the
request has generated so far: a request's tokens depend on its own seed alone, not on what it
was batched with, on preemptions, or on the engine it runs on.

Log-probabilities are those of the model's raw next-token distribution (`log_softmax` of the
float32 logits, before temperature, top-k/top-p and min_tokens bans: vLLM's default), so that
they score the model, not the sampler; every step computes the top MAX_LOGPROBS of each row on
the device, and the engine reads them back only when a sampled row asked for them.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from jaxpipe.serve.grammar import Guide
from jaxpipe.serve.refusal import Refusal

MAX_TEMPERATURE = 100.0  # above it sampling is all but uniform; 1e308 or inf would only overflow
MAX_BANNED = 16  # ids a row can keep from being sampled before min_tokens (EOS + stop ids)
MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list (OpenAI's top_logprobs)
MAX_LOGIT_BIAS = 300  # most token ids one request may bias (OpenAI's limit)
MAX_BIAS = 100.0  # a bias's magnitude (OpenAI's range: -100 bans a token, 100 all but forces it)

# (the token's log-probability, the top-k (id, log-probability) pairs, most likely first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0  # 0 = greedy (argmax)
  top_k: int = 0  # keep the k most likely tokens; 0 = all
  top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches p
  seed: int = 0  # the request's own random stream
  min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
  stop_token_ids: tuple[int, ...] = ()  # besides EOS, tokens that end the request (kept in it)
  logprobs: int | None = None  # None: none; k: each token's log-probability and the top k's
  min_p: float = 0.0  # drop tokens less likely than min_p times the most likely; 0 = off
  presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
  frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
  repetition_penalty: float = 1.0  # divides (> 0) or multiplies (< 0) seen tokens' logits
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
  guide: Guide | None = None  # structured output: the grammar every token follows

  @property
  def penalized(self) -> bool:
    """Whether any penalty is on (the step then carries the row's tokens)."""
    return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

  def check(self) -> Refusal | None:
    """Why these values cannot be used (the field at fault in `.param`), or None."""
    if not (0 <= self.temperature <= MAX_TEMPERATURE):
      return Refusal(
          f"temperature={self.temperature} must lie in [0, {MAX_TEMPERATURE:g}] "
          "(0 = greedy; above that every token is equally likely anyway)",
          "temperature",
      )
    if not isinstance(self.top_k, int) or self.top_k < 0:
      return Refusal(f"top_k={self.top_k!r} must be an integer >= 0 (0 = no limit)", "top_k")
    if not 0 < self.top_p <= 1:
      return Refusal(f"top_p={self.top_p} must lie in (0, 1] (1 = no limit)", "top_p")
    if not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
      return Refusal(f"seed={self.seed!r} must be an integer in [0, 2**31)", "seed")
    if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
      return Refusal(f"min_tokens={self.min_tokens!r} must be an integer >= 0", "min_tokens")
    if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
      return Refusal(
          f"stop_token_ids={list(self.stop_token_ids)!r} must be token ids (integers >= 0)",
          "stop_token_ids",
      )
    if self.logprobs is not None and (
        not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
    ):
      return Refusal(
          f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}] "
          "(the number of most likely alternatives to list)",
          "logprobs",
      )
    if not 0 <= self.min_p <= 1:
      return Refusal(f"min_p={self.min_p} must lie in [0, 1] (0 = off)", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(self, name) <= 2:
        return Refusal(f"{name}={getattr(self, name)} must lie in [-2, 2] (0 = off)", name)
    if not 0 < self.repetition_penalty <= 10:
      return Refusal(
          f"repetition_penalty={self.repetition_penalty} must lie in (0, 10] (1 = off; above 1 "
          "discourages repeats)",
          "repetition_penalty",
      )
    if len(self.logit_bias) > MAX_LOGIT_BIAS:
      return Refusal(
          f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias"
      )
    if self.guide is not None and self.min_tokens:
      return Refusal(
          f"min_tokens={self.min_tokens} cannot be combined with structured output: the grammar "
          "decides where the text ends; leave min_tokens out",
          "min_tokens",
      )
    for token, bias in self.logit_bias:
      if not isinstance(token, int) or token < 0 or not -MAX_BIAS <= bias <= MAX_BIAS:
        return Refusal(
            f"logit_bias {{{token!r}: {bias!r}}}: keys must be token ids (integers >= 0) and "
            f"values lie in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
            "logit_bias",
        )
    return None

  def to_dict(self) -> dict:
    """The values as JSON takes them, for another process (`from_dict` reads them back).

    Returns:
      Every field but `guide`.

    Raises:
      ValueError: a grammar (`guide`), which is an object of this process.
    """
    if self.guide is not None:
      raise ValueError("a request with structured output (a grammar) cannot leave this process")
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "guide"}
    d["stop_token_ids"] = list(self.stop_token_ids)
    d["logit_bias"] = [list(pair) for pair in self.logit_bias]
    return d

  @classmethod
  def from_dict(cls, d: dict) -> SamplingParams:
    """Sampling values from `to_dict`'s JSON.

    Args:
      d: the values.

    Returns:
      The params (their ranges unchecked: `check` judges them).

    Raises:
      ValueError: one line: an unknown field or a malformed one.
    """
    names = {f.name for f in dataclasses.fields(cls)} - {"guide"}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"unknown sampling fields {unknown}; known: {sorted(names)}")
    d = dict(d)
    try:
      d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
      d["logit_bias"] = tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))
    except (TypeError, ValueError) as e:
      raise ValueError(f"malformed stop_token_ids or logit_bias: {e}") from None
    return cls(**d)


@flax.struct.dataclass
class SamplingBatch:
  temperature_R: jax.Array  # float32
  top_k_R: jax.Array  # int32
  top_p_R: jax.Array  # float32
  seed_R: jax.Array  # int32
  index_R: jax.Array  # int32 tokens generated so far by the row's request
  # int32 [R, MAX_BANNED] ids whose logits are -inf for the row (min_tokens: EOS and stop ids
  # before the request has that many tokens), -1 padded; None: no row bans any
  banned_RxS: jax.Array | None = None
  min_p_R: jax.Array | None = None  # float32; None: no row uses min-p
  bias: LogitBias | None = None  # None: no row biases a token
  penalties: Penalties | None = None  # None: no row is penalized
  # int32 [R, ceil(V / 32)]: bit i % 32 of word i // 32 set where token i is allowed (a
  # grammar's mask, `serve.grammar`; unconstrained rows all ones); None: no row is constrained
  allowed_RxW: jax.Array | None = None
  # int32 [R, k]: each row's draft tokens (-1 padded; `serve.speculative`): the step verifies
  # them from the logits after the row's last token and each draft; None: no drafts
  drafts_RxK: jax.Array | None = None


@flax.struct.dataclass
class LogitBias:
  """Each row's biased ids (-1 padded) and the biases added to their logits."""

  ids_RxB: jax.Array  # int32
  values_RxB: jax.Array  # float32


@flax.struct.dataclass
class Penalties:
  """Each row's penalties and the tokens they count (vLLM's definitions)."""

  presence_R: jax.Array  # float32
  frequency_R: jax.Array  # float32
  repetition_R: jax.Array  # float32, 1 = off
  output_RxO: jax.Array  # int32 the row's generated tokens, -1 padded
  prompt_RxP: jax.Array  # int32 the row's prompt tokens, -1 padded (repetition only)
  # int32: where >= 0, the row's last generated token is the previous step's sampled token at
  # that row, still on the device (async scheduling)
  pending_R: jax.Array


def controls_key(s: SamplingBatch) -> tuple:
  """The shape of a batch's optional controls (min-p, bias width, penalties' token widths):
  each distinct key is its own compiled step program (`serve.programs`).

  Args:
    s: a step's sampling batch.

  Returns:
    `(min_p used, bias width or 0, (output width, prompt width) or None, mask used, drafts
    per row or 0)`.
  """
  bias = 0 if s.bias is None else s.bias.ids_RxB.shape[1]
  p = s.penalties
  widths = None if p is None else (p.output_RxO.shape[1], p.prompt_RxP.shape[1])
  drafts = 0 if s.drafts_RxK is None else s.drafts_RxK.shape[1]
  return (s.min_p_R is not None, bias, widths, s.allowed_RxW is not None, drafts)


NO_CONTROLS = (False, 0, None, False, 0)  # `controls_key` of a batch without optional controls


def batch_shapes(r: int, key: tuple = NO_CONTROLS, vocab: int = 0) -> SamplingBatch:
  """The `SamplingBatch` of r rows with the optional controls `key` names, as shapes.

  Args:
    r: rows.
    key: `controls_key` of the batches the program will take.
    vocab: the model's vocabulary (the width of a grammar's mask, when the key has one).

  Returns:
    A SamplingBatch of `jax.ShapeDtypeStruct`s.
  """
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  min_p, bias, widths, masked, drafts = key
  return SamplingBatch(
      f32(r),
      i32(r),
      f32(r),
      i32(r),
      i32(r),
      i32(r, MAX_BANNED),
      f32(r) if min_p else None,
      LogitBias(i32(r, bias), f32(r, bias)) if bias else None,
      None
      if widths is None
      else Penalties(f32(r), f32(r), f32(r), i32(r, widths[0]), i32(r, widths[1]), i32(r)),
      i32(r, (vocab + 31) // 32) if masked else None,
      i32(r, drafts) if drafts else None,
  )


def counts(ids_RxN: jax.Array, v: int) -> jax.Array:
  """How often each id occurs in each row.

  Args:
    ids_RxN: [R, N] token ids; entries < 0 count nothing.
    v: the vocabulary size.

  Returns:
    Float32 [R, V] counts.
  """
  r = ids_RxN.shape[0]
  rows_RxN = jnp.broadcast_to(jnp.arange(r)[:, None], ids_RxN.shape)
  valid = ids_RxN >= 0
  return (
      jnp.zeros((r, v), jnp.float32)
      .at[rows_RxN, jnp.where(valid, ids_RxN, 0)]
      .add(valid.astype(jnp.float32))
  )


def apply_mask(logits_RxV: jax.Array, allowed_RxW: jax.Array | None) -> jax.Array:
  """logits with the tokens each row's grammar does not allow at -inf.

  Args:
    logits_RxV: [R, V] logits.
    allowed_RxW: [R, ceil(V / 32)] int32 bitmask (bit i % 32 of word i // 32: token i), or None.

  Returns:
    [R, V] logits.
  """
  if allowed_RxW is None:
    return logits_RxV
  v = logits_RxV.shape[-1]
  ids_V = jnp.arange(v)
  bits_RxV = jnp.right_shift(allowed_RxW[:, ids_V // 32], ids_V % 32) & 1
  return jnp.where(bits_RxV == 1, logits_RxV, -jnp.inf)


def apply_bias(logits_RxV: jax.Array, bias: LogitBias | None) -> jax.Array:
  """logits plus each row's `logit_bias` (OpenAI's: added before anything else samples).

  Args:
    logits_RxV: [R, V] float32 logits.
    bias: the rows' biases, or None.

  Returns:
    [R, V] logits.
  """
  if bias is None:
    return logits_RxV
  r, v = logits_RxV.shape
  rows_RxB = jnp.broadcast_to(jnp.arange(r)[:, None], bias.ids_RxB.shape)
  valid = (bias.ids_RxB >= 0) & (bias.ids_RxB < v)
  add_RxV = (
      jnp.zeros((r, v), jnp.float32)
      .at[rows_RxB, jnp.where(valid, bias.ids_RxB, 0)]
      .add(jnp.where(valid, bias.values_RxB, 0.0))
  )
  return logits_RxV + add_RxV


def apply_penalties(
    logits_RxV: jax.Array, p: Penalties | None, prev_R: jax.Array | None = None
) -> jax.Array:
  """vLLM's penalties: a token the prompt or the output holds has its logit divided by the
  repetition penalty where positive, multiplied where not; then the frequency penalty times its
  count in the output and the presence penalty, once if the output holds it, are subtracted.

  Args:
    logits_RxV: [R, V] float32 logits.
    p: the rows' penalties and tokens, or None.
    prev_R: the previous step's sampled tokens (where `p.pending_R` points), or None.

  Returns:
    [R, V] logits.
  """
  if p is None:
    return logits_RxV
  v = logits_RxV.shape[-1]
  output_RxO = p.output_RxO
  if prev_R is not None:  # the last output token, sampled by the step before, on the device
    last_R = jnp.where(p.pending_R >= 0, prev_R[jnp.maximum(p.pending_R, 0)], -1)
    output_RxO = jnp.concatenate([output_RxO, last_R[:, None]], axis=1)
  out_RxV = counts(output_RxO, v)
  seen_RxV = (out_RxV > 0) | (counts(p.prompt_RxP, v) > 0)
  rep_RxV = jnp.where(seen_RxV, p.repetition_R[:, None], 1.0)
  logits_RxV = jnp.where(logits_RxV > 0, logits_RxV / rep_RxV, logits_RxV * rep_RxV)
  logits_RxV = logits_RxV - p.frequency_R[:, None] * out_RxV
  return logits_RxV - p.presence_R[:, None] * (out_RxV > 0)


def ban(logits_RxV: jax.Array, banned_RxS: jax.Array | None) -> jax.Array:
  """logits with each row's banned ids (entries >= 0) at -inf (transformers' min_new_tokens).

  Args:
    logits_RxV: [R, V] logits.
    banned_RxS: [R, S] ids each row may not sample (-1: none), or None.

  Returns:
    [R, V] logits.
  """
  if banned_RxS is None:
    return logits_RxV
  v = logits_RxV.shape[-1]
  hit_RxV = jnp.any(banned_RxS[:, :, None] == jnp.arange(v)[None, None, :], axis=1)
  return jnp.where(hit_RxV, -jnp.inf, logits_RxV)


def top_logprobs(
    logits_RxV: jax.Array, tokens_R: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The log-probabilities the host reads back, from `log_softmax(logits)` in float32.

  Args:
    logits_RxV: [R, V] logits.
    tokens_R: [R] the tokens sampled.

  Returns:
    (log-probability of tokens_R [R], top MAX_LOGPROBS log-probabilities [R, MAX_LOGPROBS],
    their ids [R, MAX_LOGPROBS] int32), the log-probabilities float32; fewer than MAX_LOGPROBS
    columns when V is smaller.
  """
  logp_RxV = jax.nn.log_softmax(logits_RxV.astype(jnp.float32), axis=-1)
  chosen_R = jnp.take_along_axis(logp_RxV, tokens_R[:, None], axis=-1)[:, 0]
  top_RxM, ids_RxM = jax.lax.top_k(logp_RxV, min(MAX_LOGPROBS, logp_RxV.shape[-1]))
  return chosen_R, top_RxM, ids_RxM.astype(jnp.int32)


def as_token_logprobs(chosen: float, top_M, ids_M, k: int) -> TokenLogprobs:
  """One row of `top_logprobs`, read back, as a token's TokenLogprobs with k alternatives.

  Args:
    chosen: the sampled token's log-probability.
    top_M: the top log-probabilities, most likely first.
    ids_M: their ids.
    k: alternatives to keep.

  Returns:
    (log-probability, [(id, log-probability)] of the k most likely).
  """
  return float(chosen), [(int(i), float(x)) for i, x in zip(ids_M[:k], top_M[:k])]


def argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the largest value), as int32, for rows
  without NaN (a row with one gives an index in range, not the NaN's).

  In blocks of up to 256 values (the largest power of two from 16 dividing V; else one block):
  each block's max, the first block holding the row's, then the first index of it within that
  block. XLA:CPU runs argmax's (value, index) reduction element by element, and the two passes
  over the whole row (`_first_max`) materialized the broadcast max and an index per value:
  12 ms of a 64 x 49,152 decode step, against under 1 ms in blocks.

  Args:
    x: [..., V] values.

  Returns:
    [...] int32 indices.
  """
  v = x.shape[-1]
  b = next((b for b in (256, 128, 64, 32, 16) if v % b == 0 and v > b), 0)
  if not b:
    return _first_max(x)
  x_NxB = x.reshape(*x.shape[:-1], v // b, b)
  first = _first_max(jnp.max(x_NxB, axis=-1))  # the first block holding the row's max
  block_B = jnp.take_along_axis(x_NxB, first[..., None, None], axis=-2)[..., 0, :]
  return first * b + _first_max(block_B)


def _first_max(x: jax.Array) -> jax.Array:
  """The first index of the last axis's max, in two vectorized passes (clamped into range)."""
  v = x.shape[-1]
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jnp.arange(v, dtype=jnp.int32)
  return jnp.minimum(jnp.min(jnp.where(x == top, index, v), axis=-1), v - 1)


def sample(logits_RxV: jax.Array, s: SamplingBatch, prev_R: jax.Array | None = None) -> jax.Array:
  """Token ids [R] (int32), one per row of logits, in the module docstring's order.

  A step whose rows are all greedy takes the argmax alone (`lax.cond` runs one branch): the sort
  over the vocabulary that top-k / top-p need is skipped.

  Args:
    logits_RxV: [R, V] logits.
    s: each row's sampling values (temperature 0: greedy), banned ids, biases and penalties.
    prev_R: the previous step's sampled tokens on the device (`Penalties.pending_R`), or None.

  Returns:
    [R] int32 token ids.
  """
  logits_RxV = apply_mask(logits_RxV.astype(jnp.float32), s.allowed_RxW)
  logits_RxV = ban(logits_RxV, s.banned_RxS)
  logits_RxV = apply_penalties(apply_bias(logits_RxV, s.bias), s.penalties, prev_R)
  greedy_R = argmax(logits_RxV)
  return jax.lax.cond(
      jnp.any(s.temperature_R > 0), lambda: _sample(logits_RxV, s, greedy_R), lambda: greedy_R
  )


def truncated(
    logits_RxV: jax.Array,
    temperature_R: jax.Array,
    top_k_R: jax.Array,
    top_p_R: jax.Array,
    min_p_R: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
  """Each row's logits over its temperature, most likely first, with what min-p, top-k and top-p
  drop at -inf: the distribution a sampled row draws from.

  Args:
    logits_RxV: [R, V] logits.
    temperature_R: [R] temperatures (> 0 where rows sample).
    top_k_R: [R] top-k (0: all).
    top_p_R: [R] top-p (1: all).
    min_p_R: [R] min-p, or None for none.

  Returns:
    (the kept scaled logits, sorted descending, -inf where dropped [R, V]; their ids [R, V]).
  """
  v = logits_RxV.shape[-1]
  scaled_RxV = logits_RxV / jnp.maximum(temperature_R, 1e-6)[:, None]
  if min_p_R is not None:  # below min_p x the most likely token's probability: dropped
    logp_RxV = jax.nn.log_softmax(scaled_RxV, axis=-1)
    floor_R = jnp.max(logp_RxV, axis=-1) + jnp.log(min_p_R)
    scaled_RxV = jnp.where(logp_RxV < floor_R[:, None], -jnp.inf, scaled_RxV)
  sorted_RxV, order_RxV = jax.lax.top_k(scaled_RxV, v)
  rank_V = jnp.arange(v)
  keep_RxV = (top_k_R[:, None] == 0) | (rank_V[None, :] < top_k_R[:, None])
  probs_RxV = jax.nn.softmax(jnp.where(keep_RxV, sorted_RxV, -jnp.inf), axis=-1)
  before_RxV = jnp.cumsum(probs_RxV, axis=-1) - probs_RxV  # mass of the more likely tokens
  keep_RxV &= (before_RxV < top_p_R[:, None]) | (rank_V[None, :] == 0)
  return jnp.where(keep_RxV, sorted_RxV, -jnp.inf), order_RxV


def row_keys(s: SamplingBatch) -> jax.Array:
  """Each row's random key: `fold_in(key(seed), tokens generated so far)`.

  Args:
    s: the rows' sampling values.

  Returns:
    [R] keys.
  """
  return jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(s.seed_R, s.index_R)


def _sample(logits_RxV: jax.Array, s: SamplingBatch, greedy_R: jax.Array) -> jax.Array:
  """Each row sampled with its temperature, top-k and top-p (greedy where temperature is 0)."""
  kept_RxV, order_RxV = truncated(logits_RxV, s.temperature_R, s.top_k_R, s.top_p_R, s.min_p_R)
  pick_R = jax.vmap(jax.random.categorical)(row_keys(s), kept_RxV)
  sampled_R = jnp.take_along_axis(order_RxV, pick_R[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(s.temperature_R > 0, sampled_R, greedy_R)
