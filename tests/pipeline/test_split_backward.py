"""A layer's backward split into I and W: each half runs its own equations once, and together
they give exactly the layer's vjp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import transformer
from jaxpipe.pipeline.executor import _Residuals
from jaxpipe.pipeline.split_backward import split_backward
from jaxpipe.planning import layout as planner

B, L = 2, 16
CFG = transformer.TransformerConfig(
    vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48
)


def llama_layer(p, x_BxLxD):
  return transformer.apply_unit(CFG, p, x_BxLxD, jnp.arange(x_BxLxD.shape[1]))


@jax.jit
def _up(x_BxLxD, w_DxF):
  return jax.nn.silu(x_BxLxD @ w_DxF)


def jitted_layer(p, x_BxLxD):
  # a jitted call holding a weight product: its backward must be split inside, or I would
  # compute that weight's cotangent
  return _up(x_BxLxD, p["up"]) @ p["down"]


def tied_layer(p, x_BxLxD):
  # the weights tied to the input by a barrier (as FSDP's gathered layer ties them): the
  # backward's barrier then joins the weight cotangent to the input cotangent
  p, x_BxLxD = jax.lax.optimization_barrier((p, x_BxLxD))
  return jnp.tanh(x_BxLxD @ p["w"])


def conv_layer(p, x_BxLxD):
  # a weight product that is a convolution over the sequence, not a dot_general
  y = jax.lax.conv_general_dilated(x_BxLxD, p["k"], (1,), "SAME", dimension_numbers=CONV_DIMS)
  return jnp.tanh(y)


CONV_DIMS = ("NWC", "WIO", "NWC")


def _layer_params():
  params = transformer.init_params(CFG, jax.random.key(0))
  return jax.tree.map(lambda a: a[0], params["layers"])


def _split(fn, params, x):
  """-> (the split, stored residuals, the reference vjp) for `fn` at (params, x)."""
  resid = _Residuals.probe(fn, params, jax.ShapeDtypeStruct(x.shape, x.dtype))
  _, vjp_fn, _ = jax.vjp(lambda p, x: resid.fn(p, x, ()), params, x, has_aux=True)
  stored = resid.split(vjp_fn, params)
  split = split_backward(lambda s, p, g: resid.join(s, p)(g), stored, params, x)
  return split, stored, vjp_fn


def _dots(fn, *args) -> int:
  """Matrix products (dot_general, convolution) in the jaxpr of fn(*args), calls included."""

  def count(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name in ("dot_general", "conv_general_dilated")
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        n += count(sub)
    return n

  return count(jax.make_jaxpr(fn)(*args).jaxpr)


CASES = {
    "llama": (llama_layer, _layer_params),
    "jitted": (
        jitted_layer,
        lambda: {
            "up": jax.random.normal(jax.random.key(1), (CFG.d_model, 48)),
            "down": jax.random.normal(jax.random.key(2), (48, CFG.d_model)),
        },
    ),
    "conv": (
        conv_layer,
        lambda: {"k": jax.random.normal(jax.random.key(6), (3, CFG.d_model, CFG.d_model)) / 8},
    ),
    "tied": (
        tied_layer,
        lambda: {"w": jax.random.normal(jax.random.key(5), (CFG.d_model, CFG.d_model))},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_halves_give_the_layers_vjp(case):
  fn, make_params = CASES[case]
  params = make_params()
  x = jax.random.normal(jax.random.key(3), (B, L, CFG.d_model))
  g = jax.random.normal(jax.random.key(4), (B, L, CFG.d_model))

  @jax.jit  # under a trace, as the executor runs it (the parameters are matched by identity)
  def run(params, x, g):
    split, stored, vjp_fn = _split(fn, params, x)
    dx, kept = split.input_half(stored, params, g)
    dx0, kept0 = split.input_half(stored, params, g, need_dx=False)
    return vjp_fn(g), (split.weight_half(stored, params, kept), dx), (dx0, kept0, kept)

  (want_dp, want_dx), (dp, dx), (dx0, kept0, kept) = run(params, x, g)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), dp, want_dp)
  # without the input cotangent, I still hands W the same values
  np.testing.assert_array_equal(dx0, np.zeros_like(dx))
  for a, b in zip(kept0, kept):
    np.testing.assert_array_equal(a, b)


def _traced_split(fn, params, x) -> dict:
  """The split of fn's backward and its parts' dot counts, traced as the executor traces it."""
  found = {}

  def run(params, x):
    split, stored, vjp_fn = _split(fn, params, x)
    kept = [jnp.zeros(k.shape, k.dtype) for k in split.kept]
    found["split"] = split
    found["full"] = _dots(lambda g: vjp_fn(g), x)
    found["I"] = _dots(lambda s, p, g: split.input_half(s, p, g), stored, params, x)
    found["W"] = _dots(lambda s, p, k: split.weight_half(s, p, k), stored, params, kept)
    return x

  jax.make_jaxpr(run)(params, x)
  return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_product_runs_once(case):
  """I and W together run the backward's matrix products once each, W only the weight ones: a W
  that re-derived its cotangents from the layer's output cotangent would run more."""
  fn, make_params = CASES[case]
  params = make_params()
  found = _traced_split(fn, params, jnp.ones((B, L, CFG.d_model)))
  weights = sum(a.ndim >= 2 for a in jax.tree.leaves(params))  # one product per weight matrix
  assert found["W"] == weights, found
  assert found["I"] + found["W"] == found["full"], found


def test_kept_is_the_cotangent_at_each_weight_product():
  """What I hands W for a Llama layer: per token, the cotangents at the outputs of q, k and v
  (heads x head_dim each), of the MLP's gate and up (d_ff each) and of the two products that end
  in the residual stream (d_model each); per layer, the two norms' scale cotangents (d_model
  each), which I computes (a W keeping their per-token inputs would hold 2 d_model per token
  more)."""
  split = _traced_split(llama_layer, _layer_params(), jnp.ones((B, L, CFG.d_model)))["split"]
  per_token = [k for k in split.kept if k.shape[:2] == (B, L)]
  per_layer = [k.shape for k in split.kept if k.shape[:2] != (B, L)]
  c = CFG
  want = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 2 * c.d_ff + 2 * c.d_model
  got = sum(int(np.prod(k.shape)) for k in per_token) // (B * L)
  assert got == want, (got, want, [k.shape for k in split.kept])
  assert sorted(per_layer) == [(c.d_model,), (c.d_model,)], per_layer


def test_the_planner_prices_what_the_split_keeps():
  """The layout planner's `kept_elements` (pure Python, no JAX) against the traced split of the
  same layer: per token, the elements of what I keeps for W."""
  split = _traced_split(llama_layer, _layer_params(), jnp.ones((B, L, CFG.d_model)))["split"]
  got = sum(int(np.prod(k.shape)) for k in split.kept if k.shape[:2] == (B, L)) / (B * L)
  c = CFG
  model = planner.Model("t", c.vocab, c.d_model, 1, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff)
  assert planner.kept_elements(model, planner.Layout(), moe=False) == got
