"""Workload generator, trace CSVs, SLO metrics and the goodput search (pure Python)."""

import math

import numpy as np
import pytest

from jaxpipe.serve.slo import SLO, attainment, e2e, percentiles, search_goodput, summary
from jaxpipe.serve.workload import Lengths, at_rate, generate, read_csv, write_csv

UNIFORM, FIXED, LONG = Lengths.parse("8:96"), Lengths.parse("40"), Lengths.parse("lognormal:64:512")


def test_length_specs():
  assert UNIFORM == Lengths("uniform", 8, 96) and FIXED == Lengths("fixed", 40, 40)
  assert Lengths.parse("lognormal:64:512:0.5") == Lengths("lognormal", 64, 512, 0.5)
  for bad in (
      "",
      "0",
      "9:8",
      "a:b",
      "lognormal:64",
      "lognormal:600:512",
      "lognormal:64:512:0",
      "1:2:3",
  ):
    with pytest.raises(ValueError, match="length spec"):
      Lengths.parse(bad)


def test_generate_is_seeded_and_draws_what_it_says():
  a = generate(2000, 5.0, UNIFORM, LONG, vocab=50, seed=3)
  assert a == generate(2000, 5.0, UNIFORM, LONG, vocab=50, seed=3)
  assert a != generate(2000, 5.0, UNIFORM, LONG, vocab=50, seed=4)
  gaps = np.diff([0.0] + [w.arrival for w in a])
  # exponential gaps of mean 1/5: the sample mean's standard error is (1/5)/sqrt(n)
  assert abs(gaps.mean() - 0.2) < 5 * 0.2 / math.sqrt(len(gaps))
  assert abs(np.std(gaps) - 0.2) < 0.02  # an exponential's deviation equals its mean
  prompts = np.array([len(w.prompt) for w in a])
  assert prompts.min() >= 8 and prompts.max() <= 96 and set(range(8, 97)) <= set(prompts)
  outs = np.array([w.max_tokens for w in a])
  assert 1 <= outs.min() and outs.max() <= 512 and (outs == 512).any()  # clipped tail
  assert abs(np.median(outs) - 64) <= 6  # lognormal's median is exp(mu)
  assert all(0 <= t < 50 for w in a for t in w.prompt)
  fixed = generate(10, 1.0, FIXED, FIXED, vocab=50, seed=0)
  assert {len(w.prompt) for w in fixed} == {40} and {w.max_tokens for w in fixed} == {40}


def test_another_rate_scales_the_same_requests():
  slow, fast = (generate(50, r, UNIFORM, UNIFORM, 64, seed=1) for r in (2.0, 8.0))
  assert [w.prompt for w in slow] == [w.prompt for w in fast]
  np.testing.assert_allclose([w.arrival for w in slow], [4 * w.arrival for w in fast], rtol=1e-12)
  scaled = at_rate(slow, 10.0)
  assert scaled[-1].arrival == pytest.approx(len(slow) / 10.0)
  assert [w.prompt for w in scaled] == [w.prompt for w in slow]


def test_trace_csv_round_trip(tmp_path):
  work = generate(20, 3.0, UNIFORM, LONG, vocab=64, seed=2)
  path = tmp_path / "trace.csv"
  write_csv(path, work)
  assert read_csv(path, vocab=64) == work
  lines = path.read_text().splitlines()
  assert lines[0] == "arrival_s,prompt_len,output_len,prompt"
  # without the prompt column the tokens are drawn from the seed, the lengths kept
  short = tmp_path / "short.csv"
  short.write_text("arrival_s,prompt_len,output_len\n0.5,3,7\n1.25,2,1\n")
  got = read_csv(short, vocab=64, seed=0)
  assert [(w.arrival, len(w.prompt), w.max_tokens) for w in got] == [(0.5, 3, 7), (1.25, 2, 1)]
  assert got == read_csv(short, vocab=64, seed=0) != read_csv(short, vocab=64, seed=1)


MALFORMED = [
    ("time,prompt_len,output_len\n1,2,3\n", ":1: header"),
    ("arrival_s,prompt_len,output_len\n", "holds no requests"),
    ("arrival_s,prompt_len,output_len\nx,2,3\n", ":2: arrival_s='x' is not a number"),
    ("arrival_s,prompt_len,output_len\n-1,2,3\n", ":2: arrival_s=-1"),
    ("arrival_s,prompt_len,output_len\nnan,2,3\n", ":2: arrival_s=nan"),
    ("arrival_s,prompt_len,output_len\n1,2,3\n0.5,2,3\n", ":3: arrival_s=0.5 is before"),
    ("arrival_s,prompt_len,output_len\n1,2.5,3\n", ":2: prompt_len='2.5' is not an integer"),
    ("arrival_s,prompt_len,output_len\n1,2,0\n", ":2: output_len=0 must be >= 1"),
    ("arrival_s,prompt_len,output_len\n1,2\n", ":2: 2 fields"),
    ("arrival_s,prompt_len,output_len,prompt\n1,2,3,4 5 6\n", ":2: prompt has 3 tokens"),
    ("arrival_s,prompt_len,output_len,prompt\n1,2,3,4 99\n", ":2: prompt token 99 is outside"),
    ("arrival_s,prompt_len,output_len,prompt\n1,2,3,4 b\n", ":2: prompt '4 b' is not token ids"),
]


@pytest.mark.parametrize("text, words", MALFORMED)
def test_a_malformed_trace_names_the_line_and_value(tmp_path, text, words):
  path = tmp_path / "bad.csv"
  path.write_text(text)
  with pytest.raises(ValueError) as e:
    read_csv(path, vocab=64)
  assert words in str(e.value) and str(path) in str(e.value)


class R:
  """A finished request as the metrics see it."""

  def __init__(self, ttft, tpot, error=None, arrival=0.0, finish=None):
    self.ttft, self.tpot, self.error = ttft, tpot, error
    self.arrival, self.finish_time = arrival, finish


def test_slo_attainment_percentiles():
  slo = SLO(ttft=0.5, tpot=0.1)
  reqs = [
      R(0.1, 0.05),
      R(0.5, 0.1),
      R(0.6, 0.05),
      R(0.1, 0.2),
      R(0.1, None),
      R(0.1, 0.01, "boom"),
      R(None, None),
  ]
  # met: within both (bounds inclusive), one-token requests need only TTFT; errors never meet
  assert [slo.met(r) for r in reqs] == [True, True, False, False, True, False, False]
  assert attainment(reqs, slo) == pytest.approx(3 / 7)
  assert slo.scaled(2) == SLO(1.0, 0.2)
  # tightest scale: per request max(ttft / 0.5, tpot / 0.1) = 0.5, 1, 1.2, 2, 0.2, inf, inf; the
  # share 3/7 needs the third smallest, 1.0; the scaled SLO is met by exactly that share
  loose = SLO(0.5, 0.1, attainment=3 / 7)
  assert loose.tightest_scale(reqs) == pytest.approx(1.0)
  assert attainment(reqs, loose.scaled(1.0)) >= 3 / 7 > attainment(reqs, loose.scaled(0.99))
  assert SLO(0.5, 0.1, attainment=1.0).tightest_scale(reqs) == math.inf
  assert percentiles([3.0, None, 1.0, 2.0], (0, 50, 100)) == [1.0, 2.0, 3.0]
  assert math.isnan(percentiles([None])[0])
  got = summary([R(0.1, 0.02), R(0.3, None), R(0.2, 0.04)], slo)
  assert got == pytest.approx(
      {"ttft50": 0.2, "ttft90": 0.28, "tpot50": 0.03, "tpot90": 0.038, "met": 1.0}
  )
  assert e2e(R(0, 0, arrival=1.0, finish=3.5)) == 2.5 and e2e(R(0, 0)) is None
  for bad in (
      dict(ttft=0, tpot=1),
      dict(ttft=1, tpot=-1),
      dict(ttft=float("nan"), tpot=1),
      dict(ttft=1, tpot=1, attainment=0),
  ):
    with pytest.raises(ValueError, match="must"):
      SLO(**bad)


@pytest.mark.parametrize("threshold, rates", [(13.7, [1.0]), (13.7, [100.0]), (0.3, [4.0, 8.0])])
def test_goodput_search_brackets_the_threshold(threshold, rates):
  """Attainment falls below 0.9 past `threshold`: the search's answer passes and lies within
  its tolerance of it; rates are probed at most max_probes times."""
  calls = []

  def attain(rate):
    calls.append(rate)
    return 1.0 if rate <= threshold else 0.5

  s = search_goodput(attain, rates, rel_tol=0.05, max_probes=20)
  assert s.goodput <= threshold < s.above <= s.goodput * 1.05
  assert len(calls) == len(set(calls)) <= 20
  capped = search_goodput(attain, rates, rel_tol=0.0, max_probes=4)
  assert len(capped.tried) == 4 and capped.goodput <= threshold
  assert search_goodput(lambda r: 0.0, [1.0], max_probes=3).goodput == 0.0
