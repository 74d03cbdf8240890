"""Dispatch layout, transports and fp8 payload against hand-worked cases and their adjoints."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe.parallel import expert


def test_layout_hand_case():
  # ep = 2, E = 4 (two per rank), T = 4, K = 2, capacity 2: token 3 overflows both ranks.
  idx = jnp.array([[0, 1], [1, 2], [3, 2], [0, 3]], jnp.int32)
  plan = expert.make_plan(4, 2, 4, 2, capacity_factor=0.5)
  assert plan.capacity == 2  # ceil(0.5 * 4 * min(2, 2) / 2)
  lay = expert.make_layout(idx, plan)
  np.testing.assert_array_equal(lay.rank_TxK, [[0, 0], [0, 1], [1, 1], [0, 1]])
  np.testing.assert_array_equal(lay.is_token_in_rank_TxR, [[1, 0], [1, 1], [0, 1], [1, 1]])
  np.testing.assert_array_equal(lay.num_tokens_per_rank_R, [3, 3])
  np.testing.assert_array_equal(lay.num_tokens_per_expert_E, [2, 2, 2, 2])
  np.testing.assert_array_equal(lay.kept_TxK, [[1, 1], [1, 1], [1, 1], [0, 0]])
  np.testing.assert_array_equal(lay.carrier_TxK, [[1, 0], [1, 1], [1, 0], [0, 0]])
  np.testing.assert_array_equal(lay.send_pos_TxK, [[0, 0], [1, 2], [3, 3], [4, 4]])
  np.testing.assert_array_equal(lay.src_S, [0, 2, 3, 4])  # flat t*K+k of each row's carrier
  np.testing.assert_array_equal(lay.send_sizes_R, [2, 2])
  packed = expert.make_layout(idx, expert.make_plan(4, 2, 4, 2, impl="ragged"))
  np.testing.assert_array_equal(packed.send_pos_TxK, [[0, 0], [1, 3], [4, 4], [2, 5]])
  np.testing.assert_array_equal(packed.send_sizes_R, [3, 3])


def test_ragged_emulation_matches_documented_example():
  """The two-device example of `jax.lax.ragged_all_to_all`'s docstring."""
  mesh = jax.make_mesh(
      (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
  )
  arrays = dict(
      operand=[[1, 2, 2], [3, 4, 0]],
      output=[[0] * 4] * 2,
      input_offsets=[[0, 1], [0, 1]],
      send_sizes=[[1, 2], [1, 1]],
      output_offsets=[[0, 0], [1, 2]],
      recv_sizes=[[1, 1], [2, 1]],
  )
  args = [jnp.asarray(v, jnp.int32).reshape(-1) for v in arrays.values()]
  fn = jax.shard_map(
      functools.partial(expert.ragged_all_to_all_emulated, axis_name="x"),
      mesh=mesh,
      in_specs=(P("x"),) * 6,
      out_specs=P("x"),
  )
  np.testing.assert_array_equal(fn(*args), [1, 3, 0, 0, 2, 2, 4, 0])


@pytest.mark.parametrize("impl, cf", [("fixed", None), ("fixed", 0.5), ("ragged_emulated", None)])
def test_dispatch_and_combine_are_adjoint(impl, cf):
  """vjp(dispatch) is combine and vjp(combine) is dispatch: <dispatch(x), y> = <x, combine(y)>."""
  ep, t, k, e, d = 4, 8, 2, 8, 4
  mesh = jax.make_mesh((2, ep), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  plan = expert.make_plan(t, k, e, ep, cf, impl)
  keys = jax.random.split(jax.random.key(0), 4)
  idx = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(keys[0], 8 * t))
  x = jax.random.normal(keys[1], (8 * t, d))
  y = jax.random.normal(keys[2], (8 * plan.recv_rows, d))
  w = jnp.ones((8 * t, k))

  def local(x, y, idx, w):
    def disp(x):
      recv, handle = expert.dispatch(x, idx, w, plan, axis="ep")
      return recv.x_NxD, handle

    fx, vjp_disp, handle = jax.vjp(disp, x, has_aux=True)
    cy, vjp_comb = jax.vjp(lambda y: expert.combine(y, handle, plan, axis="ep"), y)
    return fx, vjp_disp(y)[0], cy, vjp_comb(x)[0]

  tok, rows = P(("dp", "ep")), P(("dp", "ep"))
  fx, disp_t, cy, comb_t = jax.jit(
      jax.shard_map(
          local, mesh=mesh, in_specs=(tok, rows, tok, tok), out_specs=(rows, tok, tok, rows)
      )
  )(x, y, idx, w)
  np.testing.assert_allclose(disp_t, cy, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(comb_t, fx, rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(cy)).sum() > 0
