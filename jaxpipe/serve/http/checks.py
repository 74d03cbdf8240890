"""The one place a completions or chat request's content is checked, once it is a `Job`.

`check` refuses, with a `BadRequest` naming the field as the request spells it, what this server
or its backend cannot serve: the number of choices, stop sequences and stop ids, the seed,
logprobs and echo, and each prompt with its max_tokens and sampling values (the backend's
`check_request`). Before a request is a `Job`, `protocol` refuses what does not parse: wrong
types, unknown fields, values of fields a `Job` does not keep (`suffix`, `best_of` below n or
streamed, a chat's `top_logprobs` without `logprobs` or `max_tokens` and
`max_completion_tokens` that differ), text that is not Unicode and malformed messages. Whether
the server can take a request now (capacity, failure, draining) is the app's to decide, after
these checks.
"""

from __future__ import annotations

import dataclasses

from jaxpipe.serve import sampling as sampling_lib
from jaxpipe.serve.http import logprobs as logprobs_lib
from jaxpipe.serve.http.protocol import BadRequest, Job
from jaxpipe.serve.refusal import Refusal

MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_STOP_TOKEN_IDS = 16  # ids a request may end on besides EOS
# A chat request's names for the fields the checks name after a completions request.
CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server checks a request against besides its backend.

  Attributes:
    max_seq_len: the context (the shortest of the backend's engines); a request without
      max_tokens generates up to its end.
    eos: the ids that end a choice, as `check_request` takes them (ENGINE_EOS: the engine's).
  """

  max_seq_len: int
  eos: tuple[int, ...] | str


def spelled(param: str | None, chat: bool) -> str | None:
  """A request field's name as a chat or a completions request spells it.

  Args:
    param: the field as a completions request names it (`prompt`, `logprobs`, ...).
    chat: whether the request came to /v1/chat/completions.

  Returns:
    `param`, or its chat name (`messages`, `top_logprobs`) for a chat request.
  """
  return CHAT_PARAMS.get(param, param) if chat else param


def scores(backend) -> bool:
  """Whether the backend scores prompts, which logprobs and echo need.

  Args:
    backend: an Engine or a deployment (`score`; `Backend` makes it optional).

  Returns:
    True if it has a callable `score`.
  """
  return callable(getattr(backend, "score", None))


def check(job: Job, backend, limits: Limits) -> list[int]:
  """Checks a request's content, in the order its refusals are reported.

  Args:
    job: the request, from either endpoint.
    backend: what serves it (`loop.Backend`); its `check_request` judges each prompt.
    limits: the server's context and EOS ids.

  Returns:
    Each prompt's max_tokens: the request's, the rest of the context when it gives none, or 0
    for a prompt that is only scored (echo with max_tokens 0).

  Raises:
    BadRequest: the first fault found (status 400), its `param` and message naming the field
      as the request spells it (a chat's prompt is `messages`, its logprobs `top_logprobs`).
  """
  _check_choices(job)
  _check_logprobs(job, backend)
  return _check_prompts(job, backend, limits)


def _check_choices(job: Job) -> None:
  """What is asked of every choice: stop ids, n, stop sequences, prompts, seed."""
  stop_ids = job.sampling.stop_token_ids
  if len(stop_ids) > MAX_STOP_TOKEN_IDS:
    raise BadRequest(
        f"stop_token_ids has {len(stop_ids)} ids; give at most {MAX_STOP_TOKEN_IDS}",
        "stop_token_ids",
    )
  if job.n < 1:
    raise BadRequest(f"n={job.n} must be >= 1", "n")
  if len(job.stops) > MAX_STOPS or any(not s for s in job.stops):
    raise BadRequest(f"stop={job.stops!r}: give at most {MAX_STOPS} non-empty strings", "stop")
  if not job.prompts:
    raise BadRequest(
        "the prompt list is empty; give at least one prompt", spelled("prompt", job.chat)
    )
  if job.seed is not None and not 0 <= job.seed < 2**31:
    raise BadRequest(f"seed={job.seed} must lie in [0, 2**31)", "seed")


def _check_logprobs(job: Job, backend) -> None:
  """Logprobs and echo this server cannot answer, naming the fix."""
  param = spelled("logprobs", job.chat)
  if job.logprobs is not None:
    if not 0 <= job.logprobs <= sampling_lib.MAX_LOGPROBS:
      raise BadRequest(
          f"{param}={job.logprobs} must lie in [0, {sampling_lib.MAX_LOGPROBS}] "
          "(the alternatives listed)",
          param,
      )
    if not scores(backend):
      raise BadRequest(f"{param} is not supported by this engine; leave it out", param)
  if job.echo and job.stream and job.logprobs is not None:
    raise BadRequest(
        "echo with logprobs cannot be streamed; send stream=false (or leave out logprobs)", "echo"
    )
  if job.max_tokens == 0 and not job.echo:
    raise BadRequest(
        "max_tokens=0 must be a positive integer (0 only with echo=true: score the prompt)",
        "max_tokens",
    )
  if job.echo and job.max_tokens == 0 and job.stream:
    raise BadRequest("max_tokens=0 scores the prompt only; it cannot be streamed", "stream")


def _check_prompts(job: Job, backend, limits: Limits) -> list[int]:
  """Each prompt with its max_tokens and the sampling values, as the backend judges them."""
  sampling = logprobs_lib.with_logprobs(job.sampling, job.logprobs)
  scoring = job.echo and job.max_tokens == 0
  eos = None if job.ignore_eos else limits.eos
  max_tokens = []
  for i, (tokens, _) in enumerate(job.prompts):
    # Without max_tokens, the rest of the context (a prompt that fills it is the backend's to
    # refuse, as the prompt's fault).
    m = max(limits.max_seq_len - len(tokens), 1) if job.max_tokens is None else job.max_tokens
    # A scored prompt generates nothing, but the backend judges it as one that generates.
    why = backend.check_request(tokens, max(m, 1) if scoring else m, sampling, eos)
    if why:
      raise _refused(why.prefixed(f"prompt {i}: " if len(job.prompts) > 1 else ""), job)
    max_tokens.append(0 if scoring else m)
  return max_tokens


def _refused(why: Refusal, job: Job) -> BadRequest:
  """The 400 for the backend's refusal; a chat's max_tokens may have come as
  max_completion_tokens, which the message then names."""
  message = str(why)
  if job.chat and why.param == "max_tokens" and job.max_tokens is not None:
    message += " (max_completion_tokens)"
  return BadRequest(message, spelled(why.param, job.chat))
