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
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpipe.models.attention import attention


def check_divisible(seq_len: int, heads: int, kv_heads: int, cp: int,
                    axis_name: str = "cp") -> None:
  """Raises ValueError when the sequence or the (KV) heads do not split evenly over cp ranks."""
  if seq_len % cp:
    raise ValueError(f"sequence length {seq_len} is not divisible by the context axis "
                     f"{axis_name!r} of size {cp}; pad the sequence to a multiple of {cp}")
  if heads % cp:
    raise ValueError(f"{heads} query heads do not divide over the context axis {axis_name!r} of "
                     f"size {cp}; use a context size that divides {heads}")
  if kv_heads % cp:
    raise ValueError(f"{kv_heads} key/value heads do not divide over the context axis "
                     f"{axis_name!r} of size {cp}; use a cp that divides {kv_heads}, or more KV "
                     f"heads")


def seq_to_heads(x_BxSxNxK: jax.Array, axis_name: str = "cp") -> jax.Array:
  """[B, L/P, N, K] (this rank's tokens) -> [B, L, N/P, K] (this rank's heads), inside shard_map."""
  return lax.all_to_all(x_BxSxNxK, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BxLxNxK: jax.Array, axis_name: str = "cp") -> jax.Array:
  """[B, L, N/P, K] (this rank's heads) -> [B, L/P, N, K] (this rank's tokens), inside shard_map."""
  return lax.all_to_all(x_BxLxNxK, axis_name, split_axis=1, concat_axis=2, tiled=True)


def positions_local(seq_local: int, axis_name: str = "cp") -> jax.Array:
  """Global token positions [L/P] of this context rank's contiguous slice, inside shard_map."""
  return lax.axis_index(axis_name) * seq_local + lax.iota("int32", seq_local)


def ulysses_attention_local(q_BxSxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, *,
                            axis_name: str = "cp", causal: bool = True, backend: str = "xla",
                            segment_ids_BxS: jax.Array | None = None,
                            sm_scale: float | None = None) -> jax.Array:
  """Attention over the full sequence from sequence shards; returns this rank's [B, L/P, H, K].

  Rank r holds tokens [r·L/P, (r+1)·L/P). Query head h reads KV head h // (H/G); a tiled
  all_to_all gives rank r query heads [r·H/P, ..) and KV heads [r·G/P, ..), the same groups.
  """
  cp = lax.axis_size(axis_name)
  check_divisible(q_BxSxHxK.shape[1] * cp, q_BxSxHxK.shape[2], k_BxSxGxK.shape[2], cp, axis_name)
  q, k, v = (seq_to_heads(t, axis_name) for t in (q_BxSxHxK, k_BxSxGxK, v_BxSxGxK))
  segment_ids = None
  if segment_ids_BxS is not None:
    segment_ids = lax.all_gather(segment_ids_BxS, axis_name, axis=1, tiled=True)
  o_BxLxHpxK = attention(q, k, v, causal=causal, backend=backend, segment_ids=segment_ids,
                         sm_scale=sm_scale)
  return heads_to_seq(o_BxLxHpxK, axis_name)


def ulysses_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, *,
                      mesh: Mesh, axis_name: str = "cp",
                      batch_axes: str | tuple[str, ...] | None = None,
                      causal: bool = True, backend: str = "xla",
                      segment_ids_BxL: jax.Array | None = None,
                      sm_scale: float | None = None) -> jax.Array:
  """Global-array entry: shards the sequence over `axis_name` (and batch over `batch_axes`)."""
  cp = mesh.shape[axis_name]
  check_divisible(q_BxLxHxK.shape[1], q_BxLxHxK.shape[2], k_BxLxGxK.shape[2], cp, axis_name)
  spec = P(batch_axes, axis_name)
  fn = functools.partial(ulysses_attention_local, axis_name=axis_name, causal=causal,
                         backend=backend, sm_scale=sm_scale)
  args = (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
  in_specs = (spec, spec, spec)
  if segment_ids_BxL is not None:
    args += (segment_ids_BxL,)
    in_specs += (spec,)
    fn = lambda q, k, v, s, fn=fn: fn(q, k, v, segment_ids_BxS=s)
  # Interpreted Pallas kernels carry no varying-axes types, so shard_map cannot check them.
  check_vma = backend != "pallas"
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec,
                       check_vma=check_vma)(*args)


def context_parallel_loss_and_grads(cfg, mesh: Mesh, microbatches: int = 1, *,
                                    axis_name: str = "cp",
                                    batch_axes: tuple[str, ...] = ("dp", "ep")):
  """The trainer's `loss_and_grads(params, batch)` with the sequence split over `axis_name`.

  Inside one `shard_map` every rank embeds, normalises and runs the MLPs on its own L/P tokens,
  with rotary positions offset to its slice; `attention` runs Ulysses (see
  `jaxpipe.models.attention.context_parallel`). Per-rank loss sums leave the shard_map as
  partials and are added outside, so the gradient of the replicated parameters is the sum of
  every rank's contribution whether or not shard_map checks varying axes.

  As in the pipeline path, tokens are weighted by `transformer.mean_weights` and MoE auxiliary
  losses ride on the gradient weighted by the tokens of their micro-batch, so dividing by the
  step's token count gives the trainer's objective; the reported loss is the cross-entropy.
  With MoE layers the metrics add the routing statistics (`moe.train_metrics`), each MoE layer's
  summed over all token shards inside the shard_map.
  """
  from jaxpipe.models import fp8 as fp8_lib
  from jaxpipe.models import moe as moe_lib
  from jaxpipe.models import transformer
  from jaxpipe.models.attention import context_parallel

  if cfg.fp8 == "delayed" and cfg.attention == "pallas":
    # delayed scaling's amaxes leave the shard_map as the scales' cotangents, max-reduced only
    # where it tracks varying axes, which interpreted Pallas kernels need switched off
    raise ValueError("model.fp8='delayed' with attention='pallas' cannot run the context-parallel "
                     "path (mesh.cp > 1, pp = 1); use attention='xla' or 'cudnn', or mesh.pp > 1")

  spec = P(batch_axes, axis_name)
  every_axis = P(tuple(mesh.axis_names))
  aux_spec = {k: P() for k in moe_lib.AUX_KEYS} if cfg.moe is not None else {}

  def apply_layers(layers, x_BxSxD, positions_S):
    if cfg.moe is None:
      return transformer.apply_layers(cfg, layers, x_BxSxD, positions_S), {}
    # transformer.apply_layers, keeping each MoE group's statistics
    body = lambda x, unit: transformer.moe_unit(cfg, unit, x, positions_S)
    return lax.scan(jax.checkpoint(body) if cfg.remat else body, x_BxSxD, layers)

  def local_sums(params, tokens_BxS, targets_BxS, weights_BxS):
    with context_parallel(axis_name):
      x_BxSxD = transformer.embed(cfg, params, tokens_BxS)
      positions_S = positions_local(tokens_BxS.shape[1], axis_name)
      x_BxSxD, aux = apply_layers(params["layers"], x_BxSxD, positions_S)
      total, _ = transformer.head_loss(cfg, params, x_BxSxD, targets_BxS, weights_BxS)
    return total[None], aux

  sharded = jax.shard_map(local_sums, mesh=mesh, in_specs=(P(), spec, spec, spec),
                          out_specs=(every_axis, aux_spec), check_vma=cfg.attention != "pallas")

  def loss_sum(params, batch):
    total, aux = sharded(params, batch["tokens"], batch["targets"], batch["weights"])
    return jnp.sum(total), aux

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

  def loss_and_grads(params, batch):
    n_tokens = batch["tokens"].size
    count = jnp.sum(batch["mask"].astype(jnp.float32))
    batch = {"tokens": batch["tokens"], "targets": batch["targets"],
             "weights": transformer.mean_weights(batch["mask"])}
    if microbatches == 1:
      (total, aux), grads = grad_fn(params, batch)
    else:
      # Row i*m + j goes to micro-batch j, as in the data-parallel path.
      split = jax.tree.map(lambda x: jnp.swapaxes(
          x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1), batch)

      def body(carry, mb):
        return fp8_lib.accumulate(carry, grad_fn(params, mb)), None

      first = jax.tree.map(lambda x: x[0], split)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(grad_fn, params, first))
      ((total, aux), grads), _ = lax.scan(body, zeros, split)
    metrics = {"tokens": count}
    if cfg.moe is not None:
      metrics.update(moe_lib.train_metrics(aux, microbatches, n_tokens, cfg.moe.top_k))
    return total / n_tokens, fp8_lib.map_grads(lambda g: g / n_tokens, grads), metrics

  return loss_and_grads
