"""Packed rows: several documents per row, kept apart by `segment_ids`, with their own `positions`.

Oracle: every document run alone (unpacked, at the start of its own row, no segment ids, the
model's 1-D positions), summed. Each training path (data-parallel, MoE, context-parallel,
pipelined with and without recomputation) must give the packed batch that summed loss and
gradient, and, handed all-ones segment ids and positions 0..L-1, what it gives without (to a
few ulps: `SAME_RTOL`).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.training import losses, zero
from jaxpipe.training.config import model_config
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.pipeline_lm import pipeline_loss_and_grads
from tests import helpers

B, L = 4, 16  # packed rows, tokens per row
# Documents sit at positions 0, 2, 4, ...: rotary scores depend only on position differences, so
# unit steps from any start would hide a path that ignores the given positions.
STRIDE = 2


def _documents(seed=0):
  """Per row, document lengths (2..7) that fill it, the last row ending in 3 padding tokens."""
  rng = np.random.default_rng(seed)
  rows = []
  for b in range(B):
    room, lens = L - (3 if b == B - 1 else 0), []
    while room:
      n = min(int(rng.integers(2, 8)), room)
      n = room if room - n < 2 else n  # no document shorter than 2
      lens.append(n)
      room -= n
    rows.append(lens)
  return rows


def packed_and_alone(vocab, seed=0):
  """(packed batch [B, L], every document alone: a batch [documents, L], each at its row's start).

  A document of n tokens predicts n targets (its next tokens); padding has segment 0, mask 0.
  """
  rng = np.random.default_rng(seed)
  keys = ("tokens", "targets", "segment_ids", "positions")
  packed = {k: np.zeros((B, L), np.int32) for k in keys}
  packed["mask"] = np.zeros((B, L), np.float32)
  alone = {k: [] for k in ("tokens", "targets", "mask")}
  for b, lens in enumerate(_documents(seed)):
    start = 0
    for d, n in enumerate(lens):
      seq = rng.integers(0, vocab, n + 1).astype(np.int32)
      span = slice(start, start + n)
      packed["tokens"][b, span], packed["targets"][b, span] = seq[:-1], seq[1:]
      packed["mask"][b, span], packed["segment_ids"][b, span] = 1.0, d + 1
      packed["positions"][b, span] = STRIDE * np.arange(n)
      row = {k: np.zeros(L, np.int32) for k in ("tokens", "targets")}
      row["tokens"][:n], row["targets"][:n] = seq[:-1], seq[1:]
      alone["tokens"].append(row["tokens"])
      alone["targets"].append(row["targets"])
      alone["mask"].append((np.arange(L) < n).astype(np.float32))
      start += n
    packed["tokens"][b, start:] = rng.integers(0, vocab, L - start)  # padding: never counted
  return packed, {k: np.stack(v) for k, v in alone.items()}


def alone_sums(cfg, params, alone):
  """(summed cross-entropy, its gradient) of each document alone, summed: the 1-D positions path."""

  def total(params):
    x = transformer.embed_first(cfg, params, alone["tokens"], STRIDE * jnp.arange(L))
    x, _ = transformer.apply_layers_aux(cfg, params["layers"], x, STRIDE * jnp.arange(L))
    return transformer.head_loss(cfg, params, x, alone["targets"], alone["mask"])[0]

  return jax.jit(jax.value_and_grad(total))(params)


def unpacked(batch):
  return {k: batch[k] for k in ("tokens", "targets", "mask")}


def trivially_packed(batch):
  """One document per row at positions 0..L-1: the same rows as `unpacked` says."""
  ones = np.ones((B, L), np.int32)
  return {**unpacked(batch), "segment_ids": ones, "positions": ones.cumsum(1) - 1}


def assert_sums(got, want, what, rtol=1e-5):
  (loss, grads, metrics), (want_total, want_grads) = got, want
  n = float(metrics["tokens"])
  helpers.close(float(loss) * n, want_total, f"{what}: summed loss", rtol)
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  wanted = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  assert len(flat) == len(wanted)
  for path, g in flat:
    helpers.close(np.asarray(g) * n, wanted[path], f"{what}: {jax.tree_util.keystr(path)}", rtol)


def assert_same(got, want, what, rtol):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    helpers.close(a, b, f"{what}: {jax.tree_util.keystr(path)}", rtol=rtol)


def config(**mesh):
  c = tiny.get_config()
  c.data.seq_len = L
  c.pipeline.microbatches = 2
  for axis, size in mesh.items():
    c.mesh[axis] = size
  return c


@functools.cache
def dense_setup():
  c = config()
  cfg = model_config(c)
  params = helpers.random_params(cfg, seed=1)
  packed, alone = packed_and_alone(cfg.vocab)
  return c, cfg, params, packed, alone_sums(cfg, params, alone)


# All-ones segments against none: the same sums, but one program builds its attention mask from
# data and the other from a constant, and under the suite's XLA flags (backend -O0, XLA:CPU's LLVM
# IR fusion emitters) CPU code rounds a few of them one ulp apart. 1e-6 of a leaf's largest entry
# is a few ulps; a key reaching across a document moves gradients by orders of magnitude more.
SAME_RTOL = 1e-6


def check_path(step, params, packed, want, what, rtol_same=SAME_RTOL, rtol=1e-5):
  """Packed batch vs. the documents alone (rtol of each leaf's largest entry); all-ones
  segments vs. none, to rtol_same."""
  step = jax.jit(step)
  assert_sums(step(params, packed), want, what, rtol)
  got, plain = step(params, trivially_packed(packed)), step(params, unpacked(packed))
  assert_same(got, plain, what, rtol_same)


def test_data_parallel_path():
  c, cfg, params, packed, want = dense_setup()
  check_path(losses.data_parallel_loss_and_grads(cfg, 2), params, packed, want, "dp")


def test_moe_path():
  c = helpers.moe_config(ep=2, lb_loss_coef=0.0, z_loss_coef=0.0, every=1)  # dropless
  c.model.n_layers, c.data.seq_len, c.pipeline.microbatches = 2, L, 2
  cfg = model_config(c)
  assert cfg.moe.dispatch == "dropless"  # fixed capacity would couple a row's documents
  params = helpers.random_params(cfg, seed=2)
  packed, alone = packed_and_alone(cfg.vocab, seed=2)
  want = alone_sums(cfg, params, alone)
  mesh = make_mesh(c.mesh, jax.devices()[:2])
  check_path(losses.moe_loss_and_grads(cfg, mesh, 2), params, packed, want, "moe")


def test_context_parallel_path():
  _, cfg, params, packed, want = dense_setup()
  mesh = make_mesh(config(cp=2).mesh, jax.devices()[:2])
  check_path(losses.context_parallel_loss_and_grads(cfg, mesh, 2), params, packed, want, "cp")


@pytest.mark.parametrize("recompute", [False, True])
def test_pipeline_path(recompute):
  c, cfg, params, packed, want = dense_setup()
  c = config(pp=2)
  c.pipeline.schedule, c.pipeline.recompute = "zb-h1", recompute
  mesh = make_mesh(c.mesh, jax.devices()[:2])
  step = pipeline_loss_and_grads(cfg, c.pipeline, mesh)
  check_path(step, params, packed, want, f"pp, recompute={recompute}")


@pytest.mark.parametrize("path", ["pp", "cp"])
def test_first_dense_layers_keep_to_each_document(path):
  """DeepSeek's first dense layers (model.first_dense) before the MoE stack: pipelined, they run
  with the embedding on the stage that embeds, so the packed rows' keys must reach it; under
  context parallelism each rank runs them on its slice."""
  c = helpers.moe_config(ep=1, lb_loss_coef=0.0, z_loss_coef=0.0, every=1)
  c.model.n_layers, c.model.first_dense, c.data.seq_len = 3, 1, L
  c.mesh[path] = 2
  c.pipeline.schedule, c.pipeline.microbatches = "1f1b", 2
  cfg = model_config(c)
  params = helpers.random_params(cfg, seed=3)
  assert set(params) >= {"first_layers", "layers"} and cfg.stack_units == 2
  packed, alone = packed_and_alone(cfg.vocab, seed=3)
  mesh = make_mesh(c.mesh, jax.devices()[:2])
  if path == "pp":
    step = pipeline_loss_and_grads(cfg, c.pipeline, mesh)
  else:
    step = losses.context_parallel_loss_and_grads(cfg, mesh, 2)
  want = alone_sums(cfg, params, alone)
  check_path(step, params, packed, want, f"first_dense, {path}")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_attention_never_crosses_a_document(backend):
  # Changing one document's tokens changes its own logits and no other document's, bit for bit.
  _, cfg, params, packed, _ = dense_setup()
  cfg = dataclasses.replace(cfg, attention=backend)
  forward = jax.jit(
      lambda tokens: transformer.forward(
          cfg,
          params,
          tokens,
          segment_ids_BxL=packed["segment_ids"],
          positions_BxL=packed["positions"],
      )
  )
  before = np.asarray(forward(packed["tokens"]))
  seg = packed["segment_ids"]
  doc = (seg[:, None] == np.arange(1, 4)[None, :, None])[:, 1]  # the second document of each row
  tokens = np.where(doc, (packed["tokens"] + 1) % cfg.vocab, packed["tokens"])
  after = np.asarray(forward(tokens))
  np.testing.assert_array_equal(after[~doc], before[~doc])
  assert np.all(np.abs(after[doc] - before[doc]).max(-1) > 0)


def test_bad_packed_keys_fail_before_running():
  _, cfg, params, packed, _ = dense_setup()
  step = losses.data_parallel_loss_and_grads(cfg)
  bad_shape = (
      r"batch\['segment_ids'\] has shape \(4, 15\) but tokens have \(4, 16\).*\[batch, seq\]"
  )
  with pytest.raises(ValueError, match=bad_shape):
    step(params, {**packed, "segment_ids": packed["segment_ids"][:, 1:]})
  with pytest.raises(ValueError, match=r"batch\['positions'\] has dtype float32; pass integers"):
    step(params, {**packed, "positions": packed["positions"].astype(np.float32)})


def side_stage_fn(params, x_BxLxD, side):
  # the side input gates the stage's nonlinearity: its vjp closure holds what depends on it
  return jnp.tanh(x_BxLxD @ params["w"]) * side["gate_BxL"][..., None] + params["b"]


@pytest.mark.parametrize("recompute", [False, True])
def test_executor_side_inputs_reach_every_part(recompute):
  # An opaque stage (no layers) on a split-backward schedule: F, I and W each see the side
  # inputs of their own micro-batch, and the result is the unpipelined value and gradient.
  from jaxpipe.pipeline.api import pipeline_value_and_grad
  from jaxpipe.pipeline.executor import Model
  from jaxpipe.pipeline.ir.schedules import make_schedule

  stages, m = 2, 4
  params, xs, ts = helpers.make_data(stages, m, seed=5)
  gates = jnp.asarray(np.random.default_rng(6).uniform(0.5, 1.5, ts.shape), jnp.float32)
  model = Model(side_stage_fn, lambda head, y, t: helpers.loss_fn(y, t), side_inputs=True)

  def sequential(params):
    total = 0.0
    for i in range(m):
      x = xs[i]
      for s in range(stages):
        x = side_stage_fn(jax.tree.map(lambda a: a[s], params), x, {"gate_BxL": gates[i]})
      total += helpers.loss_fn(x, ts[i])
    return total

  loss, grads, _, _ = pipeline_value_and_grad(
      model,
      params,
      xs,
      ts,
      schedule=make_schedule("zb-h1", pp=stages, microbatches=m),
      sharding=make_mesh(config(pp=2).mesh, jax.devices()[:2]),
      recompute=recompute,
      side_inputs={"gate_BxL": gates},
  )
  want_loss, want_grads = jax.jit(jax.value_and_grad(sequential))(params)
  helpers.close(loss, want_loss, "loss")
  for k in want_grads:
    helpers.close(grads[k], want_grads[k], k)


# The model families' variants on one model: sliding windows (3, shorter than most documents)
# beside a full layer with its own rotary base, q/k/v, o and FFN biases, GeGLU, (1 + w) and
# sandwich norms, scaled embeddings, the scores' scale and caps, the final cap, llama3 rotary on
# half of each head. Each parallel path equals the documents alone on one device.
# The variants' packed and alone gradients differ by up to 1.9e-5 of a leaf's largest entry
# where the suite compiles at LLVM level 0 (conftest) on an AVX-512 EPYC, 7e-6 at the default
# level: float32 sums through soft-caps, GELU and sliding windows in another order. Documents
# that see each other (segment ids all one) move every leaf by 0.4 of its largest entry or more.
VARIANTS_RTOL = 4e-5
VARIANTS = dict(
    n_kv_heads=4,
    sliding_window=3,
    layer_types=("sliding", "full"),
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
    activation="gelu_tanh",
    norm_plus_one=True,
    sandwich_norm=True,
    embed_scale=True,
    attn_scale_dim=12.0,
    attn_softcap=2.0,
    final_softcap=5.0,
    rope_local_theta=100.0,
    rope_fraction=0.5,
    rope_scaling=dict(
        type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=8,
    ),
)


@functools.cache
def variants_setup():
  c = config()
  c.model.update(VARIANTS)
  cfg = model_config(c)
  params = helpers.random_params(cfg, seed=3)
  packed, alone = packed_and_alone(cfg.vocab, seed=3)
  return cfg, params, packed, alone_sums(cfg, params, alone)


def test_model_variants_on_the_data_parallel_path():
  cfg, params, packed, want = variants_setup()
  assert cfg.mixed_layers and cfg.layer_windows == (3, 0)
  check_path(
      losses.data_parallel_loss_and_grads(cfg, 2),
      params,
      packed,
      want,
      "variants dp",
      rtol=VARIANTS_RTOL,
  )


@pytest.mark.parametrize("mesh, shard", [(dict(cp=2, tp=2), "none"), (dict(dp=2), "fsdp")])
def test_model_variants_on_the_shard_map_path(mesh, shard):
  """Ulysses over cp with Megatron's tp (biases split with their heads), and fsdp's per-layer
  gathers: each layer still takes its index's window and rotary."""
  cfg, params, packed, want = variants_setup()
  mesh = make_mesh(config(**mesh).mesh, jax.devices()[: math.prod(mesh.values())])
  if shard == "fsdp":
    params = jax.device_put(params, zero.data_split(params, mesh))
  step = losses.context_parallel_loss_and_grads(cfg, mesh, 2, shard=shard)
  check_path(step, params, packed, want, f"variants {shard}", rtol=VARIANTS_RTOL)


def test_model_variants_on_the_pipeline_path():
  """zb-h1 over 2 ranks: the sliding layer on rank 0, the full one on rank 1, each numbered by
  its model stage (a stage that took its local index would slide on both)."""
  cfg, params, packed, want = variants_setup()
  c = config(pp=2)
  c.pipeline.schedule = "zb-h1"
  mesh = make_mesh(c.mesh, jax.devices()[:2])
  step = pipeline_loss_and_grads(cfg, c.pipeline, mesh)
  check_path(step, params, packed, want, "variants pp", rtol=VARIANTS_RTOL)
