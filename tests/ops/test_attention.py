"""Attention backend registry: each backend equals the XLA reference; bad requests fail clearly."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpipe.ops import attention as attn


def _qkv(batch=2, seq=24, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim)).astype(dtype)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim)).astype(dtype)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim)).astype(dtype)
  return q, k, v


def _rel(a, b) -> float:
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("causal", [True, False])
def test_pallas_and_auto_match_xla(causal):
  q, k, v = _qkv()
  want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  for backend in ("pallas", "auto", "xla"):
    got = jax.jit(functools.partial(attn.attention, causal=causal, backend=backend))(q, k, v)
    assert _rel(got, want) < 1e-5, backend


def test_segment_ids_pallas_matches_xla_with_gradients():
  q, k, v = _qkv(seq=20)
  seg = jnp.array([[0] * 8 + [1] * 12, [0] * 20], jnp.int32)
  loss = lambda backend: jax.jit(
      jax.value_and_grad(
          lambda q, k, v: jnp.sum(
              jnp.sin(attn.attention(q, k, v, backend=backend, segment_ids=seg))
          ),
          argnums=(0, 1, 2),
      )
  )
  (lp, gp), (lx, gx) = loss("pallas")(q, k, v), loss("xla")(q, k, v)
  # Oracle for the mask itself: two documents computed separately.
  first = jax.nn.dot_product_attention(q[:1, :8], k[:1, :8], v[:1, :8], is_causal=True)
  out = attn.attention(q, k, v, backend="xla", segment_ids=seg)
  assert _rel(out[:1, :8], first) < 1e-5
  assert abs(float(lp - lx)) < 1e-5 * abs(float(lx))
  for a, b in zip(gp, gx):
    assert _rel(a, b) < 1e-5


def test_auto_is_xla_off_gpu():
  q, k, v = _qkv()
  assert jax.default_backend() == "cpu"
  assert attn.resolve_backend("auto", q, k, v) == "xla"


def test_auto_on_gpu_picks_fastest_that_serves(monkeypatch):
  monkeypatch.setattr(attn, "_gpu_major", lambda: 9)
  bf16 = _qkv(head_dim=128, dtype=jnp.bfloat16)
  assert attn.resolve_backend("auto", *bf16) == "cudnn"
  assert attn.resolve_backend("auto", *bf16, segment_ids=jnp.zeros((2, 24), jnp.int32)) == "pallas"
  assert attn.resolve_backend("auto", *_qkv(head_dim=128)) == "pallas"  # float32: not cuDNN
  assert attn.resolve_backend("auto", *_qkv(head_dim=512)) == "xla"  # beyond both kernels


def test_cudnn_limits_named(monkeypatch):
  monkeypatch.setattr(attn, "_gpu_major", lambda: 8)
  with pytest.raises(ValueError, match="bfloat16/float16 only, got float32"):
    attn.resolve_backend("cudnn", *_qkv(head_dim=64))
  with pytest.raises(ValueError, match="head_dim a multiple of 8 and <= 128, got 256"):
    attn.resolve_backend("cudnn", *_qkv(head_dim=256, dtype=jnp.bfloat16))


@pytest.mark.parametrize(
    "backend,qkv,match",
    [
        ("cudnn", _qkv(), "needs a CUDA GPU, but this process runs on cpu"),
        ("pallas", _qkv(head_dim=512), "head_dim 512"),
        ("pallas", _qkv(dtype=jnp.int32), "dtype int32"),
        ("xla", _qkv(heads=3, kv_heads=2), r"query heads \(3\) must be a multiple"),
        ("flash", _qkv(), "unknown attention backend 'flash'"),
    ],
)
def test_bad_requests_raise(backend, qkv, match):
  with pytest.raises(ValueError, match=match):
    attn.attention(*qkv, backend=backend)


def _written_out(q, k, v, window, softcap, segment_ids=None):
  """Causal attention written out in numpy (float64): query i sees keys j <= i with
  i - j < window (all with window 0) of its own segment, scores capped as c·tanh(s / c)."""
  import numpy as np

  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, l, h, d = q.shape
  g = k.shape[2]
  scores = np.einsum("blhd,bshd->bhls", q, np.repeat(k, h // g, axis=2)) / np.sqrt(d)
  if softcap:
    scores = softcap * np.tanh(scores / softcap)
  i, j = np.arange(l)[:, None], np.arange(l)[None, :]
  keep = (j <= i) & ((i - j < window) if window else True)
  keep = np.broadcast_to(keep, (b, 1, l, l))
  if segment_ids is not None:
    seg = np.asarray(segment_ids)
    keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
  scores = np.where(keep, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return np.einsum("bhls,bshd->blhd", p, np.repeat(v, h // g, axis=2))


@pytest.mark.parametrize("window, softcap", [(5, 0.0), (1, 0.0), (0, 3.0), (7, 2.0)])
def test_xla_window_and_softcap_equal_attention_written_out(window, softcap):
  """A window fixed at trace time (jax.nn's local window), one traced as a layer's own inside
  a scan over layers, and soft-capping, with and without packed segments."""
  q, k, v = _qkv()
  seg = jnp.asarray([[1] * 10 + [2] * 14, [1] * 24])
  for segment_ids in (None, seg):
    want = _written_out(q, k, v, window, softcap, segment_ids)
    static = functools.partial(
        attn.attention, window=window, softcap=softcap, segment_ids=segment_ids
    )
    assert _rel(jax.jit(static)(q, k, v), want) < 1e-5
    traced = lambda q, k, v, w: attn.attention(
        q, k, v, window=w, softcap=softcap, segment_ids=segment_ids
    )
    assert _rel(jax.jit(traced)(q, k, v, jnp.int32(window)), want) < 1e-5
  plain = _written_out(q, k, v, 0, 0.0)
  assert _rel(jax.jit(static)(q, k, v), plain) > 1e-2  # the window or cap is seen


def test_backends_without_windows_or_softcap_say_so():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="takes no sliding window; use 'xla'"):
    attn.attention(q, k, v, backend="pallas", window=4)
  with pytest.raises(ValueError, match="takes no score soft-capping .* use 'xla'"):
    attn.attention(q, k, v, backend="pallas", softcap=30.0)
  assert attn.resolve_backend("auto", q, k, v, window=jnp.int32(4), softcap=50.0) == "xla"
