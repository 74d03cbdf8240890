"""Logit bias, presence, frequency and repetition penalties and min-p (`jaxpipe.serve.sampling`)
against direct NumPy implementations of vLLM's definitions, written here apart from the
library's: on fixed logits, in the draws' distribution, row by row whatever the neighbours,
and in the engine's greedy tokens (its last output token read on the device under async
scheduling) against a recompute of every sequence with the NumPy rules applied."""

import numpy as np
import pytest

from jaxpipe.serve import sampling
from jaxpipe.serve.engine import Engine
from jaxpipe.serve.sampling import SamplingParams
from tests import helpers

V = 16


def np_controls(logits, sp: SamplingParams, prompt, output):
  """vLLM's order: logit bias, then repetition (prompt and output), frequency, presence."""
  x = np.array(logits, np.float64)
  for token, bias in sp.logit_bias:
    x[token] += bias
  counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
  seen = (counts > 0) | (np.bincount(np.asarray(prompt, np.int64), minlength=len(x)) > 0)
  rep = np.where(seen, sp.repetition_penalty, 1.0)
  x = np.where(x > 0, x / rep, x * rep)
  return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def _batch(sps, prompts, outputs, pending=None):
  """A SamplingBatch of len(sps) rows as the engine builds it (`batch._penalties`, ...)."""
  from jaxpipe.serve import batch as batch_lib
  from jaxpipe.serve.request import Request

  reqs = []
  for i, (sp, p, o) in enumerate(zip(sps, prompts, outputs)):
    r = Request(i, list(p), 64, sp, None)
    r.output = list(o)
    reqs.append(r)
  r_max = len(sps)
  return sampling.SamplingBatch(
      np.array([sp.temperature for sp in sps], np.float32),
      np.array([sp.top_k for sp in sps], np.int32),
      np.array([sp.top_p for sp in sps], np.float32),
      np.array([sp.seed for sp in sps], np.int32),
      np.zeros(r_max, np.int32),
      None,
      batch_lib._min_p(reqs, r_max),
      batch_lib._logit_bias(reqs, r_max),
      batch_lib._penalties(reqs, r_max, pending or {}),
  )


ROWS = [  # (sampling, prompt, output)
    (SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), [1, 2, 3], [4, 4, 5, 4]),
    (SamplingParams(repetition_penalty=1.8), [2, 6, 6, 9], [9, 11]),
    (SamplingParams(repetition_penalty=0.6, logit_bias=((3, 5.0), (7, -100.0))), [3, 7], [0]),
    (SamplingParams(logit_bias=((12, 2.5),)), [5], []),
    (SamplingParams(), [1], [1, 1]),
]


def test_argmax_is_numpys_first_largest_index():
  """Ties (few distinct values), rows of -inf, +inf and one-hot rows, over 2 and 3 axes."""
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 3, (9, 4, 257)).astype(np.float32)
  x[0] = -np.inf
  x[1, :, 100] = np.inf
  x[1, :, 200] = np.inf
  x[2] = -1.0
  x[2, :, 256] = 0.0
  for a in (x, x[3]):
    got = np.asarray(sampling.argmax(a))
    assert got.dtype == np.int32 and (got == np.argmax(a, axis=-1)).all()


@pytest.mark.parametrize("vocab", [1024, 49152, 32064, 48])
def test_argmax_in_blocks_is_numpys_first_largest_index(vocab):
  """Vocabularies taken in blocks of 256, 64 (Phi-3's 32,064) and 16: the row's max tied in
  several blocks and within one (the first wins), a max in a block's last slot, rows of -inf;
  a row holding NaN gives an index in range."""
  rng = np.random.default_rng(vocab)
  x = rng.integers(-3, 3, (7, 2, vocab)).astype(np.float32)
  x[0] = -np.inf
  x[1] = -1.0
  x[1, :, [vocab // 2 + 3, vocab - 1, vocab // 2 + 5]] = 4.0  # ties in two blocks
  x[2] = -1.0
  x[2, :, vocab - 1] = 0.0  # the last block's last slot
  x[3] = -1.0
  x[3, :, 15] = 0.0  # the first block's last slot at width 16
  got = np.asarray(sampling.argmax(x))
  assert got.dtype == np.int32 and (got == np.argmax(x, axis=-1)).all()
  assert got[1].tolist() == [vocab // 2 + 3] * 2
  x[4, 0, 9] = np.nan
  assert 0 <= int(sampling.argmax(x[4, 0])) < vocab


def test_bias_and_penalties_equal_numpy_on_fixed_logits():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (len(ROWS), V)).astype(np.float32)  # positive and negative
  sps, prompts, outputs = zip(*ROWS)
  s = _batch(sps, prompts, outputs)
  got = sampling.apply_penalties(sampling.apply_bias(logits, s.bias), s.penalties)
  for i, (sp, p, o) in enumerate(ROWS):
    np.testing.assert_allclose(got[i], np_controls(logits[i], sp, p, o), rtol=1e-6, atol=1e-5)
  # greedy rows take the argmax of the controlled logits
  want = [int(np.argmax(np_controls(logits[i], *row))) for i, row in enumerate(ROWS)]
  assert np.asarray(sampling.sample(logits, s)).tolist() == want
  assert want != np.argmax(logits, -1).tolist()  # the controls changed some choice


def test_the_last_output_token_can_come_from_the_device():
  """Under async scheduling a row's last output token is the step in flight's sampled token:
  `pending_R` names its row there and the device reads it."""
  sp = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
  logits = np.random.default_rng(1).normal(0, 2, (1, V)).astype(np.float32)
  s = _batch([sp], [[1]], [[4, 5, -1]], pending={0: 2})  # -1: PENDING
  prev_R = np.array([9, 9, 4, 9], np.int32)  # the step before sampled 4 in its row 2
  got = sampling.apply_penalties(logits, s.penalties, prev_R)
  np.testing.assert_allclose(got[0], np_controls(logits[0], sp, [1], [4, 5, 4]), rtol=1e-6)


def test_min_p_draws_from_the_numpy_distribution():
  """4,000 rows with the same logits and their own seeds: each token's share of the draws is
  the NumPy min-p distribution's within five standard errors, and none falls below the floor."""
  n, temperature, min_p = 4000, 0.7, 0.15
  logits = np.random.default_rng(2).normal(0, 1.5, V).astype(np.float32)
  sp = SamplingParams(temperature=temperature, min_p=min_p)
  s = _batch([sp] * n, [[0]] * n, [[]] * n)
  s = s.replace(seed_R=np.arange(n, dtype=np.int32))
  draws = np.asarray(sampling.sample(np.tile(logits, (n, 1)), s))
  p = np.exp(logits / temperature - np.max(logits / temperature))
  p /= p.sum()
  p = np.where(p < min_p * p.max(), 0.0, p)
  p /= p.sum()
  share = np.bincount(draws, minlength=V) / n
  assert np.all(share[p == 0] == 0) and (p == 0).sum() >= 3
  assert np.all(np.abs(share - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_a_row_samples_alike_whatever_its_neighbours():
  """Row 2 of a batch whose other rows bias, penalize and min-p differently draws what it draws
  alone, at every seed."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 2, (len(ROWS), V)).astype(np.float32)
  warm = lambda sp, seed: SamplingParams(
      temperature=0.9,
      top_k=10,
      min_p=0.05,
      seed=seed,
      presence_penalty=sp.presence_penalty,
      frequency_penalty=sp.frequency_penalty,
      repetition_penalty=sp.repetition_penalty,
      logit_bias=sp.logit_bias,
  )
  sps, prompts, outputs = zip(*ROWS)
  for seed in range(20):
    crowd = _batch([warm(sp, seed + 31 * i) for i, sp in enumerate(sps)], prompts, outputs)
    alone = _batch([warm(sps[2], seed + 62)], prompts[2:3], outputs[2:3])
    got = np.asarray(sampling.sample(logits, crowd))[2]
    assert got == np.asarray(sampling.sample(logits[2:3], alone))[0], seed


def test_the_engines_greedy_tokens_follow_the_numpy_rules():
  """Requests with penalties and biases beside a plain one, in a pool small enough to preempt:
  each output equals a recompute of the whole sequence at every step with the NumPy rules
  applied to its last logits."""
  engine = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=17,
      nan_freed_pages=True,
      **helpers.ENGINE_ARGS,
  )
  prompts = helpers.prompts(seed=4, n=6)
  sps = [
      SamplingParams(presence_penalty=1.5, frequency_penalty=0.8),
      SamplingParams(repetition_penalty=2.0),
      SamplingParams(logit_bias=((7, 3.0), (1, -100.0))),
      SamplingParams(repetition_penalty=0.5, frequency_penalty=-0.5),
      SamplingParams(),
      SamplingParams(presence_penalty=-2.0),
  ]
  steps = 10
  got = helpers.serve_arrivals(engine, prompts, steps, first=4, sampling=sps, eos_id=None)
  want = _recompute(prompts, sps, steps)
  assert [r.output for r in got] == want
  assert want != helpers.oracle("dense", prompts, steps)  # the controls changed tokens
  assert sum(r.preemptions for r in got) > 0
  helpers.check_pages(engine)


def _recompute(prompts, sps, steps):
  pick = lambda i, x, out: int(np.argmax(np_controls(x, sps[i], prompts[i], out)))
  return helpers.recompute("dense", prompts, steps, pick)


@pytest.mark.parametrize(
    "sp, words",
    [
        (SamplingParams(min_p=1.5), "min_p=1.5 must lie in [0, 1]"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty=2.5 must lie in [-2, 2]"),
        (SamplingParams(frequency_penalty=-3.0), "frequency_penalty=-3.0 must lie in [-2, 2]"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty=0.0 must lie in (0, 10]"),
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias {3: 101.0}: keys must be"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias {-1: 1.0}"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "at most 300"),
    ],
)
def test_bad_values_are_refused_by_name(sp, words):
  refusal = sp.check()
  assert refusal is not None and words in refusal
