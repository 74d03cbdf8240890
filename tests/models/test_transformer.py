"""The Flax LM against a plain-JAX reference written from the formulas, and its block structure."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import flops, transformer
from jaxpipe.models import moe as moe_lib
from jaxpipe.models.transformer import TransformerConfig
from tests import helpers

_forward = jax.jit(transformer.forward, static_argnums=0)
_loss = jax.jit(transformer.loss, static_argnums=0)
CFG = TransformerConfig(
    vocab=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, rope_theta=100.0
)
B, L = 2, 12


def _random_params(cfg, seed=0):
  """Model-shaped random parameters (norm scales too, so each one matters), drawn by numpy."""
  shapes = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if path[-1].key == "scale":
      return jnp.asarray(1 + 0.3 * rng.standard_normal(s.shape), jnp.float32)
    return jnp.asarray(0.2 * rng.standard_normal(s.shape), jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


# -- the reference: one function per formula, no Flax, no shared code with the model -------------


def ref_rms_norm(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def ref_rope(x_BxLxHxK, theta):
  # Channel pair (i, i + K/2) as one complex number, rotated by position * theta^(-i/(K/2)).
  half = x_BxLxHxK.shape[-1] // 2
  z = x_BxLxHxK[..., :half] + 1j * x_BxLxHxK[..., half:]
  pos = jnp.arange(x_BxLxHxK.shape[1])[None, :, None, None]
  z = z * jnp.exp(1j * pos * theta ** (-jnp.arange(half) / half))
  return jnp.concatenate([z.real, z.imag], -1)


def ref_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
  rep = q_BxLxHxK.shape[2] // k_BxLxGxK.shape[2]
  k = jnp.repeat(k_BxLxGxK, rep, axis=2)  # query head h reads KV head h // rep
  v = jnp.repeat(v_BxLxGxK, rep, axis=2)
  s = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k, precision="highest") / np.sqrt(k.shape[-1])
  n = s.shape[-1]
  s = jnp.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
  return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(s, -1), v, precision="highest")


def ref_layer(cfg, p, x):
  mm = lambda a, w, spec: jnp.einsum(spec, a, w, precision="highest")
  h = ref_rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)
  q = ref_rope(mm(h, p["attn"]["q"]["kernel"], "bld,dhk->blhk"), cfg.rope_theta)
  k = ref_rope(mm(h, p["attn"]["k"]["kernel"], "bld,dgk->blgk"), cfg.rope_theta)
  v = mm(h, p["attn"]["v"]["kernel"], "bld,dgk->blgk")
  x = x + mm(ref_attention(q, k, v), p["attn"]["o"]["kernel"], "blhk,hkd->bld")
  h = ref_rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
  gate = mm(h, p["mlp"]["gate"]["kernel"], "bld,df->blf")
  up = mm(h, p["mlp"]["up"]["kernel"], "bld,df->blf")
  return x + mm(gate * jax.nn.sigmoid(gate) * up, p["mlp"]["down"]["kernel"], "blf,fd->bld")


def ref_logits(cfg, params, tokens):
  x = params["embed"][tokens]
  for i in range(cfg.n_layers):
    x = ref_layer(cfg, jax.tree.map(lambda a: a[i], params["layers"]), x)
  x = ref_rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
  w = params["embed"].T if cfg.tied_embeddings else params["head"]
  return jnp.einsum("bld,dv->blv", x, w, precision="highest")


def ref_loss(cfg, params, tokens, targets, mask):
  logp = jax.nn.log_softmax(ref_logits(cfg, params, tokens), -1)
  nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return jnp.sum(nll * mask), jnp.sum(mask)


def _batch(cfg, seed=0):
  r = np.random.default_rng(seed)
  tokens = r.integers(0, cfg.vocab, (B, L)).astype(np.int32)
  targets = r.integers(0, cfg.vocab, (B, L)).astype(np.int32)
  mask = (r.random((B, L)) < 0.7).astype(np.float32)
  return tokens, targets, mask


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_shapes(tied):
  cfg = dataclasses.replace(CFG, tied_embeddings=tied)
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  n, d, h, g, k, f, v = (
      cfg.n_layers,
      cfg.d_model,
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.head_dim,
      cfg.d_ff,
      cfg.vocab,
  )
  expected = {
      "embed": (v, d),
      "final_norm/scale": (d,),
      "layers/attn_norm/scale": (n, d),
      "layers/mlp_norm/scale": (n, d),
      "layers/attn/q/kernel": (n, d, h, k),
      "layers/attn/k/kernel": (n, d, g, k),
      "layers/attn/v/kernel": (n, d, g, k),
      "layers/attn/o/kernel": (n, h, k, d),
      "layers/mlp/gate/kernel": (n, d, f),
      "layers/mlp/up/kernel": (n, d, f),
      "layers/mlp/down/kernel": (n, f, d),
  }
  if not tied:
    expected["head"] = (d, v)
  got = {
      "/".join(p.key for p in path): x.shape
      for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  assert got == expected
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_forward_matches_reference():
  cfg = CFG  # tied; the untied head is checked through the loss and its gradients below
  params = _random_params(cfg)
  tokens, _, _ = _batch(cfg)
  got = _forward(cfg, params, tokens)
  assert got.shape == (B, L, cfg.vocab) and got.dtype == jnp.float32
  want = jax.jit(ref_logits, static_argnums=0)(cfg, params, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_loss_and_gradients_match_reference():
  cfg = dataclasses.replace(CFG, tied_embeddings=False)
  params = _random_params(cfg)
  tokens, targets, mask = _batch(cfg)
  (s, n), g = jax.jit(
      jax.value_and_grad(lambda p: transformer.loss(cfg, p, tokens, targets, mask), has_aux=True)
  )(params)
  (rs, rn), rg = jax.jit(
      jax.value_and_grad(lambda p: ref_loss(cfg, p, tokens, targets, mask), has_aux=True)
  )(params)
  assert "head" in g
  assert float(n) == mask.sum()
  np.testing.assert_allclose(s, rs, rtol=1e-5)
  for path, a, b in zip(
      jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g), jax.tree.leaves(rg)
  ):
    scale = np.max(np.abs(b))
    np.testing.assert_allclose(a / scale, b / scale, atol=2e-5, err_msg=str(path[0]))


def test_layer_blocks_compose_like_pipeline_stages():
  params = _random_params(CFG)
  x = transformer.embed(CFG, params, _batch(CFG)[0])
  apply = jax.jit(transformer.apply_layers, static_argnums=0)
  whole = apply(CFG, params["layers"], x)
  # Two stages of two layers each: the [num_stages, layers_per_stage, ...] view.
  staged = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), params["layers"])
  y = x
  for s in range(2):
    y = apply(CFG, jax.tree.map(lambda a: a[s], staged), y)
  np.testing.assert_allclose(y, whole, rtol=1e-6, atol=1e-6)
  one = jax.tree.map(lambda a: a[:1], params["layers"])
  want = jax.jit(ref_layer, static_argnums=0)(
      CFG, jax.tree.map(lambda a: a[0], params["layers"]), x
  )
  np.testing.assert_allclose(apply(CFG, one, x), want, rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
  params = _random_params(CFG)
  tokens = _batch(CFG)[0]
  changed = tokens.copy()
  changed[:, 7] = (changed[:, 7] + 1) % CFG.vocab
  a, b = _forward(CFG, params, tokens), _forward(CFG, params, changed)
  np.testing.assert_array_equal(a[:, :7], b[:, :7])
  assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-3


def test_remat_gradients_and_bfloat16_loss():
  params = _random_params(CFG)
  tokens, targets, mask = _batch(CFG)
  grad = jax.jit(
      jax.value_and_grad(
          lambda cfg, p: transformer.loss(cfg, p, tokens, targets, mask)[0], argnums=1
      ),
      static_argnums=0,
  )
  (l0, g0), (l1, g1) = grad(CFG, params), grad(dataclasses.replace(CFG, remat=True), params)
  np.testing.assert_array_equal(l0, l1)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  bf16 = _loss(dataclasses.replace(CFG, dtype="bfloat16"), params, tokens, targets, mask)[0]
  assert bf16.dtype == jnp.float32
  np.testing.assert_allclose(bf16, l0, rtol=5e-2)


def test_selective_remat_recomputes_the_attention_core_only():
  """remat='selective' (Megatron's): the same gradients; the backward's temporaries fall below
  keeping everything (the [L, L] scores are recomputed) and stay above recomputing each whole
  layer (the projections' outputs are kept), in the compiled program's own bytes."""
  cfg = dataclasses.replace(CFG, n_layers=4)
  params = _random_params(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 256)), jnp.int32)
  mask = jnp.ones(tokens.shape)
  temp, grads = {}, {}
  for remat in (False, "selective", True):
    c = dataclasses.replace(cfg, remat=remat)
    step = jax.jit(jax.grad(lambda p, c=c: transformer.loss(c, p, tokens, tokens, mask)[0]))
    temp[remat] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    grads[remat] = step(params)
  assert temp[True] < temp["selective"] < 0.6 * temp[False]
  for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads["selective"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="remat='partial' is unknown"):
    dataclasses.replace(cfg, remat="partial")


def test_analytic_flops_match_compiled_count():
  # One layer so the scan body (which XLA counts once) is the whole model; sizes where matmuls
  # dominate the elementwise work XLA also counts.
  cfg = TransformerConfig(
      vocab=512, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024
  )
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
  compiled = jax.jit(transformer.forward, static_argnums=0).lower(cfg, params, tokens).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # XLA computes the full (masked) score matrix, so compare with the non-causal count.
  analytic = 2 * flops.forward_flops_per_sequence(cfg, 128, causal=False)
  assert abs(cost["flops"] - analytic) / analytic < 0.03, (cost["flops"], analytic)
  assert flops.training_flops_per_step(cfg, 2, 128) == 3 * 2 * flops.forward_flops_per_sequence(
      cfg, 128
  )


def test_flops_count_an_moe_layer_by_the_experts_a_token_runs():
  """A dense first layer (d_ff 96), then two MoE layers: each the router (2·l·d·E) and its
  top_k routed plus shared experts' three projections (2·l·d·f·3 each) in place of the dense
  FFN, worked out by hand."""
  from jaxpipe.models.moe import MoEConfig

  dense = TransformerConfig(vocab=8, d_model=64, n_layers=3, n_heads=4, head_dim=16, d_ff=96)
  moe = MoEConfig(num_experts=8, top_k=2, d_ff=32, num_shared_experts=1)
  mixed = dataclasses.replace(dense, moe=moe, first_dense=1)
  l = 16
  router, experts, ffn = 2 * l * 64 * 8, 2 * l * 64 * 32 * 3 * 3, 2 * l * 64 * 96 * 3
  assert (router, experts, ffn) == (16384, 589824, 589824)
  want = flops.forward_flops_per_sequence(dense, l) + 2 * (router + experts - ffn)
  assert flops.forward_flops_per_sequence(mixed, l) == want


def test_unrolled_layer_stack_has_the_loops_gradients():
  """model.unroll_layers: a stack of at most that many units runs unrolled (no while loop, no
  more temporaries), a longer one (or 0, or any under remat) as the lax.scan loop; the loss and
  gradients match the loop's to float rounding, and the unstacked reference's (`ref_loss`)."""
  params = _random_params(CFG)
  tokens, targets, mask = _batch(CFG)

  def grad(cfg, p):
    f = jax.value_and_grad(lambda p: transformer.loss(cfg, p, tokens, targets, mask)[0])
    return jax.jit(f).lower(p).compile()

  got, temp = {}, {}
  for unroll in (0, 2, 4):
    for remat in (False, True):
      compiled = grad(dataclasses.replace(CFG, unroll_layers=unroll, remat=remat), params)
      looped = unroll < CFG.n_layers or remat
      # the layer scan's loops (a scatter-add's gradient may be expanded into a loop of its own)
      loops = re.findall(r" while\(.*op_name=\"[^\"]*/while\"", compiled.as_text())
      assert bool(loops) == looped, (unroll, remat)
      temp[unroll, remat] = compiled.memory_analysis().temp_size_in_bytes
      got[unroll, remat] = compiled(params)
  assert temp[4, False] <= temp[0, False]
  ref_value, ref_grads = jax.jit(
      jax.value_and_grad(lambda p: ref_loss(CFG, p, tokens, targets, mask)[0])
  )(params)
  for (unroll, remat), (value, grads) in got.items():
    loop_value, loop_grads = got[0, remat]
    np.testing.assert_allclose(value, loop_value, rtol=1e-6)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, a), b, r in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(loop_grads),
        jax.tree.leaves(ref_grads),
    ):
      where = f"unroll_layers={unroll}, remat={remat}: {jax.tree_util.keystr(path)}"
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=where)
      scale = np.max(np.abs(r))
      np.testing.assert_allclose(a / scale, r / scale, atol=2e-5, err_msg=where)


def test_unrolled_moe_groups_match_the_loop():
  moe = moe_lib.MoEConfig(num_experts=4, top_k=2, d_ff=16, every=2)
  cfg = dataclasses.replace(CFG, moe=moe)  # 2 groups of (dense, MoE)
  params = _random_params(cfg)
  x = transformer.embed(cfg, params, _batch(cfg)[0])

  def run(unroll):
    c = dataclasses.replace(cfg, unroll_layers=unroll)

    def objective(p):
      y, aux = transformer.apply_layers_aux(c, p["layers"], x)
      return jnp.sum(y**2) + jnp.sum(aux["loss"]), (y, aux)

    (_, (y, aux)), g = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    return y, aux, g

  (y0, aux0, g0), (y1, aux1, g1) = run(0), run(2)
  helpers.close(y1, y0, "x")  # to float rounding: atol 1e-5 of the largest entry
  for k in aux0:
    helpers.close(aux1[k], aux0[k], k)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g0)):
    helpers.close(a, b, jax.tree_util.keystr(path))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_unroll_layers_is_refused(bad):
  with pytest.raises(ValueError, match=re.escape(f"unroll_layers={bad!r} must be an integer >= 0")):
    dataclasses.replace(CFG, unroll_layers=bad)
  if bad == -1:  # the config file's field is an int: only a negative one gets this far
    helpers.assert_refused(
        {"model.unroll_layers": -1}, "model.unroll_layers=-1 must be an integer >= 0"
    )


MOE = moe_lib.MoEConfig(num_experts=4, top_k=2, d_ff=32)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(first_dense=1), r"first_dense=1 places dense layers before the MoE ones, but moe"),
        (dict(first_dense=-1, moe=MOE), r"first_dense=-1 must be an integer >= 0"),
        (dict(first_dense=4, moe=MOE), r"first_dense=4 leaves none of the n_layers=4 layers"),
        (
            dict(first_dense=1, moe=dataclasses.replace(MOE, every=2)),
            r"n_layers=4 leaves 3 layers after first_dense=1, not a multiple of moe.every=2",
        ),
    ],
)
def test_bad_first_dense_layers_are_one_line(fields, match):
  with pytest.raises(ValueError, match=match):
    TransformerConfig(n_layers=4, **fields)


@pytest.mark.parametrize("activation, torch_act", [("silu", "silu"), ("gelu_tanh", "gelu_tanh")])
def test_bfloat16_activation_is_torchs_rounded_once(activation, torch_act):
  """In bfloat16 the gated FFN's activation is computed in float32 and rounded once, as torch's
  kernels compute it (transformers' ACT2FN on bfloat16 gate values): with identity projections
  the FFN's output is act(x) * x, equal to torch's (SiLU bit-equal; GELU-tanh's float32 tanh
  differs in its last bits, which moves a few values near 0 by under 1e-5). Rounded after each
  of its ops, either differed from torch's on about 40% of the values, by up to 0.03."""
  torch = pytest.importorskip("torch")
  d = 64
  cfg = TransformerConfig(
      vocab=64,
      d_model=d,
      n_layers=1,
      n_heads=4,
      n_kv_heads=2,
      head_dim=16,
      d_ff=d,
      dtype="bfloat16",
      activation=activation,
  )
  eye = jnp.eye(d, dtype=jnp.float32)
  params = {"params": {name: {"kernel": eye} for name in ("gate", "up", "down")}}
  x = np.random.default_rng(0).normal(0, 3, (2, 512, d)).astype(np.float32)
  x_bf16 = jnp.asarray(x, jnp.bfloat16)
  got = np.asarray(transformer.Mlp(cfg).apply(params, x_bf16).astype(jnp.float32))
  t = torch.tensor(np.asarray(x_bf16.astype(jnp.float32))).to(torch.bfloat16)
  act = {
      "silu": torch.nn.functional.silu,
      "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
  }[torch_act]
  want = (act(t) * t).float().numpy()
  if activation == "silu":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
