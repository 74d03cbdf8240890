"""The engine's async scheduling: step n+1 planned and dispatched before step n is read back, its
tokens from step n taken on the device; the same tokens, finishes and pages as without it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpipe.serve.engine import Engine
from jaxpipe.serve.request import PENDING
from jaxpipe.serve.sampling import SamplingParams
from tests import helpers


def _engine(async_scheduling: bool, **kw) -> Engine:
  return Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=17,
      nan_freed_pages=True,
      async_scheduling=async_scheduling,
      **{**helpers.ENGINE_ARGS, **kw},
  )


def _recorded(engine: Engine) -> list:
  """Wraps the engine's launch, collect and step programs: the order of launches and collects,
  and each dispatched batch's (tokens_T, prev_T) as the host built them."""
  events = []
  launch, collect, program = engine.launch, engine.collect, engine.step_program

  def launch_(after=None):
    events.append(("launch", after is not None))
    return launch(after)

  def collect_(launched):
    events.append(("collect", launched is not None))
    return collect(launched)

  def program_(t, n, controls=None, logprobs=False):
    run = program(t, n, controls, logprobs)

    def call(params, kv, batch, sampling, prev_R):
      events.append(("batch", np.asarray(batch.tokens_T), np.asarray(batch.prev_T)))
      return run(params, kv, batch, sampling, prev_R)

    return call

  engine.launch, engine.collect, engine.step_program = launch_, collect_, program_
  return events


def test_async_serves_what_sync_serves():
  """Preemption, prefix hits, NaN-filled freed pages, EOS stops mid-way, a sampled request: the
  same outputs and finish reasons step by step, and every page back at the end."""
  prompts = helpers.prompts()
  want = helpers.oracle("dense", prompts, 10)
  eos = [w[3] if i % 3 == 0 else None for i, w in enumerate(want)]  # a third stop early
  sampling = [
      SamplingParams(temperature=1.0, top_k=16, seed=i) if i == 4 else None for i in range(12)
  ]
  got = {}
  for mode in (False, True):
    engine = _engine(mode)
    done = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=eos, sampling=sampling)
    got[mode] = [(r.output, r.finish_reason, r.error) for r in done]
    assert engine.counts["preemptions"] > 0 and engine.counts["cached_tokens"] > 0
    assert engine.allocator.num_used == len(engine.prefix_cache)
    assert not engine.has_work()
  assert got[True] == got[False]
  for i, (output, reason, _) in enumerate(got[True]):
    if i == 4:
      continue  # sampled: equal between the modes, not to the greedy oracle
    stop = want[i].index(eos[i]) + 1 if eos[i] is not None else 10
    assert output == want[i][:stop] and reason == ("eos" if eos[i] is not None else "length")


def test_a_step_of_few_tokens_samples_few_rows_and_the_next_reads_them_whatever_its_rows():
  """Token buckets below max_batch: a step of t tokens brings min(t, max_batch) sequence and
  sampled rows (a lone decode: one), its tokens padded back to max_batch for the next step to
  read, whose rows differ: greedy tokens equal the recompute oracle, async or not."""
  prompts = helpers.prompts(seed=6, n=6)
  want = helpers.oracle("dense", prompts, 8)
  for mode in (True, False):
    engine = _engine(mode, token_buckets=(1, 2, 4, 16))
    seen, program = set(), engine.step_program

    def program_(t, n, controls=None, logprobs=False, program=program):
      run = program(t, n, controls, logprobs)

      def call(params, kv, batch, sampling, prev_R):
        seen.add((t, len(batch.seq_starts_B), len(sampling.temperature_R), len(prev_R)))
        new_R, *rest = run(params, kv, batch, sampling, prev_R)
        assert new_R.shape == (engine.max_batch,)
        return (new_R, *rest)

      return call

    engine.step_program = program_
    done = helpers.serve_arrivals(engine, prompts, max_tokens=8, first=1, per_arrival=1)
    assert [r.output for r in done] == want
    assert all(b == r == min(t, 4) and p == 4 for t, b, r, p in seen), seen
    assert {t for t, *_ in seen} >= {1, 2, 4, 16}, seen


def test_the_next_step_is_dispatched_before_this_one_is_read_back():
  """Async: launch n+1 comes before collect n, and a decode token of step n+1 is PENDING on the
  host, its row in step n's tokens given instead (prev_T); without async, neither."""
  prompts = helpers.prompts(seed=4, n=3)
  for mode in (True, False):
    engine = _engine(mode)
    events = _recorded(engine)
    for p in prompts:
      engine.add_request(p, 6, eos_id=None)
    outs = []
    while engine.has_work():
      outs.append(engine.step())
    calls = [e for e in events if e[0] != "batch"]
    batches = [e for e in events if e[0] == "batch"]
    # every request's six tokens came back, one per step() call at most
    assert sorted(sum((len(o.get(i, [])) for o in outs), 0) for i in range(3)) == [6, 6, 6]
    from_device = [(tok[prev >= 0], prev[prev >= 0]) for _, tok, prev in batches]
    if mode:
      assert calls[:3] == [("launch", False), ("launch", True), ("collect", True)]
      assert all(c == ("launch", True) for c in calls[1::2][: len(batches) - 1])
      assert sum(len(p) for _, p in from_device) >= 3 * 5 - 3  # every decode input but a few
      assert all((t == PENDING).all() for t, _ in from_device)
    else:
      assert calls[:4] == [("launch", False), ("collect", True)] * 2
      assert all(len(p) == 0 for _, p in from_device)


def test_a_request_stopped_by_its_token_drops_the_step_it_was_already_given():
  """The step after EOS was dispatched with the request in it (async): its token is never
  reported, the output ends at EOS, and its pages come back."""
  prompt = helpers.prompts(seed=5, n=1)[0][:12]  # one prefill step (16 tokens a step)
  want = helpers.oracle("dense", [prompt], 8)[0]
  stop = next(i for i in range(2, 8) if want[i] not in want[:i])  # its first occurrence
  engine = _engine(True, prefix_caching=False)
  events = _recorded(engine)
  rid = engine.add_request(prompt, 8, eos_id=want[stop])
  reported = []
  while engine.has_work():
    reported += engine.step().get(rid, [])
  (r,) = engine.finished()
  assert r.output == reported == want[: stop + 1] and r.finish_reason == "eos"
  dispatched = sum(1 for e in events if e[0] == "batch")
  assert dispatched == 1 + stop + 1  # the prefill, `stop` decode steps, and the dropped one
  assert engine.allocator.num_free == engine.num_pages - 1  # all but the scratch page


def test_cancel_and_fork_with_a_step_in_flight():
  """Cancelling a request whose step is in flight finishes it with no PENDING token; forking
  first reads the step in flight back, and the fork continues the original's greedy tokens."""
  prompts = helpers.prompts(seed=6, n=2)
  want = helpers.oracle("dense", prompts, 8)
  engine = _engine(True, prefix_caching=False)
  a, b = (engine.add_request(p, 8, eos_id=None) for p in prompts)
  for _ in range(3):
    engine.step()
  assert engine._inflight is not None
  engine.cancel(a)
  fork = engine.fork(b)
  assert engine._inflight is None  # fork collected it; its tokens wait for the next step()
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  assert done[a].finish_reason == "cancelled" and PENDING not in done[a].output
  assert done[a].output == want[0][: len(done[a].output)] and len(done[a].output) >= 2
  assert done[b].output == want[1] and done[fork].output == want[1]


def test_prefill_workers_schedule_in_step():
  """A prefill_only engine parks each request at its first token: async scheduling is off by
  default there and refused when asked for, in one line naming the fix."""
  assert not _engine(None, prefill_only=True).async_scheduling
  assert _engine(None).async_scheduling
  with pytest.raises(ValueError, match="leave async_scheduling off on prefill workers"):
    _engine(True, prefill_only=True)
