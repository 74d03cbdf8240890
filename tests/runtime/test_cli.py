"""jaxpipe.runtime.cli: the runners' command lines, in this process and as programs."""

import subprocess
import sys

from absl import flags
from ml_collections import config_flags

from jaxpipe.runtime import cli
from tests import helpers


def _config_runner() -> flags.FlagValues:
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Config file.", flag_values=values)
  flags.DEFINE_integer("repeats", 5, "Rounds.", flag_values=values)
  return values


def test_parse_takes_config_overrides_and_forgets_them_next_time():
  values = _config_runner()
  tiny = f"{helpers.ROOT}/configs/tiny.py"
  rest = cli.parse(values, ["runner", "--config", tiny, "--config.model.n_layers=3", "--repeats=2"])
  assert rest == ["runner"]
  assert (values.config.model.n_layers, values.repeats) == (3, 2)
  cli.parse(values, ["runner", "--config", tiny])
  assert (values.config.model.n_layers, values.repeats) == (2, 5)  # tiny's own, the default


def test_call_runs_main_with_overrides_and_refuses_a_bad_flag_in_one_line(capsys):
  values = _config_runner()
  seen = []
  main = lambda argv: seen.append((argv, values.config.model.d_model)) or 0
  tiny = f"{helpers.ROOT}/configs/tiny.py"
  assert cli.call(main, values, ["--config", tiny, "--config.model.d_model=48", "extra"]) == 0
  assert seen == [(["main", "extra"], 48)]
  assert cli.call(main, values, ["--config", tiny, "--repeat=2"]) == cli.USAGE
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "error: Unknown command line flag 'repeat'" in err, err
  assert len(seen) == 1


def test_launch_refuses_absl_log_dir_for_the_ranks_logs(tmp_path):
  r = subprocess.run(
      [sys.executable, "-m", "jaxpipe.launch", "--processes", "1", "--log_dir", str(tmp_path)]
      + ["--", sys.executable, "-c", "pass"],
      capture_output=True,
      text=True,
      cwd=helpers.ROOT,
      timeout=120,
  )
  assert r.returncode == cli.USAGE, r.stderr
  assert r.stderr.strip().splitlines() == [
      "error: --log_dir is absl's log directory; the ranks' logs go to --rank_log_dir"
  ]
  assert list(tmp_path.iterdir()) == []
