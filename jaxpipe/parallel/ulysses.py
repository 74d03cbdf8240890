"""Ulysses context parallelism: sequence-sharded activations meet head-sharded attention.

Outside attention every layer op (norms, MLP, projections) is token-local, so the sequence
stays split over the context axis `cp` and those ops run unchanged on L/P tokens. Around the
attention core one `all_to_all` turns [B, L/P, H, K] into [B, L, H/P, K] (every token, a slice
of the heads) and one turns the output back: 4·L·H·K/P elements per link per layer for q, k,
v, o, against 4·L·H·K for Megatron-style sequence parallelism.

The functions named `*_local` run inside `shard_map` over (at least) the context axis, so they
compose with data and pipeline axes in the same mesh; `ulysses_attention` wraps one for
callers holding global arrays.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.ops.attention import attention


def check_divisible(
    seq_len: int, heads: int, kv_heads: int, cp: int, axis_name: str = "cp"
) -> None:
  """Checks that the sequence and the (KV) heads split evenly over the context ranks.

  Args:
    seq_len: the whole sequence's length L.
    heads: query heads H.
    kv_heads: key/value heads G.
    cp: context ranks P.
    axis_name: the context axis, named in the errors.

  Raises:
    ValueError: `seq_len`, `heads` or `kv_heads` is not divisible by `cp`.
  """
  if seq_len % cp:
    raise ValueError(
        f"sequence length {seq_len} is not divisible by the context axis "
        f"{axis_name!r} of size {cp}; pad the sequence to a multiple of {cp}"
    )
  if heads % cp:
    raise ValueError(
        f"{heads} query heads do not divide over the context axis {axis_name!r} of "
        f"size {cp}; use a context size that divides {heads}"
    )
  if kv_heads % cp:
    raise ValueError(
        f"{kv_heads} key/value heads do not divide over the context axis "
        f"{axis_name!r} of size {cp}; use a cp that divides {kv_heads}, or more KV "
        f"heads"
    )


def seq_to_heads(x_BxSxNxK: jax.Array, axis_name: str = "cp") -> jax.Array:
  """Trades this rank's tokens for this rank's heads with one all_to_all, inside `shard_map`.

  Args:
    x_BxSxNxK: this rank's tokens, [B, L/P, N, K].
    axis_name: the context axis.

  Returns:
    Every token of this rank's heads, [B, L, N/P, K].
  """
  return lax.all_to_all(x_BxSxNxK, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BxLxNxK: jax.Array, axis_name: str = "cp") -> jax.Array:
  """Trades this rank's heads for this rank's tokens with one all_to_all, inside `shard_map`.

  The inverse of `seq_to_heads`.

  Args:
    x_BxLxNxK: every token of this rank's heads, [B, L, N/P, K].
    axis_name: the context axis.

  Returns:
    This rank's tokens, every head, [B, L/P, N, K].
  """
  return lax.all_to_all(x_BxLxNxK, axis_name, split_axis=1, concat_axis=2, tiled=True)


def positions_local(seq_local: int, axis_name: str = "cp") -> jax.Array:
  """Global token positions of this context rank's contiguous slice, inside `shard_map`.

  Args:
    seq_local: tokens per rank, L/P.
    axis_name: the context axis.

  Returns:
    int32 [L/P]: positions `r·L/P .. (r+1)·L/P - 1` on rank r.
  """
  return lax.axis_index(axis_name) * seq_local + lax.iota("int32", seq_local)


def ulysses_attention_local(
    q_BxSxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    axis_name: str = "cp",
    causal: bool = True,
    backend: str = "xla",
    segment_ids_BxS: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """Attention over the full sequence from sequence shards, inside `shard_map`.

  Rank r holds tokens [r·L/P, (r+1)·L/P). Query head h reads KV head h // (H/G); a tiled
  all_to_all gives rank r query heads [r·H/P, ..) and KV heads [r·G/P, ..), the same groups.

  Args:
    q_BxSxHxK: this rank's queries, [B, L/P, H, K].
    k_BxSxGxK: this rank's keys, [B, L/P, G, K].
    v_BxSxGxK: this rank's values, [B, L/P, G, K].
    axis_name: the context axis.
    causal: mask each query to keys at or before its position.
    backend: the attention backend, as `jaxpipe.ops.attention.attention` takes it.
    segment_ids_BxS: this rank's segment ids, [B, L/P] (packed sequences); gathered whole.
    sm_scale: the softmax scale; None: `attention`'s default.
    window: a sliding window, as `jaxpipe.ops.attention.attention` takes it, over the whole
      sequence.
    softcap: a score soft-cap, as `jaxpipe.ops.attention.attention` takes it.

  Returns:
    This rank's attention output, [B, L/P, H, K].

  Raises:
    ValueError: the sequence or the (KV) heads do not split evenly over the context ranks.
  """
  cp = lax.axis_size(axis_name)
  check_divisible(q_BxSxHxK.shape[1] * cp, q_BxSxHxK.shape[2], k_BxSxGxK.shape[2], cp, axis_name)
  q, k, v = (seq_to_heads(t, axis_name) for t in (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK))
  segment_ids = None
  if segment_ids_BxS is not None:
    segment_ids = lax.all_gather(segment_ids_BxS, axis_name, axis=1, tiled=True)
  o_BxLxHpxK = attention(
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
  return heads_to_seq(o_BxLxHpxK, axis_name)


def ulysses_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str = "cp",
    batch_axes: str | tuple[str, ...] | None = None,
    causal: bool = True,
    backend: str = "xla",
    segment_ids_BxL: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
  """Ulysses attention on global arrays.

  Shards the sequence over `axis_name` (and the batch over `batch_axes`) and runs
  `ulysses_attention_local` in a `shard_map` over `mesh`.

  Args:
    q_BxLxHxK: queries, [B, L, H, K].
    k_BxLxGxK: keys, [B, L, G, K].
    v_BxLxGxK: values, [B, L, G, K].
    mesh: the device mesh holding `axis_name` (and `batch_axes`).
    axis_name: the context axis the sequence is split over.
    batch_axes: the mesh axes the batch is split over; None: replicated.
    causal: mask each query to keys at or before its position.
    backend: the attention backend, as `jaxpipe.ops.attention.attention` takes it.
    segment_ids_BxL: segment ids, [B, L] (packed sequences).
    sm_scale: the softmax scale; None: `attention`'s default.

  Returns:
    The attention output, [B, L, H, K], sharded as the inputs.

  Raises:
    ValueError: the sequence or the (KV) heads do not split evenly over the context ranks.
  """
  cp = mesh.shape[axis_name]
  check_divisible(q_BxLxHxK.shape[1], q_BxLxHxK.shape[2], k_BxLxGxK.shape[2], cp, axis_name)
  spec = P(batch_axes, axis_name)
  fn = functools.partial(
      ulysses_attention_local,
      axis_name=axis_name,
      causal=causal,
      backend=backend,
      sm_scale=sm_scale,
  )
  args = (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
  in_specs = (spec, spec, spec)
  if segment_ids_BxL is not None:
    args += (segment_ids_BxL,)
    in_specs += (spec,)
    fn = lambda q, k, v, s, fn=fn: fn(q, k, v, segment_ids_BxS=s)
  # Interpreted Pallas kernels carry no varying-axes types, so shard_map cannot check them.
  check_vma = backend != "pallas"
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=check_vma)(*args)
