"""The layers' attention call: one device's attention core, Ulysses, or the serving KV cache.

Inside `with context_parallel("cp"):` (entered within a `shard_map` whose sequence is split over
"cp"), `attention` runs Ulysses attention over that axis (`jaxpipe.parallel.ulysses`), so a model
written for one device needs no change to train with context parallelism. Inside
`with kv_cache(hook):` the call hands its q, k, v to the hook instead (serving: store the new
keys/values in pages, attend over the cached ones), so the same layers serve a paged KV cache.
Otherwise it is `jaxpipe.ops.attention.attention` (the backends).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from jaxpipe.ops import attention as core
from jaxpipe.parallel.ulysses import ulysses_attention_local

_CONTEXT_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "context_axis", default=None
)
_POINT_TO_POINT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "point_to_point", default=True
)
_KV_CACHE: contextvars.ContextVar = contextvars.ContextVar("kv_cache", default=None)


@contextlib.contextmanager
def context_parallel(axis_name: str | None = "cp", point_to_point: bool | None = None):
  """While tracing inside, `attention` takes sequence shards over `axis_name` (Ulysses).

  Enter it within a `shard_map` whose sequence is split over `axis_name`.

  Args:
    axis_name: the context axis; None: one device's attention.
    point_to_point: False: the code runs where a `ppermute` cannot (a branch that other devices
      of the program do not take), so layers move data with all_to_alls only; None keeps the
      enclosing setting (True at the top).
  """
  if point_to_point is None:
    point_to_point = _POINT_TO_POINT.get()
  tokens = _CONTEXT_AXIS.set(axis_name), _POINT_TO_POINT.set(point_to_point)
  try:
    yield
  finally:
    _CONTEXT_AXIS.reset(tokens[0])
    _POINT_TO_POINT.reset(tokens[1])


@contextlib.contextmanager
def kv_cache(hook):
  """While tracing inside, `attention` hands its q, k, v to `hook` instead.

  `attention(q, k, v, causal=True, ...)` returns `hook(q, k, v, sm_scale=..., window=...,
  softcap=...)` (serving: store the new keys/values in pages, attend over the cached ones).

  Args:
    hook: the function that attends over the cache.
  """
  token = _KV_CACHE.set(hook)
  try:
    yield
  finally:
    _KV_CACHE.reset(token)


def caches_latents() -> bool:
  """Whether the `kv_cache` being traced holds latent attention's latents (the serving engine's
  `mla_cache='latent'`), so that the layer must call `latent_attention`."""
  return bool(getattr(_KV_CACHE.get(), "latent", False))


def latent_attention(
    q_BxLxHxC: jax.Array,
    latent_BxLxC: jax.Array,
    *,
    values: int,
    sm_scale: float,
    backend: str = "xla",
) -> jax.Array:
  """Causal multi-query attention whose key is each token's latent and whose value is the
  latent's first `values` channels: MLA with its up-projections absorbed (DeepSeek-V2 §2.1.2).

  Inside `kv_cache(hook)` the hook stores the latents and attends over its cached ones
  (`hook.latent_attention`).

  Args:
    q_BxLxHxC: queries in the latent's space, [B, L, H, C].
    latent_BxLxC: each token's latent, [B, L, C].
    values: the value channels, the latent's first ones.
    sm_scale: the scores' scale.
    backend: the attention core's backend (outside a cache).

  Returns:
    [B, L, H, values].
  """
  hook = _KV_CACHE.get()
  latent_BxLx1xC = latent_BxLxC[:, :, None]
  if hook is not None:
    return hook.latent_attention(q_BxLxHxC, latent_BxLx1xC, values, sm_scale)
  o_BxLxHxC = core.attention(
      q_BxLxHxC, latent_BxLx1xC, latent_BxLx1xC, causal=True, backend=backend, sm_scale=sm_scale
  )
  return o_BxLxHxC[..., :values]


def context_axis() -> str | None:
  """The axis the sequence is split over while tracing inside `context_parallel`, else None."""
  return _CONTEXT_AXIS.get()


def point_to_point() -> bool:
  """Whether `ppermute` may run here (see `context_parallel`)."""
  return _POINT_TO_POINT.get()


def attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    causal: bool = True,
    backend: str = "xla",
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Scaled dot-product attention, `jax.nn.dot_product_attention` layout.

  K/V may have fewer heads than Q. Inside `context_parallel(axis)` the arrays are this rank's
  sequence shard (Ulysses runs); inside `kv_cache(hook)` the hook attends over the cache;
  otherwise `jaxpipe.ops.attention.attention` runs.

  Args:
    q_BxLxHxK: queries, [B, L, H, K] (L/P tokens per rank inside `context_parallel`).
    k_BxLxGxK: keys, [B, L, G, K].
    v_BxLxGxK: values, [B, L, G, K].
    causal: a query sees keys at its own position and before only.
    backend: one of `jaxpipe.ops.attention.BACKENDS`.
    segment_ids: [B, L] document ids of packed rows; attention stays inside each document.
    sm_scale: the scores' scale (default head_dim^-1/2).
    window: a sliding window, as `jaxpipe.ops.attention.attention` takes it.
    softcap: a score soft-cap, as `jaxpipe.ops.attention.attention` takes it.

  Returns:
    [B, L, H, K] (this rank's shard inside `context_parallel`), or what the hook returns.

  Raises:
    ValueError: inside `kv_cache`, a call that is not causal or has `segment_ids`; otherwise as
      the attention core raises.
  """
  q, k, v = q_BxLxHxK, k_BxLxGxK, v_BxLxGxK
  hook = _KV_CACHE.get()
  if hook is not None:
    if not causal or segment_ids is not None:
      raise ValueError("a KV cache serves causal attention without segment_ids")
    return hook(q, k, v, sm_scale=sm_scale, window=window, softcap=softcap)
  axis_name = _CONTEXT_AXIS.get()
  if axis_name is not None:
    return ulysses_attention_local(
        q,
        k,
        v,
        axis_name=axis_name,
        causal=causal,
        backend=backend,
        segment_ids_BxS=segment_ids,
        sm_scale=sm_scale,
        window=window,
        softcap=softcap,
    )
  return core.attention(
      q,
      k,
      v,
      causal=causal,
      backend=backend,
      segment_ids=segment_ids,
      sm_scale=sm_scale,
      window=window,
      softcap=softcap,
  )
