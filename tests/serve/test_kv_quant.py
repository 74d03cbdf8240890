"""The 8-bit KV cache (kv_cache_dtype 'int8' / 'fp8'): its bytes, its attention error against
the float cache within a bound derived from the rounding of each format, greedy agreement with
the float cache over a small workload, and a disaggregated handoff of int8 pages.
"""

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxpipe.ops.attention import RaggedRows
from jaxpipe.serve import Engine
from jaxpipe.serve import model as serve_model
from jaxpipe.serve.deploy import Colocated, Disaggregated
from tests import helpers

CFG, PAGE = helpers.DENSE, helpers.PAGE


def bytes_per_token(kv) -> tuple[float, float]:
  """(value bytes, scale bytes) per token slot of every layer, from the arrays themselves."""
  slots = kv.num_pages * kv.page_size
  values = (kv.k.nbytes + kv.v.nbytes) / slots
  scales = 0 if kv.k_scales is None else (kv.k_scales.nbytes + kv.v_scales.nbytes) / slots
  return values, scales


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_an_8bit_cache_is_a_half_or_a_quarter_of_the_float_one_plus_scales(dtype, ratio, kind):
  cfg = dataclasses.replace(CFG, dtype=dtype)
  base = serve_model.init_kv(cfg, 5, PAGE)
  quant = serve_model.init_kv(cfg, 5, PAGE, kv_cache_dtype=kind)
  (float_values, none), (values, scales) = bytes_per_token(base), bytes_per_token(quant)
  assert none == 0 and values * ratio == float_values
  assert scales == 2 * cfg.n_layers * cfg.n_kv_heads * 4  # one float32 per K/V, layer, head
  assert values == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # one byte per element
  total = (values + scales) * 5 * PAGE
  assert serve_model.kv_bytes(cfg, 5, PAGE, kv_cache_dtype=kind) == total
  assert serve_model.kv_bytes(cfg, 5, PAGE) == float_values * 5 * PAGE


def rounding_bound(x_TxGxK: np.ndarray, kind: str) -> np.ndarray:
  """The largest |x - dequantised x| each element can have: int8 rounds x / s (s = absmax / 127)
  to an integer, off by at most s / 2; float8_e4m3fn keeps 3 mantissa bits, so a normal value
  is off by at most 2^-4 of itself, a subnormal (below 2^-6 after scaling by 448 / absmax) by
  half its spacing 2^-9, i.e. 2^-10 * absmax / 448."""
  top = np.abs(x_TxGxK).max(-1, keepdims=True)
  if kind == "int8":
    return np.broadcast_to(top / 254, x_TxGxK.shape)
  return np.maximum(np.abs(x_TxGxK) / 16, top / 448 * 2.0**-10)


def attention_bound(q_TxHxK, k_TxGxK, v_TxGxK, kind) -> np.ndarray:
  """Bound on |o_8bit - o_float| per (query token, head), causal over one sequence.

  With logits s_j = q.k_j / sqrt(d) moved by at most eps = max_j sum_k |q_k| dk_jk / sqrt(d),
  each softmax weight moves by a factor within [e^-2eps, e^2eps], so sum_j |p'_j - p_j| <=
  e^(2 eps) - 1; and o' - o = sum_j p'_j (v'_j - v_j) + sum_j (p'_j - p_j) v_j, hence
  |o' - o| <= max_j |dv_j| + (e^(2 eps) - 1) max_j |v_j|.
  """
  t, h, d = q_TxHxK.shape
  g = k_TxGxK.shape[1]
  dk, dv = rounding_bound(k_TxGxK, kind), rounding_bound(v_TxGxK, kind)
  out = np.zeros((t, h))
  for i in range(t):
    for head in range(h):
      kv_head = head // (h // g)
      eps = (np.abs(q_TxHxK[i, head]) * dk[: i + 1, kv_head]).sum(-1).max() / math.sqrt(d)
      vmax = np.abs(v_TxGxK[: i + 1, kv_head]).max()
      out[i, head] = dv[: i + 1, kv_head].max() + np.expm1(2 * eps) * vmax
  return out


@pytest.mark.parametrize(
    "kind, backend",
    [
        ("int8", "xla"),
        ("fp8", "xla"),
        ("int8", "pallas"),
        ("int8", "xla_ragged"),
        ("fp8", "xla_ragged"),
    ],
)
def test_attention_over_an_8bit_cache_is_within_the_rounding_bound(kind, backend):
  """One 11-token sequence written and attended through pages [5, 2, 7] of pools whose every
  other slot (and scale) is NaN; pallas: the kernel, interpreted; xla_ragged: the tokens as one
  row."""
  rng = np.random.default_rng(0)
  t, h, g, d = 11, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
  q, k, v = (rng.standard_normal((t, n, d)).astype(np.float32) for n in (h, g, g))
  table = np.asarray([5, 2, 7], np.int32)
  pos = np.arange(t)
  if backend == "xla_ragged":  # one row of t tokens, nothing cached before
    rows = RaggedRows(*(np.asarray(x, np.int32) for x in (table[None], [0], [t], [0])))
  else:
    rows = (np.tile(table, (t, 1)), pos + 1)
  args = (table[pos // PAGE] * PAGE + pos % PAGE, rows, 0)
  nan = float("nan")
  outs = {}
  for name in ("auto", kind):
    kv = serve_model.init_kv(CFG, 8, PAGE, fill=nan, kv_cache_dtype=name)
    o, pools = jax.jit(serve_model._write_and_attend, static_argnames="backend")(
        q, k, v, kv.pools, *args, backend=backend
    )
    outs[name] = np.asarray(o)
  # what was stored: each written value dequantised is within its rounding bound of the input
  values_GxPxSxK, _, scales_GxPxS, _ = (np.asarray(x, np.float32) for x in pools)
  pages, slots = table[pos // PAGE], pos % PAGE
  stored_TxGxK = np.swapaxes(
      values_GxPxSxK[:, pages, slots] * scales_GxPxS[:, pages, slots, None], 0, 1
  )
  top_TxGx1 = np.abs(k).max(-1, keepdims=True)
  assert np.all(np.abs(stored_TxGxK - k) <= rounding_bound(k, kind) + 1e-6 * top_TxGx1)
  err_TxH = np.abs(outs[kind] - outs["auto"]).max(-1)
  bound_TxH = attention_bound(q, k, v, kind)
  slack = 1e-5 * np.abs(outs["auto"]).max()  # float32 arithmetic of the two paths
  ratio = err_TxH.max() / bound_TxH[err_TxH.argmax() // h, err_TxH.argmax() % h]
  print(f"{kind} {backend}: max error {err_TxH.max():.2e}, {ratio:.2f} of its bound")
  assert np.all(np.isfinite(outs[kind]))
  assert np.all(err_TxH <= bound_TxH + slack)
  assert err_TxH.max() > 1e-4  # the values really went through 8 bits


# -- engines ------------------------------------------------------------------------------------

# Greedy agreement with the float cache over helpers.prompts(seed=0, n=12), 10 tokens each
# (measured: int8 88% of tokens before each request's first divergence and 11 of 12 first
# tokens; fp8 38% and 11 of 12). The model is random with unit-scale weights, so its top two
# logits are often close and one flipped token changes every later one: the prefix share is
# the strict measure, the first token (decided by the prompt alone, no cascade) the per-decision
# one. E4M3 keeps 3 mantissa bits (up to 6% per element) against int8's 1/254 of the head's
# maximum, hence the lower fp8 floor. The floors leave room for another CPU's float rounding;
# they catch a cache that is broken outright, while the rounding of every stored value is
# checked exactly above.
AGREEMENT_FLOOR = {"int8": (0.75, 11), "fp8": (0.3, 10)}  # (prefix share, first tokens of 12)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_greedy_agreement_with_the_float_cache(kind):
  engine = Engine(
      CFG,
      helpers.engine_params("dense"),
      num_pages=17,
      nan_freed_pages=True,
      kv_cache_dtype=kind,
      **helpers.ENGINE_ARGS,
  )
  prompts = helpers.prompts(seed=0, n=12)
  got = engine.generate(prompts, max_tokens=10)
  want = helpers.oracle("dense", prompts, 10)  # the float cache's tokens (test_engine)
  share = helpers.agreement(got, want)
  first = sum(g[0] == w[0] for g, w in zip(got, want))
  print(f"{kind}: {share:.0%} of greedy tokens before the first divergence, {first}/12 first")
  assert engine.counts["preemptions"] > 0
  assert (share, first) >= AGREEMENT_FLOOR[kind] and first >= AGREEMENT_FLOOR[kind][1]


def test_an_int8_handoff_gives_the_tokens_of_colocated_int8():
  d = jax.devices()
  # XLA's dots: they sum a row-parallel product split over two devices as one device does, so
  # the tokens depend on the handoff alone (oneDNN's blocking may round the halves apart)
  kw = dict(num_pages=33, nan_freed_pages=True, kv_cache_dtype="int8", **helpers.ENGINE_ARGS)
  kw["matmul"] = "xla"
  args = (CFG, helpers.engine_params("dense"))
  colo = Colocated(*args, [d[0:1]], **kw)
  dis = Disaggregated(*args, [d[1:2]], [d[2:4]], **kw)  # decode splits KV heads (and scales)
  prompts = helpers.prompts(seed=4, n=6)
  a, b = helpers.run_deployments((colo, dis), prompts, 8)
  assert [r.output for r in a] == [r.output for r in b]
  per_token = 2 * CFG.n_layers * CFG.n_kv_heads * (CFG.head_dim + 4)  # int8 values + scales
  for r, p in zip(b, prompts):
    assert r.transfers == 1 and r.kv_bytes == per_token * math.ceil(len(p) / PAGE) * PAGE


def test_a_bad_cache_dtype_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not one of \['auto'"):
    Engine(CFG, helpers.engine_params("dense"), kv_cache_dtype="int4")
  d = jax.devices()
  with pytest.raises(ValueError, match="must share kv_cache_dtype"):
    Disaggregated(
        CFG,
        helpers.engine_params("dense"),
        [d[0:1]],
        [d[1:2]],
        prefill_kwargs=dict(kv_cache_dtype="int8"),
    )


def test_bfloat16_serving_keeps_weights_and_pages_in_bfloat16_on_every_kernel():
  """serve --dtype bfloat16: weights cast once, pools bfloat16, and the same greedy tokens from
  the CPU kernel (which reads the pools' bits in place) and the XLA path; the logits are the
  model's in bfloat16: within its rounding of the float32 ones, and not equal to them."""
  from jaxpipe.serve import __main__ as serve_main

  cfg, params = serve_main.in_dtype(CFG, helpers.engine_params("dense"), "bfloat16")
  assert cfg.dtype == "bfloat16" and {x.dtype for x in jax.tree.leaves(params)} == {
      np.dtype("bfloat16")
  }
  prompts = helpers.prompts(seed=4, n=6)
  outs = {}
  for attention in ("cpu_ragged", "xla_ragged"):
    engine = Engine(cfg, params, num_pages=17, attention=attention, **helpers.ENGINE_ARGS)
    assert engine.kv.dtype == np.dtype("bfloat16") and engine.backend == attention
    outs[attention] = engine.generate(prompts, max_tokens=8)
  assert outs["cpu_ragged"] == outs["xla_ragged"]
  kv = serve_model.init_kv(cfg, 9, PAGE)
  got, _ = serve_model.prefill(cfg, params, kv, prompts[0], 0, list(range(1, 9)))
  want, _ = serve_model.prefill(
      CFG, helpers.engine_params("dense"), serve_model.init_kv(CFG, 9, PAGE), prompts[0], 0,
      list(range(1, 9)),
  )  # fmt: skip
  # bfloat16 keeps 8 bits of mantissa (2^-9 relative rounding): through the two layers' dozen
  # rounded products of unit-scale random weights the logits move by a few percent, not more
  err = float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())
  assert 1e-4 < err < 6e-2
