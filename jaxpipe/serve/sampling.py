"""Next-token sampling, one row per request: greedy, temperature, top-k, top-p.

Row r's randomness is `fold_in(key(seed_r), index_r)` with index_r the number of tokens the
request has generated so far: a request's tokens depend on its own seed alone, not on what it
was batched with, on preemptions, or on the engine it runs on.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

MAX_TEMPERATURE = 100.0  # above it sampling is all but uniform; 1e308 or inf would only overflow
MAX_BANNED = 16  # ids a row can keep from being sampled before min_tokens (EOS + stop ids)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0  # 0 = greedy (argmax)
  top_k: int = 0  # keep the k most likely tokens; 0 = all
  top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches p
  seed: int = 0  # the request's own random stream
  min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
  stop_token_ids: tuple[int, ...] = ()  # besides EOS, tokens that end the request (kept in it)

  def check(self) -> str | None:
    """Why these values cannot be used, or None."""
    if not (0 <= self.temperature <= MAX_TEMPERATURE):
      return (
          f"temperature={self.temperature} must lie in [0, {MAX_TEMPERATURE:g}] "
          "(0 = greedy; above that every token is equally likely anyway)"
      )
    if not isinstance(self.top_k, int) or self.top_k < 0:
      return f"top_k={self.top_k!r} must be an integer >= 0 (0 = no limit)"
    if not 0 < self.top_p <= 1:
      return f"top_p={self.top_p} must lie in (0, 1] (1 = no limit)"
    if not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
      return f"seed={self.seed!r} must be an integer in [0, 2**31)"
    if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
      return f"min_tokens={self.min_tokens!r} must be an integer >= 0"
    if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
      return f"stop_token_ids={list(self.stop_token_ids)!r} must be token ids (integers >= 0)"
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
  """logits with each row's banned ids (entries >= 0) at -inf (transformers' min_new_tokens)."""
  if banned_RxS is None:
    return logits_RxV
  v = logits_RxV.shape[-1]
  hit_RxV = jnp.any(banned_RxS[:, :, None] == jnp.arange(v)[None, None, :], axis=1)
  return jnp.where(hit_RxV, -jnp.inf, logits_RxV)


def sample(logits_RxV: jax.Array, s: SamplingBatch) -> jax.Array:
  """Token ids [R] (int32)."""
  logits_RxV = ban(logits_RxV, s.banned_RxS)
  v = logits_RxV.shape[-1]
  greedy_R = jnp.argmax(logits_RxV, axis=-1).astype(jnp.int32)
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
