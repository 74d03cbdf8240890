"""Hugging Face checkpoints to training workdirs and back (`python -m jaxpipe.convert`).

hf-to-orbax checks SRC_DIR (config.json, the safetensors headers) before any device work, streams
the weights onto a pp x ep mesh of the first pp·ep devices (`jaxpipe.models.hf`) and writes
WORKDIR/checkpoints/0, a training state at step 0 (fresh optimizer moments; with --fp8 delayed,
unit scales and empty amax histories, as a new FP8 run starts);
WORKDIR/config.py, the fine-tuning config (`finetune_config`), and config.json, that config
resolved as a training run writes it (so `python -m jaxpipe.serve --workdir WORKDIR` serves the
imported model at once); and WORKDIR/hf/, the source's config.json, tokenizer and other files,
which the export carries along. The training runner
then resumes from step 0 under any schedule and mesh: that is fine-tuning. orbax-to-hf writes
the newest committed step (or `step`) of a workdir in transformers' layout, by default in the
source's dtype, with the files of WORKDIR/hf/ beside it."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections

from jaxpipe.models import hf, transformer
from jaxpipe.ops import fp8 as fp8_lib
from jaxpipe.runtime import checkpoint as checkpoint_lib
from jaxpipe.training import config as config_lib
from jaxpipe.training.restore import run_config

HF_DIR = hf.HF_DIR  # WORKDIR/hf: the source's config.json and its other non-weight files

_CONFIG_PY = '''"""Fine-tuning config of the Hugging Face checkpoint converted from {src}.

  python -m jaxpipe.train --workdir {workdir}

data.source is the standard library's bytes, which mean nothing to this model's tokenizer: train
on a corpus tokenized by it (docs/data.md),

  python -m jaxpipe.data prepare --tokenizer {workdir} --input FILE.jsonl --out DIR
  python -m jaxpipe.train --workdir {workdir} --config.data.source=tokens:DIR

Written by `python -m jaxpipe.convert hf-to-orbax`: the model section is the checkpoint's
({model_type}, from hf/config.json). Override training fields (mesh, pipeline, data, optimizer,
train) and runtime options (model.attention, model.remat, model.moe.dispatch,
model.moe.lb_loss_form, ...) here or with --config.key=value; fields that shape the parameters
must stay, and so must optimizer.clip_norm > 0 (checkpoints/0 holds that optimizer's state).
"""
import os

from jaxpipe.training import hf_workdir


def get_config(arg=None):
  del arg
  c = hf_workdir.finetune_config(os.path.dirname(os.path.abspath(__file__)))
  c.model.fp8 = {fp8!r}  # hf-to-orbax --fp8: checkpoints/0 holds this recipe's state
  c.model.mtp_depth = {mtp_depth!r}  # the checkpoint's multi-token prediction modules
  return c
'''


def finetune_config(workdir: str) -> ml_collections.ConfigDict:
  """The default config with the model of WORKDIR/hf/config.json and fine-tuning settings.

  Args:
    workdir: a workdir `hf_to_orbax` wrote (its hf/config.json names the model).

  Returns:
    The config.
  """
  with open(os.path.join(workdir, HF_DIR, hf.CONFIG_FILE)) as f:  # the import said what it ignored
    return _finetune_config(hf.config_from_hf(json.load(f), warn=False))


def _finetune_config(cfg: transformer.TransformerConfig) -> ml_collections.ConfigDict:
  c = config_lib.default_config()
  model = dataclasses.asdict(cfg)
  moe = model.pop("moe")
  c.model.update(model)
  if moe is not None:
    c.model.moe = ml_collections.ConfigDict(moe)
  # Tokens come from jaxpipe's own sources: stdlib bytes need a vocabulary of 256 or more.
  c.data.source = "stdlib" if cfg.vocab >= 256 else "synthetic"
  c.data.tokenizer = "hf"  # the checkpoint's own, in WORKDIR/hf (jaxpipe.models.tokenizer)
  c.optimizer.lr = 1e-5  # fine-tuning, not pre-training, rates
  c.optimizer.warmup_steps = 10
  c.train.steps = 100
  return c


def _mesh(pp: int, ep: int):
  """A pp x ep mesh over the first pp·ep devices (dp = 1), for placing one copy of the model."""
  from jaxpipe.training.mesh import make_mesh

  if pp * ep > jax.device_count():
    raise ValueError(
        f"--pp {pp} x --ep {ep} needs {pp * ep} devices, {jax.device_count()} are visible"
    )
  mesh = config_lib.default_config().mesh
  mesh.pp, mesh.ep, mesh.dp = pp, ep, 1
  return make_mesh(mesh, devices=jax.devices()[: pp * ep])


def _param_shardings(cfg: transformer.TransformerConfig, mesh):
  from jaxpipe.training.state import state_shardings

  shapes = jax.eval_shape(lambda k: transformer.init_params(cfg, k), jax.random.key(0))
  return shapes, state_shardings(shapes, mesh)


def hf_to_orbax(src: str, workdir: str, pp: int = 1, ep: int = 1, fp8: str = "none") -> hf.Plan:
  """Writes a training workdir that resumes from the checkpoint in `src` (module docstring).

  For fine-tuning with the FP8 recipe `fp8` (model.fp8). Every refusal comes before any device
  work.

  Args:
    src: a checkpoint directory written by transformers' `save_pretrained`.
    workdir: the training workdir to write; it must hold no checkpoint yet.
    pp: pipeline ranks the weights are loaded over.
    ep: expert ranks the weights are loaded over.
    fp8: the fine-tuning run's FP8 recipe (model.fp8); 'delayed' adds its scales and amax
      histories to checkpoint 0.

  Returns:
    The `hf.Plan` of the source: its config and where each tensor is.

  Raises:
    CheckpointError: a source that does not fit (`hf.check`).
    ValueError: an FP8 recipe the model cannot run, a workdir that already holds checkpoints,
      or more devices asked for than are visible.
  """
  from jaxpipe.training.state import fresh_state, make_optimizer, state_shardings

  plan = hf.check(src)  # every refusal comes before any device work
  config = _finetune_config(plan.cfg)  # what WORKDIR/config.py gives
  config.model.fp8 = fp8
  try:
    config_lib.check_fp8(config.model)
  except ValueError as e:
    raise ValueError(f"--fp8 {fp8}: {e}") from None
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
    raise ValueError(f"{ckpt_dir} already holds checkpoints; convert into a new workdir")
  _copy_files(src, os.path.join(workdir, HF_DIR), weights=False)
  with open(os.path.join(workdir, "config.py"), "w") as f:
    f.write(
        _CONFIG_PY.format(
            src=os.path.abspath(src),
            workdir=os.path.abspath(workdir),
            model_type=plan.hf_config["model_type"],
            fp8=fp8,
            mtp_depth=plan.cfg.mtp_depth,
        )
    )
  with open(
      os.path.join(workdir, "config.json"), "w"
  ) as f:  # as a run writes it (serving reads it)
    f.write(config.to_json_best_effort(indent=2))
  mesh = _mesh(pp, ep)
  cfg = config_lib.model_config(config)
  shapes, shardings = _param_shardings(cfg, mesh)  # hf.load reads the weights' entries only
  _, params = hf.load(plan, shardings)
  optimizer = make_optimizer(config.optimizer, config.train.steps)

  def start(params):
    # delayed: each GEMM's scales start at 1, as `transformer.init_params` sets them
    ones = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), fp8_lib.state_of(shapes))
    return fresh_state(cfg, optimizer, fp8_lib.with_state(params, ones))

  # the params donated: the state takes their buffers rather than a copy beside them
  out = state_shardings(jax.eval_shape(start, params), mesh)
  state = jax.jit(start, out_shardings=out, donate_argnums=0)(params)
  del params
  checkpointer = checkpoint_lib.Checkpointer(ckpt_dir, config.checkpoint.keep, async_save=False)
  checkpointer.save(0, state, force=True)
  checkpointer.wait()
  checkpointer.close()
  return plan


def _copy_files(src: str, dst: str, weights: bool) -> None:
  """Copies the files of `src` (not its weights unless asked) into `dst`."""
  os.makedirs(dst, exist_ok=True)
  for name in sorted(os.listdir(src)):
    path = os.path.join(src, name)
    is_weights = name.endswith(".safetensors") or name == hf.INDEX_FILE
    if os.path.isfile(path) and (weights or not is_weights):
      shutil.copyfile(path, os.path.join(dst, name))


def workdir_model(workdir: str) -> transformer.TransformerConfig:
  """The model a workdir trains: its config.json (a run's or the conversion's), else hf/'s.

  Args:
    workdir: a training or converted workdir.

  Returns:
    The `TransformerConfig`.

  Raises:
    ValueError: the workdir has neither config.json nor hf/config.json.
  """
  if os.path.isfile(os.path.join(workdir, "config.json")):  # written by the trainer
    return config_lib.model_config(run_config(workdir))
  if os.path.isfile(os.path.join(workdir, HF_DIR, hf.CONFIG_FILE)):
    return config_lib.model_config(finetune_config(workdir))
  raise ValueError(
      f"{workdir} has neither config.json (a training run's) nor {HF_DIR}/"
      f"{hf.CONFIG_FILE} (a conversion's); which model it holds is unknown"
  )


def committed_steps(workdir: str) -> list[int]:
  """The committed checkpoint steps of a workdir, oldest first.

  Args:
    workdir: a training or converted workdir.

  Returns:
    The steps; [] without checkpoints.
  """
  ckpt_dir = os.path.join(workdir, "checkpoints")
  names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  return sorted(
      int(n)
      for n in names
      if n.isdigit() and checkpoint_lib.is_committed(os.path.join(ckpt_dir, n))
  )


def restore_params(workdir: str, step: int, cfg: transformer.TransformerConfig, mesh) -> dict:
  """The params of checkpoint `step` (model order) on `mesh`; optimizer moments are not read.

  Unlike `jaxpipe.training.restore.restore_params` (the newest readable step, checked against
  the whole TrainState's metadata, on one device), this reads a given step, needs no optimizer
  config and splits the model over pp and ep, as an export of a model too large for one device
  must. Both read the params alone (`Checkpointer.restore_part`).

  Args:
    workdir: the workdir whose checkpoints/ holds the step.
    step: the checkpoint's step.
    cfg: the model the checkpoint holds.
    mesh: a pp x ep mesh the params are split over.

  Returns:
    The params tree, sharded over `mesh`.
  """
  shapes, shardings = _param_shardings(cfg, mesh)
  abstract = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )
  checkpointer = checkpoint_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"), keep=1, async_save=False, read_only=True
  )
  try:
    return checkpointer.restore_part(step, "params", abstract)
  finally:
    checkpointer.close()


def orbax_to_hf(
    workdir: str,
    dst: str,
    step: int | None = None,
    dtype: str | None = None,
    pp: int = 1,
    ep: int = 1,
) -> dict:
  """Writes checkpoint `step` (default the newest) of `workdir` as a transformers directory.

  The files of WORKDIR/hf/ go beside the weights.

  Args:
    workdir: a training or converted workdir.
    dst: the transformers directory to write.
    step: the committed checkpoint to export; None: the newest.
    dtype: of the written weights ('float32', 'bfloat16', 'float16'); None: the source's
      (else float32).
    pp: pipeline ranks the params are restored over.
    ep: expert ranks the params are restored over.

  Returns:
    The config.json written.

  Raises:
    ValueError: a workdir without a model config or committed checkpoint, a `step` that is not
      a committed one, a model no supported architecture computes, or more devices asked for
      than are visible.
  """
  cfg = workdir_model(workdir)
  base_path = os.path.join(workdir, HF_DIR, hf.CONFIG_FILE)
  base = None
  if os.path.isfile(base_path):
    with open(base_path) as f:
      base = json.load(f)
  hf.config_to_hf(cfg, base)  # refuses a model no supported architecture computes, early
  steps = committed_steps(workdir)
  if not steps:
    raise ValueError(f"{workdir}/checkpoints holds no committed checkpoint")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"--step {step}: not a committed checkpoint of {workdir}; have {steps}")
  params = restore_params(workdir, step, cfg, _mesh(pp, ep))
  if os.path.isdir(os.path.join(workdir, HF_DIR)):
    _copy_files(os.path.join(workdir, HF_DIR), dst, weights=False)
  return hf.save(cfg, params, dst, hf_config=base, dtype=dtype)
