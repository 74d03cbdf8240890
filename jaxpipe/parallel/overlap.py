"""Projection GEMMs fused with Ulysses' all-to-alls, chunked so transfers hide behind matmuls.

An all-to-all over P ranks is P-1 point-to-point exchanges plus a local copy. Both projections
around attention factor along the same split:

- input side (x -> QKV -> all_to_all): the heads destined for rank d are x @ W[:, heads(d)],
  so step s computes the chunk for rank r+s and ppermutes it by s; step s+1's GEMM has no
  dependence on step s's transfer and runs while it is in flight.
- output side (o -> all_to_all -> W_o): out = sum over sources of o_from(src) @ W_o[heads(src)],
  so every transfer is issued up front and step s's GEMM starts as soon as chunk s lands,
  while the later chunks are still moving.

Everything here runs inside `shard_map` over the context axis and is plain JAX (`ppermute`,
`dot_general`), so it differentiates and runs on any backend; XLA's scheduler turns the
independent collective-permutes into async start/done pairs around the GEMMs on GPU.
`kernels_pallas/proj_a2a.py` and `kernels_pallas/gemm_a2a.py` are the two sides as persistent
GPU kernels.

Where a `ppermute` cannot run (inside the pipeline executor's per-tick branch, where it would
wait for every device of the program), the `*_chunked_local` variants split the work along this
rank's tokens instead: chunk j's GEMM and its own (smaller) all_to_all, so chunk j+1's GEMM
can run while chunk j's all_to_all is in flight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.parallel.ulysses import heads_to_seq, seq_to_heads


def _shift(x: jax.Array, shift: int, axis_name: str, size: int) -> jax.Array:
  """Sends x from rank i to rank (i + shift) % size."""
  if shift % size == 0:
    return x
  return lax.ppermute(x, axis_name, [(i, (i + shift) % size) for i in range(size)])


def _heads_of(w: jax.Array, rank: jax.Array, per_rank: int, axis: int) -> jax.Array:
  """The `per_rank` heads of `rank` along `axis` of a weight (a dynamic slice: rank is traced)."""
  return lax.dynamic_slice_in_dim(w, rank * per_rank, per_rank, axis=axis)


def _check_heads(heads: int, cp: int, what: str) -> int:
  if heads % cp:
    raise ValueError(
        f"{what}: {heads} heads do not divide over {cp} context ranks; "
        f"use a context size that divides {heads}"
    )
  return heads // cp


def proj_a2a_local(x_BxSxD: jax.Array, w_DxNxK: jax.Array, *, axis_name: str = "cp") -> jax.Array:
  """`seq_to_heads(x @ w)` in P chunked steps, inside `shard_map`.

  Step s computes the heads destined for rank r+s and ppermutes them by s, so each step's GEMM
  runs while the previous step's transfer is in flight.

  Args:
    x_BxSxD: this rank's tokens, [B, L/P, D].
    w_DxNxK: the projection, [D, N, K], every head.
    axis_name: the context axis.

  Returns:
    Every token of this rank's heads, [B, L, N/P, K].

  Raises:
    ValueError: N heads do not divide over the context ranks.
  """
  cp = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  heads_per = _check_heads(w_DxNxK.shape[1], cp, "proj_a2a_local")
  batch, seq, _ = x_BxSxD.shape
  out_BxLxNpxK = jnp.zeros(
      (batch, seq * cp, heads_per, w_DxNxK.shape[2]), jnp.result_type(x_BxSxD, w_DxNxK)
  )
  for step in range(cp):
    dest = (rank + step) % cp
    y_BxSxNpxK = jnp.einsum("bsd,dnk->bsnk", x_BxSxD, _heads_of(w_DxNxK, dest, heads_per, 1))
    y_BxSxNpxK = _shift(y_BxSxNpxK, step, axis_name, cp)  # now holds rank (r - step)'s tokens
    src = (rank - step) % cp
    out_BxLxNpxK = lax.dynamic_update_slice_in_dim(out_BxLxNpxK, y_BxSxNpxK, src * seq, axis=1)
  return out_BxLxNpxK


def a2a_proj_local(
    o_BxLxNpxK: jax.Array, w_NxKxD: jax.Array, *, axis_name: str = "cp"
) -> jax.Array:
  """`heads_to_seq(o) @ w` in P chunked steps, inside `shard_map`.

  Every transfer is issued up front; step s's GEMM starts as soon as chunk s lands.

  Args:
    o_BxLxNpxK: every token of this rank's heads, [B, L, N/P, K].
    w_NxKxD: the output projection, [N, K, D], every head.
    axis_name: the context axis.

  Returns:
    This rank's tokens, projected, [B, L/P, D].

  Raises:
    ValueError: N heads do not divide over the context ranks, `o` holds another number of heads
      per rank, or L is not divisible by P.
  """
  cp = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  heads_per = _check_heads(w_NxKxD.shape[0], cp, "a2a_proj_local")
  if o_BxLxNpxK.shape[2] != heads_per:
    raise ValueError(
        f"a2a_proj_local: o holds {o_BxLxNpxK.shape[2]} heads per rank but w has "
        f"{w_NxKxD.shape[0]} heads over {cp} ranks ({heads_per} per rank)"
    )
  if o_BxLxNpxK.shape[1] % cp:
    raise ValueError(f"a2a_proj_local: sequence {o_BxLxNpxK.shape[1]} is not divisible by {cp}")
  seq = o_BxLxNpxK.shape[1] // cp
  # Issue every transfer first: none depends on a GEMM, so all are in flight while GEMMs run.
  received = []
  for step in range(cp):
    dest = (rank + step) % cp
    chunk_BxSxNpxK = lax.dynamic_slice_in_dim(o_BxLxNpxK, dest * seq, seq, axis=1)
    received.append(_shift(chunk_BxSxNpxK, step, axis_name, cp))
  out_BxSxD = None
  for step, chunk_BxSxNpxK in enumerate(received):
    src = (rank - step) % cp  # the chunk carries rank src's heads of my tokens
    part = jnp.einsum("bsnk,nkd->bsd", chunk_BxSxNpxK, _heads_of(w_NxKxD, src, heads_per, 0))
    out_BxSxD = part if out_BxSxD is None else out_BxSxD + part
  return out_BxSxD


def _check_chunks(seq: int, chunks: int, what: str) -> int:
  if chunks < 1 or seq % chunks:
    raise ValueError(
        f"{what}: chunks={chunks} must be >= 1 and divide this rank's {seq} tokens; "
        f"use a divisor of {seq}"
    )
  return seq // chunks


def proj_a2a_chunked_local(
    x_BxSxD: jax.Array, w_DxNxK: jax.Array, *, axis_name: str = "cp", chunks: int = 2
) -> jax.Array:
  """`seq_to_heads(x @ w)` as `chunks` GEMM + all_to_all pairs over slices of this rank's tokens.

  For where a `ppermute` cannot run: chunk j+1's GEMM can run while chunk j's all_to_all is in
  flight.

  Args:
    x_BxSxD: this rank's tokens, [B, L/P, D].
    w_DxNxK: the projection, [D, N, K], every head.
    axis_name: the context axis.
    chunks: slices of this rank's tokens; must divide L/P.

  Returns:
    Every token of this rank's heads, [B, L, N/P, K].

  Raises:
    ValueError: N heads do not divide over the context ranks, or `chunks` is < 1 or does not
      divide L/P.
  """
  cp = lax.axis_size(axis_name)
  heads_per = _check_heads(w_DxNxK.shape[1], cp, "proj_a2a_chunked_local")
  batch, seq, _ = x_BxSxD.shape
  c = _check_chunks(seq, chunks, "proj_a2a_chunked_local")
  parts = []
  for j in range(chunks):
    y_BxCxNxK = jnp.einsum("bsd,dnk->bsnk", x_BxSxD[:, j * c : (j + 1) * c], w_DxNxK)
    parts.append(seq_to_heads(y_BxCxNxK, axis_name))  # [B, P·c, N/P, K], source rank major
  # token (source r, chunk j, t) sits at r·S + j·c + t of the whole sequence
  out = jnp.stack(parts, axis=1).reshape(batch, chunks, cp, c, heads_per, -1)
  return out.transpose(0, 2, 1, 3, 4, 5).reshape(batch, cp * seq, heads_per, -1)


def a2a_proj_chunked_local(
    o_BxLxNpxK: jax.Array, w_NxKxD: jax.Array, *, axis_name: str = "cp", chunks: int = 2
) -> jax.Array:
  """`heads_to_seq(o) @ w` as `chunks` all_to_all + GEMM pairs over slices of each rank's tokens.

  Args:
    o_BxLxNpxK: every token of this rank's heads, [B, L, N/P, K].
    w_NxKxD: the output projection, [N, K, D], every head.
    axis_name: the context axis.
    chunks: slices of each rank's tokens; must divide L/P.

  Returns:
    This rank's tokens, projected, [B, L/P, D].

  Raises:
    ValueError: N heads do not divide over the context ranks, `o` holds another number of heads
      per rank, L is not divisible by P, or `chunks` is < 1 or does not divide L/P.
  """
  cp = lax.axis_size(axis_name)
  heads_per = _check_heads(w_NxKxD.shape[0], cp, "a2a_proj_chunked_local")
  if o_BxLxNpxK.shape[2] != heads_per:
    raise ValueError(
        f"a2a_proj_chunked_local: o holds {o_BxLxNpxK.shape[2]} heads per rank but "
        f"w has {w_NxKxD.shape[0]} heads over {cp} ranks ({heads_per} per rank)"
    )
  batch, length, _, head_dim = o_BxLxNpxK.shape
  if length % cp:
    raise ValueError(f"a2a_proj_chunked_local: sequence {length} is not divisible by {cp}")
  c = _check_chunks(length // cp, chunks, "a2a_proj_chunked_local")
  o = o_BxLxNpxK.reshape(batch, cp, chunks, c, heads_per, head_dim)
  parts = []
  for j in range(chunks):
    o_BxPCxNpxK = o[:, :, j].reshape(batch, cp * c, heads_per, head_dim)
    mine_BxCxNxK = heads_to_seq(o_BxPCxNpxK, axis_name)  # chunk j of my tokens, every head
    parts.append(jnp.einsum("bsnk,nkd->bsd", mine_BxCxNxK, w_NxKxD))
  return jnp.concatenate(parts, axis=1)


def proj_then_a2a_local(
    x_BxSxD: jax.Array, w_DxNxK: jax.Array, *, axis_name: str = "cp"
) -> jax.Array:
  """Unfused reference for `proj_a2a_local`: one GEMM, then one all_to_all.

  Args:
    x_BxSxD: this rank's tokens, [B, L/P, D].
    w_DxNxK: the projection, [D, N, K].
    axis_name: the context axis.

  Returns:
    Every token of this rank's heads, [B, L, N/P, K].
  """
  return seq_to_heads(jnp.einsum("bsd,dnk->bsnk", x_BxSxD, w_DxNxK), axis_name)


def a2a_then_proj_local(
    o_BxLxNpxK: jax.Array, w_NxKxD: jax.Array, *, axis_name: str = "cp"
) -> jax.Array:
  """Unfused reference for `a2a_proj_local`: one all_to_all, then one GEMM.

  Args:
    o_BxLxNpxK: every token of this rank's heads, [B, L, N/P, K].
    w_NxKxD: the output projection, [N, K, D].
    axis_name: the context axis.

  Returns:
    This rank's tokens, projected, [B, L/P, D].
  """
  return jnp.einsum("bsnk,nkd->bsd", heads_to_seq(o_BxLxNpxK, axis_name), w_NxKxD)
