"""The training bench: the plain step equals the Trainer's, the table and samples it promises, a
MaxText run (a stand-in package with MaxText's log format) alternated and parsed, bad inputs."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from configs import tiny
from experiments import train_bench
from jaxpipe.runtime import cli
from jaxpipe.training import batches as data_lib
from jaxpipe.training.trainer import Trainer
from tests import helpers

# MaxText's own per-step lines: docs/guides/monitoring_and_debugging/understand_logs_and_metrics.md
# (older format), and src/maxtext/common/metric_logger.py's current one (lm_loss, perplexity),
# a rampup-phase line (no throughput) and a profiler-boundary line, as max_logging prints them.
MAXTEXT_LOG = """\
Updating keys from env and command line: ['run_name', 'model_name', 'steps']
completed step: 0, seconds: 44.923, TFLOP/s/device: 17.022, Tokens/s/device: 1094.129, total_weights: 196608, loss: 12.038
completed step: 1, seconds: 0.319, TFLOP/s/device: 2400.734, Tokens/s/device: 154316.608, total_weights: 196608, loss: 12.038
I0101 00:00:00.000 140 metric_logger.py:190] completed step: 2, seconds: 5.658, TFLOP/s/device: 135.158, Tokens/s/device: 8687.815, total_weights: 196608, loss: 11.689, lm_loss: 11.689, perplexity: 119000.123
[Rampup Batch Size Phase] completed step: 3, seconds: 5.402, total_weights: 98304, loss: 11.379, lm_loss: 11.379, perplexity: 87000.000
completed profiler activation/deactivation step: 4, total_weights: 196608, loss: 11.110, lm_loss: 11.110, perplexity: 66000.000
completed step: 5, seconds: 5.668, TFLOP/s/device: 134.909, Tokens/s/device: 8671.794, total_weights: 196608, loss: 10.879
"""  # noqa: E501

# maxtext 0.2.5 on the quickstart shape (CPU, 8 host devices) through experiments/maxtext_run.py,
# as it printed them on 2026-12-02: MaxText's lines, each followed by the runner's.
MAXTEXT_RUN_LOG = """train_bench parameters: 820352
I1202 11:26:32.956883 140642008181632 metric_logger.py:425] number parameters: 0.001 billion
I1202 11:26:41.251433 140642008181632 metric_logger.py:265] completed step: 3, seconds: 1.630, TFLOP/s/device: 0.002, Tokens/s/device: 314.168, total_weights: 4096, loss: 70.472, lm_loss: 70.472, perplexity: 4033914660670423879059375128576.000
train_bench cpu: step 3, process_time: 22.7426, minor_faults: 1000000
I1202 11:26:43.685493 140642008181632 metric_logger.py:265] completed step: 4, seconds: 1.518, TFLOP/s/device: 0.002, Tokens/s/device: 337.336, total_weights: 4096, loss: 66.616, lm_loss: 66.616, perplexity: 85293702251123630256081076224.000
train_bench cpu: step 4, process_time: 23.7618, minor_faults: 1070000
I1202 11:26:45.941195 140642008181632 metric_logger.py:265] completed step: 5, seconds: 1.596, TFLOP/s/device: 0.002, Tokens/s/device: 320.846, total_weights: 4096, loss: 61.251, lm_loss: 61.251, perplexity: 398838529357200112253665280.000
train_bench cpu: step 5, process_time: 24.7146
"""  # noqa: E501

# A stand-in for MaxText's package (maxtext 0.2.5's layout): configs/base.yml, utils/max_logging
# and utils/max_utils, and a train module that records its arguments, counts the parameters of
# the shape it is given and logs them as MaxText does, then logs `steps` lines as MaxText's
# metric_logger does (absl, through max_logging.log), each taking 0.25 s and burning 0.05 s of CPU.
FAKE_MAX_LOGGING = textwrap.dedent("""\
    from absl import logging
    def log(user_str):
      logging.info(user_str, stacklevel=2)
""")
FAKE_MAX_UTILS = textwrap.dedent("""\
    def calculate_num_params_from_pytree(params):
      return sum(params.values())
""")
FAKE_TRAIN = textwrap.dedent("""\
    import json, os, time
    from absl import app
    from maxtext.utils import max_logging, max_utils
    def main(argv):
      args = dict(a.split("=", 1) for a in argv[2:])
      with open(os.environ["FAKE_MAXTEXT_ARGS"], "a") as f:
        f.write(json.dumps([argv[1], args]) + "\\n")
      d, heads, kv, k, ff, layers, vocab = (int(args[n]) for n in (
          "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim", "base_mlp_dim",
          "base_num_decoder_layers", "vocab_size"))
      params = {"embedding": vocab * d, "final_norm": d,
                "layers": layers * (2 * d * heads * k + 2 * d * kv * k + 3 * d * ff + 2 * d)}
      n = max_utils.calculate_num_params_from_pytree(params)
      max_logging.log(f"number parameters: {n/1e9:.3f} billion")
      for s in range(int(args["steps"])):
        t = time.process_time()
        while time.process_time() - t < 0.05:
          pass
        max_logging.log(f"completed step: {s}, seconds: 0.250, TFLOP/s/device: 0.010, "
                        f"Tokens/s/device: 2048.000, total_weights: 4096, loss: 4.000, "
                        f"lm_loss: 4.000, perplexity: 54.598")
    if __name__ == "__main__":
      app.run(main)
""")


def tiny_config():
  c = tiny.get_config()
  c.train.steps = 30
  return c


@pytest.mark.parametrize("scan", [False, True])
def test_plain_step_equals_trainer_step(scan):
  """Two steps from the same parameters on the same batches: loss and gradient norm of each
  equal the Trainer's (the second after an AdamW update with the clipped gradient), as do the
  parameters after them; tiny's synthetic rows carry padding, so the mask counts."""
  config = tiny_config()
  trainer = Trainer(config)
  trainer.init()
  source = data_lib.make_source(config.data, config.model.vocab)
  plain = train_bench.PlainStep(config, scan=scan)
  for i in range(2):
    host = source.batch("train", i, config.data.batch, config.data.seq_len)
    assert host["mask"].min() == 0  # padded rows
    want = trainer.step(host)
    got = plain.step(plain.put(host))
    helpers.close(got["loss"], want["loss"], f"loss at step {i}")
    helpers.close(got["grad_norm"], want["grad_norm"], f"grad norm at step {i}")
  for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(plain.state[0]), jax.tree.leaves(trainer.state.params)
  ):
    helpers.close(np.asarray(a), np.asarray(b), str(path))


def test_plain_step_refuses_a_model_it_does_not_write():
  config = tiny_config()
  config.model.qk_norm = True
  with pytest.raises(train_bench.app.UsageError, match="qk_norm"):
    train_bench.PlainStep(config)


def test_parse_maxtext_log():
  steps = train_bench.parse_maxtext_log(MAXTEXT_LOG)
  assert [s["step"] for s in steps] == [0, 1, 2, 5]
  assert steps[2] == {
      "step": 2,
      "seconds": 5.658,
      "tflops_per_device": 135.158,
      "tokens_per_device": 8687.815,
      "total_weights": 196608.0,
      "loss": 11.689,
  }
  assert steps[-1]["seconds"] == 5.668 and steps[-1]["loss"] == 10.879
  assert train_bench.parse_maxtext_log("no steps here\n") == []


def test_parse_maxtext_run_log():
  """The real MaxText's lines with the runner's: seconds, CPU seconds since the previous step
  (none for the first logged), the exact parameter count."""
  steps = train_bench.parse_maxtext_log(MAXTEXT_RUN_LOG)
  assert [(s["step"], s["seconds"], s["total_weights"]) for s in steps] == [
      (3, 1.630, 4096.0),
      (4, 1.518, 4096.0),
      (5, 1.596, 4096.0),
  ]
  cpu = train_bench.parse_maxtext_cpu(MAXTEXT_RUN_LOG)
  assert list(cpu) == [4, 5]
  assert cpu[4][0] == pytest.approx(1.0192) and cpu[5][0] == pytest.approx(0.9528)
  assert cpu[4][1] == 70_000 and cpu[5][1] is None  # step 5's line lacks the faults
  assert train_bench.parse_maxtext_params(MAXTEXT_RUN_LOG) == 820352
  assert train_bench.parse_maxtext_params("number parameters: 0.001 billion") is None


@pytest.fixture
def fake_maxtext(tmp_path, monkeypatch):
  """A `maxtext` package on PYTHONPATH; -> the file its train module appends its arguments to."""
  pkg = tmp_path / "site" / "maxtext"
  (pkg / "configs").mkdir(parents=True)
  (pkg / "utils").mkdir(parents=True)
  (pkg / "trainers" / "pre_train").mkdir(parents=True)
  for d in (pkg, pkg / "utils", pkg / "trainers", pkg / "trainers" / "pre_train"):
    (d / "__init__.py").write_text("")
  (pkg / "configs" / "base.yml").write_text("steps: 1\n")
  (pkg / "utils" / "max_logging.py").write_text(FAKE_MAX_LOGGING)
  (pkg / "utils" / "max_utils.py").write_text(FAKE_MAX_UTILS)
  (pkg / "trainers" / "pre_train" / "train.py").write_text(FAKE_TRAIN)
  record = tmp_path / "maxtext_args.jsonl"
  path = os.pathsep.join([str(tmp_path / "site"), helpers.ROOT, os.environ.get("PYTHONPATH", "")])
  monkeypatch.setenv("PYTHONPATH", path)
  monkeypatch.setenv("FAKE_MAXTEXT_ARGS", str(record))
  return record


def test_bench_table_samples_and_maxtext(tmp_path, capsys, fake_maxtext):
  """Every contender (plain, plain with scanned layers, pp = 1, pp = 2 1F1B, MaxText, the
  matmul) in every round in a
  rotated order, one sample per step; the table has one row per contender and the promised
  columns; the plain step's ratios are 1; MaxText's step time is the one its log gives."""
  out = tmp_path / "bench.json"
  args = [
      "--config",
      os.path.join(helpers.ROOT, "configs", "tiny.py"),
      "--batch=16",
      "--pp=2",
      "--schedules=1f1b",
      "--microbatches=2",
      "--rounds=2",
      "--steps=2",
      "--warmup=1",
      f"--peer_python={sys.executable}",
      f"--out={out}",
  ]
  assert cli.call(train_bench.main, train_bench.FLAGS, args) is None
  names = [
      train_bench.PLAIN,
      train_bench.PLAIN_SCAN,
      "jaxpipe pp=1",
      "jaxpipe pp=2 1f1b",
      train_bench.MAXTEXT,
      f"{train_bench.MATMUL} float32 xla",
  ]
  got = json.loads(out.read_text())
  assert got["order"] == [names, names[1:] + names[:1]]
  for name in names:
    assert len(got["samples"][name]) == 2 and all(len(r) == 2 for r in got["samples"][name])
  assert all(s[1] > 0 and s[2] >= 0 for r in got["samples"][train_bench.MAXTEXT] for s in r)
  assert len(got["load"]) == 2

  rows = {r["name"]: r for r in got["rows"]}
  assert list(rows) == names[:-1]
  assert rows[train_bench.PLAIN]["wall_ratio"] == [1.0, 1.0]
  assert rows[train_bench.PLAIN]["cpu_ratio"] == [1.0, 1.0]
  maxtext = rows[train_bench.MAXTEXT]
  assert maxtext["ms_per_step"] == pytest.approx(250.0)
  assert 0.04 < maxtext["cpu_s_per_step"] < 0.5 and len(maxtext["cpu_ratio"]) == 2
  assert maxtext["faults_per_step"] >= 0
  assert maxtext["parameters"] == train_bench.parameter_count(tiny_config())
  for name in names[:4]:
    r = rows[name]
    assert r["temp_bytes"] > 0 and r["hlo_instructions"] > 0 and 0 < r["mfu_percent"] < 100
    assert r["faults_per_step"] >= 0 and all(s[2] >= 0 for rd in got["samples"][name] for s in rd)
    walls = [np.mean([s[0] for s in rd]) for rd in got["samples"][name]]
    assert r["tokens_per_s"] == pytest.approx(np.median([16 * 16 / w for w in walls]))

  printed = capsys.readouterr().out.splitlines()
  header = printed.index("| " + " | ".join(train_bench.COLUMNS) + " |")
  table = printed[header + 2 : header + 2 + len(names) - 1]
  assert [line.split(" | ")[0].lstrip("| ") for line in table] == names[:-1]
  assert all(line.count("|") == len(train_bench.COLUMNS) + 1 for line in table)
  n = train_bench.parameter_count(tiny_config())
  assert f"parameters: jaxpipe {n:,}, MaxText {n:,}" in printed
  assert any(line.startswith("peak float32 (the reference GEMMs' fastest): ") for line in printed)

  runs = [json.loads(line) for line in fake_maxtext.read_text().splitlines()]
  assert len(runs) == 2  # one MaxText run per round, none for the warm-up
  base, keys = runs[0]
  assert base.endswith(os.path.join("maxtext", "configs", "base.yml"))
  want = {
      "hardware": "cpu",
      "skip_jax_distributed_system": "true",
      "dataset_type": "synthetic",
      "steps": "5",  # 3 untimed (MAXTEXT_MIN_WARMUP, above --warmup=1), then the 2 timed
      "per_device_batch_size": "2",
      "max_target_length": "16",
      "base_emb_dim": "32",
      "base_num_query_heads": "4",
      "base_num_kv_heads": "2",
      "head_dim": "8",
      "base_mlp_dim": "64",
      "base_num_decoder_layers": "2",
      "vocab_size": "64",
      "logits_via_embedding": "true",
      "normalize_embedding_logits": "false",
      "rope_interleave": "false",
      "learning_rate_final_fraction": "0.1",
  }
  assert {k: keys.get(k) for k in want} == want


def _run(*flags):
  return subprocess.run(
      [sys.executable, "-m", "experiments.train_bench", *flags],
      capture_output=True,
      text=True,
      cwd=helpers.ROOT,
      timeout=120,
      check=False,
  )


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--peer_python=/nonexistent/python"], "not an executable file"),
        ([f"--peer_python={sys.executable}"], "not a Python with MaxText importable"),
        (["--peer_python=/bin/true"], "not a Python with MaxText importable"),
        (["--pp=two"], "--pp two"),
        (["--microbatches=8,0"], "--microbatches [8, 0]"),
        (["--rounds=0"], "--rounds=0"),
        (["--matmul_tokens=-1"], "--matmul_tokens=-1 must be 0"),
        (["--steps=x"], "steps"),
        (["--matmuls=xla,mkl"], "train.matmul='mkl' is unknown"),
        (["--dtypes=float8"], "model.dtype='float8' is unknown"),
        (["--shape=gpt5"], "shape"),
    ],
)
def test_bad_flags_are_one_line(flags, words):
  r = _run(*flags)
  assert r.returncode == cli.USAGE, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.stderr
  assert r.stdout == ""


def test_faults_per_step_are_the_median_over_rounds_of_the_mean_per_step():
  """Page faults per step: each round's mean over its steps, the median over rounds; a step that
  fills a fresh 64 MiB array (mapped afresh by glibc: over its 32 MB ceiling) faults."""
  contenders = [
      train_bench.Contender(train_bench.PLAIN, None, 1.0, 1),
      train_bench.Contender("other", None, 1.0, 1),
      train_bench.Contender("matmul", None, 1.0, 0, {"reference": True, "dtype": "float32"}),
  ]
  one = lambda faults: [[[1.0, 1.0, f] for f in faults]]
  samples = {
      train_bench.PLAIN: one([10, 30]) + one([0, 0]) + one([5, 5]),
      "other": one([100, 300]) + one([50, 50]) + one([0, 0]),
      "matmul": one([0, 0]) * 3,
  }
  rows = train_bench.summarise(contenders, {"samples": samples})
  assert [r["faults_per_step"] for r in rows] == [5, 50]
  ((wall, cpu, faults),) = train_bench.timed(lambda: np.ones(1 << 24, np.float32))(1)
  assert wall > 0 and cpu >= 0 and faults > 0


def test_shape_sets_the_models_sizes_and_keeps_the_rest():
  from configs import quickstart
  from experiments.shapes import SHAPES
  from jaxpipe.training.config import model_config

  c = quickstart.get_config()
  seq, unroll = c.data.seq_len, c.model.unroll_layers
  train_bench.with_shape(c, SHAPES["smollm2-135m"])
  got = model_config(c)
  for name in train_bench.SHAPE_FIELDS:
    assert getattr(got, name) == getattr(SHAPES["smollm2-135m"], name), name
  assert (got.d_model, got.n_layers, got.vocab) == (576, 30, 49152)
  assert c.data.seq_len == seq and c.model.unroll_layers == unroll


def test_mfu_is_against_the_fastest_reference_of_the_contenders_dtype_in_each_round():
  """A dtype's peak in a round is its fastest reference GEMM's FLOPs per CPU second (another
  dtype's faster one does not count); MFU is the median over rounds of each round's ratio."""
  ref = lambda name, dtype, flops: train_bench.Contender(
      name, None, flops, 0, {"reference": True, "dtype": dtype}
  )
  contenders = [
      train_bench.Contender(train_bench.PLAIN, None, 10.0, 1, {"dtype": "float32"}),
      train_bench.Contender("half", None, 10.0, 1, {"dtype": "bfloat16"}),
      train_bench.Contender("unmatched", None, 10.0, 1, {"dtype": "float16"}),
      ref("matmul float32 xla", "float32", 100.0),
      ref("matmul float32 onednn", "float32", 100.0),
      ref("matmul bfloat16 onednn", "bfloat16", 400.0),
  ]
  rounds = lambda *cpu: [[[c, c, 0]] for c in cpu]  # one step a round: (wall, CPU s, faults)
  samples = {
      train_bench.PLAIN: rounds(1.0, 1.0, 1.0),  # 10 FLOP/s
      "half": rounds(0.5, 0.5, 0.5),  # 20 FLOP/s
      "unmatched": rounds(1.0, 1.0, 1.0),
      "matmul float32 xla": rounds(2.0, 5.0, 4.0),  # 50, 20, 25 FLOP/s
      "matmul float32 onednn": rounds(4.0, 2.5, 5.0),  # 25, 40, 20
      "matmul bfloat16 onednn": rounds(2.0, 2.0, 4.0),  # 200, 200, 100
  }
  peak = train_bench.peaks(contenders, {"samples": samples})
  assert peak == {"float32": [50.0, 40.0, 25.0], "bfloat16": [200.0, 200.0, 100.0]}
  rows = {r["name"]: r for r in train_bench.summarise(contenders, {"samples": samples})}
  assert list(rows) == [train_bench.PLAIN, "half", "unmatched"]
  assert rows[train_bench.PLAIN]["mfu_percent"] == pytest.approx(25.0)  # 20, 25, 40
  assert rows["half"]["mfu_percent"] == pytest.approx(10.0)  # 10, 10, 20
  assert rows["unmatched"]["mfu_percent"] is None
