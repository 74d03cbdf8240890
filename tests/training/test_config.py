"""Config validation: each bad value fails before device work, naming the value and the fix."""

import dataclasses
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import quickstart, tiny
from jaxpipe.models.moe import MoEConfig
from jaxpipe.pipeline import SCHEDULE_NAMES, make_schedule
from jaxpipe.training import config as config_lib
from jaxpipe.training.config import ConfigError, validate
from tests import helpers

ROOT = helpers.ROOT


def _cfg(**overrides):
  c = tiny.get_config()
  for dotted, value in overrides.items():
    section, key = dotted.split("__")
    c[section][key] = value
  return c


def test_defaults_and_examples_validate():
  assert validate(quickstart.get_config(), 8) == {"pp": 1, "dp": 8, "ep": 1, "cp": 1, "tp": 1}
  assert validate(tiny.get_config(), 1)["dp"] == 1
  assert validate(_cfg(mesh__pp=2, mesh__ep=2), 8) == {"pp": 2, "dp": 2, "ep": 2, "cp": 1, "tp": 1}


@pytest.mark.parametrize(
    "overrides, devices, needle",
    [
        # mesh product != device count
        (
            dict(mesh__dp=3),
            8,
            "mesh pp=1 x dp=3 x ep=1 x cp=1 x tp=1 = 3 devices, but 8 are available",
        ),
        (dict(mesh__pp=3), 8, "does not divide the 8 available"),
        (dict(mesh__tp=8), 8, "model.n_heads=4 does not split over mesh.tp=8"),
        # layers not divisible by the schedule's model stages (its own count, not pp x chunks)
        (
            dict(mesh__pp=4),
            8,
            "model.n_layers=2 does not split into the 4 model stages of schedule "
            "'1f1b' (one per rank on mesh.pp=4 ranks)",
        ),
        (
            dict(mesh__pp=2, pipeline__schedule="interleaved-1f1b", pipeline__microbatches=2),
            8,
            "model.n_layers=2 does not split into the 4 model stages of schedule "
            "'interleaved-1f1b' (mesh.pp=2 ranks x 2 chunks per rank)",
        ),
        (
            dict(
                mesh__pp=2,
                pipeline__schedule="interleaved-1f1b",
                pipeline__chunks=3,
                pipeline__microbatches=2,
                model__n_layers=4,
            ),
            8,
            "the 6 model stages",
        ),
        (
            dict(mesh__pp=2, pipeline__schedule="zb-v"),
            8,
            "model.n_layers=2 does not split into the 4 model stages of schedule 'zb-v' (2 per "
            "rank on mesh.pp=2 ranks, in a V: each rank's layers split into two equal chunks, so "
            "each rank needs an even number of them)",
        ),
        (
            dict(
                mesh__pp=2,
                pipeline__schedule="dualpipev",
                model__n_layers=6,
                pipeline__microbatches=4,
                data__batch=32,
            ),
            8,
            "model.n_layers=6 does not split into the 4 model stages of "
            "schedule 'dualpipev' (2 per rank on mesh.pp=2 ranks, in a V",
        ),
        (
            dict(
                mesh__pp=2,
                pipeline__schedule="chimera",
                model__n_layers=3,
                pipeline__microbatches=2,
            ),
            8,
            "model.n_layers=3 does not split into the 2 model stages of schedule 'chimera' (one "
            "per rank on mesh.pp=2 ranks, each stage held twice",
        ),
        (
            dict(
                mesh__pp=4,
                mesh__dp=2,
                pipeline__schedule="dualpipe",
                model__n_layers=6,
                pipeline__microbatches=8,
            ),
            8,
            "the 4 model stages of schedule 'dualpipe'",
        ),
        # micro-batch counts (and chunks) the schedule forbids: the generator's own message
        (
            dict(mesh__pp=2, pipeline__schedule="dualpipe", pipeline__microbatches=2),
            8,
            "pipeline.schedule='dualpipe' cannot run mesh.pp=2 with pipeline.microbatches=2: "
            "dualpipe needs an even number of micro-batches of at least 2*pp = 4, got "
            "microbatches=2",
        ),
        (
            dict(
                mesh__pp=2,
                pipeline__schedule="dualpipe",
                pipeline__microbatches=5,
                data__batch=20,
                mesh__dp=4,
            ),
            8,
            "dualpipe needs an even number of micro-batches",
        ),
        (
            dict(mesh__pp=2, pipeline__schedule="dualpipev", pipeline__microbatches=2),
            8,
            "dualpipev needs at least 2*pp = 4 micro-batches, got microbatches=2",
        ),
        (
            dict(mesh__pp=2, pipeline__schedule="chimera", pipeline__microbatches=1),
            8,
            "chimera splits micro-batches evenly between its down and up pipelines",
        ),
        (
            dict(mesh__pp=2, pipeline__chunks=2),
            8,
            "pipeline.schedule='1f1b' cannot run mesh.pp=2 with "
            "pipeline.microbatches=1, pipeline.chunks=2: 1f1b runs one chunk per rank",
        ),
        # heads not divisible by kv heads, or by the context axis
        (dict(model__n_kv_heads=3), 8, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
        (
            dict(model__n_heads=6, model__n_kv_heads=3, mesh__cp=2),
            8,
            "model.n_kv_heads=3 is not divisible by mesh.cp=2",
        ),
        (
            dict(model__n_heads=2, model__n_kv_heads=2, mesh__cp=4),
            8,
            "model.n_heads=2 is not divisible by mesh.cp=4",
        ),
        # batch not divisible by data x micro-batches
        (dict(data__batch=12), 8, "data.batch=12 is not divisible by data-parallel ranks"),
        (
            dict(pipeline__microbatches=4),
            8,
            "(mesh.dp x mesh.ep = 8 x 1) x pipeline.microbatches=4 = 32",
        ),
        (
            dict(mesh__ep=2, data__batch=8, pipeline__microbatches=2),
            8,
            "= 4 x 2) x pipeline.microbatches=2",
        ),
        # unknown schedule
        (
            dict(pipeline__schedule="1f1b-interleaved"),
            8,
            "pipeline.schedule='1f1b-interleaved' is unknown",
        ),
        (
            dict(pipeline__schedule="missing.csv"),
            8,
            "pipeline.schedule='missing.csv': no such file",
        ),
        # negative / zero sizes
        (dict(model__d_model=0), 8, "model.d_model=0 must be a positive integer"),
        (dict(model__n_layers=-2), 8, "model.n_layers=-2 must be a positive integer"),
        (dict(data__seq_len=0), 8, "data.seq_len=0 must be a positive integer"),
        (dict(pipeline__microbatches=0), 8, "pipeline.microbatches=0 must be a positive integer"),
        (dict(mesh__ep=0), 8, "mesh.ep=0 must be a positive integer"),
        (dict(mesh__dp=-8), 8, "mesh.dp=-8 must be a positive integer"),
        (dict(train__steps=0), 8, "train.steps=0 must be a positive integer"),
        (dict(optimizer__lr=-1e-3), 8, "optimizer.lr=-0.001 must be >= 0"),
        # other values the run cannot use
        (dict(model__head_dim=7), 8, "model.head_dim=7 must be even"),
        (dict(model__dtype="fp8"), 8, "model.dtype='fp8' is unknown"),
        (dict(data__source="c4"), 8, "data.source='c4' is unknown"),
        (dict(data__source="stdlib"), 8, "model.vocab=64 cannot hold the byte-level stdlib corpus"),
        (dict(data__seq_len=9, mesh__cp=2), 8, "data.seq_len=9 is not divisible by mesh.cp=2"),
        # the model families' fields
        (dict(model__activation="relu"), 8, "model: activation='relu' is unknown"),
        (
            dict(model__layer_types=("sliding", "full")),
            8,
            "model: layer_types names sliding layers but sliding_window=0",
        ),
        (
            dict(model__sliding_window=4, model__layer_types=("sliding",)),
            8,
            "model: layer_types=('sliding',) must name each of the 2 layers",
        ),
        (dict(model__rope_fraction=1.5), 8, "model: rope_fraction=1.5 must lie in (0, 1]"),
        (
            dict(model__rope_scaling=dict(type="yarn", factor=4.0)),
            8,
            "model: rope type 'yarn' needs original_max_position",
        ),
        (dict(model__attn_softcap=-1.0), 8, "model: attn_softcap=-1.0 must be >= 0"),
    ],
)
def test_bad_values_raise_clear_errors(overrides, devices, needle):
  with pytest.raises(ConfigError) as e:
    validate(_cfg(**overrides), devices)
  assert needle in str(e.value)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_name_is_accepted(name):
  validate(_cfg(pipeline__schedule=name), 8)


def test_schedules_with_their_own_stage_counts_are_accepted():
  # p model stages held twice (chimera, dualpipe) and 2p in a V (zb-v, dualpipev)
  validate(_cfg(mesh__pp=2, pipeline__schedule="dualpipe", pipeline__microbatches=4), 8)
  validate(_cfg(mesh__pp=2, pipeline__schedule="chimera", pipeline__microbatches=2), 8)
  validate(_cfg(mesh__pp=2, pipeline__schedule="zb-v", model__n_layers=4), 8)
  validate(
      _cfg(
          mesh__pp=2,
          pipeline__schedule="dualpipev",
          model__n_layers=8,
          pipeline__microbatches=4,
          data__batch=32,
      ),
      8,
  )


def _moe_cfg(**overrides):
  c = _cfg(**overrides)
  c.model.moe = ml_collections.ConfigDict(dataclasses.asdict(MoEConfig(every=2)))
  return c


def test_moe_layer_groups_must_split_into_the_stages():
  # 4 layers are 2 groups of (dense, MoE): two 1f1b stages hold one each, four zb-v stages cannot
  validate(_moe_cfg(mesh__pp=2, model__n_layers=4), 8)
  with pytest.raises(
      ConfigError,
      match=r"model.n_layers=4 \(2 groups of model.moe.every=2 "
      r"layers\) does not split into the 4 model stages of schedule 'zb-v'.* use "
      "a multiple of 8 layers",
  ):
    validate(_moe_cfg(mesh__pp=2, model__n_layers=4, pipeline__schedule="zb-v"), 8)
  with pytest.raises(ConfigError, match="model.n_layers=3 is not a multiple of model.moe.every=2"):
    validate(_moe_cfg(model__n_layers=3), 8)


def _csv(tmp_path, name, pp, microbatches):
  path = tmp_path / f"{name}.csv"
  path.write_text(make_schedule(name, pp=pp, microbatches=microbatches).to_csv())
  return str(path)


def test_schedule_csv_path_is_loaded_and_checked_against_the_mesh(tmp_path):
  path = _csv(tmp_path, "1f1b", 2, 2)
  validate(_cfg(pipeline__schedule=path, mesh__pp=2, pipeline__microbatches=2), 8)
  for overrides, needle in [
      (
          dict(mesh__pp=4, pipeline__microbatches=2),
          f"pipeline.schedule={path!r} has 2 ranks but mesh.pp=4; set --config.mesh.pp=2",
      ),
      (dict(mesh__pp=1, pipeline__microbatches=2), "has 2 ranks but mesh.pp=1"),
      (
          dict(mesh__pp=2, pipeline__microbatches=4),
          "runs 2 micro-batches but "
          "pipeline.microbatches=4; set --config.pipeline.microbatches=2",
      ),
      (
          dict(mesh__pp=2, pipeline__microbatches=2, pipeline__chunks=2),
          "places 1 chunk on each rank but pipeline.chunks=2",
      ),
  ]:
    with pytest.raises(ConfigError) as e:
      validate(_cfg(pipeline__schedule=path, **overrides), 8)
    assert needle in str(e.value)
  # a V-shaped file: 4 model stages on 2 ranks, so 2 layers do not split
  zbv = _csv(tmp_path, "zb-v", 2, 2)
  with pytest.raises(ConfigError, match="model.n_layers=2 does not split into the 4 model stages"):
    validate(_cfg(pipeline__schedule=zbv, mesh__pp=2, pipeline__microbatches=2), 8)
  bad = tmp_path / "bad.csv"
  bad.write_text("0F0,1F0\n")  # two stages on one rank, no backward
  with pytest.raises(ConfigError, match=f"pipeline.schedule={str(bad)!r} is not a valid schedule"):
    validate(_cfg(pipeline__schedule=str(bad)), 8)


def test_trainer_validates_before_device_work():
  from jaxpipe.training.trainer import Trainer

  with pytest.raises(ConfigError, match="model.n_heads=4 is not divisible by model.n_kv_heads=3"):
    Trainer(_cfg(model__n_kv_heads=3))


def test_config_is_locked_and_names_the_closest_key():
  c = tiny.get_config()
  with pytest.raises(AttributeError, match='Did you mean "d_model"'):
    c.model.d_modle = 3


def test_model_section_is_the_model_dataclass():
  c = _cfg(model__d_model=48, model__tied_embeddings=False)
  m = config_lib.model_config(c)
  assert m.d_model == 48 and not m.tied_embeddings and m.vocab == 64


def test_gin_bindings_override_sections(tmp_path):
  gin_file = tmp_path / "sweep.gin"
  gin_file.write_text("model.d_model = 64\noptimizer.lr = 0.02\n")
  c = config_lib.apply_gin(
      tiny.get_config(), [str(gin_file)], ["mesh.dp = 4", "optimizer.lr = 0.05"]
  )
  assert (c.model.d_model, c.optimizer.lr, c.mesh.dp) == (64, 0.05, 4)


@pytest.mark.parametrize(
    "binding, needle",
    [
        ("model.d_modle = 3", "no such field; did you mean model.d_model?"),
        ("modl.d_model = 3", "No configurable matching 'modl'"),
        ("model.d_model = 'x'", "gin binding model.d_model = 'x'"),
        ("include 'missing.gin'", "gin: "),
    ],
)
def test_bad_gin_bindings_raise_clear_errors(binding, needle):
  with pytest.raises(ConfigError) as e:
    config_lib.apply_gin(tiny.get_config(), [], [binding])
  assert needle in str(e.value)


def test_cli_misspelt_override_names_the_closest_key():
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "jaxpipe.train",
          "--config",
          "configs/tiny.py",
          "--config.model.d_modle=3",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 2
  assert r.stderr == (
      'error: --config.model.d_modle: no such config field; Did you mean "d_model" '
      'instead of "d_modle"?\n'
  )  # one line, the override named, quotes intact


@pytest.mark.parametrize(
    "gin_file", sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".gin"))
)
def test_example_gin_files_apply_to_the_quickstart(gin_file):
  c = config_lib.apply_gin(quickstart.get_config(), [os.path.join(ROOT, "configs", gin_file)])
  assert c.to_dict() != quickstart.get_config().to_dict()
  validate(c, 8)
