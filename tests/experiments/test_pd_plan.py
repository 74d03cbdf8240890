"""`experiments.pd_plan --cpu`: its engine profile runs the engine's own step programs, and it
prices a K/V move as measured (`kv_wire_bench.fit`)."""

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


def test_the_cpu_plan_prices_a_move_between_processes_as_measured():
  """--transfer_bw and --transfer_latency reach the simulated cluster: a move of a 33-token
  request (3 pages of 16) costs the latency plus its whole pages' bytes over the bandwidth."""
  import types

  from jaxpipe.serve import sim

  table = sim.StepTable({(8, 1): 0.004}, page_size=16, host_step=0.001)
  args = types.SimpleNamespace(
      kv_tokens=1024,
      page_size=16,
      max_batch=8,
      token_budget=64,
      cores=2,
      kv_bytes_per_token=1000,
      transfer_bw=2e9,
      transfer_latency=3e-3,
  )
  cluster = pd_plan.cpu_cluster(table, args, prefill=1, decode=1)
  assert cluster.transfer_time(33) == 3e-3 + 3 * 16 * 1000 / 2e9
  args.transfer_bw, args.transfer_latency = float("inf"), 0.0  # one process: a host copy
  assert pd_plan.cpu_cluster(table, args, prefill=1, decode=1).transfer_time(33) == 0.0


def test_kv_wire_bench_fits_latency_and_bandwidth_to_its_moves():
  from experiments import kv_wire_bench

  nbytes = [1e6, 4e6, 16e6, 1e6, 16e6]
  seconds = [2e-3 + b / 0.5e9 for b in nbytes]
  latency, bandwidth = kv_wire_bench.fit(nbytes, seconds)
  assert abs(latency - 2e-3) < 1e-9 and abs(bandwidth / 0.5e9 - 1) < 1e-9
