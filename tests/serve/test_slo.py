"""TTFT and TPOT have one definition (serve/slo.py), which the engine's requests, the simulator's
and serve_bench's all read: the same times give the same figures in each."""

import pytest

from experiments import serve_bench
from jaxpipe.serve import slo
from jaxpipe.serve.request import Request
from jaxpipe.serve.sampling import SamplingParams
from jaxpipe.serve.sim import SimRequest


def test_ttft_and_tpot_are_one_definition_everywhere():
  arrival, times = 1.0, [1.25, 1.5, 2.0, 2.75]
  assert slo.ttft(arrival, times[0]) == 0.25 and slo.ttft(arrival, None) is None
  assert slo.tpot(times[0], times[-1], len(times)) == pytest.approx(0.5)  # 1.5 s over 3 gaps
  assert slo.tpot(times[0], times[0], 1) is None  # one token: no gap, meets any TPOT target
  engine = Request(
      0,
      [1, 2],
      4,
      SamplingParams(),
      None,
      output=[5, 6, 7, 8],
      arrival=arrival,
      first_token_time=times[0],
      token_times=times,
  )
  simulated = SimRequest(
      0, arrival, 2, 4, generated=4, first_token_time=times[0], last_token_time=times[-1]
  )
  bench = serve_bench.Done(arrival, times)
  for r in (engine, simulated, bench):
    assert (r.ttft, r.tpot) == (slo.ttft(arrival, times[0]), slo.tpot(times[0], times[-1], 4))
  one = (
      Request(
          1,
          [1],
          1,
          SamplingParams(),
          None,
          arrival=arrival,
          first_token_time=times[0],
          token_times=times[:1],
      ),
      SimRequest(
          1, arrival, 1, 1, generated=1, first_token_time=times[0], last_token_time=times[0]
      ),
      serve_bench.Done(arrival, times[:1]),
  )
  assert [(r.ttft, r.tpot) for r in one] == [(0.25, None)] * 3
  assert Request(2, [1], 1, SamplingParams(), None).tpot is None  # no token yet
