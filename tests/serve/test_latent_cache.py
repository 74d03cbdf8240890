"""Latent attention served from a latent cache, as FlashMLA and vLLM's MLA backends serve it.

The pages hold one vector per token and layer, its latent c_kv then its rotary key
(`kv_lora_rank + qk_rope_head_dim` values: 576 for DeepSeek-V3's shape), and every step attends
with the key up-projection absorbed into the query and the value up-projection applied after
(`mla.LatentAttention`). Against the training forward pass recomputed over the whole sequence
(`helpers.oracle`, as tests/serve/test_engine.py) and the expanded cache (every head's K and V),
on `helpers.MLA` (DeepSeek-V3's parts) with preemption and a shared prefix: the greedy tokens
on every attention path, the bytes per token, 8-bit latent pages, and a prefill/decode handoff.
"""

import math

import jax
import pytest

from jaxpipe.models import hf
from jaxpipe.serve import Engine
from jaxpipe.serve import model as serve_model
from jaxpipe.serve.deploy import Colocated, Disaggregated
from tests import helpers

CFG, PAGE = helpers.MLA, helpers.PAGE
WIDTH = CFG.mla.kv_lora_rank + CFG.mla.qk_rope_head_dim  # 24: the CPU kernel's multiple of 8


def _engine(**kw):
  params = helpers.engine_params("mla")
  return Engine(CFG, params, num_pages=17, nan_freed_pages=True, **helpers.ENGINE_ARGS, **kw)


def _serve(engine, prompts, max_tokens=10):
  got = helpers.serve_arrivals(engine, prompts, max_tokens=max_tokens, eos_id=None)
  helpers.check_pages(engine)
  return [r.output for r in got]


@pytest.mark.parametrize(
    "cache, backend",
    [
        ("latent", "xla_ragged"),
        ("latent", "cpu_ragged"),
        ("latent", "pallas_ragged"),
        ("latent", "xla"),
        ("expanded", "xla_ragged"),
    ],
)
def test_greedy_tokens_equal_the_recompute_oracle(cache, backend):
  engine = _engine(mla_cache=cache, attention=backend)
  assert engine.backend == backend
  heads, k_width, v_width = (1, WIDTH, 0) if cache == "latent" else (4, 12, 12)
  assert engine.kv.k.shape[::3] == (heads, k_width) and engine.kv.v.shape[::3] == (heads, v_width)
  prompts = helpers.prompts()
  assert _serve(engine, prompts) == helpers.oracle("mla", prompts, 10)
  assert engine.counts["preemptions"] > 0 and engine.counts["cached_tokens"] > 0


def test_bytes_per_token_of_deepseek_v3s_shape():
  """DeepSeek-V3's config.json (transformers' defaults): 576 values per token and layer in the
  latent cache, against 128 heads x 192 for keys and as many for the values zero-padded to
  them in the expanded one (128 x (192 + 128) = 40,960 in an unpadded expanded cache)."""
  v3 = hf.config_from_hf({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
  assert (v3.n_layers, v3.n_heads, v3.first_dense) == (61, 128, 3)
  per_layer = lambda cache, dtype: serve_model.kv_bytes(v3, 1, 1, dtype, mla_cache=cache) // 61
  assert per_layer("latent", "bfloat16") == 576 * 2 == 1152
  assert per_layer("expanded", "bfloat16") == 2 * 128 * 192 * 2 == 98304
  assert per_layer("latent", "int8") == 576 + 8  # a K and a (moot) V scale, float32
  assert per_layer("expanded", "int8") == 128 * (2 * 192 + 8) == 50176
  # the engine's own pools, here: (values, scales) per token slot and layer
  for kind, itemsize, scales in (("auto", 4, 0), ("int8", 1, 8)):
    kv = _engine(kv_cache_dtype=kind).kv
    slots = kv.num_pages * kv.page_size * CFG.n_layers
    assert (kv.k.nbytes + kv.v.nbytes) / slots == WIDTH * itemsize
    if scales:
      assert (kv.k_scales.nbytes + kv.v_scales.nbytes) / slots == scales


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_latent_pages_agree_with_the_float_ones(kind):
  engine = _engine(kv_cache_dtype=kind)
  prompts = helpers.prompts(seed=0, n=12)
  got = _serve(engine, prompts)
  want = helpers.oracle("mla", prompts, 10)
  share = helpers.agreement(got, want)
  first = sum(g[0] == w[0] for g, w in zip(got, want))
  print(f"{kind}: {share:.0%} of greedy tokens before the first divergence, {first}/12 first")
  assert (share, first) >= FLOOR[kind] and first >= FLOOR[kind][1]


# (prefix share, first tokens of 12), measured 77% and 12/12 (int8), 56% and 8/12 (fp8): one
# scale per token spans the whole latent, and e4m3 keeps 3 mantissa bits of each channel
FLOOR = {"int8": (0.75, 11), "fp8": (0.5, 8)}


def test_a_latent_handoff_gives_the_tokens_of_colocated():
  d = jax.devices()
  # XLA's dots, as the oracle's: the test holds tokens bit for bit (oneDNN's rounding may flip a
  # near tie of these random weights)
  kw = dict(num_pages=33, nan_freed_pages=True, matmul="xla", **helpers.ENGINE_ARGS)
  args = (CFG, helpers.engine_params("mla"))
  colo = Colocated(*args, [d[0:1]], **kw)
  dis = Disaggregated(*args, [d[1:2]], [d[2:3]], **kw)
  prompts = helpers.prompts(seed=4, n=6)
  a, b = helpers.run_deployments((colo, dis), prompts, 8)
  assert [r.output for r in a] == [r.output for r in b] == helpers.oracle("mla", prompts, 8)
  per_token = CFG.n_layers * WIDTH * 4  # float32 latents, nothing in the V pool
  for r, p in zip(b, prompts):
    assert r.transfers == 1 and r.kv_bytes == per_token * math.ceil(len(p) / PAGE) * PAGE
