"""An engine on several devices runs the model tensor-parallel (Megatron's layout, as training)."""

import functools
import re

import jax
import numpy as np
import pytest

from jaxpipe.serve.engine import Engine
from tests import helpers


@functools.cache
def _shared(name: str, devices: int) -> Engine:
  """One engine per model and device count for the tests that only read or serve."""
  return _engine(name, devices)


def _engine(name: str, devices: int, **kw) -> Engine:
  # XLA's dots: the tests hold a split engine's tokens to one device's bit for bit, and XLA sums
  # a row-parallel product's halves as one device does (oneDNN's blocking may round them apart;
  # tests/ops/test_matmul.py holds oneDNN over two devices to the oracle's logprobs)
  kw.setdefault("matmul", "xla")
  return Engine(
      helpers.CONFIGS[name],
      helpers.engine_params(name),
      num_pages=33,
      devices=jax.devices()[:devices],
      **helpers.ENGINE_ARGS,
      **kw,
  )


def _collectives(engine: Engine) -> dict[str, int]:
  text = engine.step_program(engine.token_buckets[-1], engine.page_buckets[-1]).as_text()
  ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  return {op: len(re.findall(rf" {op}(-start)?\(", text)) for op in ops}


def test_weights_and_pools_split_and_the_step_holds_megatrons_collectives():
  engine = _shared("dense", 2)
  cfg = helpers.DENSE
  layers = engine.params["layers"][0]  # on CPU each layer's own arrays (`unstack_layers`)
  # column-parallel q (heads), k and v (KV heads), row-parallel o, gate/up/down over d_ff
  for path, dim in (
      (("attn", "q", "kernel"), -2),
      (("attn", "k", "kernel"), -2),
      (("attn", "o", "kernel"), -3),
      (("mlp", "gate", "kernel"), -1),
      (("mlp", "down", "kernel"), -2),
  ):
    leaf = layers
    for key in path:
      leaf = leaf[key]
    local = leaf.addressable_shards[0].data.shape
    assert local[dim] * 2 == leaf.shape[dim], (path, local, leaf.shape)
    assert sum(local) - local[dim] == sum(leaf.shape) - leaf.shape[dim]
  assert engine.params["embed"].addressable_shards[0].data.shape == (cfg.vocab // 2, cfg.d_model)
  assert engine.kv.k.addressable_shards[0].data.shape[0] == cfg.n_kv_heads // 2
  # one all-reduce for the vocabulary-parallel embedding, two in each layer (the attention
  # output and the down projection; on CPU the layers are a loop the HLO holds each of), one
  # all-gather of the wanted rows' logits; nothing else
  assert _collectives(engine) == {
      "all-reduce": 1 + 2 * cfg.n_layers,
      "all-gather": 1,
      "reduce-scatter": 0,
      "all-to-all": 0,
      "collective-permute": 0,
  }


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_on_two_devices_equals_the_recompute_oracle(name):
  """MoE: the dense part split, the experts whole on each device."""
  engine = _shared(name, 2)
  prompts = helpers.prompts(seed=3, n=4)
  outputs = engine.generate(prompts, max_tokens=8, temperature=0.0)
  assert outputs == helpers.oracle(name, prompts, 8)


def test_an_8_bit_cache_splits_its_scales_with_the_heads():
  one, two = _engine("dense", 1, kv_cache_dtype="int8"), _engine("dense", 2, kv_cache_dtype="int8")
  assert two.kv.k_scales.addressable_shards[0].data.shape[0] == helpers.DENSE.n_kv_heads // 2
  prompts = helpers.prompts(seed=4, n=3)
  assert two.generate(prompts, max_tokens=6) == one.generate(prompts, max_tokens=6)


def test_scoring_a_prompt_on_two_devices_equals_one():
  prompt = helpers.prompts(seed=6, n=1)[0]
  one, two = (_shared("dense", n).score(prompt, top_logprobs=2) for n in (1, 2))
  assert one[0] is None and two[0] is None
  for (lp_one, top_one), (lp_two, top_two) in zip(one[1:], two[1:]):
    np.testing.assert_allclose(lp_two, lp_one, rtol=1e-5, atol=1e-6)
    assert [t for t, _ in top_two] == [t for t, _ in top_one]
    np.testing.assert_allclose([p for _, p in top_two], [p for _, p in top_one], rtol=1e-5)


@pytest.mark.parametrize(
    "devices, message",
    [
        (3, "n_heads=4 does not split over the engine's 3 devices"),
        (4, "n_kv_heads=2 does not split over the engine's 4 devices"),
    ],
)
def test_a_model_that_does_not_split_is_refused_before_device_work(devices, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    _engine("dense", devices)
