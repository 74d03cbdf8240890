"""The completions protocol alone (serve/http/protocol.py): no engine, no network."""

import json

import pytest

from jaxpipe.models.tokenizer import ByteTokenizer
from jaxpipe.serve.http.protocol import (
    BadRequest,
    Choice,
    chat_messages,
    parse_chat,
    parse_request,
    prompts_of,
    stop_list,
    usage_of,
)

BYTES = ByteTokenizer()


def test_a_stop_sequence_is_held_back_until_it_cannot_begin_and_never_sent():
  c = Choice(0, ["ab"], BYTES.decoder())
  out = [c.add(t, None) for t in b"xya"]  # 'a' could begin the stop sequence: held
  assert out == ["x", "y", ""] and c.finish_reason is None
  assert c.add(ord("c"), None) == "ac"  # 'ac' cannot begin it: released
  assert c.add(ord("a"), None) == "" and c.add(ord("b"), None) == ""
  assert c.finish_reason == "stop" and c.text == "xyac"
  assert usage_of(3, [c]) == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_a_character_split_over_tokens_arrives_whole():
  c = Choice(0, [], BYTES.decoder())
  assert [c.add(t, None) for t in "é".encode()] == ["", "é"]
  assert c.add(None, "length") == "" and c.finish_reason == "length"


def test_requests_parse_or_are_refused_naming_the_value():
  req = parse_request(json.dumps({"prompt": ["01", "2"], "stop": "x", "n": 2}).encode())
  assert prompts_of(req.prompt, BYTES) == [([48, 49], "01"), ([50], "2")]
  assert prompts_of([[3, 4], [5]], BYTES) == [([3, 4], None), ([5], None)]
  assert prompts_of([3, 4], BYTES) == [([3, 4], None)]
  assert stop_list(req.stop) == ["x"] and stop_list(None) == []
  for body, words in (
      (b"{", "not valid JSON"),
      (b'{"prompt": "1", "colour": 1}', "'colour'"),
      (b'{"prompt": "1", "suffix": "x"}', "suffix='x' is not supported"),
      (b'{"prompt": "1", "stop": "\\ud800"}', "stop holds a lone UTF-16 surrogate"),
      (b'{"prompt": "1", "n": 3, "best_of": 2}', r"best_of=2 must be >= n=3"),
      (b'{"prompt": "1", "best_of": 2, "stream": true}', "best_of=2 > n=1 cannot be streamed"),
  ):
    with pytest.raises(BadRequest, match=words) as e:
      parse_request(body)
    assert e.value.status == 400


def test_the_token_that_ends_a_choice_and_special_tokens_have_no_text():
  c = Choice(0, [], BYTES.decoder(), hidden=frozenset({300}))
  assert c.add(ord("a"), None) == "a" and c.add(300, None) == ""  # special: no text
  assert c.add(ord("b"), "stop") == ""  # the EOS / stop id that ended it: in tokens, not text
  assert c.tokens == [97, 300, 98] and c.text == "a"
  c = Choice(0, [], BYTES.decoder())
  assert c.add(ord("b"), "length") == "b"  # a length finish keeps its last token's text
  c = Choice(0, [], BYTES.decoder(), ends=frozenset({0}))
  assert c.add(ord("}"), "stop") == "}"  # a grammar's last token is text
  c = Choice(0, [], BYTES.decoder(), ends=frozenset({0}))
  assert c.add(0, "stop") == "" and c.tokens == [0]


def test_chat_messages_are_checked_naming_the_message():
  parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
  assert chat_messages([{"role": "user", "content": parts}]) == [
      {"role": "user", "content": "a\nb"}
  ]
  for messages, words in (
      ([], "messages is empty"),
      (
          [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}],
          "messages[1].role='wizard'",
      ),
      (
          [{"role": "user", "content": "x", "tool_calls": []}],
          "messages[0].tool_calls: only an assistant message has tool_calls",
      ),
      ([{"role": "user", "content": 5}], "messages[0].content=5"),
      ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "content[0]"),
      (
          [{"role": "user", "content": "\ud800"}],
          "messages[0].content holds a lone UTF-16 surrogate",
      ),
      (["hi"], "messages[0] is a JSON str"),
  ):
    with pytest.raises(BadRequest, match=words.replace("[", "\\[").replace("(", "\\(")) as e:
      chat_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages"
  with pytest.raises(BadRequest, match="top_logprobs=3 needs logprobs=true"):
    parse_chat(b'{"messages": [], "top_logprobs": 3}')
