"""MoE routers: softmax top-k (Switch/Mixtral) and sigmoid top-k with a balancing bias
(DeepSeek-V3)."""

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp


class RouterSettings(Protocol):
  """The fields of `MoEConfig` the router reads."""

  num_experts: int
  top_k: int
  router: str
  norm_topk_prob: bool
  norm_top1: bool
  routed_scaling: float
  n_groups: int
  topk_groups: int
  jitter: float


class Routing(NamedTuple):
  """One routing decision for T tokens; arithmetic in float32."""

  idx_TxK: jax.Array  # chosen experts, best first
  w_TxK: jax.Array  # combine weights of the chosen experts
  probs_TxE: jax.Array  # per-token distribution over experts seen by the load-balancing loss
  logits_TxE: jax.Array  # raw router logits (the z-loss penalises their log-sum-exp)


def router_logits(
    w_DxE: jax.Array, x_TxD: jax.Array, rng: jax.Array | None = None, jitter: float = 0.0
) -> jax.Array:
  """The router's float32 logits.

  With `rng` and `jitter > 0` the input is scaled by U(1-jitter, 1+jitter) (Switch).

  Args:
    w_DxE: the router's weight, [D, E].
    x_TxD: the tokens, [T, D].
    rng: a PRNG key for the jitter; None: no jitter.
    jitter: the jitter's half-width.

  Returns:
    Float32 logits, [T, E].
  """
  x_TxD = x_TxD.astype(jnp.float32)
  if rng is not None and jitter > 0:
    x_TxD = x_TxD * jax.random.uniform(rng, x_TxD.shape, jnp.float32, 1.0 - jitter, 1.0 + jitter)
  return jnp.dot(x_TxD, w_DxE.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def group_mask(scores_TxE: jax.Array, n_groups: int, topk_groups: int, per_group: int) -> jax.Array:
  """1.0 on the experts of each token's `topk_groups` best groups of contiguous experts.

  A group scores the sum of its `per_group` best experts: 2 is DeepSeek-V3's rule, 1 (the max)
  DeepSeek-V2's.

  Args:
    scores_TxE: each token's expert scores, [T, E].
    n_groups: groups of E / n_groups contiguous experts.
    topk_groups: groups kept per token.
    per_group: experts summed for a group's score.

  Returns:
    Float32 [T, E]: 1.0 on the kept groups' experts, 0.0 elsewhere.
  """
  t, e = scores_TxE.shape
  grouped_TxGxM = scores_TxE.reshape(t, n_groups, e // n_groups)
  best = jax.lax.top_k(grouped_TxGxM, min(per_group, e // n_groups))[0]
  _, gidx_TxH = jax.lax.top_k(best.sum(-1), topk_groups)
  gmask_TxG = jax.nn.one_hot(gidx_TxH, n_groups, dtype=jnp.float32).sum(1)
  return jnp.repeat(gmask_TxG, e // n_groups, axis=1)


def route(
    cfg: RouterSettings,
    w_DxE: jax.Array,
    bias_E: jax.Array | None,
    x_TxD: jax.Array,
    rng: jax.Array | None = None,
) -> Routing:
  """Top-k routing of T tokens.

  `bias_E` steers only the sigmoid router's choice, never its weights; it is balanced outside
  the gradient (auxiliary-loss-free balancing).

  Args:
    cfg: the router's settings (`MoEConfig`'s fields).
    w_DxE: the router's weight, [D, E].
    bias_E: the sigmoid router's balancing bias, [E]; None: none.
    x_TxD: the tokens, [T, D].
    rng: a PRNG key for the router's jitter; None: no jitter.

  Returns:
    The `Routing`: chosen experts [T, K] (best first), their combine weights [T, K], the
    per-token distribution over experts [T, E] and the raw logits [T, E].

  Raises:
    ValueError: an unknown `cfg.router`.
  """
  logits = router_logits(w_DxE, x_TxD, rng, cfg.jitter)
  if cfg.router == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    select, probs, per_group = scores, scores, 1
  elif cfg.router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    # The bias is balanced by a counter outside the gradient (auxiliary-loss-free balancing).
    select = (
        scores if bias_E is None else scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    )
    probs, per_group = scores / scores.sum(-1, keepdims=True), 2
  else:
    raise ValueError(f"router={cfg.router!r} is unknown; use 'softmax' or 'sigmoid'")
  if cfg.n_groups > 1:
    keep = group_mask(select, cfg.n_groups, cfg.topk_groups, per_group)
    select = jnp.where(keep > 0, select, -jnp.inf)
  _, idx = jax.lax.top_k(select, cfg.top_k)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  if cfg.norm_topk_prob and (cfg.top_k > 1 or cfg.norm_top1 or cfg.router == "sigmoid"):
    w = w / w.sum(-1, keepdims=True)
  return Routing(idx.astype(jnp.int32), w * cfg.routed_scaling, probs, logits)


def load_balancing_loss(
    probs_sum_E: jax.Array, counts_E: jax.Array, n_tokens, top_k: int
) -> jax.Array:
  """Switch loss `E * sum_e f_e * P_e`.

  f_e is expert e's share of the T*K assignments, P_e its mean probability. Takes sums so that
  the caller can add them over token shards first; 1.0 at perfect balance.

  Args:
    probs_sum_E: each expert's probability summed over the tokens, [E].
    counts_E: assignments per expert, [E].
    n_tokens: T, the tokens the sums cover.
    top_k: K, experts per token.

  Returns:
    The loss, a float32 scalar.
  """
  e = probs_sum_E.shape[0]
  f_E = counts_E.astype(jnp.float32) / (n_tokens * top_k)
  return e * jnp.sum(f_E * probs_sum_E / n_tokens)


def z_loss(logits_TxE: jax.Array) -> jax.Array:
  """Per-token squared log-sum-exp of the logits, summed (ST-MoE).

  Divide by the token count for the mean.

  Args:
    logits_TxE: the router's logits, [T, E].

  Returns:
    The sum over tokens, a scalar.
  """
  return jnp.sum(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2)


def update_expert_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's step: raise the bias of underloaded experts by `rate`, lower overloaded ones.

  Leading axes (stacked layers) are independent.

  Args:
    bias_E: the balancing bias, [..., E].
    tokens_per_expert_E: the step's tokens per expert, [..., E].
    rate: the bias update speed.

  Returns:
    The new bias, [..., E]: `bias + rate * sign(mean load - load)`.
  """
  load = tokens_per_expert_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(load.mean(-1, keepdims=True) - load).astype(bias_E.dtype)
