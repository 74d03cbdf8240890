"""Attention cores behind one call; the backend is chosen by config."""
import jax


def attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, *,
              causal: bool = True, backend: str = "xla") -> jax.Array:
  """Scaled dot-product attention, `jax.nn.dot_product_attention` layout (K/V may have fewer heads)."""
  if backend not in ("xla", "auto"):
    raise ValueError(f"attention backend {backend!r} is not available; use 'xla' or 'auto'")
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=causal,
                                      implementation="xla")
