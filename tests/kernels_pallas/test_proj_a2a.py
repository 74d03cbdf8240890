"""Fused projection + A2A: the tile protocol in the CPU simulator, the kernel's lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernels_pallas import gemm_a2a as ga
from kernels_pallas import proj_a2a as pa


def _simulate_global(
    p, batch, seq, d, heads, head_dim, workers, tiles, seed=0, plan_cls=pa.ProjPlan, calls=1
):
  """Global x [B, L, D] and w [D, N, K] through the per-rank layout and the simulated kernel;
  returns (what each rank holds as [B, L, N/P, K], the dense x @ w split the same way)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch, seq, d))
  w = rng.standard_normal((d, heads, head_dim))
  s = seq // p
  layouts = [pa.to_kernel_layout(x[:, r * s : (r + 1) * s], w, p) for r in range(p)]
  x_PxMxD = np.stack([np.asarray(xr) for xr, _ in layouts])
  w_PxDxC = np.asarray(layouts[0][1])
  m, c = x_PxMxD.shape[1], w_PxDxC.shape[2]
  plan = plan_cls(
      num_devices=p, m_tiles=m // tiles["tile_m"], n_tiles=c // tiles["tile_n"], workers=workers
  )
  q = pa.simulate(x_PxMxD, w_PxDxC, plan, seed=seed, calls=calls, **tiles)  # [rank, src, M, C]
  hp = heads // p
  got = q.reshape(p, p, batch, s, hp, head_dim).transpose(0, 2, 1, 3, 4, 5)
  got = got.reshape(p, batch, seq, hp, head_dim)
  dense = np.einsum("bld,dnk->blnk", x, w)
  want = np.stack([dense[:, :, r * hp : (r + 1) * hp] for r in range(p)])
  return got, want


@pytest.mark.parametrize(
    "p,workers,seed,calls",
    [(2, 1, 0, 1), (4, 3, 1, 1), (8, 5, 2, 1), (4, 11, 3, 1), (4, 2, 4, 3), (3, 1, 5, 3)],
)
def test_protocol_matches_dense_math(p, workers, seed, calls):
  got, want = _simulate_global(
      p, 2, 4 * p, 12, 2 * p, 8, workers, dict(tile_m=4, tile_n=4), seed=seed, calls=calls
  )
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@dataclasses.dataclass(frozen=True)
class _WaitTooFew(pa.ProjPlan):
  """Returns after all but one tile of each source: a rank may hand back rows still in flight."""

  @property
  def signals_per_source(self):
    return self.m_tiles * self.n_tiles - 1


@dataclasses.dataclass(frozen=True)
class _OneSemaphore(pa.ProjPlan):
  """Every source signals one counter: a fast source's next-call signals stand in for a slow
  source's tiles of this call."""

  def sem_index(self, src):
    return 0

  @property
  def num_sems(self):
    return 1

  @property
  def signals_per_source(self):
    return self.m_tiles * self.n_tiles  # waited once per source: P·m·n in all


@dataclasses.dataclass(frozen=True)
class _SkipOwnHeads(pa.ProjPlan):
  """Never computes the own heads' tiles, but still waits for them."""

  @property
  def steps(self):
    return list(range(1, self.num_devices))


@pytest.mark.parametrize(
    "plan_cls,calls,match",
    [
        (_WaitTooFew, 1, "before all its tiles arrived|not back to 0"),
        (_SkipOwnHeads, 1, "deadlock"),
        (_OneSemaphore, 3, "before all its tiles arrived"),
    ],
)
def test_simulator_catches_broken_protocols(plan_cls, calls, match):
  with pytest.raises(ga.ProtocolError, match=match):
    for seed in range(20):  # a race shows under some interleaving
      _simulate_global(
          4, 1, 16, 8, 8, 4, 3, dict(tile_m=2, tile_n=4), seed=seed, plan_cls=plan_cls, calls=calls
      )


def _sharded(config, p=2):
  mesh = jax.make_mesh(
      (p,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:p]
  )
  return jax.shard_map(
      functools.partial(pa.proj_a2a, axis_name="cp", config=config),
      mesh=mesh,
      in_specs=(P(None, "cp"), P()),
      out_specs=P(None, None, "cp"),
      check_vma=False,
  )


@pytest.mark.parametrize("heads", [4, 8])  # an output tile spans the rank's heads, or half
def test_kernel_lowers_to_mosaic_gpu_on_cpu(heads):
  """Traces the kernel and runs Pallas' Mosaic GPU lowering (shapes, layouts, wgmma operands,
  remote stores whose peers the host must be able to compute)."""
  x = jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, heads, 64), jnp.bfloat16)
  fn = _sharded(pa.ProjA2AConfig(num_sms=8))
  lowered = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
  out = jax.eval_shape(fn, x, w)
  assert out.shape == (2, 128, heads, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "x_shape,w_shape,dtype,match",
    [
        ((1, 128, 256), (256, 4, 64), jnp.float32, "bfloat16/float16"),
        ((1, 128, 256), (256, 3, 64), jnp.bfloat16, "do not fit 2 ranks"),
        ((1, 100, 256), (256, 4, 64), jnp.bfloat16, "rows 50 is not a multiple of the tile 64"),
        (
            (1, 128, 256),
            (256, 4, 32),
            jnp.bfloat16,
            "head channels 64 is not a multiple of the tile",
        ),
    ],
)
def test_bad_inputs_raise(x_shape, w_shape, dtype, match):
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(
        _sharded(pa.ProjA2AConfig(num_sms=8)),
        jax.ShapeDtypeStruct(x_shape, dtype),
        jax.ShapeDtypeStruct(w_shape, dtype),
    )
