"""OpenAI's completions and chat completions protocol as this server speaks it: the request
bodies (pydantic, strict: unknown fields and wrong types are refused with a message naming
them), the refusals, the chat messages' checks, and a choice's text as its tokens arrive
(incremental decoding, stop sequences held back until they cannot begin there). Nothing here
touches the engine or the network.

Text goes through the model's tokenizer (`jaxpipe.models.tokenizer`: the bytes of jaxpipe's own
models, the Hugging Face tokenizer of a converted checkpoint). A text prompt is `tok.encode(text)`
(with the BOS the tokenizer adds); a chat is `tok.apply_chat_template(messages)`. Output text is
the tokenizer's incremental decode of the generated ids without special tokens (vLLM's default
`skip_special_tokens=True`), so the EOS or stop token id that ends a choice is in its `token_ids`
but not in its text, and a character split over tokens arrives whole. Beyond the OpenAI fields,
every choice carries `token_ids` (its generated tokens; in a stream, the chunk's), and requests
accept vLLM's `top_k`, `ignore_eos`, `min_tokens` and `stop_token_ids`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Literal

import pydantic

from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.serve.sampling import SamplingParams

FINISH = {"eos": "stop", "length": "length", "cancelled": "abort"}  # engine reason -> OpenAI's
ROLES = ("system", "user", "assistant", "tool")


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  include_usage: bool | None = None  # a last chunk with empty choices and the usage
  continuous_usage_stats: bool | None = None  # accepted (vLLM's); every chunk's usage is null


class JsonSchema(pydantic.BaseModel):
  """`response_format.json_schema`: OpenAI's named schema."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True, populate_by_name=True)
  name: str | None = None
  description: str | None = None
  schema_: dict[str, Any] | None = pydantic.Field(None, alias="schema")  # None: any JSON object
  strict: bool | None = None  # accepted: the output always follows the schema


class ResponseFormat(pydantic.BaseModel):
  """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchema | None = None  # with type json_schema


class StructuredOutputs(pydantic.BaseModel):
  """vLLM's `structured_outputs`: one of a schema, a regex, a choice, a grammar, any object."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True, populate_by_name=True)
  json_: dict[str, Any] | str | None = pydantic.Field(None, alias="json")  # a JSON schema
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None  # Lark (or GBNF) text
  json_object: bool | None = None


class _Sampling(pydantic.BaseModel):
  """The fields completions and chat completions share; null means the default."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  model: str | None = None  # must be the served model's name when given
  temperature: float | None = None  # default 1, OpenAI's; 0 = greedy
  top_p: float | None = None
  top_k: int | None = None  # vLLM's; 0 or -1 = no limit
  seed: int | None = None  # choice k samples with seed + k (mod 2**31); default random
  stop: str | list[str] | None = None  # up to 4; the text ends before the first one found
  n: int | None = None  # choices per prompt
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  ignore_eos: bool | None = None  # vLLM's: only max_tokens or a stop sequence ends the choice
  min_tokens: int | None = None  # vLLM's: EOS and stop_token_ids are not sampled before
  stop_token_ids: list[int] | None = None  # vLLM's: ids that end the choice besides EOS
  user: str | None = None  # accepted, unused
  presence_penalty: float | None = None  # -2..2, over the generated tokens (vLLM's definition)
  frequency_penalty: float | None = None  # -2..2, times each generated token's count
  repetition_penalty: float | None = None  # vLLM's: (0, 10], over prompt and generated tokens
  logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
  min_p: float | None = None  # vLLM's: 0..1, below min_p x the top token's probability: dropped
  # structured output (`serve.grammar`), at most one of these: OpenAI's response_format, vLLM's
  # structured_outputs, and vLLM's older guided_* fields
  response_format: ResponseFormat | None = None
  structured_outputs: StructuredOutputs | None = None
  guided_json: dict[str, Any] | str | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_grammar: str | None = None


class CompletionRequest(_Sampling):
  """The body of POST /v1/completions."""

  prompt: str | list[int] | list[str] | list[list[int]]  # text or token ids, or a list
  max_tokens: int | None = None  # default 16, OpenAI's; 0 with echo: score the prompt only
  echo: bool | None = None  # the prompt before the generated text (and its logprobs)
  logprobs: int | None = None  # 0..20: each token's log-probability and the top k's
  best_of: int | None = None  # candidates per prompt; the n most likely are returned
  suffix: str | None = None


class ChatRequest(_Sampling):
  """The body of POST /v1/chat/completions."""

  messages: list[Any]  # checked by `chat_messages`, which names the bad message
  max_tokens: int | None = None  # default: the rest of the context
  max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
  logprobs: bool | None = None
  top_logprobs: int | None = None  # 0..20, with logprobs
  tools: list[Any] | None = None  # functions the model may call (`http.tools`)
  tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or a named function
  parallel_tool_calls: bool | None = None  # false: "required" makes exactly one call


UNSUPPORTED = {"suffix": (None, "")}  # accepted at their defaults only (clients send them unasked)


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


def _validation_message(e: pydantic.ValidationError, cls: type[pydantic.BaseModel]) -> tuple:
  err = e.errors()[0]
  loc = [str(x) for x in err["loc"]]
  param = loc[0] if loc else None
  if err["type"] == "extra_forbidden":
    return (
        f"unrecognized request argument {'.'.join(loc)!r}; supported: "
        f"{', '.join(cls.model_fields)}",
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


def parse_json(body: bytes) -> dict:
  """A request body as a JSON object.

  Args:
    body: the request's bytes.

  Returns:
    The object.

  Raises:
    BadRequest: the body is not JSON, or not an object.
  """
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not valid JSON ({e}); send a JSON object") from None
  if not isinstance(obj, dict):
    raise BadRequest(f"the request body is a JSON {type(obj).__name__}; send a JSON object")
  return obj


def _validate(cls, body: bytes):
  try:
    req = cls.model_validate(parse_json(body))
  except pydantic.ValidationError as e:
    raise BadRequest(*_validation_message(e, cls)) from None
  for name, defaults in UNSUPPORTED.items():
    if getattr(req, name, None) not in defaults:
      raise BadRequest(f"{name}={getattr(req, name)!r} is not supported; leave it out", name)
  for i, s in enumerate(stop_list(req.stop)):
    check_text(s, f"stop[{i}]" if isinstance(req.stop, list) else "stop", "stop")
  return req


def parse_request(body: bytes) -> CompletionRequest:
  """A /v1/completions body.

  Args:
    body: the request's bytes.

  Returns:
    The `CompletionRequest`.

  Raises:
    BadRequest: a body that does not validate, best_of below n, or best_of above n with stream.
  """
  req = _validate(CompletionRequest, body)
  n = 1 if req.n is None else req.n
  if req.best_of is not None and req.best_of < n:
    raise BadRequest(f"best_of={req.best_of} must be >= n={n} (the choices returned)", "best_of")
  if req.best_of is not None and req.best_of > n and req.stream:
    raise BadRequest(
        f"best_of={req.best_of} > n={n} cannot be streamed: the best are known only at the end; "
        "send stream=false",
        "best_of",
    )
  return req


def parse_chat(body: bytes) -> ChatRequest:
  """A /v1/chat/completions body.

  Args:
    body: the request's bytes.

  Returns:
    The `ChatRequest`.

  Raises:
    BadRequest: a body that does not validate, max_tokens and max_completion_tokens that
      differ, or top_logprobs without logprobs.
  """
  req = _validate(ChatRequest, body)
  if req.max_tokens is not None and req.max_completion_tokens is not None:
    if req.max_tokens != req.max_completion_tokens:
      raise BadRequest(
          f"max_tokens={req.max_tokens} and max_completion_tokens={req.max_completion_tokens} "
          "differ; give one of them",
          "max_completion_tokens",
      )
  if req.top_logprobs is not None and not req.logprobs:
    raise BadRequest(f"top_logprobs={req.top_logprobs} needs logprobs=true", "top_logprobs")
  return req


def check_text(text: str, where: str, param: str) -> None:
  r"""Refuses text that is not Unicode a tokenizer can read.

  JSON's "\ud800" alone (a lone surrogate) parses into a Python string that has no UTF-8.

  Args:
    text: the text.
    where: what holds it, for the message (e.g. 'the prompt').
    param: the request field at fault.

  Raises:
    BadRequest: the text holds a lone surrogate.
  """
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise BadRequest(
        f"{where} holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
        "which is not text; send valid Unicode (a surrogate pair, or the character itself)",
        param,
    ) from None


def prompts_of(
    prompt: str | list, tok: tokenizer_lib.Tokenizer
) -> list[tuple[list[int], str | None]]:
  """(tokens, the text if given as text) of each prompt of a completions request.

  Args:
    prompt: a string, a list of token ids, or a list of either (several prompts).
    tok: the model's tokenizer, for text prompts.

  Returns:
    One (token ids, text or None) per prompt.

  Raises:
    BadRequest: a text prompt that is not valid Unicode (`check_text`).
  """
  if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
    prompt = [prompt]
  out = []
  for i, p in enumerate(prompt):
    if isinstance(p, str):
      check_text(p, f"prompt {i}" if len(prompt) > 1 else "the prompt", "prompt")
      out.append((tok.encode(p) if p else [], p))
    else:
      out.append((list(p), None))
  return out


def chat_messages(raw: list[Any]) -> list[dict[str, Any]]:
  """A chat's messages as a template reads them ({"role", "content"[, "name"]}; an assistant's
  "tool_calls", a tool result's "tool_call_id").

  Content parts are joined by newlines (vLLM's). An assistant message with tool calls may have
  no content.

  Args:
    raw: the request's `messages`.

  Returns:
    The messages.

  Raises:
    BadRequest: naming the first bad message (no messages, an unknown key or role, content that
      is neither a string nor text parts, invalid Unicode, a name that is not a string).
  """
  if not raw:
    raise BadRequest("messages is empty; give at least one message", "messages")
  out = []
  for i, m in enumerate(raw):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise BadRequest(f"{where} is a JSON {type(m).__name__}; give an object", "messages")
    extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
    if extra:
      raise BadRequest(
          f"{where} has {sorted(extra)}; a message has role, content, name, tool_calls and "
          "tool_call_id only",
          "messages",
      )
    role, content = m.get("role"), m.get("content")
    calls = m.get("tool_calls")
    if calls is not None and not (role == "assistant" and isinstance(calls, list)):
      raise BadRequest(
          f"{where}.tool_calls: only an assistant message has tool_calls, a list of calls",
          "messages",
      )
    if content is None and calls:
      content = ""
    if role not in ROLES:
      raise BadRequest(
          f"{where}.role={role!r}: the role must be one of {', '.join(ROLES)}", "messages"
      )
    if isinstance(content, list):
      texts = []
      for j, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and set(part) == {"type", "text"}
            and isinstance(part["text"], str)
        ):
          raise BadRequest(
              f"{where}.content[{j}]={part!r:.80}: only text parts "
              '({"type": "text", "text": ...}) are supported',
              "messages",
          )
        texts.append(part["text"])
      content = "\n".join(texts)
    if not isinstance(content, str):
      raise BadRequest(
          f"{where}.content={content!r:.80} must be a string or a list of text parts", "messages"
      )
    check_text(content, f"{where}.content", "messages")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
      raise BadRequest(f"{where}.name={name!r:.80} must be a string", "messages")
    more = {k: m[k] for k in ("name", "tool_calls", "tool_call_id") if m.get(k)}
    out.append({"role": role, "content": content} | more)
  return out


@dataclasses.dataclass
class Job:
  """What a completions or chat request asks of the engine, whichever endpoint it came to."""

  chat: bool
  prompts: list[tuple[list[int], str | None]]  # tokens, and the text when given as text
  n: int
  max_tokens: int | None  # None: the rest of the context
  sampling: SamplingParams  # seed 0: set per choice
  seed: int | None
  stops: list[str]
  ignore_eos: bool
  stream: bool
  include_usage: bool
  logprobs: int | None  # None: none; k: the top k alternatives of every token
  echo: bool = False
  structured: Structured | None = None  # the grammar every choice follows (compiled by the app)
  best_of: int | None = None  # candidates per prompt, of which the n most likely are returned
  tools: Any = None  # a chat's `tools.ToolPlan`, set by the app

  @property
  def candidates(self) -> int:
    """Sequences generated per prompt: best_of, or n."""
    return self.best_of or self.n


@dataclasses.dataclass(frozen=True)
class Structured:
  """A request's structured output, as `grammar.Compiler.compile` takes it."""

  kind: str  # one of grammar.KINDS
  spec: Any  # the schema, pattern, choices or grammar text (None: any JSON object)
  param: str  # the request field it came in, for messages


# vLLM's structured_outputs fields -> grammar kinds
STRUCTURED_OUTPUTS = {
    "json_": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def structured_of(req: _Sampling) -> Structured | None:
  """The structured output a request asks for, from whichever field it used.

  Args:
    req: a completions or chat request.

  Returns:
    The `Structured`, or None for free text.

  Raises:
    BadRequest: more than one field asks for it, or json_schema without its schema.
  """
  found = []
  rf = req.response_format
  if rf is not None and rf.type == "json_object":
    found.append(Structured("json_object", None, "response_format"))
  elif rf is not None and rf.type == "json_schema":
    if rf.json_schema is None or rf.json_schema.schema_ is None:
      raise BadRequest(
          'response_format type "json_schema" needs json_schema.schema (the JSON schema); use '
          'type "json_object" for any JSON object',
          "response_format",
      )
    found.append(Structured("json_schema", rf.json_schema.schema_, "response_format"))
  so = req.structured_outputs
  if so is not None:
    for field, kind in STRUCTURED_OUTPUTS.items():
      value = getattr(so, field)
      if value is not None and value is not False:
        spec = None if kind == "json_object" else value
        found.append(Structured(kind, spec, f"structured_outputs.{field.rstrip('_')}"))
  for field, kind in (
      ("guided_json", "json_schema"),
      ("guided_regex", "regex"),
      ("guided_choice", "choice"),
      ("guided_grammar", "grammar"),
  ):
    if getattr(req, field) is not None:
      found.append(Structured(kind, getattr(req, field), field))
  if len(found) > 1:
    raise BadRequest(
        f"{found[0].param} and {found[1].param} both constrain the output; give one",
        found[1].param,
    )
  return found[0] if found else None


def sampling_of(req: _Sampling) -> SamplingParams:
  """The request's sampling values.

  Unchecked: `checks.check` and the backend's `check_request` refuse bad ones. Unset values take
  OpenAI's defaults (temperature 1, top_p 1; top_k -1 or unset: off).

  Args:
    req: a completions or chat request.

  Returns:
    The `SamplingParams`.
  """
  return SamplingParams(
      1.0 if req.temperature is None else req.temperature,
      0 if req.top_k in (None, -1) else req.top_k,
      1.0 if req.top_p is None else req.top_p,
      min_tokens=req.min_tokens or 0,
      stop_token_ids=tuple(req.stop_token_ids or ()),
      min_p=req.min_p or 0.0,
      presence_penalty=req.presence_penalty or 0.0,
      frequency_penalty=req.frequency_penalty or 0.0,
      repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
      logit_bias=tuple((_token_key(k), v) for k, v in (req.logit_bias or {}).items()),
  )


def _token_key(key: str) -> int:
  """A logit_bias key (a token id written as a string, OpenAI's form) as the id."""
  try:
    return int(key)
  except ValueError:
    raise BadRequest(
        f"logit_bias key {key!r} is not a token id; keys are token ids as strings, e.g. "
        '{"50256": -100}',
        "logit_bias",
    ) from None


def job_of(req: _Sampling, prompts: list, chat: bool) -> Job:
  """A parsed request as a `Job`, its values unchecked (`checks.check` refuses bad ones).

  Args:
    req: a `CompletionRequest`, or a `ChatRequest` when `chat`.
    prompts: (tokens, the text when given as text) of each prompt.
    chat: whether the request came to /v1/chat/completions.

  Returns:
    The job, with the defaults of what the request left out.
  """
  if chat:
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    echo = False
  else:
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    logprobs, echo = req.logprobs, bool(req.echo)
  return Job(
      chat=chat,
      prompts=prompts,
      n=1 if req.n is None else req.n,
      max_tokens=max_tokens,
      sampling=sampling_of(req),
      seed=req.seed,
      stops=stop_list(req.stop),
      ignore_eos=bool(req.ignore_eos),
      stream=bool(req.stream),
      include_usage=bool(req.stream_options and req.stream_options.include_usage),
      logprobs=logprobs,
      echo=echo,
      structured=structured_of(req),
      best_of=None if chat else req.best_of,
  )


class Choice:
  """One choice's text as its tokens arrive: incremental decoding, stop sequences, finish reason.

  Text that could be the start of a stop sequence is held back until it is not, so no chunk
  ever carries part of a stop sequence. Ids in `hidden` (the tokenizer's special tokens) have no
  text, and neither has the EOS or stop token id (one of `ends`) that ends the choice (vLLM's
  defaults). A choice its grammar ends (structured output) ends with finish "stop" on a token
  that is text.
  """

  def __init__(
      self,
      index: int,
      stops: Sequence[str],
      decoder: tokenizer_lib.Decoder,
      hidden: frozenset[int] = frozenset(),
      ends: frozenset[int] | None = None,
  ):
    """ends: the EOS and stop ids; None: any token that ends a choice with "stop" is one."""
    self.index, self.stops, self.hidden, self.ends = index, list(stops), hidden, ends
    self._decoder = decoder
    self.text, self.sent, self.tokens = "", 0, []
    self.logprobs: list = []  # per generated token, when asked for: (logprob, top pairs)
    self.finish_reason: str | None = None

  def add(self, token: int | None, finish: str | None) -> str:
    """Takes one token and the finish reason if the choice ends with it.

    A token in `ends` with finish "stop" is the EOS or stop id that ended it (its text is not
    released).
    Text that may begin a stop sequence is held back until it cannot.

    Args:
      token: the token, or None for none.
      finish: the finish reason if the choice ends here, else None.

    Returns:
      The text it releases.
    """
    if token is not None:
      self.tokens.append(token)
      ended = finish == "stop" and (self.ends is None or token in self.ends)
      if token not in self.hidden and not ended:
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
  """A request's stop sequences as a list (OpenAI takes one string or a list).

  Args:
    stop: one string, a list, or None.

  Returns:
    The list; [] for none.
  """
  return [stop] if isinstance(stop, str) else stop or []


def usage_of(prompt_tokens: int, choices: list[Choice]) -> dict:
  """OpenAI's `usage` of a request: its prompts' tokens and every choice's generated ones.

  Args:
    prompt_tokens: the prompts' tokens.
    choices: the request's choices.

  Returns:
    {"prompt_tokens", "completion_tokens", "total_tokens"}.
  """
  completion = sum(len(c.tokens) for c in choices)
  return {
      "prompt_tokens": prompt_tokens,
      "completion_tokens": completion,
      "total_tokens": prompt_tokens + completion,
  }
