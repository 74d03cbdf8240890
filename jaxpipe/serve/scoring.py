"""Scoring a prompt: each token's log-probability given the tokens before it.

What lm-evaluation-harness's loglikelihood asks (and `echo` with `max_tokens=0` over HTTP): one
exact forward pass of the training model over the whole prompt, with the serving parameters on
the engine's devices. No pages are touched, so a score runs between steps without disturbing
the batch. Prompts are padded to a power-of-two length: a bounded number of programs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpipe.models import transformer
from jaxpipe.models.transformer import TransformerConfig
from jaxpipe.serve.batch import bucket, powers_of_two
from jaxpipe.serve.request import outside_vocab
from jaxpipe.serve.sampling import MAX_LOGPROBS, TokenLogprobs, as_token_logprobs, top_logprobs


class Scorer:
  """Scores prompts with one engine's parameters (`Engine.score`)."""

  def __init__(
      self,
      cfg: TransformerConfig,
      param_sharding,
      replicated: NamedSharding,
      max_seq_len: int,
  ):
    """Args:
    cfg: the serving model.
    param_sharding: the parameters' shardings (a tree like the parameters).
    replicated: the sharding of the tokens and the results.
    max_seq_len: the longest prompt scored.
    """
    self.cfg, self.max_seq_len = cfg, max_seq_len
    self._param_sharding, self._replicated = param_sharding, replicated
    self.lengths = powers_of_two(max_seq_len)  # padded prompt lengths

  @functools.cached_property
  def program(self):
    """The jitted forward and scoring (one compiled program per padded length)."""

    def score(params, tokens_1xL):  # row i: the distribution after token i, scored at token i+1
      # an engine's unstacked layers each read in place, on its prepacked kernels where it has
      logits_LxV = transformer.forward(self.cfg, params, tokens_1xL)[0]
      return top_logprobs(logits_LxV, jnp.roll(tokens_1xL[0], -1))

    rep = self._replicated
    return jax.jit(score, in_shardings=(self._param_sharding, rep), out_shardings=rep)

  def score(
      self, params, prompt: Sequence[int], top_logprobs: int = 0
  ) -> list[TokenLogprobs | None]:
    """Each prompt token's log-probability and the most likely tokens at its place.

    Args:
      params: the serving parameters, placed as `param_sharding` says.
      prompt: token ids.
      top_logprobs: how many of the most likely tokens to list at each place.

    Returns:
      One entry per prompt token: None for the first, then the token's `TokenLogprobs`.

    Raises:
      ValueError: one line, for a bad prompt or top_logprobs.
    """
    if not isinstance(top_logprobs, (int, np.integer)) or not 0 <= top_logprobs <= MAX_LOGPROBS:
      raise ValueError(f"top_logprobs={top_logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
    prompt = list(prompt)
    if not prompt:
      raise ValueError("the prompt to score is empty; give at least one token")
    outside = outside_vocab(prompt, self.cfg.vocab)
    if outside:
      raise ValueError(outside)
    if len(prompt) > self.max_seq_len:
      raise ValueError(
          f"the prompt to score has {len(prompt)} tokens, more than the context of "
          f"{self.max_seq_len}; shorten it or give the engine a larger max_seq_len"
      )
    tokens_1xL = np.zeros((1, bucket(len(prompt), self.lengths)), np.int32)
    tokens_1xL[0, : len(prompt)] = prompt
    chosen_L, top_LxM, ids_LxM = jax.device_get(self.program(params, tokens_1xL))
    return [None] + [
        as_token_logprobs(chosen_L[i], top_LxM[i], ids_LxM[i], top_logprobs)
        for i in range(len(prompt) - 1)
    ]
