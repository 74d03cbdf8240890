"""Log-probabilities, prompt scoring, EOS and stop ids, and min_tokens against independent oracles.

Generated tokens' log-probabilities (and their top-k alternatives) must equal
`jax.nn.log_softmax` of the training forward pass recomputed over the whole sequence, whatever
the sampler did (greedy or temperature + top-k), inside a shared batch and across preemptions,
on one engine and across deployments' handoffs; `Engine.score` must equal transformers' own
`log_softmax(model(ids).logits)` on a converted checkpoint. min_tokens is checked against the
recompute oracle with the EOS and stop logits at -inf for the first min_tokens tokens
(transformers' `min_new_tokens`).
"""

import jax
import numpy as np
import pytest

from jaxpipe.serve import Engine, SamplingParams
from tests import helpers

CONTEXT = helpers.CONTEXT


@pytest.fixture(scope="module")
def engine():
  """A small pool (preemption happens) whose freed pages are NaN."""
  return Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=17,
      nan_freed_pages=True,
      **helpers.ENGINE_ARGS,
  )


def run(engine, prompts, max_tokens, samplings, eos_id=None):
  """Adds every request at once (one shared batch), steps until all finish; checks that what a
  step reports for a request is the tail of its `logprobs` (what the HTTP loop streams)."""
  ids = [engine.add_request(p, max_tokens, sp, eos_id=eos_id) for p, sp in zip(prompts, samplings)]
  streamed = {i: [] for i in ids}
  while engine.has_work():
    for rid, tokens in engine.step().items():
      streamed[rid] += engine.requests[rid].logprobs[-len(tokens) :]
    helpers.check_pages(engine)
  done = {r.id: r for r in engine.finished()}
  assert all(streamed[i] == done[i].logprobs for i in ids)
  return [done[i] for i in ids]


def oracle_logprobs(prompts, outputs):
  """log_softmax of the training forward's logits over each whole sequence: [N, CONTEXT, V]."""
  tokens = np.zeros((len(prompts), CONTEXT), np.int32)
  for i, (p, o) in enumerate(zip(prompts, outputs)):
    tokens[i, : len(p) + len(o)] = p + o
  return np.asarray(jax.nn.log_softmax(helpers.forward("dense")(tokens), axis=-1))


def assert_logprobs(r, want_TxV):
  """r.logprobs equal the oracle's at each generated position: the chosen token's and the top
  k (ids exactly, values to float32 rounding), most likely first."""
  k = r.sampling.logprobs
  assert len(r.logprobs) == len(r.output)
  for i, (token, (chosen, top)) in enumerate(zip(r.output, r.logprobs)):
    want_V = want_TxV[len(r.prompt) - 1 + i]
    order = np.argsort(-want_V, kind="stable")[:k]
    helpers.close(chosen, want_V[token], f"token {i}")
    assert [t for t, _ in top] == order.tolist(), f"token {i}"
    if k:
      helpers.close([x for _, x in top], want_V[order], f"token {i} top {k}")


def test_generated_logprobs_equal_the_recompute_oracle(engine):
  prompts = helpers.prompts(seed=3, n=8)
  samplings = [
      SamplingParams(logprobs=5),
      SamplingParams(temperature=0.8, top_k=10, seed=1, logprobs=20),
      SamplingParams(logprobs=None),
      SamplingParams(temperature=0.8, top_k=10, seed=2, logprobs=0),
  ] * 2
  got = run(engine, prompts, 12, samplings)
  assert any(r.preemptions for r in got if r.sampling.logprobs is not None)
  assert all(r.logprobs == [] for r in got if r.sampling.logprobs is None)
  want = oracle_logprobs(prompts, [r.output for r in got])
  for i, r in enumerate(got):
    if r.sampling.logprobs is not None:
      assert_logprobs(r, want[i])
  # the sampled requests' logprobs are the raw distribution's, not the tempered one's
  sampled = got[1]
  scaled = np.asarray(jax.nn.log_softmax(want[1] / 0.8, axis=-1))  # log_softmax(logits / T)
  first = scaled[len(sampled.prompt) - 1, sampled.output[0]]
  assert abs(sampled.logprobs[0][0] - first) > 1e-3
