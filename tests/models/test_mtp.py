"""Multi-token prediction (`jaxpipe.models.mtp`) against a direct single-device implementation of
DeepSeek-V3's equations (§2.2, eqs. 21-25), written here apart from the library's.

For depth k = 1..D, on each sequence t_1..t_T (with t_{T+1} the last target):

  h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      i = 1..T-k
  h^k_{1:T-k} = RMSNorm_k(TRM_k(h'^k_{1:T-k}))
  P^k_{i+k+1} = OutHead(h^k_i)
  L^k = -1/T Σ_{i=2+k}^{T+1} log P^k_i[t_i]
  L_MTP = λ/D Σ_k L^k

Sequences cut to T - k positions at each depth (no masks), h^0 the main model's output after
its final norm, each h^k normed by the module's own norm and OutHead the shared projection, where
transformers' `MtpModel` and vLLM put the norms (the paper names none); the batch's loss the mean
over its rows. The library's module runs at full length with
shifted weights instead. Their losses and every gradient agree, and the trainer's step adds
L_MTP to the cross-entropy.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.models import mtp, transformer
from jaxpipe.models.layers import rms_norm
from jaxpipe.models.moe import MoEConfig
from jaxpipe.training import losses
from tests import helpers

B, L = 4, 12
DENSE = transformer.TransformerConfig(
    vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, mtp_depth=2
)
MOE = dataclasses.replace(
    DENSE,
    moe=MoEConfig(num_experts=4, top_k=2, d_ff=16, lb_loss_coef=0.0, z_loss_coef=0.0),
    mtp_depth=1,
    mtp_weight=0.1,
)


def _paper(cfg, params, tokens, next_tokens):
  """L_MTP by the equations: per depth, the sequences cut to T - k, no masks."""
  x = transformer.embed(cfg, params, tokens)
  h, _ = transformer.apply_layers_aux(cfg, params["layers"], x)
  norm = lambda v, w: rms_norm(v, w, cfg.norm_eps)
  h = norm(h, params["final_norm"]["scale"])
  t_all = jnp.concatenate([tokens, next_tokens[:, -1:]], axis=1)  # t_1 .. t_{T+1}
  total = 0.0
  for k in range(1, cfg.mtp_depth + 1):
    p = jax.tree.map(lambda a, k=k: a[k - 1], params["mtp"])
    n = L - k
    e = params["embed"][t_all[:, k : k + n]]  # Emb(t_{i+k}), i = 1..T-k
    h_in = jnp.concatenate([norm(e, p["enorm"]["scale"]), norm(h[:, :n], p["hnorm"]["scale"])], -1)
    h_in = h_in @ p["eh_proj"]["kernel"]
    out = transformer.Block(cfg, moe=cfg.moe is not None).apply(
        {"params": p["block"]}, h_in, jnp.arange(n)
    )
    h = norm(out[0] if cfg.moe is not None else out, p["final_norm"]["scale"])
    logits = h @ (params["embed"].T if cfg.tied_embeddings else params["head"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = t_all[:, k + 1 : k + 1 + n]  # t_{i+k+1}
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    total = total + (-jnp.sum(picked, axis=1) / L).mean()  # 1/T, then the rows' mean
  return cfg.mtp_weight / cfg.mtp_depth * total


def _ours(cfg, params, tokens, targets):
  mask = jnp.ones(tokens.shape, jnp.float32)
  x = transformer.embed(cfg, params, tokens)
  h, _ = transformer.apply_layers_aux(cfg, params["layers"], x)
  total, _ = mtp.loss(cfg, params, h, targets, mtp.weights(cfg, mask))
  return total / tokens.size


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense-depth2", "moe-depth1"])
def test_the_loss_and_its_gradients_equal_the_papers_equations(cfg):
  params = helpers.random_params(cfg, seed=3)
  rng = np.random.default_rng(0)
  seq = rng.integers(0, cfg.vocab, (B, L + 1)).astype(np.int32)
  tokens, targets = seq[:, :-1], seq[:, 1:]
  want, want_g = jax.jit(jax.value_and_grad(lambda p: _paper(cfg, p, tokens, targets)))(params)
  got, got_g = jax.jit(jax.value_and_grad(lambda p: _ours(cfg, p, tokens, targets)))(params)
  assert float(want) > 0.1 * cfg.mtp_weight
  np.testing.assert_allclose(got, want, rtol=1e-6)
  want_flat = helpers.flat(want_g)
  for path, g in helpers.flat(got_g).items():
    helpers.close(g, want_flat[path], jax.tree_util.keystr(path), rtol=2e-5)
  for part in ("mtp", "layers", "embed"):  # the modules and the model under them both learn
    assert any(np.any(np.asarray(g)) for g in jax.tree.leaves(got_g[part])), part


def test_the_step_adds_the_modules_loss_to_the_cross_entropy():
  """The data-parallel step's gradient is that of CE + L_MTP, its loss the CE alone."""
  cfg = DENSE
  params = helpers.random_params(cfg, seed=4)
  rng = np.random.default_rng(1)
  seq = rng.integers(0, cfg.vocab, (B, L + 1)).astype(np.int32)
  batch = dict(tokens=seq[:, :-1], targets=seq[:, 1:], mask=np.ones((B, L), np.float32))
  loss, grads, metrics = jax.jit(losses.data_parallel_loss_and_grads(cfg, microbatches=2))(
      params, batch
  )

  def objective(p):
    total, count = transformer.loss(cfg, p, batch["tokens"], batch["targets"], batch["mask"])
    return total / count + _paper(cfg, p, batch["tokens"], batch["targets"]), total / count

  (_, want_ce), want = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  np.testing.assert_allclose(loss, want_ce, rtol=1e-6)
  want_mtp = jax.jit(lambda p: _paper(cfg, p, batch["tokens"], batch["targets"]))(params)
  np.testing.assert_allclose(metrics["mtp_loss"], want_mtp, rtol=1e-5)
  want = helpers.flat(want)
  for path, g in helpers.flat(grads).items():
    helpers.close(g, want[path], jax.tree_util.keystr(path), rtol=2e-5)


def test_the_trainer_trains_it():
  from configs import tiny
  from jaxpipe.training.trainer import Trainer

  c = tiny.get_config()
  c.model.mtp_depth, c.model.mtp_weight = 1, 0.3
  trainer = Trainer(c)
  assert trainer.model_cfg.mtp_depth == 1
  trainer.init()
  first = trainer.step()
  assert "mtp_loss" in first and float(first["mtp_loss"]) > 0


@pytest.mark.parametrize(
    "schedule, axis",
    [
        ("dualpipev", "ep"),  # DeepSeek's
        pytest.param("1f1b", "ep", marks=pytest.mark.slow),
        ("1f1b", "cp"),
        ("1f1b", "tp"),
    ],
)
def test_the_pipeline_trains_the_modules_on_its_last_stage(schedule, axis):
  """Pipelined at pp 2 beside ep 2 (MoE), cp 2 or tp 2 with sequence parallelism (dense), the
  modules run beside the head on the last stage (under cp each slice continued by the next
  rank's first tokens): the step's loss is the cross-entropy and its gradient that of CE +
  L_MTP + every MoE layer's aux (the module's too), as the one-device step's, on packed rows."""
  from jaxpipe.training.config import model_config
  from jaxpipe.training.mesh import make_mesh
  from jaxpipe.training.pipeline_lm import pipeline_loss_and_grads

  c = helpers.moe_config(ep=2, every=1, dispatch="dropless")  # lb and z losses on
  if axis != "ep":
    c = helpers.moe_config(ep=1)
    c.model.moe, c.mesh.dp, c.mesh[axis] = None, 1, 2
    c.model.sequence_parallel = axis == "tp"
  c.model.mtp_depth, c.model.mtp_weight = 1 if axis == "ep" else 2, 0.3
  c.mesh.pp = 2
  c.pipeline.schedule, c.pipeline.microbatches = schedule, 4
  cfg = model_config(c)
  batch = _packed_batch(cfg, rows=8, seed=6)  # 4 micro-batches of 2 rows, one per expert rank
  mesh = make_mesh(c.mesh, jax.devices()[:4])
  step = pipeline_loss_and_grads(cfg, c.pipeline, mesh)
  # tp's split sums reorder float32 additions through two modules: two entries of one leaf
  # were found just over 2e-5 of its largest gradient off
  want_metrics = _equals_one_device(cfg, step, batch, 4, rtol=5e-5 if axis == "tp" else 2e-5)
  if cfg.moe is not None:
    assert float(want_metrics["moe_aux_loss"]) > 0.05


@pytest.mark.parametrize("path", ["cp", "tp", "fsdp"])
def test_the_shard_map_path_trains_the_modules(path):
  """Under context parallelism and tensor parallelism with sequence parallelism (dense), and
  under fsdp over two expert ranks (MoE), the modules run in the one shard_map beside the head
  (under cp each rank's slice continued by the next rank's first tokens): the step's loss is
  the cross-entropy, `mtp_loss` the modules' term and the gradient that of their sum, as the
  one-device step's, on packed rows."""
  from jaxpipe.training.config import model_config
  from jaxpipe.training.mesh import make_mesh

  shard = "none"
  if path == "cp":
    c = helpers.moe_config(ep=1)
    c.model.moe, c.mesh.cp = None, 2
  elif path == "tp":
    c = helpers.moe_config(ep=1)
    c.model.moe, c.model.sequence_parallel, c.mesh.tp = None, True, 2
  else:
    c = helpers.moe_config(ep=2, every=1, dispatch="dropless")
    shard = c.optimizer.shard = "fsdp"
  c.model.n_layers, c.model.mtp_depth, c.mesh.dp = 2, 2, 1
  cfg = model_config(c)
  mesh = make_mesh(c.mesh, jax.devices()[:2])
  step = losses.context_parallel_loss_and_grads(cfg, mesh, 2, shard=shard)
  want_metrics = _equals_one_device(cfg, step, _packed_batch(cfg, rows=4, seed=7), 2)
  assert float(want_metrics["mtp_loss"]) > 0.05


def _packed_batch(cfg, rows, seed):
  """`rows` rows of two documents each, positions restarting at the second."""
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, cfg.vocab, (rows, L + 1)).astype(np.int32)
  cut = rng.integers(3, L - 3, rows)
  second = np.arange(L)[None] >= cut[:, None]
  return dict(
      tokens=seq[:, :-1],
      targets=seq[:, 1:],
      mask=np.where(np.arange(L)[None] == cut[:, None] - 1, 0, 1).astype(np.float32),
      segment_ids=(1 + second).astype(np.int32),
      positions=np.where(second, np.arange(L)[None] - cut[:, None], np.arange(L)[None]),
  )


def _equals_one_device(cfg, step, batch, microbatches, rtol=2e-5):
  """`step`'s loss, metrics and gradients against the one-device step with the modules
  (`moe_loss_and_grads` without a mesh, held to the paper's equations above), each gradient
  within `rtol` of its leaf's largest element; returns the one-device metrics."""
  params = helpers.random_params(cfg, seed=6)
  loss, grads, metrics = jax.jit(step)(params, batch)
  want_loss, want, want_metrics = jax.jit(losses.moe_loss_and_grads(cfg, None, microbatches))(
      params, batch
  )
  assert float(want_metrics["mtp_loss"]) > 0.05
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)  # the cross-entropy alone
  if "mtp_loss" in metrics:
    np.testing.assert_allclose(metrics["mtp_loss"], want_metrics["mtp_loss"], rtol=1e-5)
  want = helpers.flat(want)
  for path, g in helpers.flat(grads).items():
    helpers.close(g, want[path], jax.tree_util.keystr(path), rtol=rtol)
  assert any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["mtp"]))
  return want_metrics


def test_packed_rows_keep_each_module_inside_its_document():
  """Two documents packed in one row give the modules' loss of the two alone, padded."""
  cfg = DENSE
  params = helpers.random_params(cfg, seed=5)
  rng = np.random.default_rng(2)
  docs = [rng.integers(0, cfg.vocab, n + 1).astype(np.int32) for n in (5, 7)]
  packed = {
      k: np.zeros((1, L), np.int32) for k in ("tokens", "targets", "segment_ids", "positions")
  }
  alone = {k: np.zeros((2, L), np.int32) for k in ("tokens", "targets")}
  alone["mask"] = np.zeros((2, L), np.float32)
  start = 0
  for d, seq in enumerate(docs):
    n = len(seq) - 1
    span = slice(start, start + n)
    packed["tokens"][0, span], packed["targets"][0, span] = seq[:-1], seq[1:]
    packed["segment_ids"][0, span], packed["positions"][0, span] = d + 1, np.arange(n)
    alone["tokens"][d, :n], alone["targets"][d, :n], alone["mask"][d, :n] = seq[:-1], seq[1:], 1
    start += n
  packed["mask"] = np.ones((1, L), np.float32)

  def term(batch, seg=None, pos=None):
    x = transformer.embed(cfg, params, batch["tokens"])
    h, _ = transformer.apply_layers_aux(cfg, params["layers"], x, pos, seg)
    w = mtp.weights(cfg, batch["mask"], seg)
    return mtp.loss(cfg, params, h, batch["targets"], w, pos, seg)[0] / batch["tokens"].size

  got = term(packed, packed["segment_ids"], packed["positions"])
  np.testing.assert_allclose(got, term(alone), rtol=1e-6)
  assert float(got) != pytest.approx(float(term(packed, None, packed["positions"])), rel=1e-3)
