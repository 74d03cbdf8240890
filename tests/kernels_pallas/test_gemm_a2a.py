"""Fused A2A + output projection: the tile protocol in the CPU simulator, the kernel's lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernels_pallas import gemm_a2a as ga


def _simulate_global(
    p, batch, seq, heads, head_dim, d, plan_kw, tiles, seed=0, plan_cls=ga.TilePlan
):
  """Global o [B, L, H, K] and w [H, K, D] through the per-rank layout and the simulated kernel."""
  rng = np.random.default_rng(seed)
  o = rng.standard_normal((batch, seq, heads, head_dim))
  w = rng.standard_normal((heads, head_dim, d))
  hp = heads // p
  per_rank = [ga.to_kernel_layout(o[:, :, r * hp : (r + 1) * hp], w, p) for r in range(p)]
  o_PxPxMxC = np.stack([np.asarray(x) for x, _ in per_rank])
  w_PxCxD = np.asarray(per_rank[0][1])
  m, c = o_PxPxMxC.shape[2:]
  plan = plan_cls(
      num_devices=p,
      m_tiles=m // tiles["tile_m"],
      c_chunks=c // tiles["tile_c"],
      n_tiles=d // tiles["tile_n"],
      **plan_kw,
  )
  y = ga.simulate(o_PxPxMxC, w_PxCxD, plan, seed=seed, **tiles)
  got = np.concatenate([y[r].reshape(batch, seq // p, d) for r in range(p)], axis=1)
  return got, np.einsum("blnk,nkd->bld", o, w)


@pytest.mark.parametrize(
    "p,comm,gemm,seed", [(2, 1, 1, 0), (4, 2, 3, 1), (8, 3, 5, 2), (4, 7, 2, 3)]
)
def test_protocol_matches_dense_math(p, comm, gemm, seed):
  tiles = dict(tile_m=4, tile_c=8, tile_n=4)
  workers = dict(comm_workers=comm, gemm_workers=gemm)
  got, want = _simulate_global(p, 2, 8 * p, 2 * p, 8, 12, workers, tiles, seed=seed)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@dataclasses.dataclass(frozen=True)
class _SignalTooFew(ga.TilePlan):

  @property
  def signals_per_send(self):
    return self.n_tiles - 1


@dataclasses.dataclass(frozen=True)
class _SharedSemaphore(ga.TilePlan):
  """One semaphore per row tile for all sources: one source's signal releases another's reader."""

  def sem_index(self, src, tile):
    return tile


@dataclasses.dataclass(frozen=True)
class _SignalPerChunk(ga.TilePlan):
  """Signals after the first column chunk only: consumers may read rows still in flight."""

  @property
  def sends_per_step(self):
    return self.m_tiles * self.c_chunks

  def send_tile(self, flat):
    return flat // self.c_chunks


@pytest.mark.parametrize(
    "plan_cls,match",
    [
        (_SignalTooFew, "deadlock"),
        (_SharedSemaphore, "before they arrived"),
        (_SignalPerChunk, "before they arrived|not back to 0"),
    ],
)
def test_simulator_catches_broken_protocols(plan_cls, match):
  tiles = dict(tile_m=4, tile_c=4, tile_n=4)
  with pytest.raises(ga.ProtocolError, match=match):
    _simulate_global(
        4, 1, 16, 4, 8, 8, dict(comm_workers=2, gemm_workers=2), tiles, plan_cls=plan_cls
    )


@pytest.mark.parametrize("heads", [4, 8])  # a transfer chunk spans the rank's heads, or half
def test_kernel_lowers_to_mosaic_gpu_on_cpu(heads):
  """Traces the kernel and runs Pallas' Mosaic GPU lowering (shapes, layouts, wgmma operands,
  remote copies whose peers the host must be able to compute)."""
  mesh = jax.make_mesh(
      (2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
  )
  cfg = ga.GemmA2AConfig(num_sms=8, comm_sms=2)
  fn = jax.shard_map(
      functools.partial(ga.gemm_a2a, axis_name="cp", config=cfg),
      mesh=mesh,
      in_specs=(P(None, None, "cp"), P()),
      out_specs=P(None, "cp"),
      check_vma=False,
  )
  o = jax.ShapeDtypeStruct((2, 128, heads, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((heads, 64, 256), jnp.bfloat16)
  lowered = jax.jit(fn).trace(o, w).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "o_shape,w_shape,dtype,cfg,match",
    [
        ((1, 128, 4, 64), (4, 64, 256), jnp.float32, {}, "bfloat16/float16"),
        (
            (1, 128, 4, 64),
            (4, 64, 200),
            jnp.bfloat16,
            {},
            "model dim 200 is not a multiple of the tile",
        ),
        ((1, 128, 4, 64), (4, 64, 256), jnp.bfloat16, {"comm_sms": 8}, "comm_sms=8 must lie in"),
    ],
)
def test_bad_inputs_raise(o_shape, w_shape, dtype, cfg, match):
  mesh = jax.make_mesh(
      (2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
  )
  config = ga.GemmA2AConfig(num_sms=8, **{"comm_sms": 2, **cfg})
  fn = jax.shard_map(
      functools.partial(ga.gemm_a2a, axis_name="cp", config=config),
      mesh=mesh,
      in_specs=(P(None, None, "cp"), P()),
      out_specs=P(None, "cp"),
      check_vma=False,
  )
  with pytest.raises(ValueError, match=match):
    jax.jit(fn).trace(jax.ShapeDtypeStruct(o_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
