"""Speculative decoding (`jaxpipe.serve.speculative`): n-gram drafts, the verify rule against
NumPy (greedy) and against the target's distribution in chi-square tests (sampled), and the
engine's greedy tokens with drafts equal to the plain engine's, preempted, beside rows that may
not speculate."""

import dataclasses

import jax
import numpy as np
import pytest
import scipy.stats

from jaxpipe.serve import sampling, speculative
from jaxpipe.serve.drafter import ModelDrafter
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.sampling import SamplingParams
from jaxpipe.serve.speculative import SpecConfig
from tests import helpers

VERIFY = jax.jit(speculative.verify)


def test_ngram_drafts_follow_the_latest_match_of_the_longest_suffix():
  assert speculative.ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]
  assert speculative.ngram_drafts([5, 6, 5, 6, 4, 6], 3, 2, 1) == [4, 6]  # "6": the latest
  assert speculative.ngram_drafts([1, 2, 3], 4, 3, 1) == []
  assert speculative.ngram_drafts([4, 4], 4, 3, 1) == [4]  # as many as followed
  assert speculative.ngram_drafts([1, 2, 8, 1, 2], 1, 4, 2) == [8]


def _batch(temperature, drafts, top_k=0, seeds=None):
  r = len(drafts)
  return sampling.SamplingBatch(
      np.full(r, temperature, np.float32),
      np.full(r, top_k, np.int32),
      np.ones(r, np.float32),
      np.arange(r, dtype=np.int32) if seeds is None else np.asarray(seeds, np.int32),
      np.zeros(r, np.int32),
      drafts_RxK=np.asarray(drafts, np.int32),
  )


def test_greedy_verify_keeps_drafts_while_they_are_the_argmax():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 1, (4, 4, 10)).astype(np.float32)
  g = logits.argmax(-1)
  drafts = [
      [g[0, 0], g[0, 1], g[0, 2]],  # all kept: the argmax after the last one follows
      [g[1, 0], (g[1, 1] + 1) % 10, g[1, 2]],  # the second differs
      [(g[2, 0] + 1) % 10, -1, -1],  # the first differs
      [-1, -1, -1],  # no drafts: the plain token
  ]
  first = np.array([g[0, 0], g[1, 0], g[2, 0], 7], np.int32)
  tokens, count = VERIFY(logits, _batch(0.0, drafts), first)
  want = [
      [g[0, 0], g[0, 1], g[0, 2], g[0, 3]],
      [g[1, 0], g[1, 1], -1, -1],
      [g[2, 0], -1, -1, -1],
      [7, -1, -1, -1],
  ]
  assert np.asarray(tokens).tolist() == want and np.asarray(count).tolist() == [4, 2, 1, 1]


def _p(logits, temperature, top_k):
  """NumPy: the target's distribution after temperature and top-k."""
  x = logits.astype(np.float64) / temperature
  x = np.where(x >= np.sort(x)[-top_k], x, -np.inf) if top_k else x
  p = np.exp(x - x.max())
  return p / p.sum()


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_verify_emits_the_targets_distribution(top_k):
  """20,000 rows, one set of logits, drafts (d1, d2), their own seeds: the first token is
  distributed as p_1, the second (after d1 was kept) as p_2, the third as p_3, each in a
  chi-square test against NumPy's distribution (p-value above 1e-4), and d1 is kept with
  probability p_1(d1)."""
  n, v, temperature = 20000, 8, 0.8
  logits = np.random.default_rng(1).normal(0, 1, (3, v)).astype(np.float32)
  p = [_p(logits[i], temperature, top_k) for i in range(3)]
  d = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]  # a likely draft, but not the likeliest
  s = _batch(temperature, [d] * n, top_k=top_k)
  first = np.zeros(n, np.int32)
  tokens, count = map(np.asarray, VERIFY(np.tile(logits, (n, 1, 1)), s, first))
  assert 0 < (count == 1).mean() < 1 and (count == 3).any()

  def chi2(values, probs):
    seen = np.bincount(values, minlength=v)
    keep = probs > 0
    assert seen[~keep].sum() == 0  # nothing top-k dropped
    assert scipy.stats.chisquare(seen[keep], probs[keep] * len(values)).pvalue > 1e-4

  chi2(tokens[:, 0], p[0])
  assert abs((tokens[:, 0] == d[0]).mean() - p[0][d[0]]) < 5 * np.sqrt(p[0][d[0]] / n)
  kept = tokens[:, 0] == d[0]
  chi2(tokens[kept, 1], p[1])
  both = kept & (tokens[:, 1] == d[1])
  chi2(tokens[both, 2], p[2])
  assert np.all(count == 1 + kept + both)


def _engines(**kw):
  args = dict(helpers.ENGINE_ARGS, num_pages=15, nan_freed_pages=True, **kw)
  dense, params = helpers.DENSE, helpers.engine_params("dense")
  plain = Engine(dense, params, async_scheduling=False, **args)
  spec = Engine(dense, params, speculative=SpecConfig(num_tokens=3, ngram_max=3), **args)
  return plain, spec


def test_the_engines_greedy_tokens_with_drafts_are_the_plain_engines():
  """Prompts that repeat themselves (drafts are found and kept) beside random ones, in a pool
  small enough to preempt, with an EOS id that cuts some outputs inside a verify step's
  tokens: the same outputs and finishes as the plain engine's, in fewer steps."""
  prompts = [[1, 2, 3, 4] * 4, [9, 8, 7] * 3, [5] * 7] + helpers.prompts(seed=6, n=5)
  plain, spec = _engines()
  want = helpers.serve_arrivals(plain, prompts, 16, first=4, eos_id=44)
  got = helpers.serve_arrivals(spec, prompts, 16, first=4, eos_id=44)
  assert [(r.output, r.finish_reason) for r in got] == [(r.output, r.finish_reason) for r in want]
  assert any(r.finish_reason == "eos" for r in got)
  assert spec.counts["spec_accepted"] >= 5 and spec.steps < plain.steps
  assert sum(r.preemptions for r in got) > 0
  helpers.check_pages(spec)


def test_rows_that_may_not_speculate_decode_as_always():
  """Penalized, biased and log-probability rows take no drafts: their tokens and
  log-probabilities are the plain engine's, beside a row that speculates."""
  prompts = [[1, 2, 3] * 4] * 3
  sps = [
      SamplingParams(repetition_penalty=1.5),
      SamplingParams(logit_bias=((3, 2.0),), logprobs=2),
      SamplingParams(),
  ]
  plain, spec = _engines()
  want = helpers.serve_arrivals(plain, prompts, 8, first=4, sampling=sps, eos_id=None)
  got = helpers.serve_arrivals(spec, prompts, 8, first=4, sampling=sps, eos_id=None)
  assert [r.output for r in got] == [r.output for r in want]
  assert got[1].logprobs == want[1].logprobs and len(got[1].logprobs) == 8
  assert spec.counts["spec_drafts"] > 0  # the last row speculated


def test_speculation_is_refused_with_async_scheduling_and_bad_values():
  with pytest.raises(ValueError, match="async_scheduling=True with speculative decoding"):
    Engine(
        helpers.DENSE,
        helpers.engine_params("dense"),
        async_scheduling=True,
        speculative=SpecConfig(),
        **helpers.ENGINE_ARGS,
    )
  with pytest.raises(ValueError, match="num_tokens=0 must be an integer >= 1"):
    SpecConfig(num_tokens=0)
  with pytest.raises(ValueError, match="method 'draft' takes a drafter"):
    SpecConfig("draft")
  with pytest.raises(ValueError, match="method='eagle': use one of ngram, draft"):
    SpecConfig(method="eagle")


def test_a_draft_models_tokens_are_verified_to_the_plain_engines():
  """A draft model (serve.drafter.ModelDrafter): the target itself as its drafter has every
  draft kept; a smaller random model has nearly none kept. Both give the plain engine's greedy
  outputs, preempted, and the drafter holds nothing once the requests finish."""
  prompts = helpers.prompts(seed=7, n=6)
  plain, _ = _engines()
  want = helpers.serve_arrivals(plain, prompts, 14, first=4, eos_id=None)
  small = dataclasses.replace(helpers.DENSE, n_layers=1)
  for cfg, params in ((helpers.DENSE, helpers.engine_params("dense")),
                      (small, helpers.random_params(small, seed=3))):  # fmt: skip
    drafter = ModelDrafter(cfg, params, **dict(helpers.ENGINE_ARGS, num_pages=40))
    spec = Engine(
        helpers.DENSE,
        helpers.engine_params("dense"),
        speculative=SpecConfig("draft", 3, drafter=drafter),
        **dict(helpers.ENGINE_ARGS, num_pages=15, nan_freed_pages=True),
    )
    got = helpers.serve_arrivals(spec, prompts, 14, first=4, eos_id=None)
    assert [r.output for r in got] == [r.output for r in want]
    drafts, kept = spec.counts["spec_drafts"], spec.counts["spec_accepted"]
    if cfg is helpers.DENSE:
      assert drafts > 20 and kept == drafts and spec.steps < plain.steps / 2
    else:
      assert kept < drafts / 4
    assert sum(r.preemptions for r in got) > 0 or cfg is helpers.DENSE
    helpers.check_pages(spec)
    d = drafter.engine
    assert not d.running and not d.prefilled and d.allocator.num_free == d.num_pages - 1
