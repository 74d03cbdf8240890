"""Tensor and sequence parallelism over `tp` (jaxpipe.parallel.tensor): losses and gradients equal
the one-device model's, the compiled step holds exactly Megatron's collectives, a layer's
parameters take 1/tp of the bytes, and bad layouts stop at the config with one line."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import tiny
from jaxpipe.models import transformer
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.parallel import tensor as tp_lib
from jaxpipe.training import config as config_lib
from jaxpipe.training.losses import make_loss_and_grads
from jaxpipe.training.mesh import make_mesh
from jaxpipe.training.state import state_shardings
from jaxpipe.training.trainer import Trainer
from tests import helpers


def _config(
    tp=1, sp=False, cp=1, ep=1, kv_heads=2, moe=False, pp=1, schedule="1f1b", cp_overlap=False
):
  c = helpers.moe_config(ep=ep) if moe else tiny.get_config()
  c.mesh.tp, c.mesh.cp, c.mesh.pp = tp, cp, pp
  c.model.cp_overlap = cp_overlap
  c.model.sequence_parallel = sp
  c.model.n_kv_heads = kv_heads
  c.data.batch = 8
  if pp > 1:  # the pipeline executor: 2 micro-batches, one MoE layer per stage
    c.pipeline.schedule, c.pipeline.microbatches = schedule, 2
    if moe:
      c.model.n_layers, c.model.moe.every = 2, 1
  return c


@functools.cache
def _step(tp, sp, cp, ep, kv_heads, moe, pp=1, schedule="1f1b", cp_overlap=False):
  """(config, model config, jitted loss_and_grads, mesh) of one layout, compiled once."""
  c = _config(tp, sp, cp, ep, kv_heads, moe, pp, schedule, cp_overlap)
  shape = config_lib.validate(c, jax.device_count())
  cfg = config_lib.model_config(c)
  return c, cfg, jax.jit(make_loss_and_grads(c, cfg, shape)), make_mesh(c.mesh)


def _sharded_loss_and_grads(c, same_rows: bool = False):
  """(model config, parameters, batch, loss, gradients) of config c's compiled step on random
  parameters; same_rows: every batch row the first (data shards then see the whole batch's
  FP8 amaxes)."""
  shape = config_lib.validate(c, jax.device_count())
  cfg, mesh = config_lib.model_config(c), make_mesh(c.mesh)
  params = helpers.random_params(cfg)
  batch = helpers.random_batch(c)
  if same_rows:
    batch = {k: np.repeat(v[:1], len(v), axis=0) for k, v in batch.items()}
  loss, grads, _ = jax.jit(make_loss_and_grads(c, cfg, shape))(
      jax.device_put(params, state_shardings(params, mesh)), batch
  )
  return cfg, params, batch, loss, grads


LAYOUTS = [  # (tp, sequence parallel, cp, ep, KV heads, MoE[, pp, schedule])
    (2, False, 1, 1, 2, False),
    (2, True, 1, 1, 2, False),
    # 2 KV heads under tp 4: whole on every rank, a group each (CI runs tp 4 with sequence
    # parallelism below; the slow ones run with -m slow)
    pytest.param((4, False, 1, 1, 2, False), marks=pytest.mark.slow),
    (4, True, 1, 1, 1, False),  # one KV head
    (2, True, 2, 1, 4, False),  # with Ulysses over cp
    pytest.param(
        (2, False, 1, 2, 2, True), marks=pytest.mark.slow
    ),  # MoE: dense part over tp, experts over ep
    (2, True, 1, 2, 2, True),
    (2, False, 1, 1, 2, False, 2, "1f1b"),  # inside the pipeline executor's per-tick branch
    pytest.param((2, True, 1, 1, 2, False, 2, "zb-h1"), marks=pytest.mark.slow),
    (2, True, 1, 2, 2, True, 2, "1f1b"),
    # KV heads whole on every rank, in the pipeline
    pytest.param((4, True, 1, 1, 2, False, 2, "1f1b"), marks=pytest.mark.slow),
    (2, False, 2, 1, 4, False, 2, "zb-h1"),  # tp x cp x pp
]


@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=lambda l: "tp{}{}-cp{}-ep{}-kv{}{}{}".format(
        l[0],
        "-sp" if l[1] else "",
        l[2],
        l[3],
        l[4],
        "-moe" if l[5] else "",
        f"-pp{l[6]}-{l[7]}" if len(l) > 6 else "",
    ),
)
def test_loss_and_gradients_equal_the_one_device_model(layout):
  c, cfg, step, mesh = _step(*layout)
  params = helpers.random_params(cfg)
  batch = helpers.random_batch(c)
  loss, grads, metrics = step(jax.device_put(params, state_shardings(params, mesh)), batch)
  m = c.pipeline.microbatches if c.mesh.pp > 1 else 1  # the aux loss is per micro-batch
  aux = helpers.assert_one_device(cfg, params, batch, loss, grads, microbatches=m)
  assert float(metrics["tokens"]) == batch["mask"].sum()
  if cfg.moe is not None and c.mesh.pp == 1:
    np.testing.assert_array_equal(metrics["moe_tokens_per_expert"], aux["tokens_per_expert"])


@pytest.mark.parametrize(
    "layout",
    [
        (2, True, 2, 1, 4, False, 1, "1f1b", True),
        # inside the executor's ticks, where the fused all-to-alls are chunked, not a ring
        pytest.param((2, False, 2, 1, 4, False, 2, "zb-h1", True), marks=pytest.mark.slow),
    ],
    ids=["tp2-sp-cp2", "tp2-cp2-pp2"],
)
def test_ulysses_fused_with_its_projections_under_tp_equals_the_one_device_model(layout):
  """model.cp_overlap: each rank's heads (H/tp) through the projections fused with Ulysses'
  all-to-alls, the output projection's partial sum reduced over tp."""
  c, cfg, step, mesh = _step(*layout)
  assert cfg.cp_overlap
  params = helpers.random_params(cfg)
  batch = helpers.random_batch(c)
  loss, grads, _ = step(jax.device_put(params, state_shardings(params, mesh)), batch)
  m = c.pipeline.microbatches if c.mesh.pp > 1 else 1
  helpers.assert_one_device(cfg, params, batch, loss, grads, microbatches=m)


@pytest.mark.parametrize(
    "layout",
    [
        (2, False, 1, 1, 2, False),  # the all-reduce path, whose transposes autodiff supplies
        pytest.param((2, True, 1, 1, 2, False, 2, "1f1b"), marks=pytest.mark.slow),
    ],
    ids=["tp2", "tp2-sp-pp2"],
)
def test_pallas_attention_under_tp_equals_the_one_device_model(layout):
  """The Pallas flash attention (interpreted here) on each rank's heads: loss and every gradient
  equal the one-device XLA model's, and the step does run the kernel."""
  c = _config(*layout)
  c.model.attention = "pallas"
  shape = config_lib.validate(c, jax.device_count())
  cfg = config_lib.model_config(c)
  step = jax.jit(make_loss_and_grads(c, cfg, shape))
  params = helpers.random_params(cfg)
  batch = helpers.random_batch(c)
  placed = jax.device_put(params, state_shardings(params, make_mesh(c.mesh)))
  assert "pallas_call" in str(jax.make_jaxpr(step)(placed, batch))
  loss, grads, _ = step(placed, batch)
  reference = dataclasses.replace(cfg, attention="xla")
  m = c.pipeline.microbatches if c.mesh.pp > 1 else 1
  helpers.assert_one_device(reference, params, batch, loss, grads, microbatches=m)


@functools.cache
def _three_steps(tp, sp, pp):
  """(losses, model-order parameters) after three AdamW steps of one layout."""
  c = _config(tp, sp, pp=pp)
  c.train.steps = 3
  trainer = Trainer(c)
  trainer.init()
  losses = [float(trainer.step()["loss"]) for _ in range(3)]
  return losses, jax.device_get(trainer.model_params())


@pytest.mark.parametrize("tp, sp, pp", [(2, True, 1), (2, False, 2)])
def test_three_steps_follow_the_one_device_trajectory(tp, sp, pp):
  """Three AdamW steps under tp 2 (with sequence parallelism, and inside the pipeline at pp 2)
  give the replicated run's losses and parameters (tp 1, pp 1)."""
  losses, params = _three_steps(tp, sp, pp)
  want_losses, want_params = _three_steps(1, False, 1)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  want = helpers.flat(want_params)
  for path, p in helpers.flat(params).items():
    helpers.close(p, want[path], jax.tree_util.keystr(path), rtol=1e-5)


def _forward_hlo(tp, sp):
  """The optimised HLO of the loss (no backward) under tp, and its layer loop's body."""
  c, cfg, _, mesh = _step(tp, sp, 1, 1, 2, False)
  loss_and_grads = make_loss_and_grads(c, cfg, config_lib.validate(c, jax.device_count()))
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  shardings = state_shardings(params, mesh)
  params = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), params, shardings
  )
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), helpers.random_batch(c))
  text = jax.jit(lambda p, b: loss_and_grads(p, b)[0]).lower(params, batch).compile().as_text()
  return text


COLLECTIVE = (  # an instruction's result type (a tuple when merged), op, and operands
    r"= (?:\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(([^)]*)\)"
)
TP_GROUPS = "replica_groups={{0,1},{2,3},{4,5},{6,7}}"  # tp = 2, the innermost mesh axis


def _tp_collectives(text):
  """{(op, 'layer' or 'outside'): arrays reduced or moved over tp}; the layer loop's body is
  compiled once for all layers, and XLA may merge independent all-reduces into one tuple."""
  counts = {}
  for line in text.splitlines():
    found = re.search(COLLECTIVE, line)
    if not found:
      continue
    assert TP_GROUPS in line or "{'axis_0'}" in line, f"a collective over other groups: {line}"
    if TP_GROUPS in line:
      where = "layer" if "while/body" in line else "outside"
      key = (found.group(1), where)
      counts[key] = counts.get(key, 0) + found.group(2).count("%")
  return counts


def test_compiled_forward_holds_megatrons_collectives():
  """Over tp, without sequence parallelism: in each layer an all-reduce after attention and one
  after the MLP; outside, one for the embedding and three for the cross-entropy (max, sum of
  exponentials, target logit). With it: each layer two all-gathers and two reduce-scatters
  instead, the embedding reduce-scattered, the head's input gathered, the same three
  cross-entropy reductions. Nothing else crosses tp."""
  assert _tp_collectives(_forward_hlo(2, False)) == {
      ("all-reduce", "layer"): 2,
      ("all-reduce", "outside"): 1 + 3,
  }
  assert _tp_collectives(_forward_hlo(2, True)) == {
      ("all-gather", "layer"): 2,
      ("reduce-scatter", "layer"): 2,
      ("reduce-scatter", "outside"): 1,
      ("all-gather", "outside"): 1,
      ("all-reduce", "outside"): 3,
  }


def test_a_layers_parameters_take_one_tp_th_of_the_bytes():
  """Exact per-device argument bytes of the compiled step: the split weights (q, k, v, o, gate,
  up, down, the embedding) by tp, the norms whole, from tp 1 to tp 2."""
  cfg = config_lib.model_config(_config())
  params = jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  layers = params["layers"]
  norms = nbytes(layers["attn_norm"]) + nbytes(layers["mlp_norm"]) + nbytes(params["final_norm"])
  split = nbytes(params) - norms
  args = {}
  for tp in (1, 2):
    c, _, step, mesh = _step(tp, False, 1, 1, 2, False)
    shaped = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        params,
        state_shardings(params, mesh),
    )
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # same bytes in both
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), helpers.random_batch(c)
    )
    args[tp] = step.lower(shaped, batch).compile().memory_analysis().argument_size_in_bytes
  assert args[1] - args[2] == split // 2
  assert split % 2 == 0 and split > 10 * norms


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.tp": 8}, "model.n_heads=4 does not split over mesh.tp=8"),
        ({"mesh.tp": 2, "model.d_ff": 65}, "model.d_ff=65 does not split over mesh.tp=2"),
        ({"mesh.tp": 2, "model.vocab": 65}, "model.vocab=65 does not split over mesh.tp=2"),
        (
            {"mesh.tp": 4, "model.n_heads": 12, "model.n_kv_heads": 3},
            "model.n_kv_heads=3 neither splits over mesh.tp=4 nor divides it",
        ),
        (
            {"mesh.tp": 4, "model.sequence_parallel": True, "data.seq_len": 18},
            "splits each sequence of 18 tokens",
        ),
        ({"model.sequence_parallel": True}, "the tensor axis, which has one rank"),
        (
            {
                "mesh.tp": 2,
                "model.fp8": "block",
                "model.d_model": 128,
                "model.d_ff": 256,
                "model.head_dim": 32,
            },
            "splits model.n_heads * head_dim=128 into 64-wide slices",
        ),
        (
            {
                "mesh.tp": 2,
                "model.fp8": "block",
                "model.d_model": 128,
                "model.d_ff": 128,
                "model.head_dim": 64,
                "model.n_kv_heads": 4,
            },
            "splits model.d_ff=128 into 64-wide slices",
        ),
        (
            {
                "mesh.tp": 2,
                "model.fp8": "block",
                "model.d_model": 128,
                "model.d_ff": 256,
                "model.head_dim": 64,
            },
            "splits model.n_kv_heads * head_dim=128 into 64-wide slices",
        ),
        (
            {
                "mesh.tp": 4,
                "model.fp8": "block",
                "model.d_model": 128,
                "model.n_heads": 8,
                "model.d_ff": 512,
                "model.head_dim": 64,
            },
            "model.n_kv_heads=2 whole on every rank",
        ),
    ],
)
def test_bad_layouts_stop_at_the_config(overrides, message):
  helpers.assert_refused(overrides, message)


@pytest.mark.parametrize("pp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_fp8_current_scaling_scales_split_tensors_as_whole_ones(pp):
  """FP8 with current scaling under tp 2 and sequence parallelism (pp 1 and inside the pipeline
  executor): each split weight, activation and gradient is scaled by the amax of the whole
  tensor, so loss and gradients equal the one-device FP8 model's. Every batch row is the same,
  so data shards see the whole batch's amaxes too; without the reduction over tp the
  gradients are off by far more than the tolerance."""
  c = _config(2, True, pp=pp)
  c.model.fp8, c.model.d_model, c.model.head_dim = "current", 64, 16
  helpers.assert_one_device(*_sharded_loss_and_grads(c, same_rows=True))


def test_fp8_with_kv_heads_whole_over_tp_equals_the_one_device_model_or_is_refused():
  """KV heads whole on every rank (2 under tp 4): without sequence parallelism, on the
  data-parallel path, the K/V outputs are the same on every rank and their gradient whole before
  it is quantised, so loss and gradients equal the one-device FP8 model's. With sequence
  parallelism, or inside the pipeline, each rank's K/V gradient is a partial sum, quantised
  before the sum (measured: a norm scale's gradient 14% off): refused."""
  c = _config(4, False, kv_heads=2)
  c.model.fp8, c.model.d_model, c.model.head_dim = "current", 64, 16
  helpers.assert_one_device(*_sharded_loss_and_grads(c, same_rows=True))
  for overrides, where in (
      ({"sequence_parallel": True}, "with sequence parallelism"),
      ({"pp": 2}, "inside the pipeline"),
  ):
    bad = _config(
        4, overrides.get("sequence_parallel", False), kv_heads=2, pp=overrides.get("pp", 1)
    )
    bad.model.fp8 = "delayed"
    with pytest.raises(
        config_lib.ConfigError, match=f"n_kv_heads=2 whole on every rank of mesh.tp=4, {where}"
    ):
      config_lib.validate(bad, jax.device_count())


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("heads, head_dim, aligned", [(8, 32, True), (4, 32, False)])
def test_fp8_block_gemms_split_over_tp_equal_one_devices(kind, heads, head_dim, aligned):
  """The block recipe's GEMMs as the layers run them under tp 2: column-parallel (q: [D, H, K]
  split on heads) and row-parallel (o: [H, K, D], summed over tp). When each rank's slice of
  the split width (heads / 2 x head_dim) is a multiple of 128, every rank quantises exactly the
  one-device tiles of its slice: y, dx and dw equal one device's to float32 rounding. A
  64-wide slice cuts tiles, and the gradients move by percents: what the config refuses."""
  rng = np.random.default_rng(0)
  d = 128
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
  dot = lambda x, w, in_dims: fp8_lib.dot(x, w, in_dims, "block", None, jnp.float32)
  if kind == "column":
    shapes, in_dims = ((8, 16, d), (d, heads, head_dim), (8, 16, heads, head_dim)), 1
    local = lambda x, w: dot(x, w, 1)
    specs = dict(in_specs=(P(), P(None, "tp")), out_specs=P(None, None, "tp"))
  else:
    shapes, in_dims = ((8, 16, heads, head_dim), (heads, head_dim, d), (8, 16, d)), 2
    local = lambda x, w: jax.lax.psum(dot(x, w, 2), "tp")
    specs = dict(in_specs=(P(None, None, "tp"), P("tp")), out_specs=P())
  x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  w = w * 0.05
  split = jax.shard_map(local, mesh=mesh, **specs)

  def value_and_grads(f):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1)))(x, w)

  want = value_and_grads(lambda x, w: dot(x, w, in_dims))
  got = value_and_grads(split)
  errors = [
      float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
      for a, b in zip(jax.tree.leaves(got)[1:], jax.tree.leaves(want)[1:])
  ]
  if aligned:
    assert max(errors) < 2e-6, errors
    helpers.close(got[0], want[0], "y . g", rtol=1e-5)
  else:
    assert max(errors) > 1e-2, errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_fp8_block_scaling_under_tp_follows_the_one_device_model(sp):
  """The whole block-scaled model under tp 2 (8 heads x 32, 8 KV heads, d_ff 256: 128-wide
  slices) against the one-device block-scaled model. The GEMMs are exact (above), but the
  float32 sums' order moves a few E4M3 codes, which block scales do not smooth: measured, the
  loss is within 2e-5 and every gradient within 7% of its largest element; with 64-wide slices
  (4 heads, d_ff 128, which the config refuses) the loss moves by 3e-4 and gradients by 110%
  of it."""
  c = _config(2, sp, kv_heads=8)
  c.model.fp8, c.model.d_model, c.model.d_ff = "block", 128, 256
  c.model.n_heads, c.model.head_dim = 8, 32
  cfg, params, batch, loss, grads = _sharded_loss_and_grads(c)
  (_, (want, _)), want_grads = jax.jit(
      jax.value_and_grad(functools.partial(helpers.one_device_loss, cfg), has_aux=True)
  )(params, batch)
  helpers.close(loss, want, "loss", rtol=5e-5)
  want_flat = helpers.flat(want_grads)
  for path, g in helpers.flat(grads).items():
    g, w = np.asarray(g), np.asarray(want_flat[path])
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    assert np.max(np.abs(g - w)) <= 0.15 * np.max(np.abs(w)), jax.tree_util.keystr(path)


def test_split_dims_follow_megatrons_layout():
  assert tp_lib.split_dim(("layers", "attn", "q", "kernel"), (2, 32, 4, 8), 2) == -2
  assert tp_lib.split_dim(("layers", "attn", "o", "kernel"), (2, 4, 8, 32), 2) == -3
  assert tp_lib.split_dim(("layers", "mlp", "down", "kernel"), (2, 64, 32), 2) == -2
  assert tp_lib.split_dim(("layers", "mlp", "up", "kernel"), (2, 32, 64), 2) == -1
  assert tp_lib.split_dim(("embed",), (64, 32), 2) == -2
  assert tp_lib.split_dim(("head",), (32, 64), 2) == -1
  # KV heads that do not divide stay whole; norms, and anything at tp 1, too
  assert tp_lib.split_dim(("layers", "attn", "k", "kernel"), (2, 32, 2, 8), 4) is None
  assert tp_lib.split_dim(("layers", "attn", "k", "kernel"), (2, 32, 2, 8), 2) == -2
  assert tp_lib.split_dim(("layers", "attn_norm", "scale"), (2, 32), 2) is None
  assert tp_lib.split_dim(("layers", "attn", "q", "kernel"), (2, 32, 4, 8), 1) is None


def test_vocab_parallel_cross_entropy_equals_logsumexp():
  """The three-reduction cross-entropy over 4 vocabulary shards equals the whole-logits one,
  value and gradient, with targets in every shard."""
  mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
  rng = np.random.default_rng(0)
  logits = jnp.asarray(5 * rng.standard_normal((2, 6, 64)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)

  def sharded(x):
    def local(x_BxLxVp, t_BxL):
      with tp_lib.tensor_parallel("tp"):
        logz, target = tp_lib.vocab_cross_entropy(x_BxLxVp, t_BxL)
      return jnp.sum(logz - target)

    spec = jax.sharding.PartitionSpec(None, None, "tp")
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, jax.sharding.PartitionSpec()),
        out_specs=jax.sharding.PartitionSpec(),
    )(x, targets)

  def whole(x):
    picked = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(x, axis=-1) - picked)

  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tp"))
  got, got_g = jax.jit(jax.value_and_grad(sharded))(jax.device_put(logits, split))
  want, want_g = jax.value_and_grad(whole)(logits)
  helpers.close(got, want, "cross-entropy")
  helpers.close(got_g, want_g, "its gradient")


def test_checkpoint_saved_under_tp_restores_under_another_layout(tmp_path):
  """Saved under tp 2 with sequence parallelism, restored bit for bit under tp 1 and tp 4, each
  onto its own split (the checkpoint holds whole arrays)."""
  c = _config(2, True)
  c.train.steps, c.train.eval_every, c.checkpoint.every = 2, 0, 2
  first = Trainer(c, str(tmp_path))
  first.train(progress=False)
  want = helpers.flat(jax.device_get(first.state))
  first.close()
  for tp in (1, 4):
    other = Trainer(_config(tp, False), str(tmp_path), existing_run="resume_changed")
    state = other.init()
    assert other.resumed_from == 2
    q = state.params["layers"]["attn"]["q"]["kernel"]
    assert q.sharding.shard_shape(q.shape)[-2] == 4 // tp  # the restored split is tp's
    for path, value in helpers.flat(jax.device_get(state)).items():
      np.testing.assert_array_equal(value, want[path], err_msg=jax.tree_util.keystr(path))
    other.close()


def test_fp8_moe_in_the_pipeline_needs_sequence_parallelism():
  """Experts are whole over tp; inside the executor, without sequence parallelism, their
  gradient's amax would come from a per-rank partial: refused with the fix."""
  c = helpers.moe_config(ep=2)
  c.mesh.tp, c.mesh.pp, c.pipeline.microbatches, c.model.fp8 = 2, 2, 2, "current"
  with pytest.raises(config_lib.ConfigError, match=r"set model.sequence_parallel=True"):
    config_lib.validate(c, 8)
  c.model.sequence_parallel = True
  config_lib.validate(c, 8)
