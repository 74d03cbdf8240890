"""Tool-call parsing (`jaxpipe.serve.http.tools`) on replies written as each family's format
writes them, tools and tool_choice checked, and the schemas that enforce "required" and a named
function (the HTTP path is in test_llama.py, through the openai client)."""

import json

import jsonschema
import pytest

from jaxpipe.serve.http import tools
from jaxpipe.serve.http.protocol import BadRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _calls(calls):
  return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks_after_text_are_calls():
  raw = (
      'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
      '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  )
  content, calls = tools.parse("hermes", raw)
  assert content == "Let me check."
  assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
  assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("chatcmpl-tool-")


def test_llama3_json_is_a_whole_reply_of_objects():
  raw = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
  assert _calls(tools.parse("llama3_json", raw)[1]) == [
      ("get_weather", {"city": "Oslo", "unit": "c"})
  ]
  two = (
      '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}'
  )
  content, calls = tools.parse("llama3_json", two)
  assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
  assert tools.parse("llama3_json", "It is sunny.") == ("It is sunny.", [])


def test_mistral_lists_and_named_args():
  raw = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
  assert _calls(tools.parse("mistral", raw)[1]) == [("get_weather", {"city": "Rome"})]
  newer = 'Sure.[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}'
  content, calls = tools.parse("mistral", newer)
  assert content == "Sure." and _calls(calls) == [
      ("get_time", {}),
      ("get_weather", {"city": "Nice"}),
  ]


@pytest.mark.parametrize(
    "parser, raw",
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather"'),
        ("hermes", "no call here"),
    ],
)
def test_text_that_does_not_parse_stays_content(parser, raw):
  assert tools.parse(parser, raw) == (raw, [])


def test_templates_show_their_format():
  assert tools.detect("...{{ '<tool_call>' }}...") == "hermes"
  assert tools.detect("[TOOL_CALLS] {{ x }}") == "mistral"
  assert tools.detect("{{ '<|python_tag|>' }}") == "llama3_json"
  assert tools.detect("{{ messages }}") is None and tools.detect(None) is None


def test_required_and_named_are_json_schemas_that_admit_only_calls():
  required = tools.structured(tools.plan_of([WEATHER, TIME], "required", None))
  schema = required.spec
  jsonschema.validate([{"name": "get_weather", "parameters": {"city": "a"}}], schema)
  jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
  for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(bad, schema)
  plan = tools.plan_of(
      [WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None
  )
  assert tools.structured(plan).spec == WEATHER["function"]["parameters"]
  content, calls = tools.calls_of(plan, '{"city": "Lima"}', '{"city": "Lima"}')
  assert content is None and _calls(calls) == [("get_weather", {"city": "Lima"})]
  single = tools.structured(tools.plan_of([WEATHER, TIME], "required", None, parallel=False)).spec
  two = [{"name": "get_time", "parameters": {}}] * 2
  jsonschema.validate(two, schema)
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(two, single)
  text = '[{"name": "get_time", "parameters": {}}]'
  assert _calls(tools.calls_of(tools.plan_of([TIME], "required", None), text, text)[1]) == [
      ("get_time", {})
  ]


@pytest.mark.parametrize(
    "tool_list, choice, parser, words",
    [
        ([{"type": "function"}], None, "hermes", "tools[0]="),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "nope"}},
            "hermes",
            "one of ['get_weather']",
        ),
        ([WEATHER], None, None, "start the server with --tool_call_parser"),
        (None, "required", "hermes", "needs tools"),
    ],
)
def test_bad_tools_and_choices_are_refused_naming_the_fix(tool_list, choice, parser, words):
  with pytest.raises(BadRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
    tools.plan_of(tool_list, choice, parser)


def test_assistant_tool_call_arguments_reach_the_template_as_objects():
  messages = [
      {"role": "user", "content": "hi"},
      {
          "role": "assistant",
          "content": "",
          "tool_calls": [
              {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
          ],
      },
  ]
  out = tools.template_messages(messages)
  assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
  assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not modified


def _stream(plan, pieces, specials=()):
  """Feeds a reply piece by piece (raw: with the special pieces; text: without) -> the content
  sent, each push's content, and the tool-call deltas."""
  s = tools.ToolStream(plan)
  text = raw = ""
  sent, deltas = [], []
  for p in pieces:
    raw += p
    text += "" if p in specials else p
    content, calls = s.push(text, raw)
    sent.append(content)
    deltas += calls
  content, calls = s.finish(text, raw)
  sent.append(content)
  return "".join(sent), sent, deltas + calls


AUTO = {p: tools.plan_of([WEATHER, TIME], None, p) for p in tools.PARSERS}


def test_hermes_content_streams_until_the_call_and_never_part_of_its_marker():
  pieces = ["Let", " me", " check", ".", "\n<", "tool", "_call", ">", '{"name": "get_time", ']
  pieces += ['"arguments": {}}', "</tool_call>"]
  content, sent, deltas = _stream(AUTO["hermes"], pieces)
  assert content == "Let me check.\n"
  assert sent[:4] == ["Let", " me", " check", "."]  # as they came
  assert not any("<" in s for s in sent)  # the marker's start was held back
  assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_time")]


def test_a_reply_without_calls_streams_all_its_text():
  content, _, deltas = _stream(AUTO["hermes"], ["The ", "answer ", "is <", "5."])
  assert content == "The answer is <5." and deltas == []
  content, _, deltas = _stream(AUTO["llama3_json"], [" It", " is", " {x}"])
  assert content == " It is {x}" and deltas == []


def test_llama3_json_and_mistral_calls_send_no_content():
  pieces = ["<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}']
  content, _, deltas = _stream(AUTO["llama3_json"], pieces, specials={"<|python_tag|>"})
  assert content == "" and [json.loads(d["function"]["arguments"]) for d in deltas] == [
      {"city": "Oslo"}
  ]
  pieces = ["Sure", ".", "[TOOL_CALLS]", '[{"name": "get_time", "arguments": {}}]']
  content, _, deltas = _stream(AUTO["mistral"], pieces, specials={"[TOOL_CALLS]"})
  assert content == "Sure." and [d["function"]["name"] for d in deltas] == ["get_time"]


def test_a_named_functions_arguments_stream_as_they_come():
  plan = tools.plan_of([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
  _, _, deltas = _stream(plan, ['{"ci', 'ty": ', '"Rome"}'])
  assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"]
  assert [d["function"]["arguments"] for d in deltas[1:]] == ['{"ci', 'ty": ', '"Rome"}']
