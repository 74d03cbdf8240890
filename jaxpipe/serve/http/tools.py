"""Tool calling in /v1/chat/completions: the request's tools, its tool_choice, and the model's
tool-call text parsed into OpenAI's `tool_calls`.

The tools go to the chat template (`tools`, as transformers passes them). With tool_choice
"auto" (the default when tools are given) the model decides, and its text is parsed by its
family's format (vLLM's parser names):

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after any text;
- `llama3_json` (Llama 3.1-3.3): the whole reply is one JSON object `{"name": ...,
  "parameters": {...}}` (or several joined by ";"), after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, or (newer templates)
  `[TOOL_CALLS]name[ARGS]{...}` per call.

"required" and a named function are enforced through structured output, as vLLM does it: the
reply must be a JSON list of `{"name", "parameters"}`, one of the tools each, or the named
function's arguments. "none" leaves the text alone.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxpipe.serve.http.protocol import BadRequest, Structured

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclasses.dataclass
class ToolCall:
  """One call: the function's name and its arguments as JSON text (OpenAI's form)."""

  name: str
  arguments: str
  id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")

  def as_json(self, index: int | None = None) -> dict:
    """The call as `message.tool_calls[i]` (with index: as a stream's delta).

    Args:
      index: the call's place among the choice's calls, for a streamed delta.

    Returns:
      {"id", "type": "function", "function": {"name", "arguments"}} (and "index").
    """
    out = {"id": self.id, "type": "function"}
    out["function"] = {"name": self.name, "arguments": self.arguments}
    return out if index is None else {"index": index, **out}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
  """What a chat request's tools ask of the server."""

  tools: list[dict]  # as the template takes them ({"type": "function", "function": {...}})
  choice: str  # "auto", "required", "none", or "named"
  name: str | None = None  # the named function
  parser: str | None = None  # for "auto": the format the reply is parsed by
  parallel: bool = True  # False: "required" makes exactly one call


def detect(chat_template: str | None) -> str | None:
  """The tool-call format a chat template writes, from its markers; None if none is known.

  Args:
    chat_template: the model's chat template.

  Returns:
    One of PARSERS, or None.
  """
  template = chat_template or ""
  if "<tool_call>" in template:
    return "hermes"
  if "[TOOL_CALLS]" in template:
    return "mistral"
  if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
    return "llama3_json"
  return None


def plan_of(
    tools: list[Any] | None, tool_choice: Any, parser: str | None, parallel: bool | None = None
) -> ToolPlan | None:
  """A request's tools and tool_choice, checked.

  Args:
    tools: the request's `tools`.
    tool_choice: its `tool_choice` (None: "auto" with tools, "none" without).
    parser: the server's tool-call format (`detect`, or `--tool_call_parser`), None if unknown.
    parallel: the request's `parallel_tool_calls` (None: True).

  Returns:
    The `ToolPlan`, or None when no tools are given.

  Raises:
    BadRequest: a malformed tool or tool_choice, a named function not among the tools, or
      "auto" on a server that knows no tool-call format.
  """
  if not tools:
    if tool_choice not in (None, "none"):
      raise BadRequest(f"tool_choice={tool_choice!r:.80} needs tools", "tool_choice")
    return None
  names = []
  for i, t in enumerate(tools):
    f = t.get("function") if isinstance(t, dict) else None
    if not (
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(f, dict)
        and isinstance(f.get("name"), str)
        and f["name"]
        and isinstance(f.get("parameters", {}), dict)
    ):
      raise BadRequest(
          f"tools[{i}]={t!r:.80}: a tool is "
          '{"type": "function", "function": {"name": ..., "parameters": {JSON schema}}}',
          "tools",
      )
    names.append(f["name"])
  if tool_choice is None or tool_choice in ("auto", "none", "required"):
    choice = tool_choice or "auto"
    if choice == "auto" and parser is None:
      raise BadRequest(
          'tool_choice "auto" needs the model\'s tool-call format, which its chat template does '
          f"not show; start the server with --tool_call_parser (one of {', '.join(PARSERS)}) or "
          'send tool_choice "required" or a named function',
          "tool_choice",
      )
    return ToolPlan(list(tools), choice, parser=parser, parallel=parallel is not False)
  name = None
  if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
    name = (tool_choice.get("function") or {}).get("name")
  if name not in names:
    raise BadRequest(
        f"tool_choice={tool_choice!r:.120}: give 'auto', 'none', 'required' or "
        f'{{"type": "function", "function": {{"name": one of {names}}}}}',
        "tool_choice",
    )
  return ToolPlan(list(tools), "named", name=name)


def _parameters(tool: dict) -> dict:
  return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def structured(plan: ToolPlan) -> Structured | None:
  """The structured output that enforces "required" or a named function (vLLM's schemas).

  Args:
    plan: the request's tools.

  Returns:
    The `Structured` output, or None for "auto" and "none".
  """
  if plan.choice == "named":
    tool = next(t for t in plan.tools if t["function"]["name"] == plan.name)
    return Structured("json_schema", _parameters(tool), "tool_choice")
  if plan.choice != "required":
    return None
  one_of = [
      {
          "type": "object",
          "properties": {
              "name": {"type": "string", "enum": [t["function"]["name"]]},
              "parameters": _parameters(t),
          },
          "required": ["name", "parameters"],
          "additionalProperties": False,
      }
      for t in plan.tools
  ]
  schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of}}
  if not plan.parallel:
    schema["maxItems"] = 1
  return Structured("json_schema", schema, "tool_choice")


def calls_of(plan: ToolPlan, text: str, raw: str) -> tuple[str | None, list[ToolCall]]:
  """A reply's content and tool calls.

  Args:
    plan: the request's tools.
    text: the reply's text (special tokens left out).
    raw: the reply decoded with its special tokens (where `[TOOL_CALLS]` and `<|python_tag|>`
      show), its ending EOS left out.

  Returns:
    (the content, or None when the reply is only calls; the calls).
  """
  if plan.choice == "none":
    return text, []
  if plan.choice == "named":
    return None, [ToolCall(plan.name, text)]
  if plan.choice == "required":
    try:
      items = json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens
      return text, []
    return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in items]
  content, calls = parse(plan.parser, raw)
  return (content, calls) if calls else (text, [])


MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}  # where a call begins
PYTHON_TAG = "<|python_tag|>"


class ToolStream:
  """One streamed choice of a request with tools: what of its reply may be sent as it arrives.

  Content is sent until a call may have begun (text that could begin the format's marker is
  held back, as stop strings are; a Llama reply that opens with `{` or `<|python_tag|>` is all
  calls); a named function's arguments are sent as they come, after a first delta with its id
  and name; other calls are sent, whole, when the choice ends.
  """

  def __init__(self, plan: ToolPlan):
    self.plan = plan
    self.sent = 0  # characters of the text sent (content, or a named call's arguments)
    self.calling = False  # a call has begun: no more content

  def push(self, text: str, raw: str) -> tuple[str, list[dict]]:
    """What to send now of a reply still arriving.

    Args:
      text: the reply so far (special tokens left out).
      raw: the reply so far with its special tokens.

    Returns:
      (content to send, tool_calls deltas to send).
    """
    if self.plan.choice == "named":
      head = []
      if not self.calling:
        self.calling, self.call = True, ToolCall(self.plan.name, "")
        head = [self.call.as_json(index=0)]
      out, self.sent = text[self.sent :], len(text)
      return "", head + ([{"index": 0, "function": {"arguments": out}}] if out else [])
    if self.plan.choice != "auto" or self.calling:
      return "", []
    marker = MARKERS.get(self.plan.parser)
    if marker is None:  # llama3_json: a reply that opens with a call is all calls
      body = raw.lstrip()
      if body.startswith(("{", PYTHON_TAG)):
        self.calling = True
        return "", []
      if not body or PYTHON_TAG.startswith(body):
        return "", []
      end = len(text)
    elif marker in raw:
      self.calling = True
      end = text.index(marker) if marker in text else self.sent
    else:
      hold = max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)
      end = len(text) - hold
    out = text[self.sent : end]
    self.sent += len(out)
    return out, []

  def finish(self, text: str, raw: str) -> tuple[str, list[dict]]:
    """What is left to send when the choice ends: content not yet sent, and the calls.

    Args:
      text: the whole reply (special tokens left out).
      raw: the whole reply with its special tokens.

    Returns:
      (content to send, tool_calls deltas).
    """
    if self.plan.choice == "named":
      return self.push(text, raw)
    content, calls = calls_of(self.plan, text, raw)
    if calls:
      return "", [call.as_json(index=i) for i, call in enumerate(calls)]
    return (content or "")[self.sent :], []


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
  return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse(parser: str, raw: str) -> tuple[str | None, list[ToolCall]]:
  """A reply parsed by one tool-call format (the module docstring's); text that does not parse
  as calls is content.

  Args:
    parser: one of PARSERS.
    raw: the reply with its special tokens.

  Returns:
    (content or None, calls).
  """
  if parser == "hermes":
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", raw, re.S)
    calls = [_json_call(b) for b in blocks]
    if not blocks or None in calls:
      return raw, []
    return raw[: raw.index("<tool_call>")].strip() or None, calls
  if parser == "llama3_json":
    body = raw.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
      return raw, []
    calls = [_json_call(part, "parameters") for part in _split_objects(body)]
    return (raw, []) if not calls or None in calls else (None, calls)
  if parser == "mistral":
    if "[TOOL_CALLS]" not in raw:
      return raw, []
    content, _, rest = raw.partition("[TOOL_CALLS]")
    if "[ARGS]" in rest:  # newer templates: name[ARGS]{...} per call
      calls = [_named_call(*part.partition("[ARGS]")[::2]) for part in rest.split("[TOOL_CALLS]")]
    else:
      try:
        items = json.loads(rest.strip())
      except json.JSONDecodeError:
        return raw, []
      calls = [_call(c) for c in (items if isinstance(items, list) else [items])]
    if not calls or None in calls:
      return raw, []
    return content.strip() or None, calls
  raise ValueError(f"tool-call parser {parser!r}: use one of {', '.join(PARSERS)}")


def _json_call(text: str, arguments_key: str = "arguments") -> ToolCall | None:
  """One call from its JSON text; None if it is not one."""
  try:
    return _call(json.loads(text), arguments_key)
  except json.JSONDecodeError:
    return None


def _named_call(name: str, args: str) -> ToolCall | None:
  """A call written as its name and its arguments' JSON text; None if they are not that."""
  try:
    json.loads(args)
  except json.JSONDecodeError:
    return None
  return ToolCall(name.strip(), args.strip()) if name.strip() else None


def _split_objects(body: str) -> list[str]:
  """JSON objects joined by ";" (Llama 3's several calls), split where a whole object ends."""
  decoder, out, at = json.JSONDecoder(), [], 0
  while at < len(body):
    try:
      _, end = decoder.raw_decode(body, at)
    except json.JSONDecodeError:
      return [body]
    out.append(body[at:end])
    at = end
    while at < len(body) and body[at] in "; \n\t":
      at += 1
  return out


def template_messages(messages: list[dict]) -> list[dict]:
  """Messages as chat templates read them: an assistant's tool-call arguments as objects (OpenAI
  sends JSON text; Llama's and Qwen's templates write them with `tojson`).

  Args:
    messages: `protocol.chat_messages`' output.

  Returns:
    The messages, tool-call arguments decoded where they are JSON.
  """
  out = []
  for m in messages:
    if m.get("tool_calls"):
      calls = []
      for c in m["tool_calls"]:
        f = dict(c.get("function") or {})
        try:
          f["arguments"] = json.loads(f.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
          pass
        calls.append({**c, "function": f})
      m = {**m, "tool_calls": calls}
    out.append(m)
  return out
