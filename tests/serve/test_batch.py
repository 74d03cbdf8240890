"""A step's token batch (serve/batch.py) against arrays worked out by hand for a small plan."""

import numpy as np

from jaxpipe.serve import Engine
from jaxpipe.serve import batch as batch_lib
from jaxpipe.serve.request import PENDING, Request
from jaxpipe.serve.sampling import MAX_BANNED, SamplingParams
from tests import helpers

SHAPE = batch_lib.BatchShape(
    page_size=4, max_batch=4, token_buckets=(4, 8, 16), page_buckets=(2, 4)
)


def _plan():
  """A whole 5-token prompt (sampled, min_tokens bans its EOS and stop id), a decode step whose
  input is the step in flight's token, and the first chunk of a 10-token prompt."""
  a = Request(
      0,
      [10, 11, 12, 13, 14],
      8,
      SamplingParams(temperature=0.5, top_k=3, seed=7, min_tokens=2, stop_token_ids=(9,)),
      1,
      pages=[3, 5],
      ring=[1, 2],
  )
  b = Request(1, [20, 21], 8, SamplingParams(seed=4), None, output=[30, PENDING], pages=[6])
  b.computed, b.ring = 3, [3, 4]
  c = Request(2, list(range(40, 50)), 8, SamplingParams(), None, pages=[7, 8, 9], ring=[5, 6])
  return [(a, 5), (b, 1), (c, 4)]


def test_a_plan_becomes_the_arrays_worked_out_by_hand():
  step = batch_lib.build(_plan(), SHAPE, {1: 2})  # b's pending token: row 2 of the step before
  tb = step.tokens
  assert (step.t, step.t_real, step.pages) == (16, 10, 4)  # buckets of 10 tokens and 3 pages
  pad = [0] * 6
  np.testing.assert_array_equal(tb.tokens_T, [10, 11, 12, 13, 14, PENDING, 40, 41, 42, 43] + pad)
  np.testing.assert_array_equal(tb.positions_T, [0, 1, 2, 3, 4, 3, 0, 1, 2, 3] + pad)
  # page * 4 + offset: a's positions 0-3 on page 3, 4 on page 5; b's 3 on page 6; c's on page 7
  np.testing.assert_array_equal(tb.slots_T, [12, 13, 14, 15, 20, 27, 28, 29, 30, 31] + pad)
  np.testing.assert_array_equal(tb.tables_TxN[:6], [[3, 5, 0, 0]] * 5 + [[6, 0, 0, 0]])
  np.testing.assert_array_equal(tb.tables_TxN[6:10], [[7, 8, 9, 0]] * 4)
  assert not tb.tables_TxN[10:].any()
  np.testing.assert_array_equal(tb.rows_R, [4, 5, 0, 0])  # a and b sample; c has 6 tokens left
  np.testing.assert_array_equal(tb.prev_T, [-1] * 5 + [2] + [-1] * 10)
  np.testing.assert_array_equal(tb.seq_starts_B, [0, 5, 6, 0])
  np.testing.assert_array_equal(tb.seq_counts_B, [5, 1, 4, 0])
  np.testing.assert_array_equal(tb.seq_cached_B, [0, 3, 0, 0])
  np.testing.assert_array_equal(
      tb.seq_tables_BxN, [[3, 5, 0, 0], [6, 0, 0, 0], [7, 8, 9, 0], [0] * 4]
  )
  assert tb.ring_slots_T is None and tb.ring_tables_TxN is None
  sb = step.sampling
  np.testing.assert_allclose(sb.temperature_R, [0.5, 0, 0, 0])
  np.testing.assert_array_equal(sb.top_k_R, [3, 0, 0, 0])
  np.testing.assert_allclose(sb.top_p_R, [1, 1, 1, 1])
  np.testing.assert_array_equal(sb.seed_R, [7, 4, 0, 0])
  np.testing.assert_array_equal(sb.index_R, [0, 2, 0, 0])  # the output index each token fills
  want_banned = np.full((4, MAX_BANNED), -1)
  want_banned[0, :2] = [1, 9]  # a has fewer than min_tokens: its EOS and stop id are banned
  np.testing.assert_array_equal(sb.banned_RxS, want_banned)
  assert [r.id for r in step.sampled] == [0, 1] and step.index == [0, 2]


def test_ring_layers_get_slots_and_tables_in_ring_numbering():
  shape = batch_lib.BatchShape(4, 4, (4, 8, 16), (2, 4), ring_size=2, per_token=False)
  step = batch_lib.build(_plan(), shape, {1: 2})
  tb = step.tokens
  # ring[(position // 4) % 2] * 4 + position % 4: a's ring [1, 2], b's [3, 4], c's [5, 6]
  np.testing.assert_array_equal(tb.ring_slots_T[:10], [4, 5, 6, 7, 8, 15, 20, 21, 22, 23])
  np.testing.assert_array_equal(
      tb.ring_seq_tables_BxN[:3], [[1, 2, 1, 2], [3, 4, 3, 4], [5, 6, 5, 6]]
  )
  assert not tb.tables_TxN.any() and not tb.ring_tables_TxN.any()  # a ragged backend's: unread
  np.testing.assert_array_equal(tb.slots_T[:5], [12, 13, 14, 15, 20])  # full layers as before


def test_a_size_pads_to_the_smallest_bucket_that_holds_it():
  assert [batch_lib.bucket(n, (2, 4, 7)) for n in (1, 2, 3, 5, 7)] == [2, 2, 4, 7, 7]


def test_default_token_buckets_are_powers_of_two_with_half_steps_from_64():
  assert batch_lib.token_buckets(1024) == (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
  assert batch_lib.token_buckets(256) == (8, 16, 32, 64, 96, 128, 192, 256)
  assert batch_lib.token_buckets(100) == (8, 16, 32, 64, 96, 100)
  assert batch_lib.token_buckets(48) == (8, 16, 32, 48)
  assert batch_lib.token_buckets(4) == (4,)
  buckets = batch_lib.token_buckets(1024)
  assert batch_lib.bucket(280, buckets) == 384  # not 512
  # past 64 tokens a step is padded by less than half of itself (powers of two: up to double)
  assert all(batch_lib.bucket(n, buckets) < 1.5 * n for n in range(65, 1025))


def test_an_engine_without_token_buckets_takes_the_default_ones():
  args = {k: v for k, v in helpers.ENGINE_ARGS.items() if k != "token_buckets"}
  args["max_tokens_per_step"] = 200
  engine = Engine(helpers.CONFIGS["dense"], helpers.engine_params("dense"), num_pages=17, **args)
  assert engine.token_buckets == (8, 16, 32, 64, 96, 128, 192, 200)
