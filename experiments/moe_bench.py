"""MoE layer speed: `python -m experiments.moe_bench [--tokens 256 --d_model 128 --experts 16 ...]`.

Forward+backward tokens/s of the expert-parallel MoE layer (capacity and dropless dispatch, every
expert-axis size that fits the devices; ragged and fp8 dispatch where the backend has them)
against the dense one-device reference, with the step's load statistics, then the time and
payload bytes/s of dispatch and of combine alone. Without accelerators it runs on 8 host CPU
devices, where the numbers show relative cost only: host "devices" share the CPU's cores and
`ragged_dot` runs densely (every local expert on every row).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.timing import median_time  # noqa: E402
from jaxpipe.models import moe  # noqa: E402
from jaxpipe.parallel import expert  # noqa: E402
from jaxpipe.runtime import cli  # noqa: E402

FLAGS = cli.flag_values(__name__)
flags.DEFINE_integer("tokens", 256, "Tokens per device.", flag_values=FLAGS)
flags.DEFINE_integer("d_model", 128, "Model width.", flag_values=FLAGS)
flags.DEFINE_integer("d_ff", 256, "Expert hidden width.", flag_values=FLAGS)
flags.DEFINE_integer("experts", 16, "Experts.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 2, "Experts per token.", flag_values=FLAGS)
flags.DEFINE_float(
    "capacity_factor",
    1.0,
    "Capacity dispatch: rows per destination over the "
    "even share (moe.MoEConfig.capacity_factor).",
    flag_values=FLAGS,
)
flags.DEFINE_list("eps", ["1", "2", "4", "8"], "Expert-axis sizes to run.", flag_values=FLAGS)
flags.DEFINE_string(
    "dtype", None, "float32 on CPU, bfloat16 elsewhere by default.", flag_values=FLAGS
)
flags.DEFINE_integer("repeats", 5, "Timed calls per cell (median).", flag_values=FLAGS)

ANCHORS = (
    "DeepEP (H800, NVLink, EP8, normal kernels): 153 GB/s dispatch, 158 GB/s combine intranode; "
    "43-58 GB/s internode RDMA. Low-latency: 77 us dispatch at EP8 (128 tokens, hidden 7168, "
    "top-8, FP8)."
)


def _mesh(n_dev: int, ep: int):
  return jax.make_mesh(
      (n_dev // ep, ep), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def _variants(args, on_accelerator: bool):
  base = moe.MoEConfig(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff, fp8_block=128)
  yield "capacity", dataclasses.replace(
      base, dispatch="capacity", capacity_factor=args.capacity_factor
  )
  yield "dropless padded", dataclasses.replace(base, dropless_impl="padded")
  if on_accelerator:
    yield "dropless ragged", dataclasses.replace(base, dropless_impl="ragged")
  if args.d_model % 128 == 0:
    yield "dropless padded fp8", dataclasses.replace(
        base, dropless_impl="padded", fp8_dispatch=True
    )


def layer_table(args, x, g, params, n_dev, dtype, on_accelerator) -> None:
  tokens = x.shape[0] * x.shape[1]
  print(
      f"\n## MoE layer forward+backward, {tokens} tokens ({args.tokens} per device x {n_dev}), "
      f"d_model {args.d_model}, d_ff {args.d_ff}, {args.experts} experts, top-{args.top_k}, "
      f"{jnp.dtype(dtype).name}, {jax.devices()[0].device_kind}"
  )
  print(
      "| layer | ep x dp | tokens/s | ms/step | imbalance (max/mean) | dropped | buffer rows used |"
  )
  print("|---|---|---|---|---|---|---|")
  base = moe.MoEConfig(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff)

  def ref_loss(p, x):
    y, aux = moe.dense_reference(base, p, x.reshape(-1, args.d_model))
    return jnp.sum(y.reshape(g.shape).astype(jnp.float32) * g) + aux["loss"], aux

  ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))
  dev0 = jax.devices()[0]
  p0, x0 = jax.device_put((params, x), dev0)
  t = median_time(ref, p0, x0, repeats=args.repeats)
  (_, aux), _ = ref(p0, x0)
  print(
      f"| dense reference (1 device, all experts on all tokens) | 1 | {tokens / t:,.0f} | "
      f"{1e3 * t:.1f} | {float(aux['imbalance']):.2f} | 0 | - |"
  )
  load = np.asarray(aux["tokens_per_expert"])
  for ep in args.eps:
    if n_dev % ep or args.experts % ep:
      continue
    mesh = _mesh(n_dev, ep)
    for name, cfg in _variants(args, on_accelerator):

      def loss(p, x, cfg=cfg, mesh=mesh):
        y, aux = moe.moe_layer(cfg, p, x, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) * g) + aux["loss"], aux

      fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
      t = median_time(fn, params, x, repeats=args.repeats)
      (_, aux), _ = fn(params, x)
      plan = expert.make_plan(
          args.tokens,
          args.top_k,
          args.experts,
          ep,
          cfg.capacity_factor if cfg.dispatch == "capacity" else None,
          "fixed"
          if cfg.dispatch == "capacity" or cfg.dropless_impl == "padded"
          else cfg.dropless_impl,
      )
      used = int(aux["recv_rows"]) / (plan.recv_rows * n_dev)
      dropped = int(aux["dropped"]) / (tokens * args.top_k)
      print(
          f"| {name} | {ep} x {n_dev // ep} | {tokens / t:,.0f} | {1e3 * t:.1f} | "
          f"{float(aux['imbalance']):.2f} | {dropped:.1%} | {used:.0%} |"
      )
  print(f"\nload per expert this step (tokens, all devices): {load.tolist()}")


def transport_table(args, x, n_dev, dtype, on_accelerator) -> None:
  if not any(n_dev % ep == 0 and args.experts % ep == 0 and ep > 1 for ep in args.eps):
    print(
        f"\n## dispatch and combine alone: skipped; they move tokens between devices, and no "
        f"expert-axis size > 1 in --eps {args.eps} divides this machine's {n_dev} device(s). "
        f"The figures to hold them against: {ANCHORS}"
    )
    return
  print(
      f"\n## dispatch and combine alone (forward); payload per device = token rows it receives "
      f"(own included) x d_model x {jnp.dtype(dtype).itemsize} B (fp8: 1 B + a 4 B scale per 128)"
  )
  print("| transport | ep | dispatch us | combine us | dispatch GB/s | combine GB/s |")
  print("|---|---|---|---|---|---|")
  impls = [("fixed (dropless)", "fixed", False)]
  if on_accelerator:
    impls.append(("ragged", "ragged", False))
  if args.d_model % 128 == 0:
    impls.append(("fixed fp8 payload", "fixed", True))
  k = args.top_k
  for ep in args.eps:
    if n_dev % ep or args.experts % ep or ep == 1:
      continue
    mesh = _mesh(n_dev, ep)
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, args.experts)[:k])(
        jax.random.split(jax.random.key(3), n_dev * args.tokens)
    ).astype(jnp.int32)
    w = jnp.full((n_dev * args.tokens, k), 1.0 / k)
    xt = x.reshape(-1, args.d_model)
    for name, impl, fp8 in impls:
      plan = expert.make_plan(args.tokens, k, args.experts, ep, None, impl)
      tok = P(("dp", "ep"))

      def disp(x, idx, w, plan=plan, fp8=fp8):
        recv, handle = expert.dispatch(x, idx, w, plan, axis="ep", fp8_block=128 if fp8 else None)
        rows = jnp.sum((recv.eid_NxK < plan.n_local).any(1))
        return recv.x_NxD, handle, rows[None]

      sm = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
      d_fn = jax.jit(sm(disp, in_specs=(tok, tok, tok), out_specs=(tok, tok, tok)))
      recv_x, handle, rows = d_fn(xt, idx, w)
      c_fn = jax.jit(
          sm(
              lambda y, h, plan=plan: expert.combine(y, h, plan, axis="ep"),
              in_specs=(tok, tok),
              out_specs=tok,
          )
      )
      td = median_time(d_fn, xt, idx, w, repeats=args.repeats)
      tc = median_time(c_fn, recv_x, handle, repeats=args.repeats)
      row_bytes = args.d_model * jnp.dtype(dtype).itemsize
      payload_c = float(np.mean(np.asarray(rows))) * row_bytes
      payload_d = payload_c / jnp.dtype(dtype).itemsize * (1 + 4 / 128) if fp8 else payload_c
      print(
          f"| {name} | {ep} | {1e6 * td:.0f} | {1e6 * tc:.0f} | {payload_d / td / 1e9:.3f} | "
          f"{payload_c / tc / 1e9:.3f} |"
      )
  print(f"\nPublished anchors: {ANCHORS}")


def main(argv: list[str]) -> None:
  cli.no_arguments(argv)
  args = cli.values(FLAGS)
  try:
    args.eps = [int(e) for e in args.eps]
  except ValueError:
    raise app.UsageError(
        f"--eps={','.join(args.eps)}: give comma-separated integers, e.g. 1,2,4"
    ) from None
  on_accelerator = jax.default_backend() in ("gpu", "tpu")
  dtype = jnp.dtype(args.dtype or ("bfloat16" if on_accelerator else "float32"))
  n_dev = jax.device_count()
  base = moe.MoEConfig(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff)
  params = jax.tree.map(
      lambda v: v.astype(dtype) if v.ndim == 3 else v,
      moe.init_moe_params(base, jax.random.key(0), args.d_model),
  )
  kx, kg = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (n_dev, args.tokens, args.d_model), dtype)
  g = jax.random.normal(kg, (n_dev, args.tokens, args.d_model), jnp.float32)
  print(f"# MoE benchmark on {n_dev} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
  layer_table(args, x, g, params, n_dev, dtype, on_accelerator)
  transport_table(args, x, n_dev, dtype, on_accelerator)


if __name__ == "__main__":
  cli.run(main)
