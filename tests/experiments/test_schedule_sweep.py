"""The sweep runner: every schedule present, every figure checked against anchors.md."""

from experiments import schedule_sweep
from jaxpipe.pipeline import SCHEDULE_NAMES
from jaxpipe.runtime import cli


def test_sweep_table_has_every_schedule_and_no_mismatch(capsys):
  assert cli.call(schedule_sweep.main, schedule_sweep.FLAGS, ["--no_files"]) is None
  out = capsys.readouterr().out
  first = out.split("\n\n")[0]  # the nine schedules; the ZB-V comparison follows
  rows = [line for line in first.splitlines() if line.startswith("| ") and "schedule" not in line]
  assert len(rows) == 2 * len(SCHEDULE_NAMES)
  assert {r.split("|")[1].strip() for r in rows} == set(SCHEDULE_NAMES)
  for bad in ("missing", "error", "MISMATCH", "ABOVE", "OUTSIDE"):
    assert bad not in out, out
  for r in rows:  # the executed tick tables stay within 5% of the asynchronous makespan
    assert float(r.split("|")[-2]) <= 1.05, r


def test_zb_v_comparison_table_beside_torchs_rule():
  for p, ms in schedule_sweep.ZBV_CASES:
    for m in ms:
      _, _, gen, drop, bound, _, _, act, drop_act = schedule_sweep.zbv_row(p, m)
      assert float(gen) == bound and float(drop) == 2 * bound and act <= drop_act == 2 * p
