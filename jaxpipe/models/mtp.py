"""Multi-token prediction (DeepSeek-V3 §2.2): `depth` sequential modules after the main model,
module k predicting the token k + 1 places ahead of each position.

Module k (1..D) takes the previous depth's hidden states h^{k-1} (the main model's, before its
final norm, for k = 1) and the embeddings of the tokens k places ahead, both normed, projects
their concatenation back to d_model (DeepSeek's checkpoints put the embedding first:
`eh_proj([enorm(e); hnorm(h)])`), runs one decoder layer over it, and predicts through its own
final norm and the model's shared output head. Its loss is the cross-entropy summed over the
positions whose target exists, over the main loss's token count T (the paper's 1/T); the
objective adds λ/D times their sum to the main loss.

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
  pad = jnp.full(x_BxL.shape[:1] + (k,), fill, x_BxL.dtype)
  return jnp.concatenate([x_BxL[:, k:], pad], axis=1)


def loss(
    cfg: transformer.TransformerConfig,
    params: dict,
    h_BxLxD: jax.Array,
    targets_BxL: jax.Array,
    weights_DxBxL: jax.Array,
    positions_L: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """The modules' weighted cross-entropy sum and their MoE aux.

  Args:
    cfg: the model, with `mtp_depth` > 0.
    params: the model's parameters (`mtp`, `embed`, and `head` unless tied).
    h_BxLxD: the main model's last hidden states (before its final norm).
    targets_BxL: the main model's targets (the next tokens).
    weights_DxBxL: `weights` ([D, B, L]; `batch_weights`' [B, D, L] swapped).
    positions_L: [L] or [B, L]; default 0..L-1.
    segment_ids_BxL: packed rows' document ids: each module's layer attends within them.

  Returns:
    `(Σ_k Σ_i weights[k, i] · CE_k(i), aux)`: aux the modules' MoE aux with a leading [depth]
    axis ({} for a dense model).
  """
  l = h_BxLxD.shape[1]
  positions_L = jnp.arange(l) if positions_L is None else positions_L
  eps, plus = cfg.norm_eps, cfg.norm_plus_one
  total, auxes, h = jnp.zeros((), jnp.float32), [], h_BxLxD
  for k in range(1, cfg.mtp_depth + 1):
    p = jax.tree.map(lambda a, k=k: a[k - 1], params["mtp"])
    # module k at i reads the token k ahead, t[i + k] = targets[i + k - 1]
    e_BxLxD = transformer.embed(cfg, params, _ahead(targets_BxL, k - 1, 0))
    both = jnp.concatenate(
        [
            rms_norm(e_BxLxD, p["enorm"]["scale"], eps, plus),
            rms_norm(h, p["hnorm"]["scale"], eps, plus),
        ],
        axis=-1,
    )
    x = jnp.dot(both, p["eh_proj"]["kernel"].astype(cfg.compute_dtype))
    out = transformer.Block(cfg, moe=cfg.moe is not None).apply(
        {"params": p["block"]}, x, positions_L, segment_ids_BxL
    )
    h, aux = out if cfg.moe is not None else (out, None)
    if aux is not None:
      auxes.append(aux)
    head = {**params, "final_norm": p["final_norm"]}
    ce, _ = transformer.head_loss(cfg, head, h, _ahead(targets_BxL, k, 0), weights_DxBxL[k - 1])
    total = total + ce
  aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
  return total, aux
