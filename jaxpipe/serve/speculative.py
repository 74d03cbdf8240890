"""Speculative decoding: draft tokens proposed on the host, verified by the target in one step.

A decoding request with drafts d_1..d_m computes its last token and the m drafts in one step
(as a chunk of m + 1 tokens), and the step's logits at those m + 1 positions decide (Leviathan
et al., 2023; Chen et al., 2023, for a draft that puts all its mass on one token):

- greedy: d_i is kept while it is the target's argmax after d_1..d_{i-1}; the first argmax that
  differs (or the one after d_m) follows, so the output is token for token the plain engine's;
- sampled: d_i is kept with probability p_i(d_i) (p_i: the target's distribution after
  temperature, min-p, top-k and top-p); at the first rejection the next token is drawn from p_i
  without d_i, renormalized; after m acceptances, from p_{m+1}. Each emitted token is then
  distributed exactly as the target's (the draft's choice is deterministic, so the rejection
  rule's min(1, p/q) is p, and the residual max(0, p - q) is p less the draft).

Between one and m + 1 tokens come out of each such step. Drafts come from a `Drafter`: n-gram
lookup in the request's own tokens (`method="ngram"`, vLLM's; "prompt lookup decoding": the
longest suffix of up to `ngram_max` tokens that occurred before is matched, and the tokens that
followed it are proposed), a smaller model's greedy continuation (`method="draft"`,
`serve.drafter.ModelDrafter`), or the served model's own multi-token prediction module
(`method="mtp"`, DeepSeek-V3's; `serve.mtp_drafter.MtpDrafter`). Every drafter is certain of
its tokens, so the rule above keeps the target's distribution for each. Only rows that sample
from the plain distribution speculate (no penalties, bias, grammar, log-probabilities or
min_tokens bans); the others decode one token as always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.serve import sampling as sampling_lib
from jaxpipe.serve.sampling import SamplingBatch, SamplingParams

METHODS = ("ngram", "draft", "mtp")


class Drafter(Protocol):
  """What proposes drafts for an engine's decoding requests."""

  def propose(self, requests: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
    """Drafts for each request (`serve.request.Request`: its prompt and output so far).

    Args:
      requests: the requests that may speculate this step.
      limits: the most drafts each may take.

    Returns:
      Each request's drafts, at most its limit ([] for none).
    """
    ...

  def forget(self, rid: int) -> None:
    """Drops what it keeps of a request that finished.

    Args:
      rid: the request's id on the target engine.
    """
    ...


@dataclasses.dataclass(frozen=True, eq=False)
class SpecConfig:
  """How an engine speculates."""

  method: str = "ngram"  # one of METHODS
  num_tokens: int = 4  # drafts per request per step at most (k)
  ngram_max: int = 4  # the longest suffix matched
  ngram_min: int = 1  # the shortest
  drafter: Drafter | None = None  # method "draft": the drafter (`serve.drafter.ModelDrafter`)

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"speculative method={self.method!r}: use one of {', '.join(METHODS)}")
    if (self.method == "draft") != (self.drafter is not None):
      raise ValueError(
          f"speculative method={self.method!r} with drafter={self.drafter!r:.40}: method "
          "'draft' takes a drafter (serve.drafter.ModelDrafter), 'ngram' and 'mtp' none"
      )
    if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
      raise ValueError(f"speculative num_tokens={self.num_tokens!r} must be an integer >= 1")
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise ValueError(
          f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} need 1 <= min <= max"
      )


def ngram_drafts(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
  """Prompt-lookup drafts: the tokens that followed the latest earlier match of the longest
  suffix (n_max down to n_min tokens) of `tokens`.

  Args:
    tokens: the request's prompt and output.
    k: drafts at most.
    n_max: the longest suffix tried.
    n_min: the shortest.

  Returns:
    Up to k tokens; [] when no suffix occurred before.
  """
  seq = np.asarray(tokens, np.int64)
  length = len(seq)
  for n in range(min(n_max, length - 1), n_min - 1, -1):
    suffix = seq[length - n :]
    # windows ending before the suffix itself: starts 0..length-n-1
    windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
    hits = np.flatnonzero(np.all(windows == suffix, axis=1))
    if hits.size:
      start = int(hits[-1]) + n
      return seq[start : start + k].tolist()
  return []


class NgramDrafter:
  """`ngram_drafts` over each request's own tokens (`Drafter`)."""

  def __init__(self, spec: SpecConfig):
    self.n_max, self.n_min = spec.ngram_max, spec.ngram_min

  def propose(self, requests: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
    """Each request's n-gram drafts.

    Args:
      requests: the requests (their `tokens`).
      limits: the most drafts each may take.

    Returns:
      Their drafts.
    """
    return [ngram_drafts(r.tokens, k, self.n_max, self.n_min) for r, k in zip(requests, limits)]

  def forget(self, rid: int) -> None:
    """Nothing is kept per request.

    Args:
      rid: unused.
    """
    del rid


def drafter_of(spec: SpecConfig) -> Drafter:
  """The drafter a config names.

  Args:
    spec: the engine's speculative config.

  Returns:
    Its `drafter`, or an `NgramDrafter`.
  """
  return spec.drafter or NgramDrafter(spec)


def eligible(sp: SamplingParams, generated: int, logprobs: bool, grammar: bool) -> bool:
  """Whether a request may speculate: it samples from the target's plain distribution.

  Args:
    sp: its sampling values.
    generated: tokens it has generated.
    logprobs: it asks for log-probabilities.
    grammar: it follows a grammar.

  Returns:
    True when no penalty, bias, grammar, log-probabilities or min_tokens ban applies.
  """
  return not (sp.penalized or sp.logit_bias or grammar or logprobs or generated < sp.min_tokens)


def _sampled(logits_RxKxV, s, safe_RxK, live_RxK, m_R, greedy_a_R, greedy_next_R):
  """(kept drafts [R], the token after them [R]) by the sampled rule; greedy rows keep theirs."""
  r, k1, v = logits_RxKxV.shape
  k = k1 - 1
  rep = lambda x: None if x is None else jnp.repeat(x, k1)
  kept_NxV, order_NxV = sampling_lib.truncated(
      logits_RxKxV.reshape(r * k1, v).astype(jnp.float32),
      rep(s.temperature_R),
      rep(s.top_k_R),
      rep(s.top_p_R),
      rep(s.min_p_R),
  )
  rows_NxV = jnp.broadcast_to(jnp.arange(r * k1)[:, None], (r * k1, v))
  filtered = jnp.full((r * k1, v), -jnp.inf).at[rows_NxV, order_NxV].set(kept_NxV)  # vocab order
  probs_RxK1xV = jax.nn.softmax(filtered.reshape(r, k1, v), axis=-1)
  keys_R = sampling_lib.row_keys(s)
  u_RxK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (k,)))(keys_R)
  p_draft_RxK = jnp.take_along_axis(probs_RxK1xV[:, :k], safe_RxK[:, :, None], axis=-1)[..., 0]
  kept_RxK = (u_RxK < p_draft_RxK) & live_RxK  # kept with the target's probability of it
  a_R = jnp.sum(jnp.cumprod(kept_RxK.astype(jnp.int32), axis=1), axis=1)  # leading kept
  probs_RxV = jnp.take_along_axis(probs_RxK1xV, a_R[:, None, None], axis=1)[:, 0]
  rejected_draft_R = jnp.take_along_axis(safe_RxK, jnp.minimum(a_R, k - 1)[:, None], axis=1)[:, 0]
  rejected_RxV = (a_R < m_R)[:, None] & (jnp.arange(v)[None, :] == rejected_draft_R[:, None])
  residual_RxV = jnp.where(rejected_RxV, 0.0, probs_RxV)  # the target less the rejected draft
  draw_R = jax.vmap(lambda key, p: jax.random.categorical(jax.random.fold_in(key, 2), jnp.log(p)))(
      keys_R, residual_RxV
  ).astype(jnp.int32)
  greedy_R = s.temperature_R <= 0
  return jnp.where(greedy_R, greedy_a_R, a_R), jnp.where(greedy_R, greedy_next_R, draw_R)


def verify(
    logits_RxKxV: jax.Array, s: SamplingBatch, first_R: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """The tokens a verify step emits per row (the module docstring's rule).

  Args:
    logits_RxKxV: [R, k + 1, V] the target's logits after the row's last token and each draft.
    s: the rows' sampling values; `s.drafts_RxK` [R, k] the drafts (-1 padded, leading).
    first_R: each row's token sampled the plain way from position 0 (what a row without drafts
      emits).

  Returns:
    (tokens [R, k + 1] int32, -1 past the count; count [R] int32, 1..m + 1).
  """
  r, k1, v = logits_RxKxV.shape
  k = k1 - 1
  drafts_RxK = s.drafts_RxK
  m_R = jnp.sum(drafts_RxK >= 0, axis=1)
  safe_RxK = jnp.maximum(drafts_RxK, 0)
  live_RxK = jnp.arange(k)[None, :] < m_R[:, None]
  # greedy: a draft is kept where it is the argmax at its position
  argmax_RxK1 = sampling_lib.argmax(logits_RxKxV)
  greedy_kept_RxK = (safe_RxK == argmax_RxK1[:, :k]) & live_RxK
  greedy_a_R = jnp.sum(jnp.cumprod(greedy_kept_RxK.astype(jnp.int32), axis=1), axis=1)
  greedy_next_R = jnp.take_along_axis(argmax_RxK1, greedy_a_R[:, None], axis=1)[:, 0]
  # a step whose rows are all greedy skips the sampled rule's sort over the vocabulary
  a_R, next_R = jax.lax.cond(
      jnp.any(s.temperature_R > 0),
      lambda: _sampled(logits_RxKxV, s, safe_RxK, live_RxK, m_R, greedy_a_R, greedy_next_R),
      lambda: (greedy_a_R, greedy_next_R),
  )
  next_R = jnp.where(m_R == 0, first_R, next_R)  # no drafts: the plain token
  pos_K1 = jnp.arange(k1)[None, :]
  drafts_RxK1 = jnp.concatenate([drafts_RxK, jnp.full((r, 1), -1, jnp.int32)], axis=1)
  tokens_RxK1 = jnp.where(pos_K1 < a_R[:, None], drafts_RxK1, -1)
  tokens_RxK1 = jnp.where(pos_K1 == a_R[:, None], next_R[:, None], tokens_RxK1)
  return tokens_RxK1.astype(jnp.int32), (a_R + 1).astype(jnp.int32)
