"""PagedAttention: the Pallas kernel (interpret mode) against the gather reference, and the
reference against `jax.nn.dot_product_attention` on the same keys laid out contiguously.

Every slot a row does not own (other pages, the tail of its last page) holds NaN, so a read
outside a row's keys would show in its output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.ops import attention as attn
from kernels_pallas.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_rows,
)
from tests import helpers


def _contiguous(q, k, v, tables, lengths):
  """jax.nn.dot_product_attention over each row's keys gathered in order (NaN slots zeroed)."""
  b, h, d = q.shape
  g, _, s, _ = k.shape
  keys = np.nan_to_num(k[:, tables]).transpose(1, 2, 3, 0, 4).reshape(b, -1, g, d)
  values = np.nan_to_num(v[:, tables]).transpose(1, 2, 3, 0, 4).reshape(b, -1, g, d)
  mask = np.arange(keys.shape[1])[None, :] < lengths[:, None]
  return np.asarray(_dot_product_attention(q[:, None], keys, values, mask[:, None, None, :]))[:, 0]


@jax.jit
def _dot_product_attention(q, k, v, mask):
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# (heads, kv_heads, lengths, k_splits, pages_per_block): GQA 1/2/4/8; one page, many pages,
# ending mid-page and on a page; one split or several, blocks of 1 to 8 pages.
CASES = [
    (4, 4, [1, 4, 5], 1, 2),
    (4, 2, [3, 17, 8], 3, 1),
    (8, 2, [13, 1, 24], 2, 4),
    (8, 1, [29, 6], 1, 8),
]


@pytest.mark.parametrize("heads,kv_heads,lengths", [c[:3] for c in CASES])
def test_reference_equals_contiguous_attention(heads, kv_heads, lengths):
  q, k, v, tables, lens = helpers.paged_inputs(lengths, heads, kv_heads)
  got = paged_attention_reference(q, k, v, tables, lens)
  assert np.isfinite(got).all()
  assert _rel(got, _contiguous(q, k, v, tables, lens)) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,lengths,k_splits,pages_per_block", CASES)
def test_kernel_equals_reference(heads, kv_heads, lengths, k_splits, pages_per_block):
  q, k, v, tables, lens = helpers.paged_inputs(lengths, heads, kv_heads)
  got = paged_attention(
      q, k, v, tables, lens, k_splits=k_splits, pages_per_block=pages_per_block, interpret=True
  )
  assert np.isfinite(got).all()
  assert _rel(got, paged_attention_reference(q, k, v, tables, lens)) < 1e-5


@pytest.mark.parametrize("dtype,tolerance", [(jnp.int8, 2e-2), (jnp.float8_e4m3fn, 1.5e-1)])
def test_quantized_pages(dtype, tolerance):
  """Exact against the reference on the same stored values; within the format's rounding of the
  float pages (int8: 1/254 of the largest entry per slot; e4m3: 3 mantissa bits)."""
  q, k, v, tables, lens = helpers.paged_inputs([9, 20, 3], 8, 2, seed=3)
  (k8, ks), (v8, vs) = helpers.quantize(k, dtype), helpers.quantize(v, dtype)
  scales = dict(k_scales_GxPxS=ks, v_scales_GxPxS=vs)
  got = paged_attention(q, k8, v8, tables, lens, **scales, k_splits=2, interpret=True)
  assert _rel(got, paged_attention_reference(q, k8, v8, tables, lens, **scales)) < 1e-5
  dequantized = lambda x8, s: np.asarray(x8, np.float32) * np.asarray(s)[..., None]
  assert _rel(got, _contiguous(q, dequantized(k8, ks), dequantized(v8, vs), tables, lens)) < 1e-5
  err = _rel(got, paged_attention_reference(q, np.nan_to_num(k), np.nan_to_num(v), tables, lens))
  assert 0 < err < tolerance


def _windowed_softcapped(q, k, v, tables, lengths, window, softcap):
  """Written out in numpy (float64) over each row's keys gathered in order: a row of length n
  sees keys n - window .. n - 1 (all with window 0), its scores capped as c·tanh(s / c)."""
  b, h, d = q.shape
  g, _, s, _ = k.shape
  out = np.zeros((b, h, d))
  for row in range(b):
    n = lengths[row]
    lo = max(n - window, 0) if window else 0
    keys = k[:, tables[row]].reshape(g, -1, d)[:, lo:n].astype(np.float64)
    values = v[:, tables[row]].reshape(g, -1, d)[:, lo:n].astype(np.float64)
    for head in range(h):
      group = head // (h // g)
      scores = keys[group] @ q[row, head].astype(np.float64) / np.sqrt(d)
      if softcap:
        scores = softcap * np.tanh(scores / softcap)
      p = np.exp(scores - scores.max())
      out[row, head] = p @ values[group] / p.sum()
  return out


WINDOWED = [(0, 2.0), (5, 0.0), (9, 1.5), (1, 0.0)]  # (window, softcap): 1, the token alone


@pytest.mark.parametrize("window, softcap", WINDOWED)
def test_reference_window_and_softcap_equal_attention_written_out(window, softcap):
  q, k, v, tables, lens = helpers.paged_inputs([13, 1, 24, 9], 8, 2, seed=4, window=window)
  got = paged_attention_reference(q, k, v, tables, lens, window=window, softcap=softcap)
  assert np.isfinite(got).all()
  assert _rel(got, _windowed_softcapped(q, k, v, tables, lens, window, softcap)) < 1e-5
  if softcap and not window:  # the cap changes the output (a window's NaN keys show anyway)
    assert _rel(got, _windowed_softcapped(q, k, v, tables, lens, 0, 0.0)) > 1e-3


@pytest.mark.parametrize("window, softcap", WINDOWED)
def test_kernels_with_window_and_softcap_equal_the_reference(window, softcap):
  """The decode kernel (several splits) and the rows kernel read only the window's pages: the
  keys before it are NaN and the outputs stay finite and equal the reference's."""
  q, k, v, tables, lens = helpers.paged_inputs([13, 1, 24, 9], 8, 2, seed=4, window=window)
  args = dict(window=window, softcap=softcap)
  want = paged_attention_reference(q, k, v, tables, lens, **args)
  got = paged_attention(
      q, k, v, tables, lens, k_splits=2, pages_per_block=2, **args, interpret=True
  )
  assert np.isfinite(got).all() and _rel(got, want) < 1e-5
  # the rows kernel: each row's last token as a block of one, at its position
  got = paged_attention_rows(q[:, None], k, v, tables, (lens - 1)[:, None], **args, interpret=True)[
      :, 0
  ]
  assert np.isfinite(got).all() and _rel(got, want) < 1e-5


def test_a_row_without_keys_gives_zeros():
  q, k, v, tables, _ = helpers.paged_inputs([5, 5], 4, 2)
  lens = np.asarray([0, 5], np.int32)
  for fn in (paged_attention_reference, functools.partial(paged_attention, interpret=True)):
    out = np.asarray(fn(q, k, v, tables, lens))
    assert (out[0] == 0).all() and np.isfinite(out).all()


def test_registry_backends_agree():
  q, k, v, tables, lens = helpers.paged_inputs([7, 12], 4, 2, seed=5)
  want = paged_attention_reference(q, k, v, tables, lens)
  for backend in ("xla", "pallas", "auto"):
    assert _rel(attn.paged_attention(q, k, v, tables, lens, backend=backend), want) < 1e-5
  assert attn.resolve_paged_backend("auto", 16, 4) == "xla"  # on CPU
  with pytest.raises(ValueError, match="unknown paged attention backend 'cudnn'"):
    attn.resolve_paged_backend("cudnn", 16, 4)


def test_auto_on_gpu_picks_the_kernel_where_it_compiles(monkeypatch):
  monkeypatch.setattr(attn, "_gpu_major", lambda: 9)
  assert attn.resolve_paged_backend("auto", 128, 16) == "pallas"
  assert attn.resolve_paged_backend("auto", 8, 16) == "xla"  # below Triton's smallest tile
  with pytest.raises(ValueError, match="page_size a power of two, got 12"):
    attn.resolve_paged_backend("pallas", 128, 12)


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda a: {**a, "lengths_B": a["lengths_B"].astype(np.float32)}, "lengths must be int32"),
        (lambda a: {**a, "v_pages_GxPxSxK": a["v_pages_GxPxSxK"][:1]}, "must have k_pages' shape"),
        (lambda a: {**a, "q_BxHxK": a["q_BxHxK"][:, :3]}, "multiple of KV heads"),
        (
            lambda a: {
                **a,
                "k_pages_GxPxSxK": np.zeros_like(a["k_pages_GxPxSxK"], np.int8),
                "v_pages_GxPxSxK": np.zeros_like(a["v_pages_GxPxSxK"], np.int8),
            },
            "need k_scales",
        ),
    ],
)
def test_bad_inputs_are_named(change, words):
  q, k, v, tables, lens = helpers.paged_inputs([5, 6], 4, 2)
  args = dict(
      q_BxHxK=q, k_pages_GxPxSxK=k, v_pages_GxPxSxK=v, block_tables_BxN=tables, lengths_B=lens
  )
  with pytest.raises(ValueError, match=words):
    paged_attention_reference(**change(args))


def _rows_case(lengths, chunks, heads, kv_heads, m, seed=0):
  """Each sequence's last `chunk` tokens as blocks of m queries (the rest of it cached before),
  the tail of a sequence's last block padding (position -1): (q blocks [N, M, H, K], pages,
  block tables [N, T], positions [N, M]) and, per live query, (block, slot, sequence)."""
  q_seq, k, v, tables, _ = helpers.paged_inputs(lengths, heads, kv_heads, seed=seed)
  rng = np.random.default_rng(seed + 1)
  blocks, where = [], []
  for row, (length, chunk) in enumerate(zip(lengths, chunks)):
    for start in range(length - chunk, length, m):
      pos = np.arange(start, start + m)
      pos = np.where(pos < length, pos, -1)
      where += [(len(blocks), i, row) for i in range(m) if pos[i] >= 0]
      blocks.append((row, pos))
  q = rng.standard_normal((len(blocks), m, heads, q_seq.shape[-1])).astype(np.float32)
  block_tables = np.stack([tables[row] for row, _ in blocks])
  positions = np.stack([pos for _, pos in blocks]).astype(np.int32)
  return q, k, v, block_tables, positions, where, tables


# (heads, kv_heads, sequence lengths, chunk lengths, queries per block): GQA 1/2/4, chunks
# ending mid-page and on a page, a chunk after a cached prefix and a whole prompt, blocks of
# 1 (decode), 3 and 8 queries.
ROWS_CASES = [
    (4, 4, [9, 20], [9, 6], 3),
    (4, 2, [17, 8, 5], [4, 8, 1], 8),
    (8, 2, [24, 13], [1, 1], 1),
]


@pytest.mark.parametrize("heads,kv_heads,lengths,chunks,m", ROWS_CASES)
def test_rows_kernel_equals_the_reference_per_token(heads, kv_heads, lengths, chunks, m):
  """Every query of every block against the gather reference for its own token: its
  sequence's table and length position + 1 (causal within the chunk, the cached prefix whole);
  padding queries give 0. NaN in every slot no sequence owns."""
  q, k, v, block_tables, positions, where, tables = _rows_case(lengths, chunks, heads, kv_heads, m)
  got = np.asarray(
      paged_attention_rows(q, k, v, block_tables, positions, pages_per_block=2, interpret=True)
  )
  blk, slot, row = (np.asarray(x) for x in zip(*where))
  want = paged_attention_reference(
      q[blk, slot], k, v, tables[row], (positions[blk, slot] + 1).astype(np.int32)
  )
  assert np.isfinite(got).all()
  assert _rel(got[blk, slot], want) < 1e-5
  dead = positions < 0
  assert (got[dead] == 0).all() and dead.any() == any(c % m for c in chunks)


def test_rows_kernel_reads_8_bit_pages_as_the_reference_does():
  q, k, v, block_tables, positions, where, tables = _rows_case([11, 19], [5, 19], 8, 2, 4, seed=7)
  (k8, ks), (v8, vs) = helpers.quantize(k, jnp.int8), helpers.quantize(v, jnp.int8)
  scales = dict(k_scales_GxPxS=ks, v_scales_GxPxS=vs)
  got = np.asarray(
      paged_attention_rows(q, k8, v8, block_tables, positions, **scales, interpret=True)
  )
  blk, slot, row = (np.asarray(x) for x in zip(*where))
  want = paged_attention_reference(
      q[blk, slot], k8, v8, tables[row], (positions[blk, slot] + 1).astype(np.int32), **scales
  )
  assert _rel(got[blk, slot], want) < 1e-5


def test_ragged_attention_through_the_rows_kernel_equals_the_xla_blocks():
  """`ops.attention.ragged_paged_attention(kernel='pallas')`: a prefill chunk after a cached
  prefix, a whole prompt and decode rows in one step, equal to the XLA block path."""
  q, k, v, tables, _ = helpers.paged_inputs([21, 9, 14, 6], 4, 2, seed=9)
  counts = np.asarray([7, 9, 1, 1], np.int32)
  cached = np.asarray([14, 0, 13, 5], np.int32)
  t = int(counts.sum()) + 3  # three padding tokens
  rng = np.random.default_rng(10)
  q_TxHxK = rng.standard_normal((t, 4, q.shape[-1])).astype(np.float32)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  rows = attn.RaggedRows(jnp.asarray(tables), jnp.asarray(starts), counts, cached)
  xla = attn.ragged_paged_attention(q_TxHxK, k, v, rows, block=4)
  pallas = attn.ragged_paged_attention(q_TxHxK, k, v, rows, block=4, kernel="pallas")
  assert np.isfinite(np.asarray(pallas)).all()
  assert _rel(pallas, xla) < 1e-5
  with pytest.raises(ValueError, match="kernel='triton' is not 'xla', 'pallas' or 'cpu'"):
    attn.ragged_paged_attention(q_TxHxK, k, v, rows, kernel="triton")
