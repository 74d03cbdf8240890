"""Rotary variants against transformers' own rotary embeddings (`modeling_rope_utils` through each
model's RotaryEmbedding and `apply_rotary_pos_emb`), on positions up to the pre-training context
and beyond it: default, linear, dynamic, yarn (with and without DeepSeek's mscale), longrope with
partial rotary (Phi-3.5), llama3."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import rope
from jaxpipe.models.families import FAMILIES, Fields

HEAD_DIM, HEADS, LENGTH = 16, 2, 96
ORIGINAL = 32  # pre-training context of the scaled variants: LENGTH runs past it

# name: (transformers config class, its modeling module, config fields)
VARIANTS = {
    "default": ("LlamaConfig", "llama", {}),
    "linear": ("LlamaConfig", "llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "dynamic": (
        "LlamaConfig",
        "llama",
        dict(
            rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL
        ),
    ),
    "yarn": (
        "LlamaConfig",
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
            },
        ),
    ),
    "yarn_mscale": (
        "LlamaConfig",
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": ORIGINAL,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        ),
    ),
    "longrope": (
        "Phi3Config",
        "phi3",
        dict(
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [2.0, 3.0, 5.0, 8.0],
            },
            original_max_position_embeddings=ORIGINAL,
            max_position_embeddings=4 * ORIGINAL,
            partial_rotary_factor=0.5,
        ),
    ),
    "llama3": (
        "LlamaConfig",
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            }
        ),
    ),
}


def _transformers_rotated(name, length):
  """(q, q rotated by transformers, its config as a dict) for positions 0..length-1."""
  import importlib

  import torch
  import transformers

  config_cls, module, fields = VARIANTS[name]
  config = getattr(transformers, config_cls)(
      vocab_size=64,
      hidden_size=HEADS * HEAD_DIM,
      num_attention_heads=HEADS,
      num_key_value_heads=HEADS,
      head_dim=HEAD_DIM,
      num_hidden_layers=1,
      intermediate_size=32,
      **fields,
  )
  modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
  embedding = getattr(modeling, f"{config_cls[: -len('Config')]}RotaryEmbedding")(config)
  q = np.random.default_rng(0).standard_normal((1, HEADS, length, HEAD_DIM)).astype(np.float32)
  positions = torch.arange(length)[None]
  with torch.no_grad():
    cos, sin = embedding(torch.tensor(q), positions)
    rotated, _ = modeling.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(q), cos, sin)
  return q, rotated.numpy(), config.to_dict()


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("length", [ORIGINAL // 2, LENGTH])
def test_rotation_equals_transformers(name, length):
  q, want, hf = _transformers_rotated(name, length)
  family = FAMILIES[hf["model_type"]]
  cfg = family.read(Fields(hf, family.model_type, family.defaults))
  q_BxLxHxK = np.swapaxes(q, 1, 2)
  got = rope.apply(
      q_BxLxHxK,
      np.arange(length),
      cfg.rope_theta,
      rope.scaling_of(cfg.rope_scaling),
      cfg.rotary_dim,
  )
  np.testing.assert_allclose(np.swapaxes(np.asarray(got), 1, 2), want, rtol=2e-5, atol=2e-5)
  if name != "default":  # the variant moved the angles: the default rotation is another one
    plain = rope.apply(q_BxLxHxK, np.arange(length), cfg.rope_theta, None, cfg.rotary_dim)
    if name not in ("dynamic", "longrope") or length > ORIGINAL:
      assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 1e-3


def test_length_dependent_variants_switch_past_the_original_context():
  """longrope takes its long factors, and dynamic a grown base, exactly past the length."""
  s = rope.RopeScaling(
      "longrope",
      factor=4.0,
      original_max_position=32,
      short_factor=(1.0, 2.0),
      long_factor=(4.0, 8.0),
  )
  short, _ = rope.inverse_frequencies(10_000.0, 4, s, np.int32(32))
  long, _ = rope.inverse_frequencies(10_000.0, 4, s, np.int32(33))
  np.testing.assert_allclose(np.asarray(short) / np.asarray(long), [4.0, 4.0], rtol=1e-6)
  d = rope.RopeScaling("dynamic", factor=2.0, max_position=32)
  at, _ = rope.inverse_frequencies(10_000.0, 4, d, np.int32(32))
  past, _ = rope.inverse_frequencies(10_000.0, 4, d, np.int32(64))
  np.testing.assert_array_equal(
      np.asarray(at), rope.frequencies(10_000.0, 4, rope.RopeScaling())[0]
  )
  assert np.asarray(past)[1] < np.asarray(at)[1]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(type="ntk"), "rope type 'ntk' is not implemented"),
        (dict(type="llama3", factor=8.0), "needs low_freq_factor, high_freq_factor"),
        (
            dict(
                type="longrope",
                factor=2.0,
                original_max_position=8,
                short_factor=[1.0],
                long_factor=[1, 2],
            ),
            "one entry per rotary channel pair",
        ),
    ],
)
def test_bad_variants_are_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    rope.RopeScaling(**fields)


def test_cos_and_sin_are_computed_once_per_angle_not_per_head():
  """Compiled for the CPU, a rotation of many heads evaluates cos and sin on the [L, d/2]
  angles alone (inside a conditional), never inside the fusion that rotates [L, H, d/2]
  values; and gives the plain expression's values exactly, in a program that is differentiated
  and vmapped too."""
  inv = rope.inverse_frequencies(10000.0, HEAD_DIM, rope.RopeScaling(), None)[0]
  x = np.random.default_rng(0).standard_normal((2, LENGTH, 9, HEAD_DIM)).astype(np.float32)
  positions = np.arange(LENGTH, dtype=np.int32)
  fn = jax.jit(lambda x, p: rope.rotate(x, p, inv))
  hlo = fn.lower(x, positions).compile().as_text()
  # Where cos or sin runs: a fused one runs once per element of the fusion that calls it (its
  # outputs' shapes), an unfused one once per element of its own result.
  size = lambda dims: int(np.prod([int(n) for n in dims.split(",") if n]))
  bodies = dict(re.findall(r"^%(\S+) \(.*?\n((?:.*\n)*?)\}", hlo, re.M))
  trig = {name: body for name, body in bodies.items() if re.search(r" (?:cosine|sine)\(", body)}
  fusions = {c: out for out, c in re.findall(r"= (\S+|\(.*?\)) fusion\(.*calls=%([^,\s]+)", hlo)}
  sizes = []
  for name, body in trig.items():
    if name in fusions:
      sizes += [size(dims) for dims in re.findall(r"f32\[([0-9,]*)\]", fusions[name])]
    else:
      sizes += [size(d) for d in re.findall(r"= f32\[([0-9,]*)\]\S* (?:cosine|sine)\(", body)]
  assert sizes and set(sizes) == {LENGTH * HEAD_DIM // 2}, sizes  # the angles', not [L, 9, d/2]

  angle = positions.astype(np.float32)[:, None] * np.asarray(inv)
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
  want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  np.testing.assert_array_equal(np.asarray(fn(x, positions)), want)
  grad = jax.grad(lambda x: jnp.sum(rope.rotate(x, positions, inv) ** 2))(x)
  np.testing.assert_allclose(np.asarray(grad), 2 * x, rtol=1e-5, atol=1e-5)  # a rotation
  per_row = jax.vmap(lambda x, p: rope.rotate(x[None], p, inv)[0])(x, np.stack([positions] * 2))
  np.testing.assert_array_equal(np.asarray(per_row), want)
