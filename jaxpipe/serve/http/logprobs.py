"""Log-probabilities in OpenAI's two formats, from the engine's `TokenLogprobs` (a token's
log-probability and its top-k alternatives as (id, log-probability) pairs, most likely first).

- completions (`logprobs: k`, the legacy format lm-evaluation-harness reads): `{"tokens",
  "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`; with `echo` the prompt's
  tokens come first, scored by `Engine.score` (the first one has nothing to be conditioned on:
  null). As vLLM writes it, each position's dict lists the chosen token, then the top k.
- chat (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A token's string is its own decode (`tok.decode([id])`, special tokens included, a partial UTF-8
character as U+FFFD), as vLLM writes it; log-probabilities are floored at -9999 (vLLM's), since
JSON has no -Infinity.
"""

from __future__ import annotations

import dataclasses

from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.serve import sampling as sampling_lib

FLOOR = -9999.0


def with_logprobs(sampling: sampling_lib.SamplingParams, k: int | None):
  """The sampling with `logprobs=k` (top-k alternatives per token) where k is given.

  Args:
    sampling: the request's sampling.
    k: alternatives per token; None: the sampling unchanged.

  Returns:
    The sampling.
  """
  if k is None:
    return sampling
  return dataclasses.replace(sampling, logprobs=k)


def token_text(tok: tokenizer_lib.Tokenizer, token: int) -> str:
  """A token's string: its own decode, special tokens included (a partial UTF-8 character: U+FFFD).

  Args:
    tok: the model's tokenizer.
    token: the token's id.

  Returns:
    `tok.decode([token])`.
  """
  return tok.decode([token])


def _lp(x: float) -> float:
  return max(float(x), FLOOR)


def legacy(
    tok: tokenizer_lib.Tokenizer,
    ids: list[int],
    entries: list,
    k: int,
    offset: int = 0,
) -> dict:
  """The completions format over `ids` (module docstring).

  Args:
    tok: the model's tokenizer.
    ids: the tokens.
    entries: aligned with `ids`: a `TokenLogprobs`, or None for none (the prompt's first).
    k: alternatives per position, after the chosen token.
    offset: the first token's text offset.

  Returns:
    {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per token.
  """
  tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
  for token, entry in zip(ids, entries):
    text = token_text(tok, token)
    tokens.append(text)
    offsets.append(offset)
    offset += len(text)
    if entry is None:
      token_logprobs.append(None)
      top_logprobs.append(None)
      continue
    logprob, top = entry
    token_logprobs.append(_lp(logprob))
    alternatives = {text: _lp(logprob)}
    for i, lp in list(top)[:k]:
      alternatives.setdefault(token_text(tok, int(i)), _lp(lp))
    top_logprobs.append(alternatives)
  return {
      "tokens": tokens,
      "token_logprobs": token_logprobs,
      "top_logprobs": top_logprobs,
      "text_offset": offsets,
  }


def _entry(text: str, logprob: float) -> dict:
  return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat(tok: tokenizer_lib.Tokenizer, ids: list[int], entries: list, k: int) -> dict:
  """The chat format over `ids` (module docstring).

  Args:
    tok: the model's tokenizer.
    ids: the tokens.
    entries: aligned with `ids`, a `TokenLogprobs` each.
    k: alternatives per token.

  Returns:
    {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}, one entry per token.
  """
  content = []
  for token, (logprob, top) in zip(ids, entries):
    content.append(
        {
            **_entry(token_text(tok, token), logprob),
            "top_logprobs": [_entry(token_text(tok, int(i)), lp) for i, lp in list(top)[:k]],
        }
    )
  return {"content": content}
