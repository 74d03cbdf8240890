"""The serving simulator and its cost models against closed forms (pure Python).

Queueing theory for the clocks (M/D/1's Pollaczek-Khinchine mean wait; a saturated decoder's
tokens per step), the published parameter counts and a numpy transcription of the FLOP and byte
counts for the roofline, the K/V formula for the copies, and a hand-built planning case.
"""

import math

import numpy as np
import pytest

from experiments import pd_plan
from jaxpipe.runtime import cli
from jaxpipe.serve import sim


class Linear:
  """step_time = base + per_token * tokens."""

  def __init__(self, base, per_token=0.0):
    self.base, self.per_token = base, per_token

  def step_time(self, new, context):
    return self.base + self.per_token * sum(new)


FREE = Linear(0.0)
BIG = 1 << 30


def poisson(n, rate, seed=0):
  return np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))


def test_one_prefill_worker_is_an_md1_queue():
  """One prompt per step of fixed length s: TTFT = wait + s, the mean wait lambda s^2 / 2(1-rho)."""
  s, lam, n = 0.01, 60.0, 20000
  c = sim.Cluster(
      16,
      prefill=sim.Pool(1, Linear(s), 64, 100, BIG),
      decode=sim.Pool(1, FREE, BIG, BIG, BIG),
      kv_bytes_per_token=1,
  )
  done = sim.simulate(c, [(a, 100, 1) for a in poisson(n, lam)])
  ttft = np.array([r.ttft for r in done])
  rho = lam * s
  want = s + lam * s * s / (2 * (1 - rho))
  # the waits are correlated; 20000 requests put the sample mean well inside 5% of the formula
  assert abs(ttft.mean() - want) < 0.05 * want
  assert ttft.min() == pytest.approx(s)
  assert all(r.tpot is None and r.finish_time == r.first_token_time for r in done)


def test_a_saturated_decoder_runs_its_batch_every_step():
  """All requests at t=0, prefill and copies free: the decode worker runs its first 8 requests
  together in every step (cost c8) to their 19 tokens, then the other 4 (cost c4)."""
  base, per, batch = 0.002, 0.0001, 8
  c = sim.Cluster(
      4,
      prefill=sim.Pool(1, FREE, BIG, BIG, BIG),
      decode=sim.Pool(1, Linear(base, per), batch, BIG, BIG),
      kv_bytes_per_token=1,
  )
  done = sim.simulate(c, [(0.0, 8, 20)] * 12)
  c8, c4 = base + per * batch, base + per * 4
  assert all(r.ttft == 0.0 for r in done)
  assert [r.tpot for r in done[:batch]] == pytest.approx([c8] * batch)
  assert [r.tpot for r in done[batch:]] == pytest.approx([c8 + c4] * 4)  # (19 c8 + 19 c4) / 19


def test_copies_cost_their_pages_over_the_link_and_delay_decoding():
  kvb, bw, lat, page = 1000, 1e6, 0.001, 16
  c = sim.Cluster(
      page,
      prefill=sim.Pool(1, FREE, 4, BIG, BIG),
      decode=sim.Pool(1, FREE, 4, BIG, BIG),
      kv_bytes_per_token=kvb,
      transfer_bw=bw,
      transfer_latency=lat,
  )
  done = sim.simulate(c, [(0.0, 33, 2)])
  copy = lat + math.ceil(33 / page) * page * kvb / bw  # 3 pages of 16 = 48 tokens
  assert c.transfer_time(33) == pytest.approx(copy)
  assert done[0].transfer_bytes == 3 * page * kvb
  assert done[0].tpot == pytest.approx(copy)  # steps cost nothing: the copy is the gap


def test_lockstep_iterations_last_the_sum_of_the_workers_steps():
  """One host loop over two colocated workers, each with one request: every iteration costs both
  steps on one core, so each request's TPOT is twice a step; on two cores, or on independent
  clocks, it is one step."""
  step = 0.01
  pool = sim.Pool(2, Linear(step), 4, 64, BIG)
  work = [(0.0, 8, 5), (0.0, 8, 5)]
  lock = sim.simulate(sim.Cluster(4, colocated=pool, lockstep=True), work)
  two = sim.simulate(sim.Cluster(4, colocated=pool, lockstep=True, cores=2), work)
  free = sim.simulate(sim.Cluster(4, colocated=pool), work)
  assert [r.tpot for r in lock] == pytest.approx([2 * step] * 2)
  assert [r.tpot for r in two] == pytest.approx([step] * 2)  # two steps packed on two cores
  assert [r.tpot for r in free] == pytest.approx([step] * 2)
  assert [r.ttft for r in free] == pytest.approx([step] * 2)


def test_lockstep_host_time_is_serial_and_device_time_shares_the_cores():
  """Three busy workers, 1 ms of host and 4 ms of program each, on 2 cores: an iteration is
  3 * 1 + max(4, 12 / 2) = 9 ms."""
  table = sim.StepTable({(8, 1): 0.004}, page_size=16, host_step=0.001)
  pool = sim.Pool(3, table, 4, 8, BIG)
  done = sim.simulate(sim.Cluster(16, colocated=pool, lockstep=True, cores=2), [(0.0, 4, 3)] * 3)
  assert [r.tpot for r in done] == pytest.approx([0.009] * 3)
  assert [r.ttft for r in done] == pytest.approx([0.009] * 3)


def test_a_small_pool_preempts_and_every_request_still_finishes():
  pool = sim.Pool(1, Linear(0.001, 1e-5), 8, 32, kv_pages=12)
  done = sim.simulate(sim.Cluster(4, colocated=pool), [(0.01 * i, 20, 12) for i in range(10)])
  assert all(r.finish_time is not None and r.generated == 12 for r in done)
  assert sum(r.preemptions for r in done) > 0
  too_big = sim.simulate(sim.Cluster(4, colocated=pool), [(0.0, 40, 20)])
  assert "needs 15 pages" in too_big[0].error


def test_prefill_first_stalls_decoding_chunked_prefill_does_not():
  """A long prompt arriving mid-decode: prefill-first runs it whole in a step of its own (one
  long gap in the running request's tokens); decode-first spreads it over budget-sized chunks
  that ride along with the decode token."""
  cost = Linear(0.001, 0.001)  # 1 ms + 1 ms per token
  work = [(0.0, 4, 30), (0.010, 256, 2)]
  gaps = {}
  for policy in ("decode-first", "prefill-first"):
    pool = sim.Pool(1, cost, 8, 512 if policy == "prefill-first" else 32, BIG, policy)
    r = sim.simulate(sim.Cluster(16, colocated=pool), work)[0]
    gaps[policy] = r.tpot
  assert gaps["prefill-first"] > gaps["decode-first"]


def test_roofline_counts():
  m = sim.LLAMA3_8B
  assert m.params == pytest.approx(8.03e9, rel=2e-3)  # Meta's model card: 8.03B
  assert sim.LLAMA3_70B.params == pytest.approx(70.6e9, rel=2e-3)  # 70.6B
  assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
  r = sim.Roofline(m)
  # numpy transcription: 2 FLOPs per weight per token, attention 4 * d_head * heads per key
  # seen (QK and PV), causal keys 1..n of a 100-token prompt; the head on the last token only
  d, h, kv, hd, ff, v, layers = 4096, 32, 8, 128, 14336, 128256, 32
  w = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * ff
  keys = np.arange(1, 101).sum()
  want = 2 * 100 * layers * w + 4 * layers * h * hd * keys + 2 * v * d
  assert r.flops([100], [100]) == pytest.approx(want)
  # decode: every key of each sequence read once (its new one too), the new one written, the
  # weights read once
  want_bytes = 2 * (layers * w + v * d) + m.kv_bytes_per_token() * (1000 + 4)
  assert r.bytes([1] * 4, [250] * 4) == pytest.approx(want_bytes)
  assert r.step_time([1], [100]) == pytest.approx(r.bytes([1], [100]) / 4.8e12)  # memory bound
  assert r.step_time([4096], [4096]) == pytest.approx(r.flops([4096], [4096]) / 989e12)
  tp4 = sim.Roofline(sim.LLAMA3_70B, tp=4)
  one = sim.Roofline(sim.LLAMA3_70B, tp=4, allreduce_latency=0.0)
  size = 512 * 8192 * 2
  assert tp4.step_time([512], [512]) - one.step_time([512], [512]) == pytest.approx(80 * 2 * 10e-6)
  assert one.step_time([512], [512]) == pytest.approx(
      max(one.flops([512], [512]) / (4 * 989e12), one.bytes([512], [512]) / (4 * 4.8e12))
      + 2 * 80 * 1.5 * size / 450e9
  )
  assert sim.Roofline(m).kv_capacity() == int((141e9 * 0.9 - m.params * 2) // (128 * 1024))


def test_step_table_pads_to_the_engines_buckets():
  t = sim.StepTable(
      {(8, 2): 1.0, (32, 2): 2.0, (8, 4): 3.0, (32, 4): 4.0},
      page_size=16,
      host_step=0.5,
      host_row=0.25,
  )
  assert t.step_time([3, 4], [10, 20]) == 1.0 + 0.5 + 0.5  # 7 tokens -> 8; 2 pages
  assert t.step_time([9], [33]) == 4.0 + 0.5 + 0.25  # 9 tokens -> 32; 3 pages -> 4


def test_best_split_maximises_the_slower_side():
  pk, dk = pd_plan.Kind("prefill", 1, 64, 512), pd_plan.Kind("decode", 2, 64, 512)
  (est, p, n_p, d, n_d), *_ = pd_plan.best_split(8, {pk: 10.0}, {dk: 25.0}, top=3)
  # prefill 10/s each on 1 GPU, decode 25/s on 2 GPUs: 4 P + 2 D = 8 GPUs carry min(40, 50)
  assert (n_p, n_d, est) == (4, 2, 40.0)


def test_cluster_checks():
  pool = sim.Pool(1, FREE, 1, 1, 1)
  with pytest.raises(ValueError, match="either a colocated pool or both"):
    sim.Cluster(16, colocated=pool, prefill=pool, decode=pool)
  with pytest.raises(ValueError, match="either a colocated pool or both"):
    sim.Cluster(16)
  with pytest.raises(ValueError, match="at least one prefill and one decode"):
    sim.Cluster(16, prefill=sim.Pool(0, FREE, 1, 1, 1), decode=pool)


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--slo_8b 0,0.02", "--slo_8b: ttft SLO=0.0 must be"),
        ("--slo_70b 0.5,-1", "--slo_70b: tpot SLO=-1.0 must be"),
        ("--slo_8b 0.2", "--slo_8b=0.2: give TTFT,TPOT in seconds"),
        ("--models 8b,9b", r"--models: unknown \['9b'\]"),
        ("--gpus 8,4x", "--gpus='8,4x': give comma-separated integers"),
        ("--gpus 0", "--gpus='0': every value must be >= 1"),
        ("--prompt 9:3", "--prompt: length spec '9:3' needs 1 <= MIN <= MAX"),
        ("--probes 0", "--probes=0 must be >= 1"),
        ("--cpu --cores 0", "--cores=0.0 must be > 0"),
    ],
)
def test_planner_flags_fail_in_one_line(flags, words):
  with pytest.raises(SystemExit, match=words):
    cli.parse(pd_plan.FLAGS, ["pd_plan", *flags.split()])
    pd_plan.check_args(cli.values(pd_plan.FLAGS))
