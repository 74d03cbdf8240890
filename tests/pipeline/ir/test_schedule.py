"""Schedule IR: placements, the validator's errors (with the marked grid), the registry, no JAX."""

import os
import subprocess
import sys

import pytest

from jaxpipe.pipeline import Action, Overlap, Placement, Schedule, ScheduleError, make_schedule
from tests import helpers

REPO = helpers.ROOT
F = lambda s, mb: Action("F", s, mb)
B = lambda s, mb: Action("B", s, mb)
I = lambda s, mb: Action("I", s, mb)
W = lambda s, mb: Action("W", s, mb)


def two_rank(rank0, rank1, m=1):
  return Schedule("hand", Placement.interleaved(2), m, [rank0, rank1])


def test_placements():
  vpp = Placement.interleaved(4, 2)
  assert vpp.stage_rank == (0, 1, 2, 3, 0, 1, 2, 3)
  assert vpp.rank_stages(1) == (1, 5) and vpp.local_chunk(5) == 1
  assert (vpp.num_stages, vpp.chunks_per_rank, vpp.copies) == (8, 2, 1)
  v = Placement.vshape(3)
  assert v.stage_rank == (0, 1, 2, 2, 1, 0) and v.routes == ((0, 1, 2, 3, 4, 5),)
  bi = Placement.bidirectional(3)
  assert bi.stage_rank == (0, 1, 2, 2, 1, 0)
  assert bi.stage_model == (0, 1, 2, 0, 1, 2)
  assert bi.routes == ((0, 1, 2), (3, 4, 5))
  assert (bi.num_stages, bi.copies, bi.chunks_per_rank) == (3, 2, 2)
  assert [bi.stage_copy(s) for s in range(6)] == [0, 0, 0, 1, 1, 1]


def test_placement_errors():
  with pytest.raises(ValueError, match="unequal numbers of stages"):
    Placement(2, (0, 0, 1), (0, 1, 2), ((0, 1, 2),))
  with pytest.raises(ValueError, match="out of order"):
    Placement(2, (0, 1), (0, 1), ((1, 0),))
  with pytest.raises(ValueError, match="outside"):
    Placement(2, (0, 2), (0, 1), ((0, 1),))


def test_valid_hand_schedule_passes():
  two_rank(
      [F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), I(1, 1), W(1, 1)], m=2
  ).validate()


def _error(schedule) -> str:
  with pytest.raises(ScheduleError) as e:
    schedule.validate()
  text = str(e.value)
  assert "rank 0" in text and "rank 1" in text  # the grid is in the message
  return text


def test_missing_action():
  text = _error(two_rank([F(0, 0), B(0, 0)], [F(1, 0)]))
  assert "stage 1, micro-batch 0 lacks its backward" in text


def test_missing_forward():
  text = _error(two_rank([F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 0), B(1, 0), B(1, 1)], m=2))
  assert "no forward (1F1)" in text


def test_duplicate_action():
  text = _error(two_rank([F(0, 0), F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]))
  assert "0F0 appears 2 times" in text
  assert ">0F0<" in text


def test_wrong_rank():
  text = _error(two_rank([F(0, 0), F(1, 0), B(0, 0)], [B(1, 0)]))
  assert "1F0 is on rank 0 but stage 1 is placed on rank 1" in text
  assert ">1F0<" in text


def test_w_before_i():
  text = _error(two_rank([F(0, 0), B(0, 0)], [F(1, 0), W(1, 0), I(1, 0)]))
  assert "1W0 runs before 1I0" in text
  assert ">1W0<" in text and ">1I0<" in text


def test_backward_before_forward():
  text = _error(two_rank([B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]))
  assert "0B0 runs before 0F0" in text


def test_split_and_full_backward():
  text = _error(two_rank([F(0, 0), B(0, 0)], [F(1, 0), B(1, 0), I(1, 0), W(1, 0)]))
  assert "both a full backward and a split one" in text


def test_out_of_range():
  assert "outside [0, 1)" in _error(two_rank([F(0, 0), B(0, 0), F(0, 1)], [F(1, 0), B(1, 0)]))


def test_deadlock_marks_the_waiting_cells():
  # rank 0 wants micro-batch 0's gradient before sending micro-batch 1 forward; rank 1 does
  # micro-batch 1 first: each waits on the other.
  text = _error(
      two_rank([F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), B(1, 1), F(1, 0), B(1, 0)], m=2)
  )
  assert "deadlock" in text
  assert ">0B0<" in text and ">1F1<" in text


def test_overlap_with_itself_rejected():
  pl = Placement.interleaved(1)
  s = Schedule("hand", pl, 1, [[Overlap(F(0, 0), B(0, 0))]])
  with pytest.raises(ScheduleError, match="own backward"):
    s.validate()


def test_overlap_checks_kinds():
  with pytest.raises(ValueError, match="a forward and a backward"):
    Overlap(B(0, 0), F(0, 1))


def test_registry_errors():
  with pytest.raises(ValueError, match="did you mean '1f1b'"):
    make_schedule("1fb1", pp=4, microbatches=8)
  with pytest.raises(ValueError, match="pp=0"):
    make_schedule("1f1b", pp=0, microbatches=8)
  with pytest.raises(ValueError, match="chunks=0"):
    make_schedule("interleaved-1f1b", pp=2, microbatches=4, chunks=0)


def test_no_jax_in_ir_and_cli(tmp_path):
  """The schedule layer, the planning models and the schedule CLI run without importing JAX."""
  csv_path = tmp_path / "s.csv"
  code = f"""
import importlib, pkgutil, runpy, sys
import jaxpipe.pipeline
import jaxpipe.pipeline.ir as ir
for m in pkgutil.walk_packages(ir.__path__, "jaxpipe.pipeline.ir."):
  importlib.import_module(m.name)  # every module of the IR
for m in ("costs", "auto", "layout"):  # the planning models the schedule CLI and notebooks use
  importlib.import_module("jaxpipe.planning." + m)
from jaxpipe.pipeline import make_schedule
make_schedule("1f1b", pp=4, microbatches=8).simulate(lockstep=True)
import functools
from jaxpipe import schedule
from jaxpipe.runtime import cli
main = functools.partial(cli.call, schedule.main, schedule.FLAGS)
for fmt in ("stats", "grid", "perfetto"):
  assert main(["1f1b", "--pp", "4", "--microbatches", "8", "--format", fmt]) == 0
assert main(["gpipe", "--pp", "2", "--microbatches", "2", "--format", "csv",
             "--out", {str(csv_path)!r}]) == 0
assert main([{str(csv_path)!r}, "--format", "stats"]) == 0
sys.argv = ["jaxpipe.schedule", "1f1b", "--pp", "2", "--microbatches", "2"]
try:
  runpy.run_module("jaxpipe.schedule", run_name="__main__")
except SystemExit as e:
  assert e.code == 0, e.code
bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax")))
assert not bad, bad
"""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO
  )
  assert out.returncode == 0, out.stderr
