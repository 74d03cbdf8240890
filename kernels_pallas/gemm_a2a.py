"""Ulysses output side, all-to-all + output projection, as one persistent Mosaic GPU kernel.

Per context rank r (P ranks, M = B·L/P tokens of its own, C = H/P·K head channels, D model dim):

    y_r[M, D] = sum over src of o_src[r][M, C] @ W[src][C, D]

where o_src[r] are rank src's attention outputs (its heads) for rank r's tokens. Instead of
an all_to_all followed by a GEMM, the kernel splits the SMs of each GPU in two roles:

- communication SMs walk the send list: for step s = 1..P-1 and row tile t, copy every column
  chunk of o[dest = r+s][t] GMEM -> SMEM -> the peer's receive buffer (`remote_ref`), wait for
  the stores, then signal the peer's ready semaphore (src = r, t) once per consumer;
- GEMM SMs walk output tiles (t, n): accumulate the local heads first (s = 0, no transfer),
  then for s = 1..P-1 wait on ready(src = r-s, t) and accumulate recv[src][t] @ W[src][:, n]
  with a wgmma pipeline, so tile t's GEMM starts as soon as its rows land, not when the whole
  all-to-all is done.

Every signal is matched by exactly one wait, so all semaphores return to 0 when the kernel
ends (Mosaic GPU's contract for scratch semaphores).

What is verified where: `TilePlan` holds every index decision of the protocol (who sends which
tile where, which semaphore, how many signals, consumption order) and both the kernel and
`simulate` call it. `simulate` runs the protocol for P virtual devices on CPU under random
interleavings and checks the result against the dense math, that no tile is read before it is
written, that nothing deadlocks, and that every semaphore ends at 0. The kernel itself traces
and lowers to a Mosaic GPU custom call on CPU (tests/test_gemm_a2a.py), but it has not been
compiled to PTX or run on a GPU: timings and on-device correctness still need a multi-GPU
Hopper machine. `jaxpipe.parallel.overlap.a2a_proj_local` is the portable path.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl


def _div(a, b):
  return a // b if isinstance(a, int) else lax.div(a, b)


def _rem(a, b):
  return a % b if isinstance(a, int) else lax.rem(a, b)


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def check_tiles(kernel: str, config: object, sizes) -> None:
  """Raises ValueError naming the first (name, size, tile) whose size is not a tile multiple."""
  for name, size, tile in sizes:
    if size % tile:
      raise ValueError(
          f"{kernel}: {name} {size} is not a multiple of the tile {tile}; "
          f"change {type(config).__name__} or the shapes"
      )


def grid_sms(requested: int | None) -> int:
  """SMs of the persistent grid: `requested`, else the device's count (132 if it says none)."""
  return requested or getattr(jax.devices()[0], "core_count", None) or 132


def row_major(flat, n_tiles: int):
  """Flat output-tile index -> (row tile, column tile); row-major so early rows finish first."""
  return _div(flat, n_tiles), _rem(flat, n_tiles)


def tile_matmul(
    acc_ref,
    a_gmem,
    b_gmem,
    t,
    n,
    *,
    tile_m: int,
    tile_n: int,
    tile_k: int,
    max_concurrent_steps: int,
) -> None:
  """acc_ref += a_gmem[row tile t] @ b_gmem[:, column tile n], as a pipelined wgmma loop."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  plgpu.emit_pipeline(
      lambda _, a_smem, b_smem: plgpu.wgmma(acc_ref, a_smem, b_smem),
      grid=(a_gmem.shape[1] // tile_k,),
      in_specs=[
          plgpu.BlockSpec((tile_m, tile_k), lambda k: (t, k), delay_release=1),
          plgpu.BlockSpec((tile_k, tile_n), lambda k: (k, n), delay_release=1),
      ],
      max_concurrent_steps=max_concurrent_steps,
  )(a_gmem, b_gmem)


def store_tile(acc, dst_gmem, *, wait_read_only: bool) -> None:
  """Writes the accumulator tile `acc` to `dst_gmem` (a tile-shaped GMEM view) through SMEM."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def scope(out_smem):
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=wait_read_only)

  pl.run_scoped(scope, plgpu.SMEM(acc.shape, dst_gmem.dtype))


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Every index decision of the tile protocol; works on Python ints and on traced int32."""

  num_devices: int  # P, context ranks
  m_tiles: int  # row tiles of one rank's tokens
  c_chunks: int  # column chunks of one row tile (a TMA box is at most 256 wide)
  n_tiles: int  # column tiles of the output
  comm_workers: int  # SMs that move data
  gemm_workers: int  # SMs that multiply

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < 1:
        raise ValueError(f"TilePlan.{f.name}={getattr(self, f.name)} must be >= 1")

  # --- communication side
  @property
  def steps(self) -> range:
    """Destinations as offsets from the rank, in order (step 1 lands first)."""
    return range(1, self.num_devices)

  @property
  def sends_per_step(self) -> int:
    return self.m_tiles

  @property
  def sends_per_worker(self) -> int:
    """Sends one communication worker makes per step."""
    return ceil_div(self.sends_per_step, self.comm_workers)

  def send_tile(self, flat):
    """Send index within a step -> the row tile it moves.

    A send moves all c_chunks column chunks of the row tile before it signals: a count of
    chunks cannot tell one consumer's chunks from another's (the simulator found a plan that
    signalled per chunk letting a consumer pass after the first chunk).
    """
    return flat

  def dest(self, rank, step):
    return _rem(rank + step, self.num_devices)

  def source(self, rank, step):
    return _rem(rank + self.num_devices - step, self.num_devices)

  def sem_index(self, src, tile):
    """The receiver's ready semaphore for rows `tile` coming from rank `src`."""
    return src * self.m_tiles + tile

  @property
  def num_sems(self) -> int:
    return self.num_devices * self.m_tiles

  @property
  def signals_per_send(self) -> int:
    return self.n_tiles  # one per output column tile that will consume the rows

  @property
  def wait_value(self) -> int:
    return 1  # each consumer takes one of the signals_per_send

  # --- GEMM side
  @property
  def num_gemm_items(self) -> int:
    return self.m_tiles * self.n_tiles

  @property
  def items_per_worker(self) -> int:
    return ceil_div(self.num_gemm_items, self.gemm_workers)

  def gemm_item(self, flat):
    return row_major(flat, self.n_tiles)


# ----------------------------------------------------------------------------- simulator


class ProtocolError(AssertionError):
  """The tile protocol read unwritten data, deadlocked, or left a semaphore non-zero."""


def simulate(
    o_PxPxMxC: np.ndarray,
    w_PxCxD: np.ndarray,
    plan: TilePlan,
    *,
    tile_m: int,
    tile_c: int,
    tile_n: int,
    seed: int = 0,
) -> np.ndarray:
  """Runs the protocol for P virtual devices under a random interleaving; returns y [P, M, D].

  o_PxPxMxC[r, d] is rank r's output rows destined for rank d. Each worker is a generator that
  yields at every point where the real kernel could be preempted or block.
  """
  p = plan.num_devices
  _, _, m, c = o_PxPxMxC.shape
  d = w_PxCxD.shape[2]
  recv = np.full((p, p, m, c), np.nan)  # [device, src, M, C]; NaN = not yet written
  sems = np.zeros((p, plan.num_sems), np.int64)
  y = np.full((p, m, d), np.nan)

  def comm(rank, worker):
    for step, i in ((s, i) for s in plan.steps for i in range(plan.sends_per_worker)):
      flat = worker + i * plan.comm_workers
      if flat >= plan.sends_per_step:
        continue
      t = plan.send_tile(flat)
      dest = plan.dest(rank, step)
      rows = slice(t * tile_m, (t + 1) * tile_m)
      for ch in range(plan.c_chunks):
        cols = slice(ch * tile_c, (ch + 1) * tile_c)
        smem = o_PxPxMxC[rank, dest, rows, cols].copy()
        yield  # GMEM -> SMEM copy in flight
        recv[dest, rank, rows, cols] = smem
        yield  # store to the peer in flight; the signal must come after it completes
      sems[dest, plan.sem_index(rank, t)] += plan.signals_per_send

  def gemm(rank, worker):
    for i in range(plan.items_per_worker):
      flat = worker + i * plan.gemm_workers
      if flat >= plan.num_gemm_items:
        continue
      t, n = plan.gemm_item(flat)
      rows, cols = slice(t * tile_m, (t + 1) * tile_m), slice(n * tile_n, (n + 1) * tile_n)
      acc = o_PxPxMxC[rank, rank, rows] @ w_PxCxD[rank][:, cols]
      for step in range(1, p):
        src = plan.source(rank, step)
        sem = plan.sem_index(src, t)
        while sems[rank, sem] < plan.wait_value:
          yield "blocked"
        sems[rank, sem] -= plan.wait_value
        a = recv[rank, src, rows]
        if np.isnan(a).any():
          raise ProtocolError(f"device {rank} read rows {t} from {src} before they arrived")
        yield
        acc = acc + a @ w_PxCxD[src][:, cols]
      y[rank, rows, cols] = acc

  workers = [comm(r, w) for r in range(p) for w in range(plan.comm_workers)]
  workers += [gemm(r, w) for r in range(p) for w in range(plan.gemm_workers)]
  interleave(workers, seed)
  if sems.any():
    raise ProtocolError(f"semaphores not back to 0 at exit: {sems}")
  if np.isnan(y).any():
    raise ProtocolError("some output tile was never written")
  return y


def interleave(workers: list, seed: int) -> None:
  """Steps generator `workers` in a random order until all finish; a worker yields "blocked"
  while it waits. Raises ProtocolError when every live worker stays blocked (a deadlock)."""
  rng = random.Random(seed)
  live = list(workers)
  blocked_rounds = 0
  while live:
    wk = rng.choice(live)
    try:
      state = next(wk)
    except StopIteration:
      live.remove(wk)
      blocked_rounds = 0
      continue
    # Deadlock: every live worker blocked for many consecutive picks.
    blocked_rounds = blocked_rounds + 1 if state == "blocked" else 0
    if blocked_rounds > 100 * len(live) + 1000:
      raise ProtocolError(f"deadlock with {len(live)} workers blocked")


# ----------------------------------------------------------------------------- GPU kernel


@dataclasses.dataclass(frozen=True)
class GemmA2AConfig:
  """Tile sizes and SM split of the fused kernel."""

  tile_m: int = 64  # rows per tile (one warpgroup's wgmma M)
  tile_n: int = 128  # output columns per GEMM tile
  tile_k: int = 64  # contraction step of the wgmma pipeline
  tile_c: int = 128  # columns per transferred chunk (TMA box width <= 256)
  comm_sms: int = 16  # SMs that move data; the rest multiply
  num_sms: int | None = None  # SMs in the persistent grid; None = the device's count
  max_concurrent_steps: int = 2  # wgmma pipeline depth


def _plan(p: int, m: int, c: int, d: int, cfg: GemmA2AConfig, num_sms: int) -> TilePlan:
  check_tiles(
      "gemm_a2a",
      cfg,
      (
          ("rows", m, cfg.tile_m),
          ("head channels", c, cfg.tile_c),
          ("head channels", c, cfg.tile_k),
          ("model dim", d, cfg.tile_n),
      ),
  )
  if not 0 < cfg.comm_sms < num_sms:
    raise ValueError(f"gemm_a2a: comm_sms={cfg.comm_sms} must lie in [1, {num_sms - 1}]")
  return TilePlan(
      num_devices=p,
      m_tiles=m // cfg.tile_m,
      c_chunks=c // cfg.tile_c,
      n_tiles=d // cfg.tile_n,
      comm_workers=cfg.comm_sms,
      gemm_workers=num_sms - cfg.comm_sms,
  )


def _kernel(
    o_gmem,
    w_gmem,
    y_gmem,
    recv_gmem,
    ready_sem,
    *,
    plan: TilePlan,
    cfg: GemmA2AConfig,
    axis_name: str,
):
  from jax.experimental.pallas import mosaic_gpu as plgpu

  rank = lax.axis_index(axis_name)
  sm = lax.axis_index("sm")

  @pl.when(sm < plan.comm_workers)
  def _comm():
    def scope(buf_smem, copied):
      # Steps are unrolled: a strided remote store is a TMA copy whose descriptor is built on
      # the host, so its peer may depend on the device id but not on the SM or a loop.
      for step in plan.steps:
        dest = plan.dest(rank, step)
        peer_recv = plgpu.remote_ref(recv_gmem, {axis_name: dest})

        @pl.loop(0, plan.sends_per_worker)
        def _send(i, dest=dest, peer_recv=peer_recv):
          flat = sm + i * plan.comm_workers

          @pl.when(flat < plan.sends_per_step)
          def _():
            t = plan.send_tile(flat)
            rows = pl.ds(t * cfg.tile_m, cfg.tile_m)
            for ch in range(plan.c_chunks):
              cols = pl.ds(ch * cfg.tile_c, cfg.tile_c)
              plgpu.copy_gmem_to_smem(o_gmem.at[dest, rows, cols], buf_smem, copied)
              plgpu.barrier_wait(copied)
              plgpu.copy_smem_to_gmem(buf_smem, peer_recv.at[rank, rows, cols])
              plgpu.wait_smem_to_gmem(0)  # buf_smem is reused; the rows land before the signal
            pl.semaphore_signal(
                ready_sem.at[plan.sem_index(rank, t)],
                plan.signals_per_send,
                device_id={axis_name: dest},
            )

    pl.run_scoped(scope, plgpu.SMEM((cfg.tile_m, cfg.tile_c), o_gmem.dtype), plgpu.Barrier())

  @pl.when(sm >= plan.comm_workers)
  def _gemm():
    worker = sm - plan.comm_workers

    @pl.loop(0, plan.items_per_worker)
    def _item(i):
      flat = worker + i * plan.gemm_workers

      @pl.when(flat < plan.num_gemm_items)
      def _():
        t, n = plan.gemm_item(flat)

        def acc_scope(acc_ref):
          accumulate = functools.partial(
              tile_matmul,
              acc_ref,
              t=t,
              n=n,
              tile_m=cfg.tile_m,
              tile_n=cfg.tile_n,
              tile_k=cfg.tile_k,
              max_concurrent_steps=cfg.max_concurrent_steps,
          )

          accumulate(o_gmem.at[rank], w_gmem.at[rank])  # own heads: nothing to wait for

          @pl.loop(1, plan.num_devices)
          def _step(step):
            src = plan.source(rank, step)
            pl.semaphore_wait(ready_sem.at[plan.sem_index(src, t)], plan.wait_value)
            accumulate(recv_gmem.at[src], w_gmem.at[src])

          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        rows, cols = pl.ds(t * cfg.tile_m, cfg.tile_m), pl.ds(n * cfg.tile_n, cfg.tile_n)
        store_tile(acc, y_gmem.at[rows, cols], wait_read_only=True)


def to_kernel_layout(o_BxLxNpxK, w_NxKxD, p: int):
  """o [B, L, Np, K] -> [P(dest), B·L/P, C]; w [N, K, D] -> [P(src), C, D]
  (rank p: heads p·Np..)."""
  batch, seq, heads_per, head_dim = o_BxLxNpxK.shape
  c = heads_per * head_dim
  o_PxMxC = (
      o_BxLxNpxK.reshape(batch, p, seq // p, c)
      .transpose(1, 0, 2, 3)
      .reshape(p, batch * (seq // p), c)
  )
  return o_PxMxC, w_NxKxD.reshape(p, c, w_NxKxD.shape[2])


def gemm_a2a(
    o_BxLxNpxK: jax.Array,
    w_NxKxD: jax.Array,
    *,
    axis_name: str = "cp",
    config: GemmA2AConfig = GemmA2AConfig(),
) -> jax.Array:
  """Fused heads_to_seq(o) @ w inside shard_map over `axis_name`: [B, L, N/P, K] -> [B, L/P, D].

  Same contract as `jaxpipe.parallel.overlap.a2a_proj_local`; Hopper GPUs, bf16/fp16 only.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if o_BxLxNpxK.dtype not in (jnp.bfloat16, jnp.float16) or w_NxKxD.dtype != o_BxLxNpxK.dtype:
    raise ValueError(
        f"gemm_a2a serves bfloat16/float16 with matching weights; got o "
        f"{o_BxLxNpxK.dtype}, w {w_NxKxD.dtype}; use overlap.a2a_proj_local"
    )
  p = lax.axis_size(axis_name)
  batch, seq, heads_per, head_dim = o_BxLxNpxK.shape
  if seq % p or w_NxKxD.shape[0] != heads_per * p:
    raise ValueError(
        f"gemm_a2a: o {o_BxLxNpxK.shape} and w {w_NxKxD.shape} do not split over "
        f"{p} ranks (need seq % {p} == 0 and w heads == {heads_per} * {p})"
    )
  seq_local, c, d = seq // p, heads_per * head_dim, w_NxKxD.shape[2]
  o_PxMxC, w_PxCxD = to_kernel_layout(o_BxLxNpxK, w_NxKxD, p)
  num_sms = grid_sms(config.num_sms)
  plan = _plan(p, batch * seq_local, c, d, config, num_sms)
  y_MxD, _ = plgpu.kernel(
      functools.partial(_kernel, plan=plan, cfg=config, axis_name=axis_name),
      out_type=[
          jax.ShapeDtypeStruct((batch * seq_local, d), o_BxLxNpxK.dtype),
          jax.ShapeDtypeStruct((p, batch * seq_local, c), o_BxLxNpxK.dtype),
      ],  # recv
      scratch_types=[plgpu.SemaphoreType.REGULAR((plan.num_sems,))],
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(o_PxMxC, w_PxCxD)
  return y_MxD.reshape(batch, seq_local, d)
