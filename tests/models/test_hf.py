"""Hugging Face checkpoints against transformers itself: Llama, Mixtral and Qwen3-MoE.

Small random checkpoints are written by transformers' own `save_pretrained`; its forward and
backward (CPU torch, float32) are the oracle for jaxpipe's logits, loss and every gradient, on
one device, on a dp x ep mesh and in a zb-v pipeline over pp x ep x cp, and again after export and
reload.
"""

import copy
import dataclasses
import functools
import json
import os
import runpy
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxpipe import convert
from jaxpipe.models import hf, moe, transformer
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.runtime import cli
from jaxpipe.training import config as config_lib
from jaxpipe.training import hf_workdir as convert_lib
from jaxpipe.training.losses import make_loss_and_grads
from jaxpipe.training.state import state_shardings
from jaxpipe.training.trainer import Trainer
from tests import helpers

# `python -m jaxpipe.convert ARGS`, run in this process
convert_main = functools.partial(cli.call, convert.main, convert.FLAGS)

# The oracle, from the dev extra (CPU torch); imported on first use, not when pytest collects.
torch = transformers = None


def _import_oracle():
  global torch, transformers
  import torch
  import transformers


ROOT = helpers.ROOT
BATCH, SEQ = 8, 8
COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
ARCHS = {  # name: (config class, model class, fields); every case beside the defaults
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=True),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
}


def _randomise(model, seed):
  """Every weight random at unit-scale activations (norm scales around 1), so all of them matter."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.2 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)


def _hf_oracle(model, ids, with_aux, grad_dir):
  """transformers' (loss, aux loss, logits, gradients by checkpoint name) for labels = ids.

  The gradients are saved by save_pretrained as if they were weights, so transformers itself
  lays them out as checkpoint tensors.
  """
  model.zero_grad()
  out = model(input_ids=torch.tensor(ids), labels=torch.tensor(ids), output_router_logits=with_aux)
  out.loss.backward()
  grads = copy.deepcopy(model)
  with torch.no_grad():
    for p, g in zip(model.parameters(), grads.parameters()):
      g.copy_(p.grad)
  grads.save_pretrained(grad_dir)
  aux = out.aux_loss.item() if with_aux else 0.0
  return (
      out.loss.item(),
      aux,
      out.logits.detach().numpy(),
      load_file(os.path.join(grad_dir, hf.WEIGHTS_FILE)),
  )


@dataclasses.dataclass
class Case:
  name: str
  src: str  # the checkpoint directory
  model: object  # the transformers model
  ids: np.ndarray  # [BATCH, SEQ] tokens
  loss: float  # transformers' loss: cross-entropy (+ coef · aux loss for MoE)
  aux_loss: float  # transformers' unweighted aux loss (0 for Llama)
  logits: np.ndarray
  grads: dict  # checkpoint name -> gradient of `loss`
  ce_loss: float  # cross-entropy alone (MoE), and its gradients
  ce_grads: dict


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  _import_oracle()
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for i, (name, (config_cls, model_cls, fields)) in enumerate(ARCHS.items()):
    torch.manual_seed(i)
    model = getattr(transformers, model_cls)(
        getattr(transformers, config_cls)(**COMMON, **fields, attn_implementation="eager")
    )
    _randomise(model, i)
    src = str(root / name)
    # Mixtral in shards with an index, the others in one file.
    model.save_pretrained(src, max_shard_size="40KB" if name == "mixtral" else "1GB")
    ids = np.random.default_rng(i).integers(0, COMMON["vocab_size"], (BATCH, SEQ))
    is_moe = name != "llama"
    loss, aux, logits, grads = _hf_oracle(model, ids, is_moe, str(root / f"{name}_grads"))
    ce_loss, ce_grads = loss, grads
    if is_moe:
      ce_loss, _, _, ce_grads = _hf_oracle(model, ids, False, str(root / f"{name}_ce_grads"))
    out[name] = Case(name, src, model, ids, loss, aux, logits, grads, ce_loss, ce_grads)
  return out


def _batch(ids):
  return dict(
      tokens=jnp.asarray(ids),
      targets=jnp.roll(jnp.asarray(ids), -1, axis=1),
      mask=jnp.ones(ids.shape).at[:, -1].set(0.0),
  )  # transformers shifts the labels


def _one_device(cfg):
  """jit of params -> ((objective, logits), grads): mean cross-entropy + the MoE aux objective."""

  def objective(params, batch):
    x, aux = transformer.apply_layers_aux(
        cfg, params["layers"], transformer.embed(cfg, params, batch["tokens"])
    )
    total, count = transformer.head_loss(cfg, params, x, batch["targets"], batch["mask"])
    aux_loss = moe.aux_objective(cfg.moe, aux) if cfg.moe is not None else 0.0
    return total / count + aux_loss, transformer.logits(cfg, params, x)

  return jax.jit(jax.value_and_grad(objective, has_aux=True))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _check_grads(cfg, model_type, grads, want, tol=1e-5):
  got = dict(hf.hf_tensors(cfg, grads, model_type))
  assert got.keys() == want.keys()
  for name, g in want.items():
    assert _rel(got[name], g) < tol, name


def test_one_device_matches_transformers_before_and_after_export(cases, tmp_path):
  """Imported weights, then changed ones (as after training) exported and reloaded by
  transformers: logits, loss and gradients as transformers' (one compile per model)."""
  for case in cases.values():
    plan = hf.check(case.src)
    cfg, params = hf.load(plan)
    step = _one_device(cfg)
    (loss, logits), grads = step(params, _batch(case.ids))
    assert _rel(logits, case.logits) < 1e-5, case.name
    assert abs(float(loss) - case.loss) < 1e-5 * case.loss, case.name
    _check_grads(cfg, case.name, grads, case.grads)

    rng = np.random.default_rng(7)
    params = jax.tree.map(
        lambda p: p * (1 + 0.1 * rng.standard_normal(p.shape, np.float32)), params
    )
    dst = str(tmp_path / case.name)
    hf.save(cfg, params, dst, hf_config=plan.hf_config)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager")
    assert type(model) is type(case.model)
    want_loss, _, want_logits, want = _hf_oracle(
        model, case.ids, case.name != "llama", str(tmp_path / f"{case.name}_grads")
    )
    (loss, logits), grads = step(params, _batch(case.ids))
    assert _rel(logits, want_logits) < 1e-5, case.name
    assert abs(float(loss) - want_loss) < 1e-5 * want_loss, case.name
    _check_grads(cfg, case.name, grads, want)


def test_moe_imports_take_transformers_pooled_aux_loss(cases):
  """Pooled over layers, weighted by router_aux_loss_coef, no z-loss; it moves the routers."""
  for name in ("mixtral", "qwen3_moe"):
    case = cases[name]
    cfg = hf.check(case.src).cfg
    assert cfg.moe.lb_loss_form == "pooled" and cfg.moe.lb_loss_coef == 0.1
    assert cfg.moe.z_loss_coef == 0.0
    assert case.aux_loss > 0 and abs(case.loss - case.ce_loss - 0.1 * case.aux_loss) < 1e-6
    router = [n for n in case.grads if n.endswith("gate.weight") and "experts" not in n]
    assert router
    for n in router:  # far more than the tolerance: the comparisons above see the aux term
      assert _rel(case.grads[n], case.ce_grads[n]) > 1e-3, n


def _weights(directory):
  out = {}
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, name)))
  return out


def _assert_bit_equal(a, b):
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def test_round_trip_is_bit_exact_in_float32_and_bfloat16(cases, tmp_path):
  for case in cases.values():
    plan = hf.check(case.src)
    dst = str(tmp_path / case.name)
    hf.save(*hf.load(plan), dst, hf_config=plan.hf_config, max_shard_bytes=40_000)
    _assert_bit_equal(_weights(case.src), _weights(dst))
    with (
        open(os.path.join(case.src, hf.CONFIG_FILE)) as f,
        open(os.path.join(dst, hf.CONFIG_FILE)) as g,
    ):
      assert json.load(f) == json.load(g)
    assert len([n for n in os.listdir(dst) if n.endswith(".safetensors")]) > 1  # shards + index
  bf16 = str(tmp_path / "bf16")
  copy.deepcopy(cases["qwen3_moe"].model).to(torch.bfloat16).save_pretrained(bf16)
  plan = hf.check(bf16)
  assert plan.dtype == "bfloat16"
  hf.save(*hf.load(plan), str(tmp_path / "bf16_out"), hf_config=plan.hf_config)
  _assert_bit_equal(_weights(bf16), _weights(str(tmp_path / "bf16_out")))
  # read in bfloat16 (each tensor cast as it is read): the same weights, never float32
  _, params = hf.load(plan, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  hf.save(plan.cfg, params, str(tmp_path / "bf16_read"), hf_config=plan.hf_config)
  _assert_bit_equal(_weights(bf16), _weights(str(tmp_path / "bf16_read")))


def test_loading_shows_its_bytes_read_on_a_terminal(cases, monkeypatch):
  """`hf.load` counts the bytes it has placed on a progress bar shown on a terminal alone
  (tqdm's disable=None): its total is the loaded params' bytes, reached leaf by leaf."""
  bars = []

  class Bar:

    def __init__(self, **kw):
      self.kw, self.done = kw, []
      bars.append(self)

    def update(self, n):
      self.done.append(n)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

  monkeypatch.setattr(hf.tqdm, "tqdm", Bar)
  case = next(iter(cases.values()))
  _, params = hf.load(case.src, dtype="bfloat16")
  (bar,) = bars
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  assert bar.kw["total"] == total == sum(bar.done)
  assert len(bar.done) == len(jax.tree.leaves(params)) and bar.kw["disable"] is None


def _trainer_config(cfg, **mesh):
  c = config_lib.default_config()
  model = dataclasses.asdict(cfg)
  moe_fields = model.pop("moe")
  c.model.update(model)
  if moe_fields is not None:
    c.model.moe = moe_fields
  c.data.batch, c.data.seq_len, c.data.source = BATCH, SEQ, "synthetic"
  c.mesh.update(mesh)
  return c


def _mesh_params(c, cfg, src):
  """The checkpoint loaded straight onto the trainer's shardings of the config's mesh."""
  from jaxpipe.training.mesh import make_mesh

  mesh = make_mesh(c.mesh)
  shapes = jax.eval_shape(lambda k: transformer.init_params(cfg, k), jax.random.key(0))
  return mesh, hf.load(src, state_shardings(shapes, mesh))[1]


def test_dp_x_ep_mesh_matches_transformers(cases):
  case = cases["mixtral"]
  cfg = hf.check(case.src).cfg
  c = _trainer_config(cfg, ep=4)  # dp = 2
  mesh, params = _mesh_params(c, cfg, case.src)
  w = params["layers"]["moe"]["moe"]["wi_gate_ExDxF"]
  assert w.sharding.spec == P(None, "ep") and w.addressable_shards[0].data.shape[1] == 1
  shape = config_lib.validate(c, jax.device_count())
  loss, grads, metrics = jax.jit(make_loss_and_grads(c, cfg, shape))(params, _batch(case.ids))
  assert abs(float(loss) - case.ce_loss) < 1e-5 * case.ce_loss  # the reported loss is the CE
  assert abs(float(metrics["moe_aux_loss"]) - 0.1 * case.aux_loss) < 1e-5 * case.aux_loss
  _check_grads(cfg, "mixtral", grads, case.grads)


def test_tp_layout_matches_transformers_and_exports_from_its_shards(cases, tmp_path):
  """Llama loaded straight onto tp 2 (sequence parallel) x dp 4: heads, d_ff and the tied
  vocabulary split as Megatron's; loss and gradients equal transformers', and the export written
  from the split parameters is the source checkpoint bit for bit."""
  case = cases["llama"]
  plan = hf.check(case.src)
  cfg = dataclasses.replace(plan.cfg, sequence_parallel=True)
  c = _trainer_config(cfg, tp=2)  # dp = 4
  _, params = _mesh_params(c, cfg, case.src)
  assert params["embed"].sharding.spec == P("tp")
  q = params["layers"]["attn"]["q"]["kernel"]  # [layers, D, H, K]: heads over tp
  assert q.sharding.spec == P(None, None, "tp") and q.addressable_shards[0].data.shape[2] == 2
  shape = config_lib.validate(c, jax.device_count())
  loss, grads, _ = jax.jit(make_loss_and_grads(c, cfg, shape))(params, _batch(case.ids))
  assert abs(float(loss) - case.ce_loss) < 1e-5 * case.ce_loss
  _check_grads(cfg, "llama", grads, case.ce_grads)
  out = str(tmp_path / "llama_from_tp")
  hf.save(cfg, params, out, hf_config=plan.hf_config)
  _assert_bit_equal(_weights(case.src), _weights(out))


def test_zb_v_pipeline_with_ep_and_cp_matches_transformers_reading_each_tensor_once(
    cases, monkeypatch
):
  """Qwen3-MoE (q/k norms inside the fused cp all-to-alls, dense and MoE layers) on pp x ep x cp."""
  case = cases["qwen3_moe"]
  plan = hf.check(case.src)
  cfg = dataclasses.replace(plan.cfg, cp_overlap=True)
  c = _trainer_config(cfg, pp=2, ep=2, cp=2)  # dp = 1
  c.pipeline.schedule, c.pipeline.microbatches = "zb-v", 2
  shape = config_lib.validate(c, jax.device_count())
  with pytest.raises(config_lib.ConfigError, match="lb_loss_form='pooled' couples"):
    make_loss_and_grads(c, cfg, shape)  # transformers' pooled form spans the pipeline's stages
  cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, lb_loss_coef=0.0))
  c.model.moe.lb_loss_coef = 0.0
  reads = []
  get = hf._Reader.get
  monkeypatch.setattr(hf._Reader, "get", lambda self, name: reads.append(name) or get(self, name))
  _, params = _mesh_params(c, cfg, case.src)
  assert sorted(reads) == sorted(plan.files)  # every tensor, once, though 8 devices hold them
  w = params["layers"]["moe"]["moe"]["wi_gate_ExDxF"]
  assert w.sharding.spec == P("pp", "ep") and w.addressable_shards[0].data.shape[:2] == (2, 2)
  loss, grads, _ = jax.jit(make_loss_and_grads(c, cfg, shape))(params, _batch(case.ids))
  assert abs(float(loss) - case.ce_loss) < 1e-5 * case.ce_loss
  _check_grads(cfg, "qwen3_moe", grads, case.ce_grads)
  out = str(os.path.dirname(case.src) + "/qwen3_moe_from_mesh")
  hf.save(cfg, params, out, hf_config=plan.hf_config)  # straight from the pp x ep shards
  _assert_bit_equal(_weights(case.src), _weights(out))


# Half a minute of subprocesses: -m slow. CI keeps the import, export and ZB-V pipeline against
# transformers in process (the tests above) and the CLI's own training paths (tests/test_train.py).
@pytest.mark.slow
def test_cli_fine_tunes_an_imported_mixtral_with_zb_v_and_exports_it(cases, tmp_path):
  case = cases["mixtral"]
  workdir, dst = str(tmp_path / "run"), str(tmp_path / "out")
  convert_main(["hf-to-orbax", case.src, workdir])
  assert convert_lib.committed_steps(workdir) == [0]
  cmd = [
      sys.executable,
      "-m",
      "jaxpipe.train",
      "--workdir",
      workdir,
      "--config.mesh.pp=2",
      "--config.mesh.ep=2",
      "--config.pipeline.schedule=zb-v",
      "--config.pipeline.microbatches=2",
      "--config.model.moe.lb_loss_form=per_layer",
      "--config.train.steps=2",
      "--config.optimizer.lr=0.01",
      "--config.optimizer.warmup_steps=0",
      f"--config.data.batch={BATCH}",
      f"--config.data.seq_len={SEQ}",
      "--config.train.eval_batches=1",
      "--config.train.log_every=1",
  ]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from step 0" in r.stdout and "'pp': 2" in r.stdout
  assert convert_lib.committed_steps(workdir) == [0, 2]
  convert_main(["orbax-to-hf", workdir, dst])
  assert {"config.json", "generation_config.json", "model.safetensors"} == set(os.listdir(dst))
  before, after = _weights(case.src), _weights(dst)
  assert all(not np.array_equal(before[n], after[n]) for n in before if "gate.weight" in n)
  cfg = convert_lib.workdir_model(workdir)
  trained = convert_lib.restore_params(
      workdir, 2, cfg, jax.sharding.Mesh(jax.devices()[:1], ("dp",))
  )
  _assert_bit_equal(dict(hf.hf_tensors(cfg, trained, "mixtral")), after)
  model = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager")
  assert type(model) is type(case.model)
  assert np.isfinite(model(input_ids=torch.tensor(case.ids)).logits.detach().numpy()).all()


def test_an_imported_model_fine_tunes_with_delayed_fp8(cases, tmp_path):
  """hf-to-orbax --fp8 delayed: checkpoint 0 holds the imported weights (exported again bit for
  bit), unit scales and empty amax histories, and the runner resumes it in FP8, filling the
  histories; a recipe the model's widths cannot take is refused before anything is written."""
  case = cases["llama"]
  workdir, dst = str(tmp_path / "run"), str(tmp_path / "out")
  with pytest.raises(
      SystemExit,
      match=r"--fp8 block: model.fp8='block' .* model.d_model=32 is not a multiple of 128",
  ):
    convert_main(["hf-to-orbax", case.src, workdir, "--fp8", "block"])
  assert not os.path.exists(workdir)
  convert_main(["hf-to-orbax", case.src, workdir, "--fp8", "delayed"])
  convert_main(["orbax-to-hf", workdir, dst])
  _assert_bit_equal(_weights(case.src), _weights(dst))
  config = runpy.run_path(os.path.join(workdir, "config.py"))["get_config"]()
  assert config.model.fp8 == "delayed"
  config.update_from_flattened_dict(
      {"data.batch": BATCH, "data.seq_len": SEQ, "train.steps": 2, "train.eval_batches": 1}
  )
  with Trainer(config, workdir) as trainer:
    state = trainer.init()
    assert trainer.resumed_from == 0
    scales = jax.tree.leaves(fp8_lib.state_of(state.params))
    assert len(scales) == 7  # q, k, v, o, gate, up, down: [layers, 3] each
    assert all((np.asarray(s) == 1).all() for s in scales)
    assert not any(np.asarray(h).any() for h in jax.tree.leaves(state.fp8))
    assert np.isfinite(float(trainer.step()["loss"]))
    newest = [np.asarray(h)[..., 0] for h in jax.tree.leaves(trainer.state.fp8)]
    assert all((a > 0).all() for a in newest)  # every GEMM's x, w and g amax of the step
    moved = jax.tree.leaves(fp8_lib.state_of(trainer.state.params))
    assert all((np.asarray(s) != 1).all() for s in moved)  # scales set from those amaxes


# -- refusals, before any device work -------------------------------------------------------------


@pytest.fixture
def no_device_work(monkeypatch):
  def fail(*a, **k):
    raise AssertionError("device work before the checkpoint was checked")

  for name in ("device_put", "make_array_from_single_device_arrays"):
    monkeypatch.setattr(jax, name, fail)


def _edited(case, tmp_path, config=None, tensors=None):
  """A copy of the case's checkpoint with config.json fields and tensors replaced (None deletes)."""
  dst = str(tmp_path / "edited")
  os.makedirs(tmp_path, exist_ok=True)
  shutil.copytree(case.src, dst)
  if config:
    with open(os.path.join(dst, hf.CONFIG_FILE)) as f:
      hf_config = json.load(f)
    hf_config.update(config)
    with open(os.path.join(dst, hf.CONFIG_FILE), "w") as f:
      json.dump(hf_config, f)
  if tensors:
    path = os.path.join(dst, hf.WEIGHTS_FILE)
    weights = load_file(path)
    assert all(name in weights for name, v in tensors.items() if v is None)
    weights.update(tensors)
    save_file({k: v for k, v in weights.items() if v is not None}, path, metadata={"format": "pt"})
  return dst


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"model_type": "mamba"}, None, r"model_type='mamba' is not supported"),
        ({"attention_dropout": 0.1}, None, r"attention_dropout=0.1 is not implemented"),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            None,
            r"rope_type 'proportional' is not implemented",
        ),
        ({"hidden_act": "gelu"}, None, r"hidden_act='gelu' is not implemented"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            None,
            r"quantization_config is set: the weights are quantized",
        ),
        (
            {"attention_bias": True},
            None,
            r"tensor model.layers.0.self_attn.q_proj.bias is missing",
        ),
        (
            None,
            {"model.layers.1.mlp.up_proj.weight": None},
            r"tensor model.layers.1.mlp.up_proj.weight is missing",
        ),
        (
            None,
            {"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)},
            r"tensor model.layers.0.self_attn.q_proj.bias .* is not part of a llama model",
        ),
        (
            None,
            {"model.layers.1.self_attn.k_proj.weight": np.zeros((32, 32), np.float32)},
            r"tensor model.layers.1.self_attn.k_proj.weight has shape \[32, 32\], but config.json "
            r"implies \[16, 32\]",
        ),
    ],
    ids=[
        "model_type",
        "dropout",
        "rope_type",
        "activation",
        "quantized",
        "bias_without_tensors",
        "missing",
        "unknown",
        "shape",
    ],
)
def test_bad_checkpoints_are_refused_naming_the_field_or_tensor(
    cases, tmp_path, no_device_work, config, tensors, message
):
  src = _edited(cases["llama"], tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=message):
    hf.load(src)
  with pytest.raises(SystemExit, match="^error: .*" + message) as e:
    convert_main(["hf-to-orbax", src, str(tmp_path / "run")])
  assert str(e.value).count("config.json:") <= 1  # one prefix, not one per layer of the reader
  assert not os.path.exists(tmp_path / "run")


def test_fields_that_change_nothing_convert_with_one_warning_line(cases, tmp_path, capsys):
  """Metadata transformers ignores converts silently; a field no family knows converts with one
  warning naming it (transformers' Llama keeps it as an attribute and never reads it)."""
  quiet = {
      "_model_name_or_path": "org/model",
      "unk_token_id": 0,
      "transformers.js_config": {"dtype": "q4"},
      "is_llama_config": True,
      "rope_interleaved": False,
  }
  src = _edited(cases["llama"], tmp_path / "quiet", quiet)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert hf.check(src).cfg == hf.check(cases["llama"].src).cfg
  src = _edited(cases["llama"], tmp_path / "loud", {**quiet, "q_lora_rank": 1536, "zzz": 1})
  with pytest.warns(hf.UnknownFieldsWarning) as record:
    assert hf.check(src).cfg == hf.check(cases["llama"].src).cfg
  (w,) = record
  assert str(w.message).endswith(": q_lora_rank, zzz") and "model_type 'llama'" in str(w.message)
  run = tmp_path / "run"
  capsys.readouterr()
  convert_main(["hf-to-orbax", src, str(run)])  # the command converts it, saying so on one line
  assert convert_lib.committed_steps(str(run)) == [0]
  (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert line.startswith("warning: config.json: ignoring fields") and line.endswith("zzz")


def test_derived_tensors_are_reported_not_read(cases, tmp_path):
  inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"  # older Llama checkpoints carry it
  src = _edited(
      cases["llama"],
      tmp_path,
      {"layer_types": ["full_attention"] * 2},
      {inv_freq: np.ones(4, np.float32)},
  )
  with pytest.warns(hf.UnknownFieldsWarning, match="layer_types"):  # Llama reads none
    plan = hf.check(src)
  assert plan.ignored == {inv_freq: "rotary frequencies, recomputed from rope_theta"}
  assert inv_freq not in dict(hf.hf_tensors(*hf.load(plan), "llama"))


def test_moe_sliding_windows_are_transformers(cases, tmp_path):
  """Mixtral's sliding_window and Qwen3-MoE's use_sliding_window slide every layer, as
  transformers computes them, over a sequence longer than the window."""
  for name, fields in (
      ("mixtral", {"sliding_window": 3}),
      ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 3}),
  ):
    src = _edited(cases[name], tmp_path / name, fields)
    cfg, params = hf.load(src)
    assert cfg.sliding_window == 3 and cfg.layer_windows == (3,) * cfg.n_layers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    with torch.no_grad():
      want = model(input_ids=torch.tensor(cases[name].ids)).logits.numpy()
    got = jax.jit(functools.partial(transformer.forward, cfg))(params, cases[name].ids)
    assert _rel(got, want) < 1e-5, name
    assert _rel(got, cases[name].logits) > 1e-3, name  # the window is seen


def test_export_refuses_a_model_no_architecture_computes():
  cfg = transformer.TransformerConfig(moe=moe.MoEConfig(router="sigmoid"))
  with pytest.raises(hf.CheckpointError, match=r"model.moe.router='sigmoid' has no counterpart"):
    hf.config_to_hf(cfg)
  cfg = transformer.TransformerConfig(moe=moe.MoEConfig(num_shared_experts=1))
  with pytest.raises(hf.CheckpointError, match="num_shared_experts=1 has no counterpart"):
    hf.config_to_hf(cfg)
  for cfg in (
      transformer.TransformerConfig(),
      transformer.TransformerConfig(
          qk_norm=True, moe=moe.MoEConfig(every=2, norm_topk_prob=False, lb_loss_coef=0.0)
      ),
  ):
    back = hf.config_from_hf(hf.config_to_hf(cfg))  # a config of its own when there is no source
    assert hf._function_fields(back) == hf._function_fields(cfg)
