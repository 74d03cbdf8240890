"""OpenAI's completions protocol as this server speaks it: the request body (pydantic, strict:
unknown fields and wrong types are refused with a message naming them), the refusals, and a
choice's text as its tokens arrive (incremental UTF-8, stop sequences held back until they
cannot begin there). Nothing here touches the engine or the network.

Text is the byte tokenizer of jaxpipe's models: a prompt's UTF-8 bytes are its tokens, and
generated tokens below 256 are bytes of the output (decoded incrementally, so a character split
over tokens appears whole in the chunk of its last byte). Beyond the OpenAI fields, every
choice carries `token_ids` (its generated tokens; in a stream, the chunk's), and requests
accept vLLM's `top_k` and `ignore_eos`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pydantic

from jaxpipe.models import tokenizer as tokenizer_lib

MAX_STOPS = 4  # OpenAI's limit on stop sequences
FINISH = {"eos": "stop", "length": "length", "cancelled": "abort"}  # engine reason -> OpenAI's


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  include_usage: bool | None = None  # a last chunk with empty choices and the usage
  continuous_usage_stats: bool | None = None  # accepted (vLLM's); every chunk's usage is null


class CompletionRequest(pydantic.BaseModel):
  """The body of POST /v1/completions; null means the default."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  model: str | None = None  # must be the served model's name when given
  prompt: (
      str | list[int] | list[str] | list[list[int]]
  )  # text (UTF-8 bytes) or token ids, or a list
  max_tokens: int | None = None  # default 16, OpenAI's
  temperature: float | None = None  # default 1, OpenAI's; 0 = greedy
  top_p: float | None = None
  top_k: int | None = None  # vLLM's; 0 or -1 = no limit
  seed: int | None = None  # choice k samples with seed + k (mod 2**31); default random
  stop: str | list[str] | None = None  # up to 4; the text ends before the first one found
  n: int | None = None  # choices per prompt
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  ignore_eos: bool | None = None  # vLLM's: only max_tokens or a stop sequence ends the choice
  user: str | None = None  # accepted, unused
  # Accepted only at their defaults (clients send them unasked); anything else is refused.
  echo: bool | None = None
  logprobs: int | None = None
  best_of: int | None = None
  suffix: str | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  logit_bias: dict[str, float] | None = None


UNSUPPORTED = {
    "echo": (None, False),
    "logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
}


class BadRequest(Exception):
  """A request the server refuses: status, message and the offending parameter."""

  def __init__(
      self,
      message: str,
      param: str | None = None,
      status: int = 400,
      kind: str = "invalid_request_error",
      code: str | None = None,
      headers: dict[str, str] | None = None,
  ):
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
    self.headers = headers


def _validation_message(e: pydantic.ValidationError) -> tuple[str, str | None]:
  err = e.errors()[0]
  loc = [str(x) for x in err["loc"]]
  param = loc[0] if loc else None
  if err["type"] == "extra_forbidden":
    return (
        f"unrecognized request argument {'.'.join(loc)!r}; supported: "
        f"{', '.join(CompletionRequest.model_fields)}",
        param,
    )
  if err["type"] == "missing":
    return f"{param!r} is required", param
  if param == "prompt":
    return (
        f"prompt={err.get('input')!r:.80} must be a string, a list of token ids, or a list of "
        "either",
        param,
    )
  return f"{param}={err.get('input')!r:.80}: {err['msg']}", param


def parse_request(body: bytes) -> CompletionRequest:
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not valid JSON ({e}); send a JSON object") from None
  if not isinstance(obj, dict):
    raise BadRequest(f"the request body is a JSON {type(obj).__name__}; send a JSON object")
  try:
    req = CompletionRequest.model_validate(obj)
  except pydantic.ValidationError as e:
    raise BadRequest(*_validation_message(e)) from None
  for name, defaults in UNSUPPORTED.items():
    if getattr(req, name) not in defaults:
      raise BadRequest(f"{name}={getattr(req, name)!r} is not supported; leave it out", name)
  if req.best_of not in (None, 1, req.n or 1):
    raise BadRequest(
        f"best_of={req.best_of} is not supported; leave it out (or equal to n)", "best_of"
    )
  return req


def prompts_of(prompt: str | list) -> list[tuple[list[int], bool]]:
  """(tokens, given as text) of each prompt of a request."""
  if isinstance(prompt, str):
    return [(list(prompt.encode("utf-8")), True)]
  if not prompt or isinstance(prompt[0], int):
    return [(list(prompt), False)]
  return [
      (list(p.encode("utf-8")), True) if isinstance(p, str) else (list(p), False) for p in prompt
  ]


class Choice:
  """One choice's text as its tokens arrive: incremental UTF-8, stop sequences, finish reason.

  Text that could be the start of a stop sequence is held back until it is not, so no chunk
  ever carries part of a stop sequence.
  """

  def __init__(self, index: int, stops: Sequence[str], eos_id: int | None):
    self.index, self.stops, self.eos_id = index, list(stops), eos_id
    self._decoder = tokenizer_lib.ByteTokenizer().decoder()  # ids of 256 and above: no text
    self.text, self.sent, self.tokens = "", 0, []
    self.finish_reason: str | None = None

  def add(self, token: int | None, finish: str | None) -> str:
    """Takes one token (None: none) and the finish reason if the choice ends with it; returns
    the text it releases."""
    if token is not None:
      self.tokens.append(token)
      if token != self.eos_id:
        self.text += self._decoder.push(token)
    if finish is not None:
      self.text += self._decoder.flush()
    hold = 0
    if self.stops:
      found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
      if found:
        self.text, finish = self.text[: min(found)], "stop"
      elif finish is None:
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])),
            default=0,
        )
    out = self.text[self.sent : len(self.text) - hold]
    self.sent += len(out)
    self.finish_reason = finish
    return out


def stop_list(stop: str | list[str] | None) -> list[str]:
  """A request's stop sequences as a list (OpenAI takes one string or a list)."""
  return [stop] if isinstance(stop, str) else stop or []


def usage_of(prompt_tokens: int, choices: list[Choice]) -> dict:
  """OpenAI's `usage` of a request: its prompts' tokens and every choice's generated ones."""
  completion = sum(len(c.tokens) for c in choices)
  return {
      "prompt_tokens": prompt_tokens,
      "completion_tokens": completion,
      "total_tokens": prompt_tokens + completion,
  }
