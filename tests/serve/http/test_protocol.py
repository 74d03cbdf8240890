"""The completions protocol alone (serve/http/protocol.py): no engine, no network."""

import json

import pytest

from jaxpipe.serve.http.protocol import (
    BadRequest,
    Choice,
    parse_request,
    prompts_of,
    stop_list,
    usage_of,
)


def test_a_stop_sequence_is_held_back_until_it_cannot_begin_and_never_sent():
  c = Choice(0, ["ab"], eos_id=None)
  out = [c.add(t, None) for t in b"xya"]  # 'a' could begin the stop sequence: held
  assert out == ["x", "y", ""] and c.finish_reason is None
  assert c.add(ord("c"), None) == "ac"  # 'ac' cannot begin it: released
  assert c.add(ord("a"), None) == "" and c.add(ord("b"), None) == ""
  assert c.finish_reason == "stop" and c.text == "xyac"
  assert usage_of(3, [c]) == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_a_character_split_over_tokens_arrives_whole():
  c = Choice(0, [], eos_id=None)
  assert [c.add(t, None) for t in "é".encode()] == ["", "é"]
  assert c.add(None, "length") == "" and c.finish_reason == "length"


def test_requests_parse_or_are_refused_naming_the_value():
  req = parse_request(json.dumps({"prompt": ["01", "2"], "stop": "x", "n": 2}).encode())
  assert prompts_of(req.prompt) == [([48, 49], True), ([50], True)]
  assert prompts_of([[3, 4], [5]]) == [([3, 4], False), ([5], False)]
  assert prompts_of([3, 4]) == [([3, 4], False)]
  assert stop_list(req.stop) == ["x"] and stop_list(None) == []
  for body, words in (
      (b"{", "not valid JSON"),
      (b'{"prompt": "1", "colour": 1}', "'colour'"),
      (b'{"prompt": "1", "echo": true}', "echo=True is not supported"),
      (b'{"prompt": "1", "best_of": 3}', "best_of=3"),
  ):
    with pytest.raises(BadRequest, match=words) as e:
      parse_request(body)
    assert e.value.status == 400
