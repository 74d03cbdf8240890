"""`experiments.pd_plan --cpu`'s engine profile runs the engine's own step programs."""

from configs import tiny
from experiments import pd_plan
from jaxpipe.serve import workload
from jaxpipe.serve.engine import Engine
from jaxpipe.training import config as config_lib
from jaxpipe.training import restore


def test_profile_engine_times_every_step_program_and_fits_the_host_time():
  config = tiny.get_config()
  engine = Engine(
      config_lib.model_config(config),
      restore.fresh_params(config),
      max_batch=4,
      max_tokens_per_step=32,
      max_seq_len=64,
      num_pages=32,
      page_buckets=(4,),
  )
  calibration = [workload.Work(0.0, [1, 2, 3, 4], 4), workload.Work(0.0, [5, 6], 3)]
  lines = []
  table = pd_plan.profile_engine(engine, 1, calibration, lines.append)
  assert sorted(table.times) == engine.programs == [(8, 4), (16, 4), (32, 4)]
  assert all(t > 0 for t in table.times.values())
  assert table.page_size == engine.page_size and len(lines) == 1
  assert not engine.has_work() and engine.allocator.num_used == 0  # the calibration ran out
