"""Structured output (`jaxpipe.serve.grammar`): the token mask on the device against NumPy's
unpacking of the same bits, and the engine's greedy tokens under grammars (async scheduling,
preemption, a fork) against a recompute of every sequence at every step with the grammar's mask
applied on the host; the outputs checked with Python's `re`, which knows nothing of either."""

import dataclasses
import re

import llguidance
import numpy as np
import pytest

from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.serve import grammar, sampling
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.request import PENDING
from jaxpipe.serve.sampling import SamplingParams
from tests import helpers

EOS = 0  # the grammars' end: the byte model's id 0 (NUL), never a digit
V = helpers.DENSE.vocab  # 64: digits and punctuation are bytes, letters are not


@pytest.fixture(scope="module")
def compiler():
  return grammar.Compiler(tokenizer_lib.ByteTokenizer(), V, [EOS])


def _bits(mask_W: np.ndarray, v: int) -> np.ndarray:
  """NumPy's reading of a bitmask row: bit i % 32 of word i // 32 (little-endian words)."""
  return np.unpackbits(mask_W.view(np.uint8), bitorder="little")[:v].astype(bool)


def test_the_mask_on_the_device_is_numpys_reading_of_the_bits():
  rng = np.random.default_rng(0)
  v = 75  # not a multiple of 32: the last word is partial
  logits = rng.normal(0, 2, (3, v)).astype(np.float32)
  mask = rng.integers(-(2**31), 2**31, (3, grammar.words(v)), dtype=np.int64).astype(np.int32)
  got = np.asarray(sampling.apply_mask(logits, mask))
  for i in range(3):
    keep = _bits(mask[i], v)
    assert 0 < keep.sum() < v
    np.testing.assert_array_equal(got[i], np.where(keep, logits[i], -np.inf))


def test_masks_are_llguidances_and_unconstrained_rows_all_ones(compiler):
  guide = compiler.compile("regex", "[0-9]{2}-[0-9]")
  m = guide.matcher()
  mask = grammar.fill_masks([(1, m)], 3, V)
  assert np.all(mask[0] == -1) and np.all(mask[2] == -1)
  assert np.flatnonzero(_bits(mask[1], V)).tolist() == list(range(48, 58))  # a digit first
  for t in b"12":
    assert m.accept(t)
  assert np.flatnonzero(_bits(grammar.fill_masks([(0, m)], 1, V)[0], V)).tolist() == [45]  # "-"


CASES = [  # (kind, spec, what the output's text must fullmatch)
    ("regex", r"(0|[1-9][0-9]{0,2})(,[0-9]{1,3}){2}", r"(0|[1-9][0-9]{0,2})(,[0-9]{1,3}){2}"),
    ("choice", ["12", "345", "6-7", "8.9"], r"12|345|6-7|8\.9"),
    ("grammar", 'start: num ("+" num)*\nnum: /[1-9][0-9]?/', r"[1-9][0-9]?(\+[1-9][0-9]?)*"),
    ("regex", r"[0-9]{4}", r"[0-9]{4}"),
]


def _recompute(prompts, guides, max_tokens):
  """Greedy tokens recomputing every sequence at every step, the grammar's mask applied on the
  host (a fresh llguidance matcher per sequence); a sequence ends when its grammar does."""
  matchers = [g and llguidance.LLMatcher(g.tokenizer, g.grammar) for g in guides]

  def pick(i, x, out):
    m = matchers[i]
    if m is None:
      return int(np.argmax(x))
    if m.is_stopped():
      return None
    t = int(np.argmax(np.where(_bits(np.frombuffer(m.compute_bitmask(), np.int32), V), x, -np.inf)))
    assert m.consume_token(t)
    return t

  return helpers.recompute("dense", prompts, max_tokens, pick)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_engines_greedy_tokens_follow_their_grammars(compiler, async_scheduling):
  """Four constrained requests beside two plain ones, in a pool small enough to preempt: each
  output is the host recompute's; each constrained text fullmatches its pattern and ended by the
  grammar ("eos"), where the unconstrained output of the same prompt does not match."""
  engine = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=15,
      nan_freed_pages=True,
      async_scheduling=async_scheduling,
      **helpers.ENGINE_ARGS,
  )
  prompts = helpers.prompts(seed=5, n=6)
  guides = [compiler.compile(kind, spec) for kind, spec, _ in CASES] + [None, None]
  sps = [SamplingParams(guide=g) for g in guides]
  steps = 12
  got = helpers.serve_arrivals(engine, prompts, steps, first=4, sampling=sps, eos_id=None)
  want = _recompute(prompts, guides, steps)
  assert [r.output for r in got] == want
  plain = helpers.oracle("dense", prompts, steps)
  assert [r.output for r in got[4:]] == plain[4:]
  for r, (_, _, pattern), free in zip(got, CASES, plain):
    text = bytes(t for t in r.output if t != EOS).decode()
    assert re.fullmatch(pattern, text), (text, pattern)
    assert r.finish_reason == "eos", text
    assert not re.fullmatch(pattern, bytes(free).decode("latin-1"))
  assert sum(r.preemptions for r in got) > 0
  helpers.check_pages(engine)


def test_masks_are_filled_while_the_model_runs_and_async_stays_on(compiler, monkeypatch):
  """A constrained request's next mask needs its last token: under async scheduling its step
  dispatches the model, then the host reads the step before, fills the mask and dispatches the
  sampling. The request joins every step while async scheduling stays on (a step in flight
  after every call), and each mask is filled with its model dispatched and its sampling not,
  every earlier token of the request known."""
  engine = Engine(helpers.DENSE, helpers.engine_params("dense"), **helpers.ENGINE_ARGS)
  engine.scheduler.trace = []
  first = engine.add_request([7, 8], 20, SamplingParams(), eos_id=None)
  engine.step()
  guide = compiler.compile("regex", "[0-9]{8}")
  guided = engine.add_request([5, 6], 8, SamplingParams(guide=guide), eos_id=None)
  r = engine.requests[guided]
  fills = []
  fill_masks = grammar.fill_masks

  def spy(rows, r_max, vocab):
    ((j, m),) = rows
    assert m is r.grammar
    pending = engine._inflight
    fills.append(
        (
            pending is not None and pending.sample is not None and pending.new_R is None,
            pending is not None and pending.sampled[j] is r,
            r.output[-1] == PENDING and PENDING not in r.output[:-1],
        )
    )
    return fill_masks(rows, r_max, vocab)

  monkeypatch.setattr(grammar, "fill_masks", spy)
  inflight = []
  while r.state != "finished":
    engine.step()
    inflight.append(engine._inflight is not None)
  plans = [{q.id for q, _ in p} for kind, p in engine.scheduler.trace if kind == "plan"]
  with_guided = [i for i, p in enumerate(plans) if guided in p]
  assert len(with_guided) == 8 and with_guided == list(range(with_guided[0], with_guided[-1] + 1))
  assert all(first in p for p in plans[: with_guided[-1] + 1])
  assert all(inflight)  # async scheduling never paused
  assert len(fills) == 8 and all(all(f) for f in fills), fills
  assert re.fullmatch("[0-9]{8}", bytes(r.output).decode())
  while engine.has_work():
    engine.step()
  helpers.check_pages(engine)


def test_a_fork_continues_the_grammar_from_where_it_is(compiler):
  engine = Engine(
      helpers.DENSE, helpers.engine_params("dense"), async_scheduling=False, **helpers.ENGINE_ARGS
  )
  guide = compiler.compile("regex", "[1-9]{3}-[0-9]{3}")
  rid = engine.add_request([3, 4, 5], 16, SamplingParams(guide=guide), eos_id=None)
  for _ in range(3):
    engine.step()
  fork = engine.fork(rid, SamplingParams(temperature=1.0, seed=3, guide=guide))
  while engine.has_work():
    engine.step()
  outs = [bytes(t for t in engine.requests[i].output if t != EOS).decode() for i in (rid, fork)]
  assert all(re.fullmatch("[1-9]{3}-[0-9]{3}", o) for o in outs), outs
  assert outs[0][:3] == outs[1][:3]  # the fork's first tokens are the request's


def test_bad_grammars_and_combinations_are_refused_by_name(compiler):
  with pytest.raises(ValueError, match=r"regex: .*unclosed group"):
    compiler.compile("regex", "[0-9]+(")
  with pytest.raises(ValueError, match="json_schema: .*"):
    compiler.compile("json_schema", {"type": "objectx"})
  with pytest.raises(ValueError, match=r"choice=\[\] must be a non-empty list"):
    compiler.compile("choice", [])
  with pytest.raises(ValueError, match="kind 'yaml': use one of json_schema, json_object"):
    compiler.compile("yaml", "x")
  guide = compiler.compile("regex", "[0-9]+")
  refusal = SamplingParams(min_tokens=2, guide=guide).check()
  assert refusal.param == "min_tokens" and "structured output" in refusal
  engine = Engine(
      dataclasses.replace(helpers.DENSE, vocab=128),
      helpers.random_params(dataclasses.replace(helpers.DENSE, vocab=128)),
      **helpers.ENGINE_ARGS,
  )
  refusal = engine.check_request([1], 4, SamplingParams(guide=guide))
  assert refusal.param == "response_format" and "cover 64 token ids but the model has 128" in (
      refusal
  )


def test_json_schema_compiles_compact_unless_spaces_are_asked_for():
  """The JSON grammar's whitespace: none between tokens by default (a small model otherwise
  spends its tokens on spaces); `json_spaces=True` allows it (llguidance's own default)."""
  tok = tokenizer_lib.ByteTokenizer(vocab_size=256)
  schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
  for spaces in (False, True):
    m = grammar.Compiler(tok, 256, [0], json_spaces=spaces).compile("json_schema", schema)
    m = m.matcher()
    assert m.accept(ord("{"))
    assert _bits(grammar.fill_masks([(0, m)], 1, 256)[0], 256)[ord(" ")] == spaces
