"""Colocated and disaggregated deployments of the engine, against each other and the oracle.

The same seeded requests, arriving while others run, give the same greedy tokens colocated,
disaggregated (prefill on one device, decode on two workers, one of them splitting KV heads over
two devices) and in the recompute oracle of test_serve_engine; each moved request copies exactly
2 * layers * kv_heads * head_dim * bytes * its prompt's tokens rounded up to pages (written
out here); pages are accounted for after every step and none is left when all are done, also
after cancellations mid-prefill, mid-transfer and mid-decode and after workers stop.
"""

import collections
import math

import jax
import pytest

from experiments import serve_bench
from jaxpipe.runtime import cli
from jaxpipe.serve.deploy import (
    DECODE,
    HANDOFF,
    PREFILL,
    TRANSFER,
    Colocated,
    Disaggregated,
    device_groups,
)
from jaxpipe.serve.request import INCOMING
from tests import helpers

# XLA's dots: the tests hold tokens to the oracle's bit for bit on workers of one and of two
# devices, and XLA sums a row-parallel product's halves as one device does (oneDNN's blocking may
# round them apart)
KW = dict(num_pages=33, nan_freed_pages=True, matmul="xla", **helpers.ENGINE_ARGS)


def bench_args(args: list[str]):
  """serve_bench's flag values for the command line `python -m experiments.serve_bench ARGS`."""
  cli.parse(serve_bench.FLAGS, ["serve_bench", *args])
  return cli.values(serve_bench.FLAGS)


def kv_bytes(tokens: int) -> int:
  """2 (K and V) * layers * KV heads * head dim * 4 bytes (float32) * tokens, pages rounded up."""
  return 2 * 2 * 2 * 16 * 4 * math.ceil(tokens / helpers.PAGE) * helpers.PAGE


@pytest.fixture(scope="module")
def colocated():
  d = jax.devices()
  return Colocated(helpers.DENSE, helpers.engine_params("dense"), [d[0:1], d[1:2]], **KW)


@pytest.fixture(scope="module")
def disagg():
  d = jax.devices()
  return Disaggregated(
      helpers.DENSE, helpers.engine_params("dense"), [d[2:3]], [d[3:4], d[4:6]], **KW
  )


def run(dep, prompts, max_tokens, per_step=2, first=3, hook=None):
  """Adds `first` requests, then `per_step` more each step; returns them finished, in order.

  hook(dep, ids) runs after every step; the streamed tokens must add up to each output."""
  ids, queue, streamed = [], list(prompts), collections.defaultdict(list)
  while queue or dep.has_work():
    k = per_step if ids else first
    ids += [dep.add_request(p, max_tokens, eos_id=None) for p in queue[:k]]
    queue = queue[k:]
    for rid, tokens in dep.step().items():
      streamed[rid] += tokens
    for e in dep.engines:
      helpers.check_pages(e)
    if hook:
      hook(dep, ids)
  finished = dep.finished()
  assert sorted(r.id for r in finished) == sorted(ids)  # each request finishes exactly once
  done = {r.id: r for r in finished}
  assert all(streamed[i] == done[i].output for i in ids)
  return [done[i] for i in ids]


def assert_no_pages_held(dep):
  """Only prefix caches hold pages; nothing waits, runs, is parked or is incoming anywhere."""
  for e in dep.engines:
    assert not (e.waiting or e.running or e.prefilled or e.incoming or e.requests)
    assert e.allocator.num_used == len(e.prefix_cache or ())
  assert not getattr(dep, "transfers", {}) and not dep.requests


def test_disaggregated_greedy_equals_colocated_and_the_oracle(colocated, disagg):
  prompts = helpers.prompts(seed=0, n=12)
  want = helpers.oracle("dense", prompts, 8)
  colo = run(colocated, prompts, 8)
  disagg.precompile(max(map(len, prompts)))
  compiled = lambda: [
      (e.programs, e.transfer.gather_fn._cache_size(), e.transfer.scatter_fn._cache_size())
      for e in disagg.engines
  ]
  before = compiled()
  dis = run(disagg, prompts, 8)
  assert compiled() == before  # precompile covered every step and every chunk of every K/V move
  assert [r.output for r in colo] == want
  assert [r.output for r in dis] == want
  assert_no_pages_held(colocated)
  assert_no_pages_held(disagg)
  for r, p in zip(dis, prompts):
    assert (r.transfers, r.kv_bytes) == (1, kv_bytes(len(p)))
    pages = math.ceil(len(p) / helpers.PAGE)
    assert r.copies == bin(pages).count("1")  # power-of-two chunks of pages
    kinds = [(w[0], kind) for w, kind, *_ in r.spans]
    assert kinds[:2] == [("P", "queue"), ("P", "prefill")] and kinds[-1][1] == "decode"
    assert all(start <= end for *_, start, end in r.spans)
    assert r.ttft > 0 and r.tpot > 0 and r.finish_reason == "length"
  assert {r.worker for r in dis} == {"D0", "D1"}  # both decode workers took requests
  assert {r.worker for r in colo} == {"W0", "W1"}
  p, d0, d1 = disagg.engines
  assert p.counts["cached_tokens"] > 0  # prompts sharing a prefix hit the prefill cache
  # prefill on P only, decode on D only: D computed one token per token it generated
  generated_on_d = sum(len(r.output) - 1 for r in dis)
  assert d0.counts["step_tokens"] + d1.counts["step_tokens"] == generated_on_d
  assert d1.kv.k.sharding.device_set == set(jax.devices()[4:6])


def test_streaming_layer_by_layer_moves_the_same_bytes(disagg):
  prompts = helpers.prompts(seed=8, n=4)
  disagg.stream_layers = True
  try:
    got = run(disagg, prompts, 5)
  finally:
    disagg.stream_layers = False
  assert [r.output for r in got] == helpers.oracle("dense", prompts, 5)
  for r, p in zip(got, prompts):
    assert r.kv_bytes == kv_bytes(len(p))
    assert r.copies == helpers.DENSE.n_layers * bin(math.ceil(len(p) / helpers.PAGE)).count("1")
  assert_no_pages_held(disagg)


def test_cancel_mid_prefill_mid_transfer_and_mid_decode_frees_every_page(disagg):
  """Cancelled in each phase, a request keeps the tokens it had and frees every page; cancel of
  one that finished and was returned does nothing, and of an id never given is a KeyError."""
  prompts = helpers.prompts(seed=9, n=6)
  prompts[0] = list(range(30))  # 30 tokens: two chunks of the 16-token budget
  cancelled = {}

  def hook(dep, ids):
    for i, phase in ((0, PREFILL), (1, TRANSFER), (2, DECODE)):
      r = dep.requests.get(ids[i]) if i < len(ids) else None
      if r is not None and i not in cancelled and r.phase == phase:
        if phase == PREFILL:
          assert 0 < dep.engines[0].requests[next(iter(dep.prefill[0].ids))].computed < 30
        if phase == TRANSFER:  # D holds its reserved pages, P its own, until the copy lands
          t = dep.transfers[r.id]
          assert t.dst.engine.requests[t.dst_rid].state == INCOMING
        cancelled[i] = list(r.output)
        dep.cancel(r.id)
        for e in dep.engines:
          helpers.check_pages(e)

  got = run(disagg, prompts, 9, per_step=1, first=1, hook=hook)
  assert sorted(cancelled) == [0, 1, 2]
  want = helpers.oracle("dense", prompts, 9)
  for i, r in enumerate(got):
    if i in cancelled:
      assert r.finish_reason == "cancelled" and r.output == cancelled[i] == want[i][: len(r.output)]
    else:
      assert r.output == want[i]
  assert got[0].output == [] and got[1].output == want[1][:1] and got[1].kv_bytes == 0
  assert_no_pages_held(disagg)
  disagg.cancel(got[3].id)  # finished and returned by finished(): a client leaving; no error
  assert disagg.finished() == [] and not disagg.requests
  never = got[-1].id + 1000
  with pytest.raises(KeyError, match=rf"no request {never}: this deployment never gave that id"):
    disagg.cancel(never)


def test_a_full_decode_side_keeps_requests_waiting_on_prefill(disagg):
  """D pools with one free page each: prefilled requests wait on P, pages held; once pages come
  back they move and finish as the oracle does. D refuses what it cannot take, saying why."""
  hogs = {}
  for w in disagg.decode:
    a = w.engine.allocator
    hogs[w.name] = [a.alloc() for _ in range(a.num_free - 1)]
  prompts = [list(range(1, 9)), list(range(11, 21))]  # 2 and 3 pages: neither fits a D now
  ids = [disagg.add_request(p, 6, eos_id=None) for p in prompts]
  for _ in range(4):
    disagg.step()
  p = disagg.prefill[0].engine
  for i in ids:
    r = disagg.requests[i]
    assert r.phase == HANDOFF and "waiting for a decode worker" in r.note and len(r.output) == 1
  assert len(p.prefilled) == 2 and not disagg.transfers
  d = disagg.decode[0].engine
  state = p.transfer.export_request(p.prefilled[0].id)
  with pytest.raises(ValueError, match="2 free pages are needed to import the request, 1 are free"):
    d.transfer.reserve_request(state)
  for w in disagg.decode:
    w.engine.allocator.free(hogs[w.name])
  # the engine refuses K/V that does not match, and a request with layers still missing
  rid = d.transfer.reserve_request(state)
  ((_, k, v),) = p.transfer.kv_of(p.prefilled[0].id)  # 2 pages: one chunk
  with pytest.raises(ValueError, match=r"k has shape \(2, 2, 2, 4, 16\) at page 1"):
    d.transfer.write_kv(rid, k, v, first=1)  # past its 2 pages
  with pytest.raises(ValueError, match=r"k has shape \(2, 2, 2, 4, 8\)"):
    d.transfer.write_kv(rid, k[..., :8], v[..., :8])
  d.transfer.write_kv(rid, *p.transfer.kv_of(p.prefilled[0].id, layer=0)[0][1:], layer=0)
  with pytest.raises(ValueError, match=r"still lacks .* layers \[1\]"):
    d.transfer.admit_request(rid)
  d.cancel(rid)
  d.finished()
  while disagg.has_work():
    disagg.step()
  done = {r.id: r for r in disagg.finished()}
  assert [done[i].output for i in ids] == helpers.oracle("dense", prompts, 6)
  assert_no_pages_held(disagg)


def test_stopped_workers_lose_nothing():
  """Stop a decode worker while a copy to it is in flight and a request decodes on it, then a
  prefill worker while a copy from it is in flight: every request still gets the oracle's tokens.
  With no decode worker left, what is left fails saying so and frees its pages."""
  d = jax.devices()
  dep = Disaggregated(
      helpers.DENSE, helpers.engine_params("dense"), [d[6:7], d[7:8]], [d[0:1], d[1:2]], **KW
  )
  prompts = helpers.prompts(seed=10, n=10)
  stopped = []

  def hook(dep, ids):
    moving = list(dep.transfers.values())
    if (
        not stopped
        and any(t.dst.name == "D0" for t in moving)
        and any(r.phase == DECODE and r.worker == "D0" for r in dep.requests.values())
    ):
      stopped.append("D0")
      dep.stop_worker("D0")
    elif stopped == ["D0"] and moving:
      stopped.append(moving[0].src.name)
      held = moving[0].dst.engine.allocator.num_used
      dep.stop_worker(moving[0].src.name)
      assert moving[0].dst.engine.allocator.num_used < held  # its reservation was given back

  got = run(dep, prompts, 10, hook=hook)
  assert len(stopped) == 2
  assert [r.output for r in got] == helpers.oracle("dense", prompts, 10)
  assert sum(r.recomputes for r in got) >= 2 and dep.counts["recomputes"] >= 2
  assert all(r.worker == "D1" for r in got if r.recomputes)
  assert_no_pages_held(dep)
  with pytest.raises(ValueError, match="no live worker named 'D0'"):
    dep.stop_worker("D0")
  ids = [dep.add_request(p, 10, eos_id=None) for p in prompts[:3]]
  dep.step()
  dep.step()
  dep.stop_worker("D1")
  while dep.has_work():
    dep.step()
  done = {r.id: r for r in dep.finished()}
  assert all(
      done[i].finish_reason == "error" and "no decode worker is left" in done[i].error for i in ids
  )
  assert_no_pages_held(dep)
  late = dep.add_request(prompts[0], 4)
  (r,) = dep.finished()
  assert r.id == late and "no decode worker is left" in r.error


def test_bad_splits_and_flags_fail_before_device_work(tmp_path):
  d = jax.devices()
  with pytest.raises(ValueError, match="no prefill worker"):
    Disaggregated(helpers.DENSE, {}, [], [d[:1]])
  with pytest.raises(ValueError, match="no decode worker"):
    Disaggregated(helpers.DENSE, {}, [d[:1]], [])
  with pytest.raises(ValueError, match="disjoint"):
    Disaggregated(helpers.DENSE, {}, [d[:2]], [d[1:3]])
  with pytest.raises(ValueError, match="share page_size"):
    Disaggregated(
        helpers.DENSE, {}, [d[:1]], [d[1:2]], prefill_kwargs={"page_size": 8}, page_size=4
    )
  with pytest.raises(ValueError, match="9 workers x 1 devices need 9 devices; there are 8"):
    device_groups(9, 1)
  assert device_groups(2, 3) == [d[0:3], d[3:6]]
  cases = [
      ("--mode disaggregated --prefill_workers 0", "--prefill_workers=0 leaves no prefill worker"),
      ("--mode both --decode_workers 0", "--decode_workers=0 leaves no decode worker"),
      ("--mode both --ttft_slo 0", "--ttft_slo: ttft SLO=0.0 must be"),
      ("--mode both --tpot_slo -1", "--tpot_slo: tpot SLO=-1.0 must be"),
      ("--mode sideways", "--mode 'sideways'"),
      ("--mode both --rates 4,-1", "every rate must be > 0"),
  ]
  for flags, words in cases:
    with pytest.raises(SystemExit, match=words):
      serve_bench.check_deployment_args(bench_args(flags.split()))
  bad = tmp_path / "bad.csv"
  bad.write_text("arrival_s,prompt_len,output_len\n0.1,4,x\n")
  args = bench_args(["--mode", "both", "--trace_in", str(bad)])
  with pytest.raises(SystemExit, match=r"--trace_in: .*bad.csv:2: output_len='x'"):
    serve_bench.measure(args, ["colocated"], serve_bench.SLO(1, 1), [1.0])
  args = bench_args(["--mode", "both", "--workers", "9"])
  with pytest.raises(SystemExit, match="--mode colocated: 9 workers"):
    serve_bench.measure(args, ["colocated"], serve_bench.SLO(1, 1), [1.0])
