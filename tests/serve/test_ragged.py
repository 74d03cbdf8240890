"""The ragged paged attention (`xla_ragged`) against the per-token gather reference, and the
engine on it against the recompute oracle.

`ragged_paged_attention` groups a step's tokens by sequence and gathers each block of a
sequence's tokens' pages once; `paged_attention_reference` gathers every token's pages, an
independent computation of the same thing. Both compute in float32 with the highest matmul
precision and differ only in the order of their sums (over at most 64 keys), so they agree to
a relative 1e-5 of the output's scale. Pages no row owns, and the unwritten tail of each row's
last page, hold NaN: a key read through padding would show.
"""

import jax
import numpy as np
import pytest

from jaxpipe.ops.attention import ragged_blocks, ragged_paged_attention
from kernels_pallas.paged_attention import paged_attention_reference
from tests import helpers


@pytest.mark.parametrize("block", [1, 4, 32])
@pytest.mark.parametrize("key_chunk, pairs", [(64, 32), (4, 3), (8, 1), (4, 64)])
def test_ragged_attention_equals_the_gather_reference_per_token(block, key_chunk, pairs):
  """key_chunk 4 and 8 (one and two pages per chunk) split each block's keys over several
  pairs; 3 and 1 pairs per round split a block's pairs over rounds and put several blocks in
  one round, so the online-softmax merge of partial results is exercised both ways."""
  q, k_pages, v_pages, rows, tables_TxN, lengths_T, live = helpers.ragged_case()
  fn = jax.jit(ragged_paged_attention, static_argnames=("block", "key_chunk", "pairs"))
  got = np.asarray(fn(q, k_pages, v_pages, rows, block=block, key_chunk=key_chunk, pairs=pairs))
  want = np.asarray(paged_attention_reference(q, k_pages, v_pages, tables_TxN, lengths_T))
  assert np.isfinite(want[:live]).all()
  scale = np.abs(want[:live]).max()
  np.testing.assert_allclose(got[:live], want[:live], rtol=1e-5, atol=1e-5 * scale)
  assert (got[live:] == 0).all()  # padding tokens: no row covers them


@pytest.mark.parametrize("key_chunk, pairs", [(64, 32), (4, 3)])
def test_ragged_attention_on_int8_pages_equals_the_gather_reference(key_chunk, pairs):
  """An 8-bit cache: int8 values with a float32 scale per (head, slot), NaN scales in the slots
  no row owns; both sides dequantise the same stored values."""
  q, k_pages, v_pages, rows, tables_TxN, lengths_T, live = helpers.ragged_case()

  def int8(pages):
    unowned = np.isnan(pages[..., 0])
    scale = np.abs(np.nan_to_num(pages)).max(axis=-1) / 127
    scale[unowned] = np.nan
    values = np.where(unowned[..., None], 0, np.round(np.nan_to_num(pages) / scale[..., None]))
    return values.astype(np.int8), scale.astype(np.float32)

  (k8, k_s), (v8, v_s) = int8(k_pages), int8(v_pages)
  scales = dict(k_scales_GxPxS=k_s, v_scales_GxPxS=v_s)
  fn = jax.jit(ragged_paged_attention, static_argnames=("block", "key_chunk", "pairs"))
  got = np.asarray(fn(q, k8, v8, rows, block=4, key_chunk=key_chunk, pairs=pairs, **scales))
  want = np.asarray(paged_attention_reference(q, k8, v8, tables_TxN, lengths_T, **scales))
  assert np.isfinite(want[:live]).all()
  scale = np.abs(want[:live]).max()
  np.testing.assert_allclose(got[:live], want[:live], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
@pytest.mark.parametrize("window, softcap", [(5, 0.0), (40, 2.0), (1, 1.5)])
def test_ragged_attention_with_a_window_and_softcap_equals_the_gather_reference(
    kernel, window, softcap
):
  """Sliding windows (traced, as a mixed stack's layer passes them) and soft-capped scores on
  both ragged kernels: the keys before each row's window are NaN, as freed pages handed to
  another sequence would be, and never reach the output."""
  rng = np.random.default_rng(window)
  seqs = [(0, 30), (37, 1), (0, 3), (50, 1), (20, 13)]
  k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
      seqs, 4, 2, 16, rng, rows=7, tokens=56, window=window
  )
  q = rng.standard_normal((tables_T.shape[0], 4, 16)).astype(np.float32)
  args = dict(window=window, softcap=softcap)
  fn = jax.jit(ragged_paged_attention, static_argnames=("kernel", "block", "key_chunk", "softcap"))
  got = np.asarray(fn(q, k, v, rows, kernel=kernel, block=8, key_chunk=8, **args))
  want = np.asarray(paged_attention_reference(q, k, v, tables_T, lengths_T, **args))
  assert np.isfinite(want[:live]).all() and np.isfinite(got).all()
  scale = np.abs(want[:live]).max()
  np.testing.assert_allclose(got[:live], want[:live], rtol=1e-5, atol=1e-5 * scale)


def test_block_counts_cover_any_step():
  """The static block counts hold every split of T tokens into at most B rows."""
  for t, b, q in ((40, 8, 4), (16, 4, 16), (1024, 16, 32), (8, 16, 32)):
    ones, blocks = ragged_blocks(t, b, q)
    q, b = min(q, t), min(b, t)
    for counts in (
        [t],
        [1] * b,
        [2] * (t // 2),
        [t - b + 1] + [1] * (b - 1),
        [q + 1] * (t // (q + 1)),
    ):
      counts = counts[:b]
      multi = [c for c in counts if c > 1]
      assert sum(c == 1 for c in counts) <= ones
      assert sum(-(-c // q) for c in multi) <= blocks


@pytest.mark.parametrize("devices", [1, 2])
def test_engine_greedy_equals_recompute_oracle(devices):
  """Preemption, prefix hits, copy-on-write and NaN in freed pages, with the KV heads split over
  `devices` devices."""
  engine = helpers.ragged_engine("xla_ragged", devices)
  prompts = helpers.prompts()
  got = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=None)
  assert [r.output for r in got] == helpers.oracle("dense", prompts, 10)
  assert engine.counts["preemptions"] > 0 and engine.counts["cached_tokens"] > 0
  assert engine.counts["page_copies"] > 0
  assert len(engine.programs) == 1


def test_engine_on_the_rows_kernel_equals_recompute_oracle():
  """`attention='pallas_ragged'` (the rows kernel, interpreted here): prefill chunks beside
  decode rows, a prefix-cache hit, freed pages NaN; greedy tokens equal the recompute oracle."""
  engine = helpers.ragged_engine("pallas_ragged")
  prompts = [helpers.prompts()[i] for i in (2, 5, 0)]  # 2 and 5 share two full pages
  got = helpers.serve_arrivals(engine, prompts, max_tokens=4, first=1, per_arrival=1, eos_id=None)
  assert [r.output for r in got] == helpers.oracle("dense", prompts, 4)
  assert engine.counts["cached_tokens"] > 0


@pytest.mark.parametrize("name", ["gemma", "sliding"])
@pytest.mark.parametrize("attention", ["xla_ragged", "pallas_ragged"])
def test_sliding_window_models_keep_rings_and_equal_the_recompute_oracle(name, attention):
  """Sliding layers (between full ones, or all of them) hold a ring of their window's and a
  step's pages, overwritten as the sequence grows past it (prompts and outputs run to 40
  tokens, rings hold 24), on a small pool with NaN in every freed page and preemption."""
  engine = helpers.ragged_engine(attention, 1, name)
  assert engine.ring_size == 6 and engine.prefix_cache is None  # ceil((5 + 16 - 1) / 4) + 1
  prompts = helpers.prompts()
  got = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=None)
  assert [r.output for r in got] == helpers.oracle(name, prompts, 10)
  # gemma's full layer keeps the context's pages of a 17-page pool, and preempts; sliding keeps
  # none: its rings are all it holds, one per running request, and nothing waits for pages
  assert (engine.counts["preemptions"] > 0) == (name == "gemma")
  assert engine.kv.window_pages == 1 + 4 * 6
  helpers.check_pages(engine)
