"""The serving engine against the training forward pass recomputed over the whole sequence.

The oracle generates greedily by running `transformer.forward` (the training path, no cache) on
each whole sequence at every step; the engine must give the same tokens, one for one, while
requests arrive mid-run, pages run out (preemption), prompts share prefixes (prefix cache and
copy-on-write), freed pages hold NaN, and for a dense and an MoE model.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxpipe.models import transformer
from jaxpipe.serve import Engine, EngineConfig, SamplingParams
from jaxpipe.serve import model as serve_model
from tests import helpers

CONTEXT, PAGE = helpers.CONTEXT, helpers.PAGE


@functools.cache
def _engine(name):
  """A small pool (preemption happens) whose freed pages are NaN; shared by the tests below."""
  return Engine(
      helpers.CONFIGS[name],
      helpers.engine_params(name),
      num_pages=17,
      nan_freed_pages=True,
      **helpers.ENGINE_ARGS,
  )


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_equals_recompute_oracle(name):
  engine = _engine(name)
  before = dict(engine.counts)
  prompts = helpers.prompts()
  got = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=None)
  assert [r.output for r in got] == helpers.oracle(name, prompts, 10)
  assert all(r.finish_reason == "length" and r.error is None for r in got)
  counts = {k: engine.counts[k] - before.get(k, 0) for k in engine.counts}
  assert counts["preemptions"] > 0 and counts["cached_tokens"] > 0 and counts["page_copies"] > 0
  assert engine.allocator.num_used == len(engine.prefix_cache)  # requests freed all theirs
  assert len(engine.programs) == 1 <= engine.max_programs


def test_eos_ends_a_request_and_frees_its_pages():
  engine = _engine("dense")
  prompts = helpers.prompts(seed=1, n=4)
  want = helpers.oracle("dense", prompts, 8)
  eos = want[0][3]
  rid = engine.add_request(prompts[0], 8, eos_id=eos)
  others = [engine.add_request(p, 8, eos_id=None) for p in prompts[1:]]
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  assert done[rid].output == want[0][: want[0].index(eos) + 1]
  assert done[rid].finish_reason == "eos"
  assert [done[i].output for i in others] == want[1:]
  # The pages, counted: without a prefix cache every page is a running request's or free, so
  # right after the step that samples EOS the free count is the pool less what the other holds.
  bare = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=17,
      prefix_caching=False,
      **helpers.ENGINE_ARGS,
  )
  pool = bare.allocator.num_free
  rid = bare.add_request(prompts[0], 8, eos_id=eos)
  other = bare.add_request(prompts[1], 8, eos_id=None)
  while bare.requests[rid].finish_reason is None:
    held = len(bare.requests[rid].pages)
    bare.step()
  r, o = bare.requests[rid], bare.requests[other]
  assert r.finish_reason == "eos" and len(r.output) < 8 and held > 0 and o.finish_reason is None
  assert r.pages == [] and bare.allocator.num_free == pool - len(o.pages)
  helpers.check_pages(bare)


def test_sampling_depends_on_the_request_alone():
  """A seeded request samples the same tokens alone and in a crowd that preempts it."""
  engine = _engine("dense")
  sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
  prompt = helpers.prompts(seed=2)[0]
  alone = engine.generate([prompt], max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7)[0]
  crowd = helpers.prompts(seed=3, n=8)
  samplings = [SamplingParams(temperature=1.0, seed=i) for i in range(len(crowd))] + [sp]
  got = helpers.serve_arrivals(engine, crowd + [prompt], max_tokens=12, first=9, sampling=samplings)
  assert got[-1].output == alone
  assert got[-1].preemptions > 0
  other = engine.generate([prompt], max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=8)
  assert other[0] != alone


def test_a_request_samples_the_same_at_another_row_of_a_shared_batch():
  """Alone, a request samples in row 0 of a batch of one; here it is row 3 of a batch of four at
  every step, beside three requests sampling with their own seeds, and its tokens are the same."""
  engine = _engine("dense")
  kw = dict(temperature=1.0, top_k=20, top_p=0.9)
  prompts = np.random.default_rng(11).integers(0, 64, (4, 4)).tolist()  # 4 + 12 tokens: 4 pages
  alone = engine.generate([prompts[3]], max_tokens=12, seed=7, **kw)[0]
  others = [
      engine.add_request(p, 12, SamplingParams(seed=100 + i, **kw), eos_id=None)
      for i, p in enumerate(prompts[:3])
  ]
  rid = engine.add_request(prompts[3], 12, SamplingParams(seed=7, **kw), eos_id=None)
  rows = []
  while engine.has_work():
    launched = engine.launch()
    sampled = [r.id for r in launched.sampled]
    rows.append((sampled.index(rid) if rid in sampled else None, len(sampled)))
    engine.collect(launched)
    helpers.check_pages(engine)
  done = {r.id: r for r in engine.finished()}
  assert rows == [(3, 4)] * 12  # every token of it sampled in row 3 of 4
  assert done[rid].output == alone and done[rid].preemptions == 0
  assert all(done[i].output != alone for i in others)


BAD = [  # prompt, max_tokens, sampling, words of the error, the request field it names
    ([], 4, SamplingParams(), "empty", "prompt"),
    ([1, 64], 4, SamplingParams(), "outside the vocabulary", "prompt"),
    ([1, -1], 4, SamplingParams(), "outside the vocabulary", "prompt"),
    (list(range(40)), 9, SamplingParams(), "exceeds the context", "max_tokens"),
    ([1] * CONTEXT, 1, SamplingParams(), "leaves no room in the context of 48", "prompt"),
    ([1, 2], 0, SamplingParams(), "max_tokens=0", "max_tokens"),
    ([1, 2], 4, SamplingParams(temperature=-0.5), "temperature=-0.5", "temperature"),
    ([1, 2], 4, SamplingParams(top_p=0.0), "top_p=0.0", "top_p"),
    ([1, 2], 4, SamplingParams(stop_token_ids=(64,)), "stop_token_ids [64]", "stop_token_ids"),
    ([1, 2], 4, SamplingParams(min_tokens=-1), "min_tokens=-1", "min_tokens"),
]


def test_a_refusal_names_the_request_field_at_fault():
  engine = _engine("dense")
  for prompt, max_tokens, sp, words, param in BAD:
    why = engine.check_request(prompt, max_tokens, sp)
    assert words in why and why.param == param, (why, why.param)
  assert engine.check_request([1, 2], 4, SamplingParams()) is None


def test_bad_requests_fail_alone_and_the_rest_are_served():
  engine = _engine("dense")
  good = helpers.prompts(seed=4, n=3)
  ids = []
  for (prompt, max_tokens, sp, *_), g in zip(BAD, good + [None] * len(BAD)):
    ids.append(engine.add_request(prompt, max_tokens, sp))
    if g is not None:
      ids.append(engine.add_request(g, 6, eos_id=None))
  while engine.has_work():
    engine.step()
  done = {r.id: r for r in engine.finished()}
  errors = [done[i] for i in ids if done[i].error]
  assert [e.finish_reason for e in errors] == ["error"] * len(BAD)
  for r, (*_, words, _) in zip(errors, BAD):
    assert words in r.error, r.error
  assert [done[i].output for i in ids if not done[i].error] == helpers.oracle("dense", good, 6)


def test_a_prompt_that_never_fits_the_pool_is_refused():
  engine = Engine(
      helpers.DENSE, helpers.engine_params("dense"), num_pages=5, **helpers.ENGINE_ARGS
  )  # 4 usable pages
  rid = engine.add_request(list(range(15)), 4)
  (r,) = engine.finished()
  assert r.id == rid and "need 5 pages" in r.error and "the pool has 4" in r.error
  with pytest.raises(ValueError, match=r"prompt 1: .*empty"):
    engine.generate([[1, 2], []], max_tokens=2)
  assert not engine.has_work()


def test_cancel_frees_pages_at_once():
  engine = _engine("dense")
  used = engine.allocator.num_used
  rid = engine.add_request(list(range(18)), 10)
  while not engine.requests[rid].output:
    engine.step()
  pages = list(engine.requests[rid].pages)
  assert engine.allocator.num_used > used
  engine.cancel(rid)
  assert engine.allocator.num_used <= used + 18 // PAGE  # only the prefix cache's full pages now
  assert [r.finish_reason for r in engine.finished()] == ["cancelled"]
  assert not engine.running
  freed = [p for p in pages if engine.allocator.refs[p] == 0]
  assert freed  # the last, partly filled page is never cached
  engine.flush_fills()  # what the next step does first: freed pages become NaN on the device
  k = np.asarray(engine.kv.k).reshape(
      helpers.DENSE.n_kv_heads, helpers.DENSE.n_layers, engine.num_pages, PAGE, -1
  )
  assert np.isnan(k[:, :, freed]).all()
  kept = [p for p in pages if engine.allocator.refs[p] > 0]
  assert not np.isnan(k[:, :, kept]).any()


def test_an_id_the_engine_does_not_hold_is_a_one_line_error_and_cancel_of_a_done_one_is_not():
  """Cancelling a request that finished and was returned by `finished()` (a client leaving after
  its last token) does nothing; an id the engine never gave is a KeyError naming it, from
  cancel and from every call that takes an id, and one `finished()` returned names that."""
  engine = _engine("dense")
  rid = engine.add_request(list(range(5)), 2)
  while engine.has_work():
    engine.step()
  assert [r.id for r in engine.finished()] == [rid]
  used = engine.allocator.num_used
  engine.cancel(rid)  # nothing to do, and no error
  assert engine.finished() == [] and engine.allocator.num_used == used
  never = engine.new_id() + 1000
  calls = [engine.cancel, engine.pause, engine.resume, engine.fork, engine.release]
  for call in calls + [lambda r: engine.rewind(r, [1])]:
    with pytest.raises(KeyError, match=rf"no request {never}: this engine never gave that id"):
      call(never)
  with pytest.raises(KeyError, match=rf"no request {rid}: it finished and `finished\(\)` returned"):
    engine.pause(rid)


def test_fork_shares_pages_and_copies_on_write():
  """Two greedy samples of one prompt, the second forked mid-page: both follow the oracle."""
  engine = _engine("dense")
  prompt = helpers.prompts(seed=7, n=1)[0][:10]  # 10 tokens: the last page is half full
  copies = engine.counts["page_copies"]
  rid = engine.add_request(prompt, 8, eos_id=None)
  while not engine.requests[rid].output:
    engine.step()
  twin = engine.fork(rid)
  assert engine.requests[twin].pages == engine.requests[rid].pages
  assert all(engine.allocator.refs[p] >= 2 for p in engine.requests[rid].pages)
  helpers.check_pages(engine)
  while engine.has_work():
    engine.step()
    helpers.check_pages(engine)
  done = {r.id: r.output for r in engine.finished()}
  assert done[rid] == done[twin] == helpers.oracle("dense", [prompt], 8)[0]
  assert engine.counts["page_copies"] > copies


def test_export_import_moves_a_request_to_an_engine_on_other_devices():
  """Prefill on one device, decode on two others (KV heads split over them): oracle tokens."""
  first = _engine("dense")
  second = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=33,
      devices=jax.devices()[2:4],
      **helpers.ENGINE_ARGS,
  )
  assert second.kv.k.sharding.device_set == set(jax.devices()[2:4])
  prompts = helpers.prompts(seed=5, n=3)
  ids = [first.add_request(p, 9, eos_id=None) for p in prompts]
  while any(not first.requests[i].output for i in ids):
    first.step()
  moved = []
  for i in ids:
    moved.append(second.transfer.import_request(first.transfer.export_request(i)))
    first.cancel(i)
  first.finished()
  while second.has_work():
    second.step()
  done = {r.id: r for r in second.finished()}
  assert [done[i].output for i in moved] == helpers.oracle("dense", prompts, 9)
  assert all(done[i].ttft is not None and done[i].tpot is not None for i in moved)


def test_prefill_and_decode_step_equal_the_forward_pass_with_the_pallas_kernel():
  """The two model paths by themselves through the Pallas kernel (interpreted), pools full of
  NaN; the engine tests above run them through the gather reference."""
  backend = "pallas"
  cfg, params = helpers.DENSE, helpers.engine_params("dense")
  tokens = list(range(3, 14))
  kv = serve_model.init_kv(cfg, 8, PAGE, fill=float("nan"))
  table = [5, 2, 7]
  want = np.asarray(transformer.forward(cfg, params, np.asarray([tokens])))[0]
  first, kv = serve_model.prefill(cfg, params, kv, tokens[:5], 0, table, backend=backend)
  second, kv = serve_model.prefill(cfg, params, kv, tokens[5:10], 5, table, backend=backend)
  third, kv = serve_model.decode_step(cfg, params, kv, [tokens[10]], [10], [table], backend=backend)
  for got, w in ((first, want[4]), (second, want[9]), (third[0], want[10])):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_an_engine_takes_one_config_and_fields_that_replace_its_own():
  config = EngineConfig(page_size=PAGE, num_pages=17, max_batch=2, max_seq_len=CONTEXT)
  engine = Engine(helpers.CONFIGS["dense"], helpers.engine_params("dense"), config, max_batch=3)
  assert engine.config == dataclasses.replace(config, max_batch=3)
  assert (engine.max_batch, engine.page_size, engine.num_pages) == (3, PAGE, 17)
  assert config.max_batch == 2  # the caller's config as it was
  with pytest.raises(TypeError, match=r"unknown settings \['max_batchs'\].*'max_batch'"):
    Engine(helpers.CONFIGS["dense"], helpers.engine_params("dense"), config, max_batchs=3)
  with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
    EngineConfig(num_pages=1)
  with pytest.raises(ValueError, match="max_batch=0 must be a positive integer"):
    Engine(helpers.CONFIGS["dense"], helpers.engine_params("dense"), max_batch=0)
