"""oneDNN's GEMM (`kernels_cpu.matmul`) against XLA's dot, and the rule that picks it."""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.models import transformer
from jaxpipe.ops import matmul as matmul_lib
from jaxpipe.serve import Engine
from jaxpipe.serve import model as model_lib
from jaxpipe.serve.sampling import SamplingParams
from kernels_cpu import matmul as onednn
from tests import helpers

pytestmark = pytest.mark.skipif(
    onednn.unavailable() is not None, reason=f"oneDNN kernel: {onednn.unavailable()}"
)


def _reference(x, w):
  """The product in float64 on the host."""
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("m, k, n", [(1, 8, 3), (64, 576, 192), (37, 130, 1000), (5, 0, 4)])
def test_float32_gemm_equals_the_float64_product(m, k, n):
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  got = np.asarray(jax.jit(onednn.matmul)(x, w))
  assert got.dtype == np.float32 and got.shape == (m, n)
  np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-4 * np.sqrt(max(k, 1)))
  wt = jax.jit(lambda a, b: onednn.matmul(a, b, transpose_w=True))(x, np.ascontiguousarray(w.T))
  np.testing.assert_allclose(np.asarray(wt), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_bfloat16_gemm_rounds_the_exact_product_once(out):
  """bfloat16 inputs, float32 sums: a float32 result is the exact product of the bfloat16 values
  to float32 rounding; a bfloat16 one is that rounded once more (half a bfloat16 ulp)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 96)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((96, 40)), jnp.bfloat16)
  got = np.asarray(jax.jit(lambda a, b: onednn.matmul(a, b, out))(x, w), np.float64)
  want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
  assert jax.eval_shape(lambda: onednn.matmul(x, w, out)).dtype == out
  ulp = 2.0**-8 if out == jnp.bfloat16 else 2.0**-20
  np.testing.assert_allclose(got, want, rtol=ulp, atol=1e-3)


def _cpu_flags() -> set[str]:
  with open("/proc/cpuinfo") as f:
    return {w for line in f if line.startswith("flags") for w in line.split()[2:]}


@pytest.mark.skipif("ONEDNN_MAX_CPU_ISA" in os.environ, reason="oneDNN's ISA is capped")
def test_bfloat16_products_run_as_float32_ones_where_the_cpu_has_no_bfloat16_dots():
  """The CPU's flags decide: with AVX512_BF16 (or AMX) oneDNN's bfloat16 kernels run, and
  bfloat16 weights pack smaller than float32 ones; without, the products run in float32 and the
  weights pack as float32 ones, unless the kernel's own tiles (Intel, AVX-512) widen them."""
  native = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())
  assert onednn.bf16_in_float32() is (not native)
  sizes = {t: onednn.prepacked_bytes(256, 512, t) for t in (jnp.bfloat16, jnp.float32)}
  # held as bfloat16 where the CPU multiplies them, or the kernel's own tiles widen them
  tiles = _cpu_vendor() == "GenuineIntel" and "avx512f" in _cpu_flags()
  assert (sizes[jnp.bfloat16] < sizes[jnp.float32]) is (native or tiles)


def _cpu_vendor() -> str:
  with open("/proc/cpuinfo") as f:
    return next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")


@pytest.mark.skipif("ONEDNN_MAX_CPU_ISA" in os.environ, reason="oneDNN's ISA is capped")
def test_packed_float32_products_run_panels_on_intel_cpus_with_avx512():
  """The CPU decides: an Intel CPU with AVX-512 runs packed float32 products on the kernel's own
  tiles (`panels`), any other on oneDNN's matmul; forcing either way overrides it."""
  native = _cpu_vendor() == "GenuineIntel" and "avx512f" in _cpu_flags()
  assert onednn.panels(576, 3072) is native and onednn.panels(100, 70) is native
  with onednn.panels_forced(False):
    assert not onednn.panels(576, 3072)
  with onednn.panels_forced(True):
    assert onednn.panels(576, 3072) is ("avx512f" in _cpu_flags())


@pytest.mark.parametrize("use_panels", [True, False])
def test_either_packed_float32_kernel_equals_the_float64_product(use_panels):
  """Forced either way: packed float32 products whose last 6-row tile holds each of 1-6 rows (M
  1, 8, 15, 64, 101, 12), K not a multiple of the 16-row blocks and N not of the 64-column panels
  (below one, across several), whole or row-limited, equal the float64 product to float32's
  rounding of K terms; a row-limited one zeros the rows after its count (rounded up). bfloat16
  values run as float32 ones round their sums once; on the tiles their weights are held as
  bfloat16, and refused by oneDNN's path. Float32 products of more than PANELS_ROWS rows run on
  oneDNN even where the tiles would, bfloat16 ones on weights held for the tiles on those."""
  with onednn.panels_forced(use_panels):
    if use_panels and not onednn.panels(64, 64):
      pytest.skip("the kernel's own tiles need AVX-512")
    calls = onednn.panels_calls()
    rng = np.random.default_rng(11)
    shapes = [(1, 17, 5), (8, 100, 70), (15, 576, 130), (64, 33, 960), (101, 1536, 257)]
    for m, k, n in shapes + [(12, 64, 64)]:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
      packed = jax.block_until_ready(onednn.prepack(w))
      want = _reference(x, w)
      got = np.asarray(onednn.matmul_prepacked(x, packed, n))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=(m, k, n))
      rows = np.asarray(onednn.matmul_prepacked(x, packed, n, rows=jnp.int32(3)))
      used = min(m, onednn.ROW_GRAIN)
      np.testing.assert_array_equal(rows[:used], got[:used])
      assert not rows[used:].any()
    x = jnp.asarray(rng.standard_normal((9, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 80)), jnp.bfloat16)
    with onednn.bf16_as_float32(True):  # each run before the setting changes back
      packed = jax.block_until_ready(onednn.prepack(w))
      y = np.asarray(onednn.matmul_prepacked(x, packed, 80))
      # the tiles hold bfloat16 weights as bfloat16 (half of float32's bytes, and 64 more)
      halves = packed.shape[0] < onednn.prepacked_bytes(96, 80, jnp.float32)
      assert halves is use_panels
    want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2.0**-8, atol=1e-3)
    if use_panels:  # the tiles' bfloat16 weights are refused where oneDNN would read them
      with onednn.bf16_as_float32(True), onednn.panels_forced(False):
        with pytest.raises(ValueError, match="pack them"):
          onednn.matmul_prepacked(x, packed, 80)
    # 6 shapes whole and row-limited, and the bfloat16 one: on the tiles, or never
    assert onednn.panels_calls() - calls == (13 if use_panels else 0)
    # past PANELS_ROWS float32 products run oneDNN's matmul; bfloat16 weights held for the
    # tiles do not
    x = jnp.asarray(rng.standard_normal((onednn.PANELS_ROWS + 1, 96)), jnp.float32)
    calls = onednn.panels_calls()
    y = np.asarray(onednn.matmul_prepacked(x, onednn.prepack(w.astype(jnp.float32)), 80))
    np.testing.assert_allclose(y, _reference(x, w.astype(jnp.float32)), rtol=1e-5, atol=1e-4)
    assert onednn.panels_calls() == calls
    with onednn.bf16_as_float32(True):
      np.asarray(onednn.matmul_prepacked(x.astype(jnp.bfloat16), onednn.prepack(w), 80))
    assert onednn.panels_calls() - calls == (1 if use_panels else 0)


@pytest.mark.parametrize("in_float32", [True, False])
def test_either_bfloat16_path_rounds_the_exact_product_once(in_float32):
  """Forced either way (`bf16_as_float32`), whatever the CPU: float32 sums of the exact products,
  rounded once to bfloat16, ties to even (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), NaN and
  infinities kept; row-major, transposed, prepacked and row-limited products alike. Weights
  packed on one path are refused on the other."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((40, 96)).astype(np.float32)
  x[0, :2], x[0, 2:] = 1.0, 0.0  # row 0 sums its two first weights alone
  x[1, 0] = np.inf
  w = rng.standard_normal((96, 200)).astype(np.float32)
  w[:2, :2] = [[1.0, 1.0], [2.0**-8, 3 * 2.0**-8]]
  w[:, 2] = 0.0  # inf * 0: NaN in row 1
  x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  with np.errstate(invalid="ignore"):
    want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
  with onednn.bf16_as_float32(in_float32):
    packed = onednn.prepack(w)
    f32_size = onednn.prepacked_bytes(96, 200, jnp.float32)
    # on the float32 path held as float32, unless the kernel's own tiles widen bfloat16 ones
    as_f32 = in_float32 and not onednn.panels(96, 200)
    assert (packed.shape == (f32_size,)) is as_f32 and packed.shape[0] <= f32_size
    ys = {
        "row-major": onednn.matmul(x, w),
        "transposed": onednn.matmul(x, w.T, transpose_w=True),
        "prepacked": onednn.matmul_prepacked(x, packed, 200),
        "rows": onednn.matmul_prepacked(x, packed, 200, rows=jnp.int32(20)),
    }
    f32 = np.asarray(onednn.matmul_prepacked(x, packed, 200, jnp.float32), np.float64)
  with onednn.bf16_as_float32(not in_float32), pytest.raises(ValueError, match="pack them"):
    onednn.matmul_prepacked(x, packed, 200)
  finite = np.isfinite(want)
  np.testing.assert_allclose(f32[finite], want[finite], rtol=2.0**-20, atol=1e-3)
  for name, y in ys.items():
    assert y.dtype == jnp.bfloat16 and y.shape == (40, 200), name
    y = np.asarray(y, np.float64)
    if name == "rows":
      assert not y[32:].any()  # 20 rows rounded up to 32
      y, part = y[:32], slice(0, 32)
    else:
      part = slice(None)
    np.testing.assert_array_equal(y[0, :2], [1.0, 1.0 + 2.0**-6], err_msg=name)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want[part]), err_msg=name)
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want[part]), err_msg=name)
    ok = finite[part]
    np.testing.assert_allclose(y[ok], want[part][ok], rtol=2.0**-8, atol=1e-3, err_msg=name)


def test_the_serve_runner_says_when_bfloat16_runs_as_float32():
  """One line, for oneDNN's bfloat16 products on the float32 path alone."""
  with onednn.bf16_as_float32(True):
    note = matmul_lib.bfloat16_note("onednn", jnp.bfloat16)
    assert note.startswith("# ") and "run as float32 ones" in note and "\n" not in note
    tiles = onednn.panels(1024, 1024)
    assert ("held as float32" in note) is not tiles and ("widened as" in note) is tiles
    assert matmul_lib.bfloat16_note("onednn", jnp.float32) is None
    assert matmul_lib.bfloat16_note("xla", jnp.bfloat16) is None
  with onednn.bf16_as_float32(False):
    assert matmul_lib.bfloat16_note("onednn", jnp.bfloat16) is None


def test_the_kernel_refuses_what_it_does_not_take():
  f32 = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="both float32 .* not x float32, w bfloat16"):
    onednn.matmul(f32, jnp.zeros((3, 4), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"not x float32, w float32 -> bfloat16"):
    onednn.matmul(f32, np.zeros((3, 4), np.float32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"not x \(2, 3\) and w \(4, 4\)"):
    onednn.matmul(f32, np.zeros((4, 4), np.float32))


def _custom_calls(f, *args) -> int:
  return jax.jit(f).lower(*args).compile().as_text().count('custom_call_target="jaxpipe_matmul"')


def test_dot_runs_onednn_only_inside_its_backend_and_for_the_dtypes_it_takes():
  """DenseGeneral's product (two contracted axes too, as the attention output's) on oneDNN
  equals XLA's; outside `backend('onednn')`, or for float16, the dot stays XLA's."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)  # [B, L, H, K]
  w = rng.standard_normal((4, 8, 6)).astype(np.float32)  # [H, K, D]
  # a fresh function each time: jit's cache does not know the backend it was traced under
  f = lambda: lambda a, b: matmul_lib.dot(a, b, in_dims=2)
  assert _custom_calls(f(), x, w) == 0
  want = np.asarray(jax.jit(f())(x, w))
  with matmul_lib.backend("onednn"):
    assert _custom_calls(f(), x, w) == 1
    got = np.asarray(jax.jit(f())(x, w))
    half = x.astype(np.float16), w.astype(np.float16)
    assert _custom_calls(f(), *half) == 0
    head = lambda a, e: matmul_lib.dot(a, e, out_dtype=jnp.float32, transpose_w=True)
    e = rng.standard_normal((10, 8)).astype(np.float32)  # a tied embedding [V, D]
    np.testing.assert_allclose(np.asarray(jax.jit(head)(x[0, 0], e)), x[0, 0] @ e.T, rtol=1e-5)
  assert got.shape == (2, 5, 6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_takes_onednn_on_cpu_and_says_why_when_it_cannot(monkeypatch):
  assert matmul_lib.resolve("auto") == "onednn"
  assert matmul_lib.resolve("xla") == "xla"
  with pytest.raises(ValueError, match="unknown matmul backend 'mkl'"):
    matmul_lib.resolve("mkl")
  with pytest.raises(ValueError, match="resolve it first"):
    with matmul_lib.backend("auto"):
      pass
  reason = "oneDNN's /libdnnl.so is not installed (test)"
  monkeypatch.setattr(onednn, "unavailable", lambda: reason)
  with pytest.raises(ValueError, match=r"'onednn' is unavailable: .*not installed \(test\); use"):
    matmul_lib.resolve("onednn")
  with pytest.warns(RuntimeWarning, match=r"oneDNN kernel is unavailable \(oneDNN's"):
    assert matmul_lib.resolve("auto") == "xla"


def test_an_engine_on_cpu_runs_onednn_over_each_layers_own_weights():
  """The engine's defaults on CPU: the step's projections on oneDNN over weights prepacked in
  its layout, no layer loop (each layer's weights their own arrays, read in place, where a scan
  copies them out of the stack), held once; without prepack_weights, over the row-major weights."""
  cfg = helpers.DENSE
  engine = Engine(cfg, helpers.engine_params("dense"), num_pages=9, **helpers.ENGINE_ARGS)
  assert engine.matmul == "onednn"
  layers = engine.params["layers"]
  assert isinstance(layers, list) and len(layers) == cfg.n_layers
  text = engine.step_program(16, helpers.CONTEXT // helpers.PAGE).as_text()
  # q+k+v, o, gate+up, down (siblings fused, `layers.dense_group`), each on the step's real
  # tokens' rows alone; the head on the rows it samples alone
  assert text.count('custom_call_target="jaxpipe_matmul_prepacked_rows"') == 4 * cfg.n_layers + 1
  assert 'custom_call_target="jaxpipe_matmul_prepacked"' not in text
  assert 'custom_call_target="jaxpipe_matmul"' not in text
  # the weights held once: no layer keeps a row-major projection beside its prepacked ones,
  # and what stays (norms, the tied embedding) is the weights given, layer by layer
  want = helpers.engine_params("dense")
  for i, layer in enumerate(layers):
    held = {k: v for k, v in layer.items() if k != matmul_lib.PREPACKED}
    kernels = [p for p, _ in jax.tree_util.tree_leaves_with_path(held) if "kernel" in str(p)]
    assert not kernels, f"layer {i} holds row-major kernels {kernels}"
    given = jax.tree.map(lambda x, i=i: x[i], want["layers"])
    for path, x in jax.tree_util.tree_leaves_with_path(held):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(_at(given, path)))
  np.testing.assert_array_equal(np.asarray(engine.params["embed"]), np.asarray(want["embed"]))
  rowmajor = Engine(
      cfg, want, num_pages=9, prepack_weights=False, **helpers.ENGINE_ARGS
  ).step_program(16, helpers.CONTEXT // helpers.PAGE)
  text = rowmajor.as_text()
  per_layer = 7  # q, k, v, o, gate, up, down
  assert text.count('custom_call_target="jaxpipe_matmul"') == per_layer * cfg.n_layers + 1
  assert "jaxpipe_matmul_prepacked" not in text
  xla = Engine(
      cfg, helpers.engine_params("dense"), num_pages=9, matmul="xla", **helpers.ENGINE_ARGS
  )
  assert xla.matmul == "xla"
  assert "jaxpipe_matmul" not in xla.step_program(16, helpers.CONTEXT // helpers.PAGE).as_text()


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_stacked_layers_are_prepacked_one_by_one_into_the_unstacked_trees(name):
  """`prepack_params` on a stacked tree (what the engine hands it: each layer sliced out only as
  it is prepacked) gives the tree it gives on the layers unstacked first, leaf for leaf."""
  cfg, params = helpers.CONFIGS[name], helpers.engine_params(name)
  stacked = model_lib.prepack_params(cfg, params)
  unstacked = model_lib.prepack_params(cfg, model_lib.unstack_layers(params))
  assert isinstance(stacked["layers"], list) and len(stacked["layers"]) == len(unstacked["layers"])
  a, b = jax.tree_util.tree_flatten(stacked), jax.tree_util.tree_flatten(unstacked)
  assert a[1] == b[1]
  for x, y in zip(a[0], b[0]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_untied_head_is_held_once_and_scores_and_generates_as_the_training_forward():
  """An untied head prepacked in place of its row-major one: prompt scoring (the training
  forward over the engine's prepacked layers and head) and greedy generation both equal the
  training forward on the weights given."""
  cfg = dataclasses.replace(helpers.DENSE, tied_embeddings=False)
  params = transformer.init_params(cfg, jax.random.key(3))
  engine = Engine(cfg, params, num_pages=9, **helpers.ENGINE_ARGS)
  assert "head" not in engine.params and "head" in engine.params[matmul_lib.PREPACKED]
  forward = jax.jit(functools.partial(transformer.forward, cfg, params))
  prompt = [3, 9, 27, 17, 50, 1, 4, 33]
  want_LxV = np.asarray(jax.nn.log_softmax(forward(jnp.array([prompt]))[0]))
  got = [lp for lp, _ in engine.score(prompt)[1:]]
  np.testing.assert_allclose(got, want_LxV[np.arange(7), prompt[1:]], rtol=1e-5)
  seq = list(prompt)
  for token in engine.generate([prompt], max_tokens=4)[0]:
    assert token == int(np.argmax(forward(jnp.array([seq]))[0, -1]))
    seq.append(token)


def _at(tree, path):
  """The leaf of `tree` at a `tree_leaves_with_path` path."""
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.mark.parametrize("devices", [1, 2])
def test_onednn_steps_give_the_oracles_logprobs(devices):
  """Each prompt's first greedy token and its log-probability on oneDNN, on one device (weights
  prepacked) and tensor-parallel over two (row-major weights; row-parallel products summed over
  the halves), against the XLA recompute oracle's log-softmax."""
  engine = Engine(
      helpers.DENSE,
      helpers.engine_params("dense"),
      num_pages=33,
      devices=jax.devices()[:devices],
      matmul="onednn",
      **helpers.ENGINE_ARGS,
  )
  # one device prepacks its weights; tensor-parallel ranks run the row-major kernel
  assert (matmul_lib.PREPACKED in engine.params) == (devices == 1)
  prompts = helpers.prompts(seed=5, n=6)
  greedy = SamplingParams(logprobs=0)
  ids = [engine.add_request(p, 1, greedy, eos_id=None) for p in prompts]
  while engine.has_work():
    engine.step()
  _check_first_tokens(engine, ids, prompts)


def _check_first_tokens(engine, ids, prompts):
  """Each finished request's one greedy token and its log-probability against the XLA recompute
  oracle's log-softmax at its prompt's last position."""
  done = {r.id: r for r in engine.finished()}
  for row, rid in zip(_last_logits(prompts).astype(np.float64), ids):
    logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
    (token,), ((chosen, _),) = done[rid].output, done[rid].logprobs
    assert logp[token] >= logp.max() - 1e-4  # the argmax, up to a near tie
    assert abs(chosen - logp[token]) < 1e-4


def _last_logits(prompts):
  """The XLA recompute oracle's logits [N, V] at each prompt's last position."""
  tokens = np.zeros((len(prompts), helpers.CONTEXT), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  logits = np.asarray(helpers.forward("dense")(tokens))
  return logits[np.arange(len(prompts)), [len(p) - 1 for p in prompts]]


def test_a_prepacked_product_of_its_leading_rows_computes_those_and_zeros_the_rest():
  """`matmul_prepacked(rows=r)`: the first r rows rounded up to ROW_GRAIN (at most M) equal the
  whole product's, bit for bit; every row after them is zero. Counts below 0 or past M clamp."""
  rng = np.random.default_rng(3)
  grain = onednn.ROW_GRAIN
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((6 * grain, 64)), dtype)
    packed = onednn.prepack(jnp.asarray(rng.standard_normal((64, 48)), dtype))
    whole = np.asarray(onednn.matmul_prepacked(x, packed, 48), np.float32)
    assert np.abs(whole).min(axis=1).max() > 0  # every row of the whole product is nonzero
    part = jax.jit(lambda x, p, r: onednn.matmul_prepacked(x, p, 48, rows=r))
    cases = [(0, 0), (1, grain), (grain, grain), (grain + 1, 2 * grain), (40, 3 * grain)]
    cases += [(6 * grain, 6 * grain), (500, 6 * grain), (-3, 0)]  # past M, below 0: clamped
    for rows, used in cases:
      y = np.asarray(part(x, packed, jnp.int32(rows)), np.float32)
      np.testing.assert_array_equal(y[:used], whole[:used])
      assert not y[used:].any(), (dtype, rows)


def test_prepacked_steps_compute_their_real_tokens_and_skip_the_padding():
  """A step of 27 real tokens padded to 64: its projections compute 32 rows (the real ones,
  rounded up) and the three prompts' first tokens and log-probabilities are the oracle's. A
  count short of the real tokens (the sequences', 3) would zero the last prompt's rows."""
  args = dict(helpers.ENGINE_ARGS, max_batch=8, max_tokens_per_step=64, token_buckets=(64,))
  engine = Engine(
      helpers.DENSE, helpers.engine_params("dense"), num_pages=33, matmul="onednn", **args
  )
  rng = np.random.default_rng(11)
  prompts = [list(map(int, rng.integers(0, 64, n))) for n in (7, 9, 11)]
  ids = [engine.add_request(p, 1, SamplingParams(logprobs=0), eos_id=None) for p in prompts]
  engine.step()  # all three prompts in one step
  while engine.has_work():
    engine.step()
  assert engine.steps == 1 and engine.counts["padded_tokens"] == 64 - 27
  _check_first_tokens(engine, ids, prompts)


def test_the_head_multiplies_the_rows_a_step_samples_alone():
  """A step of 32 rows (its max_batch) that samples 3: the prepacked head computes its first
  ROW_GRAIN rows and zeros the rest, and the 3 wanted rows' logits are the training forward's at
  each prompt's last token. A head over all its rows fills rows 16.. with token 0's logits."""
  cfg, params = helpers.DENSE, helpers.engine_params("dense")
  args = dict(helpers.ENGINE_ARGS, max_batch=32, max_tokens_per_step=32, token_buckets=(32,))
  engine = Engine(cfg, params, num_pages=33, matmul="onednn", **args)
  rng = np.random.default_rng(12)
  prompts = [list(map(int, rng.integers(0, 64, n))) for n in (7, 9, 11)]
  s, t, r, n = helpers.PAGE, 32, 32, helpers.CONTEXT // helpers.PAGE
  tokens, positions, slots = (np.zeros(t, np.int32) for _ in range(3))
  tables, seq_tables = np.zeros((t, n), np.int32), np.zeros((r, n), np.int32)
  starts, counts, rows = (np.zeros(r, np.int32) for _ in range(3))
  at, page = 0, 1  # page 0: the scratch page the padding writes
  for i, p in enumerate(prompts):
    table = np.arange(page, page + -(-len(p) // s))
    page += len(table)
    pos = np.arange(len(p))
    tokens[at : at + len(p)], positions[at : at + len(p)] = p, pos
    slots[at : at + len(p)] = table[pos // s] * s + pos % s
    tables[at : at + len(p), : len(table)] = seq_tables[i, : len(table)] = table
    starts[i], counts[i] = at, len(p)
    at += len(p)
    rows[i] = at - 1
  batch = model_lib.TokenBatch(
      *(jnp.asarray(x) for x in (tokens, positions, slots, tables, rows, seq_tables)),
      jnp.asarray(starts),
      jnp.asarray(counts),
      jnp.zeros(r, jnp.int32),
  )
  run = jax.jit(functools.partial(model_lib.forward_paged, engine.cfg, backend=engine.backend))
  logits_RxV = np.asarray(run(engine.params, engine.kv, batch)[0])
  assert not logits_RxV[onednn.ROW_GRAIN :].any()
  np.testing.assert_allclose(logits_RxV[:3], _last_logits(prompts), rtol=1e-5, atol=1e-5)


def test_bfloat16_pools_are_held_as_bits_and_never_converted_whole():
  """A bfloat16 cache lives as uint16 bits: the step reads and writes it in place, with no
  conversion of a whole pool at its edges (four copies of the pools a step, before)."""
  cfg = helpers.DENSE
  engine = Engine(
      cfg,
      helpers.engine_params("dense"),
      num_pages=9,
      kv_cache_dtype="bfloat16",
      nan_freed_pages=True,
      **helpers.ENGINE_ARGS,
  )
  assert engine.kv.k.dtype == model_lib.BITS and engine.kv.dtype == jnp.bfloat16
  assert np.isnan(np.asarray(jax.lax.bitcast_convert_type(engine.kv.k, jnp.bfloat16))).all()
  text = engine.step_program(16, helpers.CONTEXT // helpers.PAGE).as_text()
  pool = ",".join(map(str, engine.kv.k.shape))
  assert f"bf16[{pool}]" not in text
  out = engine.generate(helpers.prompts(seed=2, n=3), max_tokens=4)
  assert all(len(o) == 4 for o in out)


def test_calls_at_once_each_get_their_own_product():
  """Independent products in one program run at once on XLA's threads, and on every host device
  at once: each call has its own scratchpad (oneDNN's shared one let them write over each
  other's partial sums). A call on one device takes every core, one of a `shard_map` over all
  devices its share of them."""
  rng = np.random.default_rng(3)
  xs = [rng.standard_normal((48, 160 + 16 * i)).astype(np.float32) for i in range(6)]
  ws = [rng.standard_normal((160 + 16 * i, 200)).astype(np.float32) for i in range(6)]
  f = jax.jit(lambda xs, ws: [onednn.matmul(x, w) for x, w in zip(xs, ws)])
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  on_each = jax.jit(
      jax.shard_map(f, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("d"), check_vma=False)
  )
  want = [_reference(x, w) for x, w in zip(xs, ws)]
  assert _threads(jax.jit(f).lower(xs, ws).compile().as_text()) == {0}  # one device: every core
  shares = _threads(on_each.lower(xs, ws).compile().as_text())
  assert shares == {max(1, len(os.sched_getaffinity(0)) // len(jax.devices()))}
  for _ in range(3):
    for got, ref in zip(f(xs, ws), want):
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-3)
    for got, ref in zip(on_each(xs, ws), want):
      for part in np.split(np.asarray(got), len(jax.devices())):
        np.testing.assert_allclose(part, ref, rtol=1e-4, atol=1e-3)


AUTO = jax.sharding.AxisType.Auto  # the trainer's meshes: XLA's partitioner places the values


def _threads(compiled_text: str) -> set[int]:
  """The thread counts the program's oneDNN calls are given (0: every core)."""
  return {int(t) for t in re.findall(r"jaxpipe_matmul.*threads = (\d+) : i64", compiled_text)}


def _operands(compiled_text: str) -> list[list[str]]:
  """The operand shapes of each oneDNN call in a compiled program (each device's own)."""
  calls = [line for line in compiled_text.splitlines() if 'target="jaxpipe_matmul"' in line]
  shapes = lambda line: re.findall(r"\w+\[([\d,]*)\]", line.split("operand_layout_constraints=")[1])
  return [shapes(line)[:2] for line in calls]


@pytest.mark.parametrize(
    "x_spec, w_spec, transpose_w, x_part, w_part, summed",
    [
        (P("a"), P(), False, "16,40", "40,56", False),  # data parallel: x's rows
        (P(), P(None, "b"), False, "32,40", "40,28", False),  # column parallel: w's columns
        (P(None, "b"), P("b"), False, "32,20", "20,56", True),  # row parallel: the contraction
        (P("a", "b"), P("b", None), False, "16,20", "20,56", True),  # rows and contraction
        (P("a"), P("b"), True, "16,40", "28,40", False),  # rows and a [N, K] weight's columns
        (P("a"), P("a"), False, "16,40", "40,56", False),  # columns on rows' axis: gathered
    ],
)
def test_sharded_operands_give_each_device_its_share_of_the_product(
    x_spec, w_spec, transpose_w, x_part, w_part, summed
):
  """Under jit over a 2 x 2 mesh, each device's oneDNN call takes its shards (y's rows follow
  x's, its columns w's; a sharded contraction is summed across devices, in float32 for a
  bfloat16 product), never the gathered whole, on its quarter of the cores; values equal the
  float64 product."""
  mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4], axis_types=(AUTO,) * 2)
  rng = np.random.default_rng(4)
  x = rng.standard_normal((32, 40)).astype(np.float32)
  w = rng.standard_normal((56, 40) if transpose_w else (40, 56)).astype(np.float32)
  want = _reference(x, w.T if transpose_w else w)
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2.0**-7)):
    xs = jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, x_spec))
    ws = jax.device_put(jnp.asarray(w, dtype), NamedSharding(mesh, w_spec))
    f = jax.jit(lambda x, w: onednn.matmul(x, w, transpose_w=transpose_w))
    text = f.lower(xs, ws).compile().as_text()
    (operands,) = _operands(text)
    assert operands == [x_part, w_part], text
    assert _threads(text) == {max(1, len(os.sched_getaffinity(0)) // 4)}
    assert (" all-reduce(" in text) == summed
    assert " all-gather(" not in text or x_spec == w_spec == P("a")
    got = np.asarray(f(xs, ws), np.float64)
    ref = np.asarray(jnp.asarray(want, dtype), np.float64)  # the product rounded once
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(want).max())
    if dtype == jnp.bfloat16:  # a split sum added in float32 and rounded once: the exact
      # product of the bfloat16 operands, rounded, bar a few within float32's error of a tie
      # (parts rounded first: over a third are off)
      xb, wb = (np.asarray(a, np.float32) for a in (xs, ws))
      exact = np.asarray(jnp.asarray(_reference(xb, wb.T if transpose_w else wb), dtype))
      assert np.mean(got != exact.astype(np.float64)) <= 0.02


def test_data_parallel_gradients_sum_each_devices_share_and_equal_xlas():
  """d(loss)/dw of a product whose rows are split over 4 devices: each device multiplies its own
  rows (a quarter of the batch) and the parts are summed; dx and dw equal XLA's dot's."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(AUTO,))
  rng = np.random.default_rng(5)
  x = jax.device_put(
      rng.standard_normal((64, 24)).astype(np.float32), NamedSharding(mesh, P("data"))
  )
  w = rng.standard_normal((24, 40)).astype(np.float32)
  t = rng.standard_normal((64, 40)).astype(np.float32)
  loss = lambda dot, x, w: jnp.sum(jnp.sin(dot(x, w)) * t)
  grad = lambda dot: jax.jit(jax.grad(functools.partial(loss, dot), (0, 1)))
  text = grad(onednn.matmul).lower(x, w).compile().as_text()
  # y = x @ w, dx = g @ w^T (w read as [N, K]), dw = x^T @ g over each device's 16 rows
  assert sorted(_operands(text)) == [["16,24", "24,40"], ["16,40", "24,40"], ["24,16", "16,40"]]
  assert " all-reduce(" in text and " all-gather(" not in text
  for g, h in zip(grad(onednn.matmul)(x, w), grad(lax_dot)(x, w)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=2e-5, atol=2e-5 * np.abs(h).max())


def test_the_step_profile_counts_the_kernels_calls_as_matmuls():
  from experiments import op_breakdown

  x, w = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
  with matmul_lib.backend("onednn"):
    hlo = jax.jit(lambda a, b: matmul_lib.dot(a, b) + 1).lower(x, w).compile().as_text()
  packed = matmul_lib.prepack(w)
  hlo_packed = jax.jit(lambda a, b: matmul_lib.dot(a, b) + 1).lower(x, packed).compile().as_text()
  rows = jax.jit(lambda a, b: onednn.matmul_prepacked(a, b.data, 3, jnp.float32, jnp.int32(2)))
  hlo_rows = rows.lower(x, packed).compile().as_text()
  for text in (hlo, hlo_packed, hlo_rows):
    kinds = op_breakdown.op_kinds(text)
    (call,) = [n for n in kinds if "jaxpipe_matmul" in text.split(f"%{n} = ", 1)[1].split("\n")[0]]
    assert kinds[call][0] == "matmul"
  assert "jaxpipe_matmul_prepacked" in hlo_packed


@pytest.mark.parametrize("transpose_w", [False, True])
def test_gradients_equal_xlas_dot_s(transpose_w):
  """d(loss)/dx and d(loss)/dw through oneDNN's products equal those through XLA's dot, float32
  (to float32 rounding) and bfloat16 summed in float32 (to a bfloat16 ulp)."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((24, 40)).astype(np.float32)
  w = rng.standard_normal((56, 40) if transpose_w else (40, 56)).astype(np.float32)
  t = rng.standard_normal((24, 56)).astype(np.float32)

  def loss(dot, x, w):
    return jnp.sum(jnp.sin(dot(x, w).astype(jnp.float32)) * t)

  xla = lambda x, w: lax_dot(x, w.T if transpose_w else w)
  ours = lambda x, w: onednn.matmul(x, w, jnp.float32, transpose_w=transpose_w)
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2.0**-7)):
    args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    want = jax.jit(jax.grad(functools.partial(loss, xla), (0, 1)))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, ours), (0, 1)))(*args)
    for g, h in zip(got, want):
      assert g.dtype == dtype and g.shape == h.shape
      g, h = np.asarray(g, np.float32), np.asarray(h, np.float32)
      np.testing.assert_allclose(g, h, rtol=tol, atol=tol * np.abs(h).max())
  text = jax.jit(jax.grad(functools.partial(loss, ours), (0, 1))).lower(x, w).as_text()
  assert text.count("jaxpipe_matmul") == 3  # the product and both gradients


def lax_dot(x, w):
  return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def test_training_runs_its_gemms_on_onednn_with_train_matmul():
  """train.matmul='onednn': the train step's projections and their gradients are the kernel's
  calls, and its losses and gradient norms over a few steps equal XLA's dot's (float32); 'xla'
  has none; an unknown name is refused by name."""
  from configs import tiny
  from jaxpipe.training.config import ConfigError, validate
  from jaxpipe.training.trainer import Trainer

  runs = {}
  for name in ("xla", "onednn"):
    c = tiny.get_config()
    c.train.matmul = name
    trainer = Trainer(c)
    trainer.init()
    text = trainer.compile().as_text()
    assert text.count("jaxpipe_matmul") >= (3 * 4 * c.model.n_layers if name == "onednn" else 0)
    assert ("jaxpipe_matmul" in text) == (name == "onednn")
    runs[name] = [
        {k: float(v) for k, v in trainer.step().items() if k in ("loss", "grad_norm")}
        for _ in range(3)
    ]
  for a, b in zip(runs["xla"], runs["onednn"]):
    for k in a:
      assert a[k] == pytest.approx(b[k], rel=1e-5), (k, runs)
  c = tiny.get_config()
  c.train.matmul = "mkl"
  with pytest.raises(ConfigError, match="train.matmul='mkl' is unknown; use one of xla, onednn"):
    validate(c, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prepacked_weights_give_the_row_major_weights_products_at_every_m(dtype):
  """oneDNN's blocked layout, made once (`prepack`, from [K, N] or its [N, K] transpose alike),
  gives products of any number of rows (the layout is chosen for 128) equal to the float64
  product of the same values, to float32's rounding of K terms."""
  rng = np.random.default_rng(7)
  k, n = 200, 333
  w = jnp.asarray(rng.standard_normal((k, n)), dtype)
  packed = jax.jit(onednn.prepack)(w)
  assert packed.dtype == jnp.uint8 and packed.shape == (onednn.prepacked_bytes(k, n, dtype),)
  packed_t = jax.jit(functools.partial(onednn.prepack, transpose_w=True))(w.T)
  np.testing.assert_array_equal(np.asarray(packed_t), np.asarray(packed))
  f = jax.jit(functools.partial(onednn.matmul_prepacked, n=n, out_dtype=jnp.float32))
  for m in (1, 7, 64, 129, 300):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = np.asarray(f(x, packed))
    want = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_prepacking_refuses_what_it_does_not_take():
  f32 = np.zeros((2, 3), np.float32)
  packed = onednn.prepack(np.zeros((3, 4), np.float32))
  with pytest.raises(ValueError, match=r"are not \[300, 4\] float32 weights packed"):
    onednn.matmul_prepacked(np.zeros((2, 300), np.float32), packed, 4)
  with pytest.raises(ValueError, match=r"not x \(2, 3\) float32 -> float16"):
    onednn.matmul_prepacked(f32, packed, 4, np.float16)
  with pytest.raises(ValueError, match=r"not \(2, 3, 4\) float16"):
    onednn.prepack(np.zeros((2, 3, 4), np.float16))
  with pytest.raises(ValueError, match="float32 or bfloat16 weights, not float16"):
    onednn.prepacked_bytes(3, 4, np.float16)


def test_dot_of_a_prepacked_weight_equals_the_weights_own():
  """DenseGeneral's product with two contracted axes (the attention output's) and a tied
  embedding as the head, on the weights prepacked, against XLA's dot of the weights."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)  # [B, L, H, K]
  w = rng.standard_normal((4, 8, 6)).astype(np.float32)  # [H, K, D]
  p = jax.jit(functools.partial(matmul_lib.prepack, in_dims=2))(w)
  assert p.shape == w.shape and p.in_dims == 2 and p.astype(jnp.float32) is p
  got = jax.jit(lambda a, b: matmul_lib.dot(a, b, in_dims=2))(x, p)  # a pytree through jit
  want = np.einsum("blhk,hkd->bld", x.astype(np.float64), w.astype(np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  embed = rng.standard_normal((50, 6)).astype(np.float32)  # [V, D]
  head = matmul_lib.prepack(embed, transpose_w=True)
  assert head.shape == (6, 50)
  logits = matmul_lib.dot(np.asarray(got), head, out_dtype=jnp.float32)
  want_logits = np.asarray(got, np.float64) @ embed.T.astype(np.float64)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="prepacked in float32 is used in bfloat16"):
    p.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="prepacked for 2 contracted axes in float32 is used for 1"):
    matmul_lib.dot(x, p, in_dims=1)


def test_a_dense_layer_prepacks_its_kernel_and_runs_on_it():
  """`layers.Dense` traced in `prepacking()` puts its kernel, cast to the compute dtype, in the
  PREPACKED collection; an apply given it runs on it (the row-major kernel not read: an apply of
  prepacked kernels alone works) with the kernel's product; a kernel of another shape is named."""
  from jaxpipe.models import layers
  from jaxpipe.models.transformer import TransformerConfig

  cfg = TransformerConfig(vocab=8, d_model=8, n_layers=1, n_heads=2, head_dim=4, d_ff=8)
  dense = layers.Dense((3, 5), cfg, in_dims=2)
  x = np.random.default_rng(4).standard_normal((2, 4, 6)).astype(np.float32)
  params = dense.init(jax.random.key(0), x)
  want = dense.apply(params, x)
  with matmul_lib.prepacking():
    _, state = jax.jit(lambda v: dense.apply(v, x, mutable=[matmul_lib.PREPACKED]))(params)
  kernel = state[matmul_lib.PREPACKED]["kernel"]
  assert isinstance(kernel, matmul_lib.Prepacked) and kernel.shape == (4, 6, 3, 5)
  got = dense.apply({matmul_lib.PREPACKED: state[matmul_lib.PREPACKED]}, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  other = layers.Dense((3, 5), cfg, in_dims=1)
  wrong = r"a kernel prepacked as \(4, 6, 3, 5\) projects \(6, 3, 5\)"
  with pytest.raises(ValueError, match=wrong):
    other.apply({matmul_lib.PREPACKED: state[matmul_lib.PREPACKED]}, x)


@pytest.mark.parametrize("use_bias", [False, True])
def test_a_dense_group_prepacks_its_kernels_fused_and_splits_one_product(use_bias):
  """`layers.dense_group` traced in `prepacking()` puts its Denses' kernels side by side,
  prepacked, with their biases, under one entry named by their names (none of its own each); an
  apply given only that collection runs one product and gives each Dense's output."""
  import flax.linen as nn

  from jaxpipe.models import layers
  from jaxpipe.models.transformer import TransformerConfig

  cfg = TransformerConfig(vocab=8, d_model=6, n_layers=1, n_heads=2, head_dim=4, d_ff=8)
  outs = (("q", (3, 4)), ("k", (1, 4)), ("v", (1, 4)))

  class Group(nn.Module):

    @nn.compact
    def __call__(self, x):
      return layers.dense_group(self, x, outs, cfg, use_bias)

  group = Group()
  x = np.random.default_rng(5).standard_normal((2, 4, 6)).astype(np.float32)
  params = group.init(jax.random.key(0), x)
  if use_bias:  # nonzero, so that a lost bias shows
    params = jax.tree.map(lambda a: a + 0.5, params)
  want = group.apply(params, x)
  for name, features in outs:  # the separate Denses' own products
    p = params["params"][name]
    y = np.einsum("bld,dhk->blhk", x, np.asarray(p["kernel"]).reshape(6, *features))
    np.testing.assert_allclose(
        np.asarray(want[[n for n, _ in outs].index(name)]),
        y + (np.asarray(p["bias"]) if use_bias else 0),
        rtol=1e-5,
        atol=1e-5,
    )
  with matmul_lib.prepacking():
    _, state = jax.jit(lambda v: group.apply(v, x, mutable=[matmul_lib.PREPACKED]))(params)
  packed = state[matmul_lib.PREPACKED]
  assert list(packed) == ["q+k+v"]
  entry = packed["q+k+v"]
  assert sorted(entry) == (["bias", "kernel"] if use_bias else ["kernel"])
  assert isinstance(entry["kernel"], matmul_lib.Prepacked)
  assert entry["kernel"].shape == (6, 20)
  got = group.apply({matmul_lib.PREPACKED: packed}, x)
  assert [g.shape for g in got] == [(2, 4, 3, 4), (2, 4, 1, 4), (2, 4, 1, 4)]
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
