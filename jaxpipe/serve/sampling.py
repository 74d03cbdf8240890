"""Next-token sampling, one row per request: greedy, temperature, top-k, top-p; log-probabilities.

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

from jaxpipe.serve.refusal import Refusal

MAX_TEMPERATURE = 100.0  # above it sampling is all but uniform; 1e308 or inf would only overflow
MAX_BANNED = 16  # ids a row can keep from being sampled before min_tokens (EOS + stop ids)
MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list (OpenAI's top_logprobs)

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
    return None


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


def sample(logits_RxV: jax.Array, s: SamplingBatch) -> jax.Array:
  """Token ids [R] (int32), one per row of logits.

  A step whose rows are all greedy takes the argmax alone (`lax.cond` runs one branch): the sort
  over the vocabulary that top-k / top-p need is skipped.

  Args:
    logits_RxV: [R, V] logits.
    s: each row's sampling values (temperature 0: greedy) and banned ids.

  Returns:
    [R] int32 token ids.
  """
  logits_RxV = ban(logits_RxV, s.banned_RxS)
  greedy_R = jnp.argmax(logits_RxV, axis=-1).astype(jnp.int32)
  return jax.lax.cond(
      jnp.any(s.temperature_R > 0), lambda: _sample(logits_RxV, s, greedy_R), lambda: greedy_R
  )


def _sample(logits_RxV: jax.Array, s: SamplingBatch, greedy_R: jax.Array) -> jax.Array:
  """Each row sampled with its temperature, top-k and top-p (greedy where temperature is 0)."""
  v = logits_RxV.shape[-1]
  scaled_RxV = logits_RxV / jnp.maximum(s.temperature_R, 1e-6)[:, None]
  sorted_RxV, order_RxV = jax.lax.top_k(scaled_RxV, v)
  rank_V = jnp.arange(v)
  keep_RxV = (s.top_k_R[:, None] == 0) | (rank_V[None, :] < s.top_k_R[:, None])
  probs_RxV = jax.nn.softmax(jnp.where(keep_RxV, sorted_RxV, -jnp.inf), axis=-1)
  before_RxV = jnp.cumsum(probs_RxV, axis=-1) - probs_RxV  # mass of the more likely tokens
  keep_RxV &= (before_RxV < s.top_p_R[:, None]) | (rank_V[None, :] == 0)
  keys_R = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
      s.seed_R, s.index_R
  )
  pick_R = jax.vmap(jax.random.categorical)(keys_R, jnp.where(keep_RxV, sorted_RxV, -jnp.inf))
  sampled_R = jnp.take_along_axis(order_RxV, pick_R[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(s.temperature_R > 0, sampled_R, greedy_R)
