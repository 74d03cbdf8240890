"""Ulysses input side, projection + all-to-all, as one persistent Mosaic GPU kernel.

Per context rank r (P ranks, M = B·L/P tokens of its own, D model dim, C = N/P·K head channels
of one rank's heads):

    q_r[src][M, C] = x_src[M, D] @ W[:, heads(r)]      for every rank src

Instead of a GEMM followed by an all_to_all, the SMs of rank src share the output tiles
(row tile t, column tile n) of x_src @ W[:, heads(dest)] for dest = src + s, step by step,
remote destinations first (s = 1..P-1, own heads last), and store each finished tile straight
into dest's output buffer (`remote_ref`), then signal dest's ready semaphore for source src
once. While some SMs' stores are in flight, the others multiply. SM 0 of each rank ends by
waiting for the m·n tiles of every source (its own included), so the kernel returns only with
its output whole and every semaphore back at 0 (Mosaic GPU's contract for scratch semaphores).
One semaphore per source, not one in all: a source that finished this call may already be
signalling for the next one (q, k and v run back to back), and those signals must not count
for a source still sending this call's tiles.

What is verified where, as for `gemm_a2a` (the output side): `ProjPlan` holds every index
decision, both the kernel and `simulate` call it; `simulate` runs P virtual devices on CPU
under random interleavings and checks the result against the dense math, that no rank returns
before its tiles arrived, that nothing deadlocks, and that the semaphore ends at 0. The kernel
traces and lowers to a Mosaic GPU custom call on CPU (tests/test_proj_a2a.py); compiling and
timing it needs a Hopper GPU. `jaxpipe.parallel.overlap.proj_a2a_local` is the portable path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.gemm_a2a import (
    ProtocolError,
    _rem,
    ceil_div,
    check_tiles,
    grid_sms,
    interleave,
    row_major,
    store_tile,
    tile_matmul,
)


@dataclasses.dataclass(frozen=True)
class ProjPlan:
  """Every index decision of the protocol; works on Python ints and on traced int32."""

  num_devices: int  # P, context ranks
  m_tiles: int  # row tiles of one rank's tokens
  n_tiles: int  # column tiles of one destination's C channels
  workers: int  # SMs, each multiplying and sending

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < 1:
        raise ValueError(f"ProjPlan.{f.name}={getattr(self, f.name)} must be >= 1")

  @property
  def steps(self) -> list[int]:
    """Destinations as offsets from the rank, in order: remote ones first, the own heads last."""
    return [*range(1, self.num_devices), 0]

  @property
  def items_per_step(self) -> int:
    return self.m_tiles * self.n_tiles

  @property
  def items_per_worker(self) -> int:
    """Tiles one worker computes per step."""
    return ceil_div(self.items_per_step, self.workers)

  def tile(self, flat):
    """Flat tile index within a step -> (row tile, column tile)."""
    return row_major(flat, self.n_tiles)

  def dest(self, rank, step):
    return _rem(rank + step, self.num_devices)

  def sem_index(self, src):
    """The receiver's ready semaphore for tiles from rank `src`."""
    return src

  @property
  def num_sems(self) -> int:
    return self.num_devices

  @property
  def signals_per_source(self) -> int:
    """Tiles (one signal each) a rank receives from each source, itself included."""
    return self.m_tiles * self.n_tiles


def simulate(
    x_PxMxD: np.ndarray,
    w_PxDxC: np.ndarray,
    plan: ProjPlan,
    *,
    tile_m: int,
    tile_n: int,
    seed: int = 0,
    calls: int = 1,
) -> np.ndarray:
  """Runs the protocol for P virtual devices under a random interleaving; returns q [P, P, M, C].

  x_PxMxD[r] is rank r's tokens, w_PxDxC[d] the weight columns of rank d's heads; the result's
  [r, src] is what rank r holds for src's tokens when its kernel returns. `calls` runs the
  kernel that many times back to back on every device (as q, k, v do), sharing the semaphores;
  a device starts call i+1 only when all its SMs finished call i. Returns the last call's.
  """
  p = plan.num_devices
  m, c = x_PxMxD.shape[1], w_PxDxC.shape[2]
  out = np.full((calls, p, p, m, c), np.nan)  # [call, device, src, M, C]; NaN = not written
  sems = np.zeros((p, plan.num_sems), np.int64)
  finished = np.zeros((calls, p), np.int64)  # SMs of a device done with a call
  returned = [None] * p

  def worker(rank, w):
    for call in range(calls):
      while call and finished[call - 1, rank] < plan.workers:
        yield "blocked"  # the device's previous kernel is still running
      for step, i in ((s, i) for s in plan.steps for i in range(plan.items_per_worker)):
        flat = w + i * plan.workers
        if flat >= plan.items_per_step:
          continue
        t, n = plan.tile(flat)
        dest = plan.dest(rank, step)
        rows, cols = slice(t * tile_m, (t + 1) * tile_m), slice(n * tile_n, (n + 1) * tile_n)
        tile = x_PxMxD[rank, rows] @ w_PxDxC[dest][:, cols]
        yield  # the GEMM
        out[call, dest, rank, rows, cols] = tile
        yield  # the store to the peer in flight; the signal must come after it completes
        sems[dest, plan.sem_index(rank)] += 1
      if w == 0:
        for src in range(p):
          while sems[rank, plan.sem_index(src)] < plan.signals_per_source:
            yield "blocked"
          sems[rank, plan.sem_index(src)] -= plan.signals_per_source
        if np.isnan(out[call, rank]).any():
          raise ProtocolError(f"device {rank} returned call {call} before all its tiles arrived")
        returned[rank] = out[call, rank].copy()
      finished[call, rank] += 1

  interleave([worker(r, w) for r in range(p) for w in range(plan.workers)], seed)
  if sems.any():
    raise ProtocolError(f"semaphores not back to 0 at exit: {sems}")
  return np.stack(returned)


# ----------------------------------------------------------------------------- GPU kernel


@dataclasses.dataclass(frozen=True)
class ProjA2AConfig:
  """Tile sizes of the fused kernel."""

  tile_m: int = 64  # rows per tile (one warpgroup's wgmma M)
  tile_n: int = 128  # output columns per tile
  tile_k: int = 64  # contraction step of the wgmma pipeline
  num_sms: int | None = None  # SMs in the persistent grid; None = the device's count
  max_concurrent_steps: int = 2  # wgmma pipeline depth


def _kernel(
    x_gmem, w_gmem, out_gmem, ready_sem, *, plan: ProjPlan, cfg: ProjA2AConfig, axis_name: str
):
  from jax.experimental.pallas import mosaic_gpu as plgpu

  rank = lax.axis_index(axis_name)
  sm = lax.axis_index("sm")

  # Steps are unrolled: a remote store's peer must be computable on the host (its TMA
  # descriptor is built there), so it may depend on the device id but not on the SM or a loop.
  for step in plan.steps:
    dest = plan.dest(rank, step)

    @pl.loop(0, plan.items_per_worker)
    def _item(i, dest=dest):
      flat = sm + i * plan.workers

      @pl.when(flat < plan.items_per_step)
      def _():
        t, n = plan.tile(flat)

        def acc_scope(acc_ref):
          tile_matmul(
              acc_ref,
              x_gmem,
              w_gmem.at[dest],
              t,
              n,
              tile_m=cfg.tile_m,
              tile_n=cfg.tile_n,
              tile_k=cfg.tile_k,
              max_concurrent_steps=cfg.max_concurrent_steps,
          )
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        rows, cols = pl.ds(t * cfg.tile_m, cfg.tile_m), pl.ds(n * cfg.tile_n, cfg.tile_n)
        peer_out = plgpu.remote_ref(out_gmem, {axis_name: dest})
        # wait for the whole store, not just the SMEM read: the tile lands before the signal
        store_tile(acc, peer_out.at[rank, rows, cols], wait_read_only=False)
        pl.semaphore_signal(ready_sem.at[plan.sem_index(rank)], 1, device_id={axis_name: dest})

  @pl.when(sm == 0)
  def _wait():
    for src in range(plan.num_devices):
      pl.semaphore_wait(ready_sem.at[plan.sem_index(src)], plan.signals_per_source)


def to_kernel_layout(x_BxSxD, w_DxNxK, p: int):
  """x [B, L/P, D] -> [B·L/P, D]; w [D, N, K] -> [P(dest), D, C] (rank d: heads d·N/P..)."""
  batch, seq, d = x_BxSxD.shape
  _, heads, head_dim = w_DxNxK.shape
  w_PxDxC = w_DxNxK.reshape(d, p, heads // p * head_dim).transpose(1, 0, 2)
  return x_BxSxD.reshape(batch * seq, d), w_PxDxC


def proj_a2a(
    x_BxSxD: jax.Array,
    w_DxNxK: jax.Array,
    *,
    axis_name: str = "cp",
    config: ProjA2AConfig = ProjA2AConfig(),
) -> jax.Array:
  """Fused seq_to_heads(x @ w) inside shard_map over `axis_name`: [B, L/P, D] -> [B, L, N/P, K].

  Same contract as `jaxpipe.parallel.overlap.proj_a2a_local`; Hopper GPUs, bf16/fp16 only.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if x_BxSxD.dtype not in (jnp.bfloat16, jnp.float16) or w_DxNxK.dtype != x_BxSxD.dtype:
    raise ValueError(
        f"proj_a2a serves bfloat16/float16 with matching weights; got x "
        f"{x_BxSxD.dtype}, w {w_DxNxK.dtype}; use overlap.proj_a2a_local"
    )
  p = lax.axis_size(axis_name)
  batch, seq, d = x_BxSxD.shape
  _, heads, head_dim = w_DxNxK.shape
  if heads % p or w_DxNxK.shape[0] != d:
    raise ValueError(
        f"proj_a2a: x {x_BxSxD.shape} and w {w_DxNxK.shape} do not fit {p} ranks "
        f"(need w [{d}, N, K] with N % {p} == 0)"
    )
  m, c = batch * seq, heads // p * head_dim
  check_tiles(
      "proj_a2a",
      config,
      (
          ("rows", m, config.tile_m),
          ("head channels", c, config.tile_n),
          ("model dim", d, config.tile_k),
      ),
  )
  num_sms = grid_sms(config.num_sms)
  plan = ProjPlan(
      num_devices=p, m_tiles=m // config.tile_m, n_tiles=c // config.tile_n, workers=num_sms
  )
  x_MxD, w_PxDxC = to_kernel_layout(x_BxSxD, w_DxNxK, p)
  out_PxMxC = plgpu.kernel(
      functools.partial(_kernel, plan=plan, cfg=config, axis_name=axis_name),
      out_type=jax.ShapeDtypeStruct((p, m, c), x_BxSxD.dtype),
      scratch_types=[plgpu.SemaphoreType.REGULAR((plan.num_sems,))],
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x_MxD, w_PxDxC)
  # [src, B·S, N/P·K] -> [B, src·S + s, N/P, K]: source ranks hold consecutive token slices
  out = out_PxMxC.reshape(p, batch, seq, heads // p, head_dim).transpose(1, 0, 2, 3, 4)
  return out.reshape(batch, p * seq, heads // p, head_dim)
