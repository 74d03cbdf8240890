"""Multi-token prediction (DeepSeek-V3 §2.2): `depth` sequential modules after the main model,
module k predicting the token k + 1 places ahead of each position.

Module k (1..D) takes the previous depth's states h^{k-1} and the embeddings of the tokens k
places ahead, both normed, projects their concatenation back to d_model (embedding first:
`eh_proj([enorm(e); hnorm(h)])`), runs one decoder layer over it and norms the result with its
own norm (`shared_head.norm` in DeepSeek's checkpoints): that is h^k, which the model's shared
output head projects to module k's logits. h^0 is the main model's output after its final norm.
This is transformers' `MtpModel` (which `generate(use_mtp=True)` drafts with) and what vLLM
feeds DeepSeek's MTP layer. Module k's loss is the cross-entropy summed over the positions whose
target exists, over the main loss's token count T (the paper's 1/T); the objective adds λ/D
times their sum to the main loss.

Parameters, stacked on a leading [depth] axis (`params['mtp']`, which
`transformer.init_params` makes):

  enorm, hnorm, final_norm: {'scale': [d_model]}, eh_proj: {'kernel': [2 d_model, d_model]},
  block: one decoder layer's (an MoE layer's when the model has experts)

Positions shift along each row: packed rows count a position only where the token k places
ahead lies in the same document.
"""

import jax
import jax.numpy as jnp

from jaxpipe.models import transformer
from jaxpipe.models.layers import rms_norm


def weights(cfg: transformer.TransformerConfig, mask_BxL, segment_ids_BxL=None) -> jax.Array:
  """Each module's per-position loss weights: λ/D · valid · N / T, [D, B, L].

  Module k at position i predicts targets[i + k] (the token k + 1 ahead), counted where
  mask[i + k] is and, in packed rows, where position i + k lies in position i's document. A
  weighted sum of its cross-entropies over the N = B·L positions, divided by N, is then λ/D
  times the paper's L_MTP^k: the cross-entropies summed over the counted positions, over the
  main loss's token count T (its 1/T), with nothing data-dependent inside the model.

  Args:
    cfg: the model, with `mtp_depth` and `mtp_weight`.
    mask_BxL: 1 where the main model's target counts.
    segment_ids_BxL: packed rows' document ids, or None.

  Returns:
    Float32 [D, B, L].
  """
  mask_BxL = jnp.asarray(mask_BxL, jnp.float32)
  b, l = mask_BxL.shape
  scale = b * l / jnp.maximum(jnp.sum(mask_BxL), 1.0) * (cfg.mtp_weight / cfg.mtp_depth)
  out = []
  for k in range(1, cfg.mtp_depth + 1):
    valid = _ahead(mask_BxL, k, 0.0)
    if segment_ids_BxL is not None:
      valid = valid * (_ahead(segment_ids_BxL, k, -1) == segment_ids_BxL)
    out.append(valid * scale)
  return jnp.stack(out)


def batch_weights(cfg: transformer.TransformerConfig, batch: dict) -> jax.Array:
  """`weights` of a whole batch, rows first ([B, D, L]), so that micro-batches split them as
  they split the rows and still weigh each module's tokens by the whole batch's count.

  Args:
    cfg: the model, with `mtp_depth` > 0.
    batch: `mask` [B, L], and `segment_ids` for packed rows.

  Returns:
    Float32 [B, D, L].
  """
  return jnp.swapaxes(weights(cfg, batch["mask"], batch.get("segment_ids")), 0, 1)


def _ahead(x_BxL, k: int, fill):
  """x shifted k places left along each row (x[i + k] at i), `fill` past the end."""
  if k == 0:
    return x_BxL
  pad = jnp.full(x_BxL.shape[:1] + (k,), fill, x_BxL.dtype)
  return jnp.concatenate([x_BxL[:, k:], pad], axis=1)


def _states(cfg, params, h_BxLxD, tokens_ahead, positions_L, segment_ids_BxL):
  """Yields each module's normed states h^k, [B, L, D], and its MoE aux (None if dense).

  `tokens_ahead(k)` gives the tokens k places ahead of each position, [B, L].
  """
  h = rms_norm(h_BxLxD, params["final_norm"]["scale"], cfg.norm_eps, cfg.norm_plus_one)
  block = transformer.Block(cfg, moe=cfg.moe is not None)
  for k in range(1, cfg.mtp_depth + 1):
    p = module(params, k)
    x = module_input(cfg, params, p, tokens_ahead(k), h)
    out = block.apply({"params": p["block"]}, x, positions_L, segment_ids_BxL)
    out, aux = out if cfg.moe is not None else (out, None)
    h = rms_norm(out, p["final_norm"]["scale"], cfg.norm_eps, cfg.norm_plus_one)
    yield h, aux


def module(params: dict, k: int) -> dict:
  """Module k's parameters (1..depth), off the stacked `params['mtp']`.

  Args:
    params: the model's parameters.
    k: the module's depth.

  Returns:
    Its `enorm`, `hnorm`, `eh_proj`, `block` and `final_norm`.
  """
  return jax.tree.map(lambda a: a[k - 1], params["mtp"])


def module_input(
    cfg: transformer.TransformerConfig, params: dict, p: dict, tokens_BxL, h_BxLxD
) -> jax.Array:
  """A module's decoder-layer input: `eh_proj([enorm(embed(tokens)); hnorm(h)])`.

  Args:
    cfg: the model.
    params: the model's parameters (the shared embedding).
    p: the module's (`module`).
    tokens_BxL: the tokens ahead, [B, L].
    h_BxLxD: the states it continues (the previous depth's, normed), [B, L, D].

  Returns:
    [B, L, D] in the compute dtype.
  """
  eps, plus = cfg.norm_eps, cfg.norm_plus_one
  both = jnp.concatenate(
      [
          rms_norm(transformer.embed(cfg, params, tokens_BxL), p["enorm"]["scale"], eps, plus),
          rms_norm(h_BxLxD, p["hnorm"]["scale"], eps, plus),
      ],
      axis=-1,
  )
  return jnp.dot(both, p["eh_proj"]["kernel"].astype(cfg.compute_dtype))


def module_logits(cfg: transformer.TransformerConfig, params: dict, p: dict, out_BxLxD):
  """A module's logits from its decoder layer's output: its own norm, then the shared head.

  Args:
    cfg: the model.
    params: the model's parameters (the shared head).
    p: the module's (`module`).
    out_BxLxD: the layer's output, [B, L, D].

  Returns:
    Float32 [B, L, V].
  """
  h = rms_norm(out_BxLxD, p["final_norm"]["scale"], cfg.norm_eps, cfg.norm_plus_one)
  return transformer.project(cfg, params, h)


def _positions(h_BxLxD, positions_L):
  return jnp.arange(h_BxLxD.shape[1]) if positions_L is None else positions_L


def loss(
    cfg: transformer.TransformerConfig,
    params: dict,
    h_BxLxD: jax.Array,
    targets_BxL: jax.Array,
    weights_DxBxL: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
    ahead=None,
) -> tuple[jax.Array, dict]:
  """The modules' weighted cross-entropy sum and their MoE aux.

  Args:
    cfg: the model, with `mtp_depth` > 0.
    params: the model's parameters (`mtp`, `embed`, `final_norm`, and `head` unless tied).
    h_BxLxD: the main model's last hidden states (before its final norm).
    targets_BxL: the main model's targets (the next tokens).
    weights_DxBxL: `weights` ([D, B, L]; `batch_weights`' [B, D, L] swapped).
    positions_L: [L] or [B, L]; default 0..L-1.
    segment_ids_BxL: packed rows' document ids: each module's layer attends within them.
    ahead: `(x_BxL, k, fill) -> x_BxL` shifted k places left along each row; default within
      the rows given (context parallelism passes one that reads the next rank's slice).

  Returns:
    `(Σ_k Σ_i weights[k, i] · CE_k(i), aux)`: aux the modules' MoE aux with a leading [depth]
    axis ({} for a dense model).
  """
  shift = _ahead if ahead is None else ahead
  # module k at i reads the token k ahead, t[i + k] = targets[i + k - 1]
  tokens_ahead = lambda k: shift(targets_BxL, k - 1, 0)
  positions_L = _positions(h_BxLxD, positions_L)
  states = _states(cfg, params, h_BxLxD, tokens_ahead, positions_L, segment_ids_BxL)
  total, auxes = jnp.zeros((), jnp.float32), []
  for k, (h, aux) in enumerate(states, start=1):
    if aux is not None:
      auxes.append(aux)
    logits = transformer.project(cfg, params, h)
    ce, _ = transformer.logits_loss(logits, shift(targets_BxL, k, 0), weights_DxBxL[k - 1])
    total = total + ce
  aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
  return total, aux


def logits(
    cfg: transformer.TransformerConfig,
    params: dict,
    h_BxLxD: jax.Array,
    tokens_ahead_DxBxL: jax.Array,
    positions_L: jax.Array | None = None,
) -> jax.Array:
  """Each module's logits, for drafting and inspection.

  Args:
    cfg: the model, with `mtp_depth` > 0.
    params: the model's parameters.
    h_BxLxD: the main model's last hidden states (before its final norm).
    tokens_ahead_DxBxL: for module k (row k - 1), the token k places ahead of each position.
    positions_L: [L] or [B, L]; default 0..L-1.

  Returns:
    Float32 [D, B, L, V]: module k's predictions of the token k + 1 places ahead.
  """
  ahead = lambda k: tokens_ahead_DxBxL[k - 1]
  states = _states(cfg, params, h_BxLxD, ahead, _positions(h_BxLxD, positions_L), None)
  return jnp.stack([transformer.project(cfg, params, h) for h, _ in states])


def ahead_over(axis_name: str):
  """`loss`'s `ahead` for rows split along the sequence over `axis_name` (context parallelism):
  each rank's slice continued by the next rank's first k entries, `fill` past the last rank's
  (gathered from every rank: k entries a row).

  Args:
    axis_name: the mesh axis the sequence is split over.

  Returns:
    `(x_BxS, k, fill) -> x_BxS`, to call inside a shard_map over `axis_name`.
  """

  def ahead(x_BxS, k: int, fill):
    if k == 0:
      return x_BxS
    if k > x_BxS.shape[1]:
      raise ValueError(
          f"mtp_depth reads {k} tokens ahead, beyond one context rank's {x_BxS.shape[1]}; "
          "use a longer sequence or fewer context ranks"
      )
    # every rank's first k (a few tokens per row), not a ppermute: the pipeline runs this in
    # its per-tick branch, where the executor admits no point-to-point collective
    firsts_RxBxK = jax.lax.all_gather(x_BxS[:, :k], axis_name)
    r = jax.lax.axis_index(axis_name)
    nxt = firsts_RxBxK[jnp.minimum(r + 1, jax.lax.axis_size(axis_name) - 1)]
    nxt = jnp.where(r == jax.lax.axis_size(axis_name) - 1, jnp.full_like(nxt, fill), nxt)
    return jnp.concatenate([x_BxS[:, k:], nxt], axis=1)

  return ahead
