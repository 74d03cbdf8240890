"""The CPU paged-attention kernel (`kernels_cpu.paged_attention`, XLA FFI) against the per-token
gather reference, its errors, the rule that picks it, and the engine on it against the recompute
oracle.

`paged_attention_reference` gathers every token's pages and takes one softmax with XLA; the
kernel reads the pages in place with an online softmax over chunks of 128 keys, its own
exponential, and scores summed in another order: the two agree to a relative 1e-5 of the
output's scale. Slots no row owns, and the unwritten tail of each row's last page, hold NaN, so
a key read outside a row's positions would show. The tests need a C++ compiler; without one on
PATH they skip (and the engine runs xla_ragged), but a compiler whose build fails fails them.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.ops import attention as attn
from jaxpipe.ops.attention import ragged_paged_attention
from jaxpipe.serve import model as serve_model
from kernels_cpu import paged_attention as cpu_pa
from kernels_pallas.paged_attention import paged_attention_reference
from tests import helpers

pytestmark = [
    pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "c++")) is None,
        reason="no C++ compiler on PATH: the CPU kernel cannot be built here",
    ),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a kernel for the CPU platform"),
]


def _check(q, k, v, rows, tables_T, lengths_T, live, **scales):
  fn = jax.jit(ragged_paged_attention, static_argnames=("kernel", "softcap"))
  got = np.asarray(fn(q, k, v, rows, kernel="cpu", **scales))
  want = np.asarray(paged_attention_reference(q, k, v, tables_T, lengths_T, **scales))
  assert np.isfinite(want[:live]).all()
  scale = np.abs(want[:live]).max()
  np.testing.assert_allclose(got[:live], want[:live], rtol=1e-5, atol=1e-5 * scale)
  assert (got[live:] == 0).all()  # tokens of no row


def test_kernel_equals_the_gather_reference_on_the_ragged_case():
  """The xla_ragged tests' step: a chunk ending mid-page, decode rows (one at a page's first
  slot), a chunk over a cached prefix, a prefix-cache hit sharing pages with another row,
  padding rows and tokens; 3 query heads per KV head, head dim 16 (one register block)."""
  q, k, v, rows, tables_T, lengths_T, live = helpers.ragged_case()
  _check(q, k, v, rows, tables_T, lengths_T, live)


@pytest.mark.parametrize(
    "page_size, kv_heads, heads, head_dim",
    [(16, 4, 8, 32), (8, 2, 2, 64), (16, 1, 4, 48), (4, 2, 8, 40)],
)
def test_kernel_equals_the_gather_reference_over_many_chunks(page_size, kv_heads, heads, head_dim):
  """Contexts of several 128-key chunks, rows longer than a work item's 64 tokens (several
  tiles), prefills with and without a cached prefix (a tile's queries starting mid-chunk),
  decode rows; one to four query heads per KV head (so both the transposed and the key-by-key
  scores run); head dims of 1 to 8 register blocks and not a multiple of 32 (48, 40)."""
  rng = np.random.default_rng(page_size + head_dim)
  seqs = [(0, 150), (37, 1), (0, 3), (300, 1), (70, 45), (250, 17), (0, 1), (5, 60)]
  k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
      seqs, page_size, kv_heads, head_dim, rng, rows=11, tokens=live_pad(seqs)
  )
  q = rng.standard_normal((tables_T.shape[0], heads, head_dim)).astype(np.float32)
  _check(q, k, v, rows, tables_T, lengths_T, live)


@pytest.mark.parametrize("cached", [0, 21])
def test_kernel_equals_the_gather_reference_on_a_lone_prompt(cached):
  """One prompt of 50 tokens and one KV head: too few 64-token work items to share among the
  threads, so the call takes 16-token ones (several tiles of one row); keys transposed 16 at a
  time and a last chunk's keys past a multiple of 16 (page size 8)."""
  rng = np.random.default_rng(cached)
  seqs = [(cached, 50)]
  k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
      seqs, 8, 1, 64, rng, rows=2, tokens=live_pad(seqs)
  )
  q = rng.standard_normal((tables_T.shape[0], 4, 64)).astype(np.float32)
  _check(q, k, v, rows, tables_T, lengths_T, live)


def test_work_items_take_64_tokens_unless_too_few_to_share():
  """Rows cut into 64-token items, or 16-token ones where the 64-token items would be fewer
  than 4 a thread: a lone 50-token prompt under one KV head (1 such item) takes 4, and 32
  prompts of 256 tokens under 8 KV heads (1,024 such items) take 1,024."""
  rng = np.random.default_rng(0)
  fn = jax.jit(ragged_paged_attention, static_argnames=("kernel",))
  for seqs, kv_heads, want in (([(0, 50)], 1, 4), ([(0, 256)] * 32, 8, 32 * 4 * 8)):
    k, v, rows, tables_T, *_ = helpers.ragged_pages(seqs, 16, kv_heads, 16, rng)
    q = rng.standard_normal((tables_T.shape[0], kv_heads, 16)).astype(np.float32)
    before = cpu_pa.work_items()
    jax.block_until_ready(fn(q, k, v, rows, kernel="cpu"))
    assert cpu_pa.work_items() - before == want


@pytest.mark.parametrize("window, softcap", [(5, 0.0), (150, 2.0), (1, 0.0), (0, 1.5)])
def test_kernel_with_a_window_and_softcap_equals_the_gather_reference(window, softcap):
  """Sliding windows (a traced one, as a layer of a mixed stack passes it) from the token alone
  to longer than a chunk, and soft-capped scores, float32 and int8: the keys before each row's
  window are NaN, as freed pages given to another sequence would be, and never reach it."""
  rng = np.random.default_rng(window)
  seqs = [(0, 150), (37, 1), (0, 3), (300, 1), (70, 45), (250, 17), (0, 1), (5, 60)]
  k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
      seqs, 16, 2, 32, rng, rows=11, tokens=live_pad(seqs), window=window
  )
  q = rng.standard_normal((tables_T.shape[0], 6, 32)).astype(np.float32)
  _check(q, k, v, rows, tables_T, lengths_T, live, window=window, softcap=softcap)
  (k8, k_s), (v8, v_s) = _int8(k), _int8(v)
  scales = dict(k_scales_GxPxS=k_s, v_scales_GxPxS=v_s, window=window, softcap=softcap)
  _check(q, k8, v8, rows, tables_T, lengths_T, live, **scales)


@pytest.mark.parametrize("head_dim", [32, 48])
def test_kernel_on_bfloat16_pages_equals_the_gather_reference(head_dim):
  """A bfloat16 cache (serve --dtype bfloat16): both sides widen the same stored values; decode
  rows read the pages in place, prefills a float copy; head dims of whole 32-channel blocks and
  not (48)."""
  rng = np.random.default_rng(1)
  seqs = [(0, 150), (37, 1), (70, 45), (129, 17), (0, 1)]
  k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(seqs, 16, 2, head_dim, rng, rows=7)
  q = rng.standard_normal((tables_T.shape[0], 4, head_dim)).astype(np.float32)
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  _check(q, bf16(k), bf16(v), rows, tables_T, lengths_T, live, window=40, softcap=3.0)
  assert attn.resolve_step_backend("auto", 32, 16, jnp.bfloat16) == "cpu_ragged"


@pytest.mark.parametrize("head_dim", [64, 48])
def test_bfloat16_queries_on_bfloat16_pages_score_as_bfloat16_dot_products(head_dim):
  """A bfloat16 model's step: queries of bfloat16 values over a bfloat16 cache. Every tile
  scores its keys as bfloat16 dot products, whose products are exact as float32's: prefills'
  tiles from transposed keys, decode rows' few query vectors from the rows in place (16 keys'
  sums reduced together, a row's last keys a partial group). The result equals the gather
  reference to float32's rounding, windows, soft caps and stale NaN keys included. Queries that
  are not all bfloat16 values keep the float32 scores (the items counted do not move)."""
  if cpu_pa.bf16_score_items() is None:
    pytest.skip("the kernel's bfloat16 scores are built only for a CPU with AVX512_BF16")
  rng = np.random.default_rng(2)
  seqs = [(0, 150), (37, 1), (70, 45), (129, 17), (0, 1), (3, 40)]
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  before = cpu_pa.bf16_score_items()
  for window, softcap in ((0, 0.0), (40, 3.0)):  # with a window, the keys before it are NaN
    k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
        seqs, 16, 3, head_dim, rng, rows=8, window=window
    )
    q = rng.standard_normal((tables_T.shape[0], 9, head_dim)).astype(np.float32)
    q_bf16 = np.asarray(bf16(q), np.float32)
    kw = dict(window=window, softcap=softcap)
    _check(q_bf16, bf16(k), bf16(v), rows, tables_T, lengths_T, live, **kw)
  taken = cpu_pa.bf16_score_items() - before
  # every tile: 150, 1, 45, 17, 1 and 40 tokens in tiles of 16 (10 + 1 + 3 + 2 + 1 + 3) x 3
  # KV heads, twice
  assert taken == 2 * 3 * (10 + 1 + 3 + 2 + 1 + 3)
  _check(q, bf16(k), bf16(v), rows, tables_T, lengths_T, live, **kw)
  assert cpu_pa.bf16_score_items() - before == taken


def _int8(pages):
  """An 8-bit cache of float pages: int8 values and a float32 scale per (head, page, slot), the
  engine's rounding (`serve.model.quantize`); NaN scales in the slots no row owns."""
  unowned = np.isnan(pages[..., 0])
  x = np.nan_to_num(pages)
  scale = np.abs(x).max(axis=-1) / 127
  values = np.round(x / np.where(scale > 0, scale, 1.0)[..., None])
  scale[unowned] = np.nan
  return values.astype(np.int8), scale.astype(np.float32)


@pytest.mark.parametrize("page_size, heads, head_dim", [(4, 6, 16), (16, 8, 32), (8, 2, 48)])
def test_kernel_on_int8_pages_equals_the_gather_reference(page_size, heads, head_dim):
  """An 8-bit cache: both sides dequantise the same stored values (scale times int8); the
  ragged tests' step and a multi-chunk one, both score paths, head dims of 2 to 6 blocks."""
  rng = np.random.default_rng(head_dim)
  if page_size == 4:
    q, k, v, rows, tables_T, lengths_T, live = helpers.ragged_case()
  else:
    seqs = [(0, 150), (37, 1), (70, 45), (129, 17), (0, 1)]
    k, v, rows, tables_T, lengths_T, live = helpers.ragged_pages(
        seqs, page_size, 2, head_dim, rng, rows=7
    )
    q = rng.standard_normal((tables_T.shape[0], heads, head_dim)).astype(np.float32)
  (k8, k_s), (v8, v_s) = _int8(k), _int8(v)
  _check(q, k8, v8, rows, tables_T, lengths_T, live, k_scales_GxPxS=k_s, v_scales_GxPxS=v_s)


def live_pad(seqs) -> int:
  """The step's token count: its tokens plus 13 of padding."""
  return sum(n for _, n in seqs) + 13


def test_kernel_refuses_a_page_outside_the_pool():
  """A block table entry past the pool's pages is an error naming the row and the page, not a
  read of memory outside the pool."""
  rng = np.random.default_rng(0)
  k, v, rows, _, _, _ = helpers.ragged_pages([(3, 2), (0, 4)], 4, 2, 16, rng)
  tables = rows.tables_BxN.copy()
  tables[1, 0] = k.shape[1] + 5
  q = rng.standard_normal((6, 4, 16)).astype(np.float32)
  pool = k.shape[1]
  message = rf"row 1 reads page {pool + 5}, outside the pool's {pool}(\D|$)"
  with pytest.raises(Exception, match=message):
    np.asarray(ragged_paged_attention(q, k, v, rows._replace(tables_BxN=tables), kernel="cpu"))


def test_kernel_refuses_rows_that_share_a_token():
  """Two rows that claim the same flat token would both write its output: an error naming it."""
  rng = np.random.default_rng(0)
  k, v, rows, _, _, _ = helpers.ragged_pages([(3, 2), (0, 4)], 4, 2, 16, rng)
  starts = rows.starts_B.copy()
  starts[1] = 1  # row 0 holds tokens 0 and 1
  q = rng.standard_normal((6, 4, 16)).astype(np.float32)
  with pytest.raises(Exception, match=r"row 1 holds token 1, which another row holds too"):
    np.asarray(ragged_paged_attention(q, k, v, rows._replace(starts_B=starts), kernel="cpu"))


def test_the_built_library_is_readable_by_whoever_shares_the_cache():
  """The library is written through a private temporary file and renamed: its mode must still
  let another user of a shared $JAXPIPE_KERNEL_CACHE load it."""
  assert cpu_pa.build().stat().st_mode & 0o044 == 0o044


def test_kernel_refuses_quantised_pools_and_odd_head_dims():
  rng = np.random.default_rng(0)
  k, v, rows, _, _, _ = helpers.ragged_pages([(0, 4)], 4, 1, 16, rng)
  q = rng.standard_normal((4, 2, 16)).astype(np.float32)
  with pytest.raises(ValueError, match="float32, bfloat16 or int8 pools, not float8_e4m3fn"):
    fp8 = np.zeros(k.shape, jnp.float8_e4m3fn)
    cpu_pa.ragged_paged_attention(q, fp8, fp8, *rows, sm_scale=1.0)
  with pytest.raises(ValueError, match="scales with int8 pools, and only then"):
    int8 = np.zeros(k.shape, np.int8)
    cpu_pa.ragged_paged_attention(q, int8, int8, *rows, sm_scale=1.0)
  with pytest.raises(ValueError, match="multiple of 8, not 12"):
    cpu_pa.ragged_paged_attention(q[..., :12], k[..., :12], v[..., :12], *rows, sm_scale=1.0)
  scales = np.ones(k.shape[:3], np.float32)
  with pytest.raises(ValueError, match="scales with int8 pools, and only then"):
    ragged_paged_attention(q, k, v, rows, kernel="cpu", k_scales_GxPxS=scales)


def test_auto_picks_the_kernel_on_cpu_for_float32_and_int8_pools_only():
  """The rule docs/serving.md states: a serving step on CPU runs cpu_ragged for a float32 or
  int8 cache, xla_ragged for an fp8 one or a head dim the kernel does not take; naming
  cpu_ragged for those is an error that names the fix."""
  assert attn.resolve_step_backend("auto", 32, 16) == "cpu_ragged"
  assert attn.resolve_step_backend("auto", 32, 16, jnp.int8) == "cpu_ragged"
  assert attn.resolve_step_backend("auto", 32, 16, jnp.float8_e4m3fn) == "xla_ragged"
  assert attn.resolve_step_backend("auto", 12, 16) == "xla_ragged"
  assert attn.resolve_step_backend("xla_ragged", 32, 16) == "xla_ragged"
  with pytest.raises(ValueError, match="int8 pools, not float8_e4m3fn.*use 'xla_ragged'"):
    attn.resolve_step_backend("cpu_ragged", 32, 16, jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="multiple of 8, not 12"):
    attn.resolve_step_backend("cpu_ragged", 12, 16)
  with pytest.raises(ValueError, match="takes rows of tokens"):
    q, k = np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 4, 8), np.float32)
    tables, lengths = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    attn.paged_attention(q, k, k, tables, lengths, backend="cpu_ragged")


def test_auto_falls_back_and_says_why_when_the_kernel_cannot_build(monkeypatch, tmp_path):
  """No compiler: build() names the missing one, and auto runs xla_ragged with a warning that
  carries the reason."""
  monkeypatch.setenv("CXX", "no-such-compiler-jaxpipe")
  monkeypatch.setenv("JAXPIPE_KERNEL_CACHE", str(tmp_path))
  with pytest.raises(FileNotFoundError, match="no C.. compiler 'no-such-compiler-jaxpipe'"):
    cpu_pa.build()
  reason = "no C++ compiler 'no-such-compiler-jaxpipe' on PATH (test)"
  monkeypatch.setattr(cpu_pa, "unavailable", lambda: reason)
  with pytest.warns(RuntimeWarning, match=r"CPU kernel is unavailable \(no C\+\+ compiler"):
    assert attn.resolve_step_backend("auto", 32, 16) == "xla_ragged"


@pytest.mark.parametrize("name, devices", [("dense", 1), ("dense", 2), ("moe", 1)])
def test_engine_on_the_kernel_equals_recompute_oracle(name, devices):
  """The engine on cpu_ragged: preemption, prefix hits, copy-on-write and NaN in freed pages,
  the dense model with its KV heads on one device and split over two (the kernel called per
  device), and the MoE model."""
  # over two devices XLA's dots, which round a row-parallel product's halves as one device's sum
  # (tests/ops/test_matmul.py holds oneDNN's over two devices to the oracle's logprobs)
  matmul = "xla" if devices > 1 else "auto"
  engine = helpers.ragged_engine("cpu_ragged", devices, name, matmul=matmul)
  prompts = helpers.prompts()
  got = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=None)
  assert [r.output for r in got] == helpers.oracle(name, prompts, 10)
  assert engine.counts["preemptions"] > 0 and engine.counts["cached_tokens"] > 0
  assert engine.counts["page_copies"] > 0


@pytest.mark.parametrize("name", ["gemma", "sliding"])
def test_engine_on_the_kernel_keeps_rings_for_sliding_layers(name):
  """The engine on cpu_ragged with sliding-window layers: rings overwritten past the window
  (40-token sequences, 24-slot rings), NaN in freed pages; the pools hold a full layer's pages
  for the context and a ring layer's for its rings only (none of the context's when every
  layer slides), as kv_bytes counts them."""
  engine = helpers.ragged_engine("cpu_ragged", 1, name)
  prompts = helpers.prompts()
  got = helpers.serve_arrivals(engine, prompts, max_tokens=10, eos_id=None)
  assert [r.output for r in got] == helpers.oracle(name, prompts, 10)
  cfg = helpers.CONFIGS[name]
  per_page = 2 * cfg.n_kv_heads * cfg.head_dim * 4 * 4  # K and V, float32, 4 slots
  rings, window_pages = 2, 1 + 4 * 6  # gemma's layers 0 and 2, or both of sliding's
  pools = engine.kv.k.nbytes + engine.kv.v.nbytes
  assert pools == per_page * ((cfg.n_layers - rings) * engine.num_pages + rings * window_pages)
  assert pools == serve_model.kv_bytes(cfg, engine.num_pages, 4, window_pages=window_pages)
