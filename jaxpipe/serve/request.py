"""A generation request as the engine holds it, its states, and a request moved between engines.

A request is WAITING, RUNNING (its pages hold its computed tokens), FINISHING (its last token is
in a step in flight), FINISHED; a prefill worker parks it PREFILLED, and an engine receiving
K/V holds it INCOMING. Outputs sampled by a step in flight are PENDING until read back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxpipe.serve import slo
from jaxpipe.serve.grammar import Matcher
from jaxpipe.serve.refusal import Refusal
from jaxpipe.serve.sampling import MAX_BANNED, SamplingParams, TokenLogprobs

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
PREFILLED = "prefilled"  # prefill_only: token sampled, pages kept until release() or cancel()
INCOMING = "incoming"  # reserved by reserve_request: pages held, K/V arriving, not yet scheduled
FINISHING = "finishing"  # its last token is in a step in flight: off the scheduler, pages freed
ENGINE_EOS = "engine"  # add_request's default eos_id: the engine's
PENDING = -1  # an output token sampled by a step in flight, not read back yet (async scheduling)


def eos_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
  """An eos_id argument (one id, several, or None) as a tuple of ids.

  Args:
    eos_id: one id, a sequence of ids, or None.

  Returns:
    The ids; () for None.
  """
  if eos_id is None:
    return ()
  if isinstance(eos_id, (int, np.integer)):
    return (int(eos_id),)
  return tuple(int(i) for i in eos_id)


def outside_vocab(prompt: Sequence[int], vocab: int) -> Refusal | None:
  """Why some prompt token is no id of a model with `vocab` ids, or None.

  Args:
    prompt: the prompt's tokens.
    vocab: the model's vocabulary size.

  Returns:
    None, or a `Refusal` of `prompt` naming the first bad token and their count.
  """
  bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
  if not bad:
    return None
  return Refusal(
      f"prompt token {bad[0]!r} is outside the vocabulary [0, {vocab}) ({len(bad)} such tokens)",
      "prompt",
  )


@dataclasses.dataclass(frozen=True)
class RequestLimits:
  """What an engine can serve: the numbers `Engine.check_request` judges a request by (a router
  judges requests for remote engines by the same numbers, read from them)."""

  vocab: int  # the model's token ids: [0, vocab)
  max_seq_len: int  # prompt + generated tokens, at most
  page_size: int  # tokens per KV page
  num_pages: int  # pages of the pool, page 0 (scratch) included
  eos_id: int | tuple[int, ...] | None = None  # the engine's EOS ids (ENGINE_EOS means these)

  def check(
      self,
      prompt: Sequence[int],
      max_tokens: int,
      sampling: SamplingParams,
      eos_id: int | Sequence[int] | None | str = ENGINE_EOS,
  ) -> Refusal | None:
    """Why this request cannot be served, or None.

    Args:
      prompt: the prompt's token ids.
      max_tokens: the most tokens to generate.
      sampling: the request's sampling values.
      eos_id: as `Engine.add_request` takes it (ENGINE_EOS: the engine's own).

    Returns:
      None, or a `Refusal`: one line naming the fix, with the request field at fault in
      `.param` (`max_tokens`, `prompt`, `stop_token_ids`, `min_tokens` or a sampling field).
    """
    if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
      return Refusal(f"max_tokens={max_tokens!r} must be a positive integer", "max_tokens")
    reason = sampling.check()
    if reason:
      return reason
    bad = [t for t in sampling.stop_token_ids if t >= self.vocab]
    if bad:
      return Refusal(
          f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab})",
          "stop_token_ids",
      )
    if sampling.guide is not None and sampling.guide.vocab != self.vocab:
      return Refusal(
          f"the grammar's masks cover {sampling.guide.vocab} token ids but the model has "
          f"{self.vocab}; compile it for this model's vocabulary (`grammar.Compiler`)",
          "response_format",
      )
    bad = [t for t, _ in sampling.logit_bias if t >= self.vocab]
    if bad:
      return Refusal(
          f"logit_bias names token ids {bad} outside the vocabulary [0, {self.vocab})",
          "logit_bias",
      )
    eos = self.eos_id if eos_id == ENGINE_EOS else eos_id
    banned = len(set(eos_ids(eos)) | set(sampling.stop_token_ids))
    if sampling.min_tokens and banned > MAX_BANNED:
      return Refusal(
          f"min_tokens={sampling.min_tokens} holds back {banned} EOS and stop ids, more than "
          f"{MAX_BANNED}; give fewer stop_token_ids",
          "min_tokens",
      )
    if len(prompt) == 0:
      return Refusal("the prompt is empty; give at least one token", "prompt")
    outside = outside_vocab(prompt, self.vocab)
    if outside:
      return outside
    if len(prompt) >= self.max_seq_len:
      return Refusal(
          f"the prompt has {len(prompt)} tokens, which leaves no room in the context of "
          f"{self.max_seq_len}; shorten it",
          "prompt",
      )
    total = len(prompt) + max_tokens
    if total > self.max_seq_len:
      return Refusal(
          f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
          f"context of {self.max_seq_len} tokens; shorten the prompt or lower max_tokens",
          "max_tokens",
      )
    pages = math.ceil(total / self.page_size)
    if pages > self.num_pages - 1:
      return Refusal(
          f"prompt + max_tokens = {total} tokens need {pages} pages of {self.page_size}, but "
          f"the pool has {self.num_pages - 1}; lower max_tokens or give the engine more pages",
          "max_tokens",
      )
    return None


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request and its state; times are `time.perf_counter()` seconds."""

  id: int
  prompt: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: int | tuple[int, ...] | None  # any of these ends it (kept in its output)
  output: list[int] = dataclasses.field(default_factory=list)  # generated tokens
  # aligned with output when sampling.logprobs is not None (raw log_softmax), else empty
  logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)  # block table: physical page ids
  ring: list[int] = dataclasses.field(default_factory=list)  # sliding layers' pages (ring ids)
  computed: int = 0  # leading tokens whose K/V are in `pages`
  state: str = WAITING
  finish_reason: str | None = None  # 'eos', 'length', 'cancelled', 'error'
  error: str | None = None
  arrival: float = 0.0
  first_token_time: float | None = None
  finish_time: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)
  preemptions: int = 0
  cached_tokens: int = 0  # prompt tokens taken from the prefix cache (summed over admissions)
  page_keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix keys of full pages
  registered: int = 0  # full pages offered to the prefix cache since the last admission
  grammar: Matcher | None = None  # structured output: where the output is in its grammar
  drafts: list[int] = dataclasses.field(default_factory=list)  # proposed for the step built now

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The tokens that end it once it has sampling.min_tokens: EOS ids and stop_token_ids."""
    return eos_ids(self.eos_id) + tuple(self.sampling.stop_token_ids)

  @property
  def length(self) -> int:
    """len(tokens), without building them (what the scheduler reads)."""
    return len(self.prompt) + len(self.output)

  @property
  def ttft(self) -> float | None:
    """Time to first token (`slo.ttft`)."""
    return slo.ttft(self.arrival, self.first_token_time)

  @property
  def tpot(self) -> float | None:
    """Mean time per output token after the first (`slo.tpot`)."""
    times = self.token_times
    return slo.tpot(times[0], times[-1], len(times)) if times else None


@dataclasses.dataclass
class KVState:
  """A request and its cached K/V, to move it to another engine (`export_request`)."""

  prompt: list[int]
  output: list[int]
  max_tokens: int
  sampling: SamplingParams
  eos_id: int | None
  computed: int  # leading tokens whose K/V are cached; 0: the receiver recomputes them
  # [G, n_layers, pages, page_size, head_dim]; an 8-bit cache's: (values, float32 scales
  # [G, n_layers, pages, page_size]); None: moved apart (kv_of, write_kv)
  k: np.ndarray | tuple[np.ndarray, np.ndarray] | None
  v: np.ndarray | tuple[np.ndarray, np.ndarray] | None
  arrival: float
  first_token_time: float | None
  token_times: list[float]
  logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # aligned with output


def token_slice(r: Request, start: int, stop: int) -> list[int]:
  """r.tokens[start:stop] without building r.tokens (prompt + output) first.

  A decode step reads one token of each of up to max_batch requests.

  Args:
    r: the request.
    start: the first position.
    stop: the position after the last.

  Returns:
    The tokens at positions start..stop-1 of prompt + output.
  """
  p = len(r.prompt)
  if start >= p:
    return r.output[start - p : stop - p]
  return r.prompt[start:stop] + r.output[: max(0, stop - p)]
