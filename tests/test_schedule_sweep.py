"""The sweep runner: every schedule present, every figure checked against anchors.md."""
from experiments import schedule_sweep
from jaxpipe.pipeline import SCHEDULE_NAMES


def test_sweep_table_has_every_schedule_and_no_mismatch(capsys):
  schedule_sweep.main(["--no-files"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| ") and "schedule" not in line]
  assert len(rows) == 2 * len(SCHEDULE_NAMES)
  assert {r.split("|")[1].strip() for r in rows} == set(SCHEDULE_NAMES)
  for bad in ("missing", "error", "MISMATCH", "ABOVE", "OUTSIDE"):
    assert bad not in out, out
  for r in rows:  # the executed tick tables stay within 5% of the asynchronous makespan
    assert float(r.split("|")[-2]) <= 1.05, r
