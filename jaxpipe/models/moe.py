"""Mixture-of-experts FFN: router -> dispatch -> SwiGLU experts (grouped GEMM) -> combine.

Experts are sharded over an expert mesh axis and tokens over the data axes that include it.
`moe_ffn` is the per-device program; `moe_layer` runs it on a [B, L, D] batch: directly when
called inside a `shard_map` that splits the expert axis, else in a `shard_map` over the mesh
it is given or the one set by `with expert_parallel(mesh):`, else on one device.
`dense_reference` computes the same function on one device, every expert on every token, and
is what the sharded layer is tested against.
"""

import contextlib
import contextvars
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpipe.models import router as router_lib
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.parallel import expert as ep_lib
from jaxpipe.parallel import tensor as tp_lib

Params = dict[str, jax.Array]
ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
DROPLESS_IMPLS = ("auto", "padded", "ragged", "ragged_emulated")
LB_LOSS_FORMS = ("per_layer", "pooled")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE FFN; ep-independent checks run at construction, `validate(ep)` adds the mesh ones."""

  num_experts: int = 8  # routed experts E
  top_k: int = 2  # experts per token K
  d_ff: int = 64  # hidden width of each SwiGLU expert
  num_shared_experts: int = 0  # always-on experts, fused into one SwiGLU of width n * d_ff
  router: str = "softmax"  # 'softmax' (Switch/Mixtral) or 'sigmoid' (DeepSeek-V3)
  norm_topk_prob: bool = (
      True  # renormalise the K chosen weights to sum 1 (Mixtral; Qwen3's option; DeepSeek-V3's)
  )
  norm_top1: bool = (
      False  # softmax, K = 1: renormalise too (weight 1, as Mixtral/Qwen3); False: Switch's p
  )
  routed_scaling: float = 1.0  # multiplier on the routed weights (DeepSeek-V3 uses 2.5)
  n_groups: int = 1  # contiguous expert groups for group-limited routing; 1 = off
  topk_groups: int = 1  # groups a token may use (node-limited when groups are ranks)
  jitter: float = 0.0  # router input noise U(1-j, 1+j), applied only when an rng is given
  lb_loss_coef: float = 0.01  # weight of the Switch load-balancing loss
  lb_loss_form: str = (
      "per_layer"  # 'per_layer' (Megatron) or 'pooled' over layers (transformers): aux_objective
  )
  z_loss_coef: float = 0.001  # weight of the router z-loss
  bias_update_rate: float = 0.0  # sigmoid router's balancing-bias step per training step; 0 = off
  dispatch: str = (
      "dropless"  # 'dropless' or 'capacity' (fixed buffers, overflow dropped and counted)
  )
  capacity_factor: float = 1.25  # capacity mode: rows per destination = cf * T * min(K, ep) / ep
  dropless_impl: str = (
      "auto"  # 'auto' (ragged on GPU/TPU, else padded), 'padded', 'ragged', 'ragged_emulated'
  )
  fp8_dispatch: bool = False  # send the dispatch payload as e4m3 with per-block scales
  fp8_block: int = 128  # channels sharing one fp8 scale
  every: int = 1  # in the LM: layers k-1, 2k-1, ... use this FFN, the rest the dense one

  def __post_init__(self):
    e, k = self.num_experts, self.top_k
    if e < 1 or k < 1:
      raise ValueError(f"num_experts={e} and top_k={k} must be >= 1")
    if k > e:
      raise ValueError(f"top_k={k} exceeds num_experts={e}; use top_k <= {e}")
    if self.capacity_factor <= 0:
      raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25)")
    if self.router not in ROUTERS:
      raise ValueError(f"router={self.router!r} is unknown; use one of {ROUTERS}")
    if self.dispatch not in DISPATCH:
      raise ValueError(f"dispatch={self.dispatch!r} is unknown; use one of {DISPATCH}")
    if self.lb_loss_form not in LB_LOSS_FORMS:
      raise ValueError(f"lb_loss_form={self.lb_loss_form!r} is unknown; use one of {LB_LOSS_FORMS}")
    if self.dropless_impl not in DROPLESS_IMPLS:
      raise ValueError(
          f"dropless_impl={self.dropless_impl!r} is unknown; use one of {DROPLESS_IMPLS}"
      )
    if self.n_groups < 1 or e % self.n_groups:
      raise ValueError(f"n_groups={self.n_groups} must divide num_experts={e}")
    if not 1 <= self.topk_groups <= self.n_groups:
      raise ValueError(f"topk_groups={self.topk_groups} must lie in [1, n_groups={self.n_groups}]")
    if k > self.topk_groups * (e // self.n_groups):
      raise ValueError(
          f"top_k={k} exceeds the {self.topk_groups * (e // self.n_groups)} experts in "
          f"topk_groups={self.topk_groups} groups of {e // self.n_groups}; "
          "raise topk_groups or lower top_k"
      )
    if self.bias_update_rate and self.router != "sigmoid":
      raise ValueError(f"bias_update_rate={self.bias_update_rate} needs router='sigmoid'")
    if self.fp8_block < 1:
      raise ValueError(f"fp8_block={self.fp8_block} must be >= 1")
    if self.every < 1:
      raise ValueError(f"every={self.every} must be >= 1 (1: an MoE FFN in every layer)")

  def validate(self, ep: int) -> None:
    """Checks against an expert axis of size `ep`.

    Args:
      ep: the expert axis's size.

    Raises:
      ValueError: `num_experts` is not divisible by `ep`, or expert groups (`n_groups`) neither
        divide nor are divisible by `ep` (a group must be a set of whole ranks or lie within one).
    """
    e = self.num_experts
    if ep < 1 or e % ep:
      raise ValueError(
          f"num_experts={e} is not divisible by the expert axis size ep={ep}; "
          f"use a multiple of {ep} experts or a smaller expert axis"
      )
    if self.n_groups > 1 and self.n_groups % ep and ep % self.n_groups:
      raise ValueError(
          f"n_groups={self.n_groups} does not fit ep={ep}: a group must be a set of "
          "whole ranks or lie within one rank; use n_groups dividing or divisible by ep"
      )


def init_moe_params(cfg: MoEConfig, key: jax.Array, d_model: int, dtype=jnp.float32) -> Params:
  """Fan-in scaled normal weights; the balancing bias starts at zero.

  Args:
    cfg: the MoE FFN.
    key: a PRNG key.
    d_model: D, the model width.
    dtype: the experts' (and shared experts') weight dtype; the router is float32.

  Returns:
    The params: `router_DxE` [D, E]; `wi_gate_ExDxF`, `wi_up_ExDxF` [E, D, F] and `wo_ExFxD`
    [E, F, D]; `expert_bias_E` [E] for the sigmoid router; with shared experts
    `shared_gate_DxS`, `shared_up_DxS` [D, S] and `shared_down_SxD` [S, D], S = n · d_ff.
  """
  e, f = cfg.num_experts, cfg.d_ff
  ks = jax.random.split(key, 7)
  nrm = lambda k, shape, fan_in: (jax.random.normal(k, shape) / jnp.sqrt(fan_in)).astype(dtype)
  p = {
      "router_DxE": nrm(ks[0], (d_model, e), d_model).astype(jnp.float32),
      "wi_gate_ExDxF": nrm(ks[1], (e, d_model, f), d_model),
      "wi_up_ExDxF": nrm(ks[2], (e, d_model, f), d_model),
      "wo_ExFxD": nrm(ks[3], (e, f, d_model), f),
  }
  if cfg.router == "sigmoid":
    p["expert_bias_E"] = jnp.zeros((e,), jnp.float32)
  if cfg.num_shared_experts:
    s = cfg.num_shared_experts * f
    p["shared_gate_DxS"] = nrm(ks[4], (d_model, s), d_model)
    p["shared_up_DxS"] = nrm(ks[5], (d_model, s), d_model)
    p["shared_down_SxD"] = nrm(ks[6], (s, d_model), s)
  return p


def param_specs(params: Params, ep_axis: str | None) -> dict[str, P]:
  """Experts sharded over the expert axis on their leading dim; the rest replicated.

  Args:
    params: the MoE FFN's params (names as `init_moe_params` gives them).
    ep_axis: the expert mesh axis; None: every leaf replicated.

  Returns:
    A `PartitionSpec` per param name.
  """
  return {k: P(ep_axis) if k.startswith(("wi_", "wo_")) else P() for k in params}


def _swiglu(x, gate, up, down):
  h = jax.nn.silu(jnp.dot(x, gate, preferred_element_type=jnp.float32))
  h = h * jnp.dot(x, up, preferred_element_type=jnp.float32)
  return jnp.dot(h.astype(x.dtype), down, preferred_element_type=jnp.float32)


def _shared_experts(params: Params, x_TxD: jax.Array, fp8: str) -> jax.Array:
  """The shared experts' SwiGLU; its GEMMs in the `fp8` recipe (float32 result)."""
  if fp8 == "none":
    return _swiglu(
        x_TxD, params["shared_gate_DxS"], params["shared_up_DxS"], params["shared_down_SxD"]
    )
  mm = lambda a, name, key: fp8_lib.dot(
      a, params[key], 1, fp8, params.get(fp8_lib.STATE_PREFIX + name), x_TxD.dtype
  ).astype(jnp.float32)
  h = jax.nn.silu(mm(x_TxD, "shared_gate", "shared_gate_DxS")) * mm(
      x_TxD, "shared_up", "shared_up_DxS"
  )
  return mm(h.astype(x_TxD.dtype), "shared_down", "shared_down_SxD")


def fp8_state_names(cfg: MoEConfig) -> tuple[str, ...]:
  """Delayed-scaling state leaves of an MoE FFN's params, one per GEMM (see fp8.py).

  Args:
    cfg: the MoE FFN.

  Returns:
    The leaves' names: the routed experts' three GEMMs, then the shared experts' if any.
  """
  gemms = ("wi_gate", "wi_up", "wo") + (
      ("shared_gate", "shared_up", "shared_down") if cfg.num_shared_experts else ()
  )
  return tuple(fp8_lib.STATE_PREFIX + g for g in gemms)


def experts_grouped(
    params: Params, recv: ep_lib.Received, n_local: int, fp8: str = "none"
) -> jax.Array:
  """SwiGLU of every received (row, local expert) as a grouped GEMM, weighted and summed per row.

  Args:
    params: this device's expert weights (E/ep experts), and fp8 state leaves for `'delayed'`.
    recv: the rows `dispatch` delivered: tokens [N, D], local expert ids [N, K] (`n_local`: not
      here), weights [N, K].
    n_local: experts on this device, E/ep.
    fp8: the GEMMs' recipe (`jaxpipe.ops.fp8.RECIPES`).

  Returns:
    Each row's weighted sum of its experts' outputs, [N, D] float32.
  """
  n, k = recv.eid_NxK.shape
  flat = recv.eid_NxK.reshape(-1)
  # Sorting puts the (row, expert) entries of expert 0 first, ..., then the empty ones; a row
  # has at most min(K, n_local) experts here, which bounds the entries that are real.
  m = n * min(k, n_local)
  order = jnp.argsort(flat, stable=True)[:m]
  sizes = jnp.zeros((n_local + 1,), jnp.int32).at[flat].add(1)[:n_local]
  rows = order // k
  xs = recv.x_NxD[rows]
  # Rows past the groups are the backend's to fill (zeros on CPU): select them away right at
  # each product, so nothing non-finite reaches a nonlinearity or its gradient.
  real = (jnp.arange(m) < sizes.sum())[:, None]
  gmm = lambda a, name, key: jnp.where(
      real,
      fp8_lib.grouped(a, params[key], sizes, fp8, params.get(fp8_lib.STATE_PREFIX + name)),
      0.0,
  )
  h = jax.nn.silu(gmm(xs, "wi_gate", "wi_gate_ExDxF")) * gmm(xs, "wi_up", "wi_up_ExDxF")
  ys = gmm(h.astype(xs.dtype), "wo", "wo_ExFxD")
  ws = recv.w_NxK.reshape(-1)[order]  # 0 on entries that are not experts of this rank
  return jax.ops.segment_sum(ys * ws[:, None], rows, num_segments=n)


def _resolve_impl(cfg: MoEConfig) -> tuple[float | None, str]:
  if cfg.dispatch == "capacity":
    return cfg.capacity_factor, "fixed"
  impl = cfg.dropless_impl
  if impl == "auto":
    impl = "ragged" if jax.default_backend() in ("gpu", "tpu") else "padded"
  return None, "fixed" if impl == "padded" else impl


def _axes_size(axes) -> int:
  return 1 if not axes else jax.lax.psum(1, tuple(axes))


def moe_ffn(
    cfg: MoEConfig,
    params: Params,
    x_TxD: jax.Array,
    *,
    ep_axis: str | None,
    token_axes: tuple[str, ...] = (),
    rng: jax.Array | None = None,
    fp8: str = "none",
) -> tuple[jax.Array, dict[str, Any]]:
  """MoE FFN of this device's T tokens inside `shard_map`.

  Losses and statistics are over all tokens of `token_axes`.

  Args:
    cfg: the MoE FFN.
    params: this device's params, holding its E/ep experts.
    x_TxD: this device's tokens, [T, D].
    ep_axis: the expert mesh axis; None: one device.
    token_axes: all mesh axes the tokens are split over; they must include `ep_axis`.
    rng: a PRNG key for the router's jitter (folded in per token shard); None: no jitter.
    fp8: the experts' GEMM recipe (`jaxpipe.ops.fp8`; delayed takes its `fp8_*` params).

  Returns:
    `(y, aux)`: the output [T, D] in `x_TxD`'s dtype, and the weighted auxiliary `loss`, its
    parts and the routing statistics (`AUX_KEYS`).

  Raises:
    ValueError: `token_axes` lacks `ep_axis`, d_model is not divisible by `fp8_block` with fp8
      dispatch, or the config does not fit the expert axis.
  """
  ep = jax.lax.axis_size(ep_axis) if ep_axis else 1
  cfg.validate(ep)
  if ep > 1 and ep_axis not in token_axes:
    raise ValueError(
        f"token_axes={token_axes} must include the expert axis {ep_axis!r}: "
        "expert parallelism moves tokens that are split over it"
    )
  t, d = x_TxD.shape
  if cfg.fp8_dispatch and d % cfg.fp8_block:
    raise ValueError(f"fp8 dispatch needs d_model={d} divisible by fp8_block={cfg.fp8_block}")
  if rng is not None and token_axes:
    for a in token_axes:  # independent jitter on every token shard
      rng = jax.random.fold_in(rng, jax.lax.axis_index(a))
  r = router_lib.route(cfg, params["router_DxE"], params.get("expert_bias_E"), x_TxD, rng)
  cf, impl = _resolve_impl(cfg)
  plan = ep_lib.make_plan(t, cfg.top_k, cfg.num_experts, ep, cf, impl)
  recv, handle = ep_lib.dispatch(
      x_TxD,
      r.idx_TxK,
      r.w_TxK,
      plan,
      axis=ep_axis,
      fp8_block=cfg.fp8_block if cfg.fp8_dispatch else None,
  )
  out_NxD = experts_grouped(params, recv, plan.n_local, fp8)
  y = ep_lib.combine(out_NxD, handle, plan, axis=ep_axis)
  if cfg.num_shared_experts:
    y = y + _shared_experts(params, x_TxD, fp8)
  lay = handle.layout
  psum = (lambda v: jax.lax.psum(v, token_axes)) if token_axes else (lambda v: v)
  n_tokens = t * _axes_size(token_axes)
  stats = {
      "tokens_per_expert": psum(lay.num_tokens_per_expert_E),
      "dropped": psum(jnp.sum(~lay.kept_TxK, dtype=jnp.int32)),
      "dropped_pairs": psum(
          jnp.sum(lay.is_token_in_rank_TxR, dtype=jnp.int32)
          - jnp.sum(lay.carrier_TxK, dtype=jnp.int32)
      ),
      "recv_rows": psum(jnp.sum(recv.eid_NxK < plan.n_local, axis=1).astype(bool).sum()),
  }
  aux = _aux(
      cfg,
      psum(r.probs_TxE.sum(0)),
      stats["tokens_per_expert"],
      psum(router_lib.z_loss(r.logits_TxE)),
      n_tokens,
  )
  return y.astype(x_TxD.dtype), {**aux, **stats}


def _aux(cfg: MoEConfig, probs_sum_E, counts_E, z_sum, n_tokens) -> dict[str, jax.Array]:
  """The layer's losses; its 'loss' holds the load-balancing term only in the per-layer form."""
  lb = router_lib.load_balancing_loss(probs_sum_E, counts_E, n_tokens, cfg.top_k)
  z = z_sum / n_tokens
  counts = counts_E.astype(jnp.float32)
  lb_term = cfg.lb_loss_coef * lb if cfg.lb_loss_form == "per_layer" else 0.0
  return {
      "loss": lb_term + cfg.z_loss_coef * z,
      "lb_loss": lb,
      "z_loss": z,
      "imbalance": counts.max() / counts.mean(),
      "router_probs": probs_sum_E / n_tokens,
  }


AUX_KEYS = (
    "loss",
    "lb_loss",
    "z_loss",
    "imbalance",
    "router_probs",
    "tokens_per_expert",
    "dropped",
    "dropped_pairs",
    "recv_rows",
)


def aux_objective(cfg: MoEConfig, aux_GxX: dict[str, jax.Array]) -> jax.Array:
  """Auxiliary loss of G MoE layers, to add to the mean cross-entropy.

  With f_le = c_le / T (assignments to expert e in layer l per token; they sum to K) and P_le the
  mean router probability of e in layer l over the T tokens:

  - 'per_layer' (Megatron's): sum_l lb_loss_coef · (E/K) sum_e f_le P_le + z_loss_coef · z_l,
    1 per layer at perfect balance, G for the model;
  - 'pooled' (transformers' `load_balancing_loss_func`): lb_loss_coef · E sum_e f_e P_e with f_e
    and P_e averaged over the layers first, K at perfect balance; plus the same z-losses.

  When every layer routes alike, pooled = (K / G) × per-layer sum: matching a transformers run
  takes lb_loss_coef = router_aux_loss_coef with 'pooled', or router_aux_loss_coef · K / G with
  'per_layer' at balance. The pooled form couples the layers, so it needs all of them in one
  program (`transformer.loss_and_aux`); per-layer losses ride on each layer's gradient anywhere.

  Args:
    cfg: the MoE FFN.
    aux_GxX: the layers' aux (`AUX_KEYS`), each with a leading G axis.

  Returns:
    The auxiliary loss, a scalar.
  """
  loss = aux_GxX["loss"].sum()
  if cfg.lb_loss_form == "pooled":
    counts_GxE = aux_GxX["tokens_per_expert"].astype(jnp.float32)
    f_E = (cfg.top_k * counts_GxE / counts_GxE.sum(-1, keepdims=True)).mean(0)
    loss = loss + cfg.lb_loss_coef * cfg.num_experts * jnp.sum(
        f_E * aux_GxX["router_probs"].mean(0)
    )
  return loss


@dataclasses.dataclass(frozen=True)
class _Placement:
  mesh: Any
  ep_axis: str | None
  batch_axes: tuple[str, ...]
  seq_axis: str | None


_PLACEMENT: contextvars.ContextVar[_Placement | None] = contextvars.ContextVar(
    "moe_placement", default=None
)


@contextlib.contextmanager
def expert_parallel(
    mesh,
    ep_axis: str | None = "ep",
    batch_axes: tuple[str, ...] = ("dp", "ep"),
    seq_axis: str | None = "cp",
):
  """While tracing inside, `moe_layer` calls without a mesh shard over `mesh` this way.

  Args:
    mesh: the device mesh.
    ep_axis: the expert axis.
    batch_axes: the axes the batch is split over.
    seq_axis: the axis the sequence is split over.
  """
  token = _PLACEMENT.set(_Placement(mesh, ep_axis, tuple(batch_axes), seq_axis))
  try:
    yield
  finally:
    _PLACEMENT.reset(token)


def _local_experts(cfg: MoEConfig, params: Params, ep_axis: str | None, ep: int) -> Params:
  """This rank's slice of expert weights that arrive whole (replicated into a `shard_map`)."""
  if ep == 1 or params["wi_gate_ExDxF"].shape[0] != cfg.num_experts:
    return params
  n = cfg.num_experts // ep
  start = jax.lax.axis_index(ep_axis) * n
  return {
      k: jax.lax.dynamic_slice_in_dim(v, start, n) if k.startswith(("wi_", "wo_")) else v
      for k, v in params.items()
  }


def moe_layer(
    cfg: MoEConfig,
    params: Params,
    x_BxLxD: jax.Array,
    *,
    mesh=None,
    ep_axis: str | None = "ep",
    batch_axes: tuple[str, ...] = ("dp", "ep"),
    seq_axis: str | None = "cp",
    rng: jax.Array | None = None,
    fp8: str = "none",
) -> tuple[jax.Array, dict[str, Any]]:
  """MoE FFN of a [B, L, D] batch, placed as the module docstring says.

  Axes named here but absent from the mesh are ignored.

  Args:
    cfg: the MoE FFN.
    params: the params: all experts, or this rank's E/ep inside a `shard_map` over `ep_axis`.
    x_BxLxD: the tokens, [B, L, D] (the local block inside a `shard_map`).
    mesh: the mesh to shard over; None: the one set by `expert_parallel`, else one device.
    ep_axis: the expert axis.
    batch_axes: the axes the batch is split over.
    seq_axis: the axis the sequence is split over.
    rng: a PRNG key for the router's jitter; None: no jitter.
    fp8: the experts' GEMM recipe, as `moe_ffn` takes it.

  Returns:
    `(y, aux)`: the output [B, L, D], and the weighted auxiliary `loss` to add to the training
    loss with the routing statistics (`AUX_KEYS`), over all tokens.

  Raises:
    ValueError: the config does not fit the expert axis, or as `moe_ffn` raises.
  """
  b, l, d = x_BxLxD.shape
  placement = _PLACEMENT.get()
  if mesh is None and placement is not None:
    mesh, ep_axis, batch_axes, seq_axis = (
        placement.mesh,
        placement.ep_axis,
        placement.batch_axes,
        placement.seq_axis,
    )
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if ep_axis is not None and ep_axis in manual:  # already inside a shard_map: x is the local block
    token_axes = tuple(a for a in batch_axes + (seq_axis,) if a in manual)
    if tp_lib.sequence_parallel():  # the stream holds this tensor rank's slice of the tokens
      token_axes += (tp_lib.tensor_axis(),)
    ep = jax.lax.axis_size(ep_axis)
    y, aux = moe_ffn(
        cfg,
        _local_experts(cfg, params, ep_axis, ep),
        x_BxLxD.reshape(b * l, d),
        ep_axis=ep_axis,
        token_axes=token_axes,
        rng=rng,
        fp8=fp8,
    )
    return y.reshape(b, l, d), aux
  if mesh is None:
    y, aux = moe_ffn(cfg, params, x_BxLxD.reshape(b * l, d), ep_axis=None, rng=rng, fp8=fp8)
    return y.reshape(b, l, d), aux
  names = mesh.axis_names
  ep_axis = ep_axis if ep_axis in names else None
  batch_axes = tuple(a for a in batch_axes if a in names)
  seq_axis = seq_axis if seq_axis in names else None
  token_axes = batch_axes + ((seq_axis,) if seq_axis else ())
  x_spec = P(batch_axes or None, seq_axis, None)
  cfg.validate(mesh.shape[ep_axis] if ep_axis else 1)

  def local(params, x, rng):
    bl, ll, _ = x.shape
    y, aux = moe_ffn(
        cfg, params, x.reshape(bl * ll, d), ep_axis=ep_axis, token_axes=token_axes, rng=rng, fp8=fp8
    )
    return y.reshape(bl, ll, d), aux

  aux_spec = {k: P() for k in AUX_KEYS}
  fn = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(param_specs(params, ep_axis), x_spec, P()),
      out_specs=(x_spec, aux_spec),
  )
  return fn(params, x_BxLxD, rng)


def dense_reference(
    cfg: MoEConfig,
    params: Params,
    x_TxD: jax.Array,
    keep_TxK: jax.Array | None = None,
    x_expert_TxD: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
  """One device, no dispatch: every expert on every token, mixed by the routing weights.

  Args:
    cfg: the MoE FFN.
    params: all experts' params.
    x_TxD: the tokens, [T, D].
    keep_TxK: zeroes the assignments a capacity-mode layer dropped; None keeps all.
    x_expert_TxD: what the routed experts see instead of `x_TxD` (the fp8 round trip of the
      dispatch payload); None: `x_TxD`.

  Returns:
    `(y, aux)`: the output [T, D] in `x_TxD`'s dtype, and the auxiliary losses with
    `tokens_per_expert`.
  """
  r = router_lib.route(cfg, params["router_DxE"], params.get("expert_bias_E"), x_TxD)
  w_TxK = r.w_TxK if keep_TxK is None else jnp.where(keep_TxK, r.w_TxK, 0.0)
  mix_TxE = (
      jnp.zeros((x_TxD.shape[0], cfg.num_experts), jnp.float32)
      .at[jnp.arange(x_TxD.shape[0])[:, None], r.idx_TxK]
      .add(w_TxK)
  )
  hp = jax.lax.Precision.HIGHEST
  xe = x_TxD if x_expert_TxD is None else x_expert_TxD
  h_ExTxF = jax.nn.silu(
      jnp.einsum("td,edf->etf", xe, params["wi_gate_ExDxF"], precision=hp)
  ) * jnp.einsum("td,edf->etf", xe, params["wi_up_ExDxF"], precision=hp)
  y_ExTxD = jnp.einsum("etf,efd->etd", h_ExTxF, params["wo_ExFxD"], precision=hp)
  y = jnp.einsum("etd,te->td", y_ExTxD, mix_TxE, precision=hp)
  if cfg.num_shared_experts:
    y = y + _swiglu(
        x_TxD, params["shared_gate_DxS"], params["shared_up_DxS"], params["shared_down_SxD"]
    )
  counts_E = jnp.zeros((cfg.num_experts,), jnp.int32).at[r.idx_TxK.ravel()].add(1)
  aux = _aux(cfg, r.probs_TxE.sum(0), counts_E, router_lib.z_loss(r.logits_TxE), x_TxD.shape[0])
  return y.astype(x_TxD.dtype), {**aux, "tokens_per_expert": counts_E}


class MoEFFN(nn.Module):
  """Flax face of `moe_layer`: parameters from `init_moe_params`, placement from the context."""

  cfg: MoEConfig
  dtype: Any = jnp.float32  # compute dtype of the experts; the router stays float32
  fp8: str = "none"  # the experts' GEMM recipe (jaxpipe.ops.fp8); the router stays float32

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """Runs `moe_layer` on `x_BxLxD` with the module's params.

    At initialisation it only makes the params (`init_moe_params`; fp8 state leaves as ones) and
    returns zeros and an empty aux: the output is discarded, and tracing the dispatch would cost
    compile time.

    Args:
      x_BxLxD: the tokens, [B, L, D].

    Returns:
      `(y, aux)` as `moe_layer` returns them, y [B, L, D] in the module's dtype.

    Raises:
      ValueError: MoE parameters are missing from the module's params.
    """
    d = x_BxLxD.shape[-1]
    shapes = jax.eval_shape(lambda k: init_moe_params(self.cfg, k, d), jax.random.key(0))
    if self.fp8 == "delayed":
      shapes = {
          **shapes,
          **{n: jax.ShapeDtypeStruct((3,), jnp.float32) for n in fp8_state_names(self.cfg)},
      }
    if (
        self.is_initializing()
    ):  # the output is discarded; tracing the dispatch would cost compile time
      for name in shapes:
        if name.startswith(fp8_lib.STATE_PREFIX):
          self.param(name, nn.initializers.ones, (3,), jnp.float32)
        else:
          self.param(name, lambda key, name=name: init_moe_params(self.cfg, key, d)[name])
      return jnp.zeros_like(x_BxLxD), {}
    # Read, not `self.param`: inside a shard_map that splits experts over the expert axis (the
    # pipeline executor) the expert weights arrive as this rank's E/ep slice, which `moe_layer`
    # takes as is, while `self.param` would insist on the full init shape.
    missing = [name for name in shapes if not self.has_variable("params", name)]
    if missing:
      raise ValueError(f"MoE parameters {missing} are missing; build them with init_moe_params")
    params = {name: self.get_variable("params", name) for name in shapes}
    params = {
        k: v
        if k in ("router_DxE", "expert_bias_E") or k.startswith(fp8_lib.STATE_PREFIX)
        else v.astype(self.dtype)
        for k, v in params.items()
    }
    return moe_layer(self.cfg, params, x_BxLxD.astype(self.dtype), fp8=self.fp8)


def step_metrics(aux_GxX: dict[str, jax.Array], n_tokens, top_k: int) -> dict[str, jax.Array]:
  """Scalar training metrics from the aux of G MoE layers (leading axis G).

  Args:
    aux_GxX: the layers' aux (`AUX_KEYS`), each with a leading G axis.
    n_tokens: tokens each layer routed.
    top_k: K, experts per token.

  Returns:
    `moe_aux_loss` (summed over layers), `moe_lb_loss` and `moe_z_loss` (means), `moe_imbalance`
    (the worst layer's max / mean tokens per expert) and `moe_dropped_frac`.
  """
  counts = aux_GxX["tokens_per_expert"].astype(jnp.float32)
  return {
      "moe_aux_loss": aux_GxX["loss"].sum(),
      "moe_lb_loss": aux_GxX["lb_loss"].mean(),
      "moe_z_loss": aux_GxX["z_loss"].mean(),
      "moe_imbalance": (counts.max(-1) / counts.mean(-1)).max(),
      "moe_dropped_frac": aux_GxX["dropped"].sum() / (n_tokens * top_k * counts.shape[0]),
  }


COUNT_KEYS = ("tokens_per_expert", "dropped", "dropped_pairs", "recv_rows")


def train_metrics(
    aux_sum_GxX: dict[str, jax.Array], microbatches: int, n_tokens, top_k: int
) -> dict[str, jax.Array]:
  """A training step's MoE metrics from its G layers' aux summed over its micro-batches.

  Counts add up over micro-batches and losses and ratios are averaged.

  Args:
    aux_sum_GxX: the layers' aux summed over the micro-batches, each with a leading G axis.
    microbatches: the step's micro-batches.
    n_tokens: the step's tokens.
    top_k: K, experts per token.

  Returns:
    `step_metrics`'s, plus `moe_tokens_per_expert` [G, E], which the train step consumes to move
    the balancing biases (`update_biases`).
  """
  aux = {k: v if k in COUNT_KEYS else v / microbatches for k, v in aux_sum_GxX.items()}
  return {**step_metrics(aux, n_tokens, top_k), "moe_tokens_per_expert": aux["tokens_per_expert"]}


def update_biases(
    cfg: MoEConfig, old_params: Any, new_params: Any, tokens_per_expert_GxE: jax.Array
) -> Any:
  """Every `expert_bias_E` leaf becomes its old value plus the balancing step.

  The optimizer's update of the bias (weight decay; its gradient is zero) is discarded: the bias
  moves only by DeepSeek-V3's sign rule (not at all when `cfg.bias_update_rate` is 0).

  Args:
    cfg: the MoE FFN.
    old_params: the parameters before the optimizer step.
    new_params: the parameters after it.
    tokens_per_expert_GxE: the step's tokens per expert, [G, E], reshaped onto each bias leaf.

  Returns:
    `new_params` with every `expert_bias_E` leaf replaced.
  """

  def pick(path, old, new):
    if getattr(path[-1], "key", None) != "expert_bias_E":
      return new
    counts = tokens_per_expert_GxE.reshape(old.shape)
    return (
        router_lib.update_expert_bias(old, counts, cfg.bias_update_rate)
        if cfg.bias_update_rate
        else old
    )

  return jax.tree_util.tree_map_with_path(pick, old_params, new_params)


EXPERT_WEIGHTS = ("wi_gate_ExDxF", "wi_up_ExDxF", "wo_ExFxD")


def expert_shardings(tree: Any, mesh, ep_axis: str = "ep") -> Any:
  """NamedShardings for a tree holding model parameters (train state, optimizer moments too).

  Expert weights (any leading stacked axes, then [E, ., .]) are split over `ep_axis` on E, so
  each rank stores its own experts; everything else is replicated.

  Args:
    tree: a tree of arrays or shapes.
    mesh: the device mesh.
    ep_axis: the expert axis; absent from the mesh: everything replicated.

  Returns:
    A tree of `NamedSharding`s of the same structure.
  """
  from jax.sharding import NamedSharding

  def spec(path, leaf):
    if getattr(path[-1], "key", None) in EXPERT_WEIGHTS and ep_axis in mesh.axis_names:
      return NamedSharding(mesh, P(*(None,) * (len(leaf.shape) - 3), ep_axis))
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(spec, tree)
