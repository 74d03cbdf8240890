"""Serving past one process (`jaxpipe.serve.fleet`): prefill, decode and replica servers and
their routers as real processes (`python -m jaxpipe.serve --role ...`) over loopback.

Greedy tokens through router -> prefill server -> decode server equal one engine's, sampled and
streamed ones equal the replica's; the fleet's calls need its secret; and each fault ends in a
retry or one line, no server keeps a page, and the router stays up: a decode server killed
mid-stream (then restarted at its address), a prefill server killed holding the pages, an offer
nobody pulls, a pull nobody serves, the router killed mid-stream (and restarted), and SIGTERM on
each role (what runs finishes, nothing new is taken, the process exits 0).
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jaxpipe.serve.fleet import routing
from jaxpipe.serve.fleet.worker import job_from_json, job_json
from jaxpipe.serve.kv_wire import Ticket
from jaxpipe.serve.sampling import SamplingParams
from tests import helpers

SECRET = "fleet-s3cret"
API_KEY = "router-key"
AUTH = {"Authorization": f"Bearer {SECRET}"}
# the tiny model of configs/tiny.py, fresh parameters (the same in every process)
ENGINE = [
    "--config",
    "configs/tiny.py",
    "--max_seq_len",
    "256",
    "--num_pages",
    "48",
    "--max_batch",
    "8",
    "--max_tokens_per_step",
    "64",
    "--token_buckets",
    "16,64",
]
PROMPTS = ["0123", "3210321", "0", "1111111111111111111112", "0123012301230123", "2"]


# -- routing, without processes ----------------------------------------------------------------


def test_the_cache_aware_rule_follows_prefixes_until_the_loads_are_uneven():
  """SGLang's rule: the longest cached prefix at or above the threshold; below it, or when the
  loads differ by more than both thresholds, the least-loaded server; ties to the first."""
  cfg = routing.RoutingConfig(cache_threshold=0.5, balance_abs_threshold=32)
  assert routing.choose([10, 0], [32, 0], 40, cfg) == (0, "prefix")
  assert routing.choose([10, 0], [16, 0], 40, cfg) == (1, "least_loaded")  # 16 < 0.5 * 40
  assert routing.choose([50, 10], [32, 0], 40, cfg) == (1, "balance")  # 40 apart, 5x
  assert routing.choose([42, 10], [32, 0], 40, cfg) == (0, "prefix")  # 32 apart: not past 32
  assert routing.choose([5, 5], [0, 0], 40, cfg) == (0, "least_loaded")
  assert routing.choose([5, 5], [16, 16], 20, cfg) == (0, "prefix")
  assert routing.choose([10, 0], [32, 0], 40, routing.RoutingConfig("least_loaded")) == (
      1,
      "least_loaded",
  )
  with pytest.raises(ValueError, match="use one of cache_aware, least_loaded"):
    routing.RoutingConfig("random")


def test_a_prefix_index_matches_whole_pages_and_forgets_the_least_recently_used():
  index = routing.PrefixIndex(page_size=4, capacity=3)
  index.insert(list(range(10)))  # pages [0..3], [4..7]; the last 2 tokens are no page
  assert index.match(list(range(10))) == 8
  assert index.match(list(range(8)) + [99]) == 8
  assert index.match([0, 1, 2, 3, 9, 9, 9, 9]) == 4  # the second page differs
  assert index.match([1, 2, 3, 4]) == 0  # a page is keyed by what precedes it too
  index.insert([50, 51, 52, 53, 54, 55, 56, 57])  # 2 more pages: capacity 3 drops the oldest
  assert len(index) == 3
  assert index.match(list(range(8))) == 0
  assert index.match([50, 51, 52, 53, 54, 55, 56, 57]) == 8


def test_jobs_and_sampling_values_cross_as_json_and_bad_ones_are_refused_in_one_line():
  sampling = SamplingParams(temperature=0.7, seed=3, stop_token_ids=(5,), logit_bias=((2, 1.5),))
  body = json.loads(json.dumps(job_json([1, 2], 4, sampling, (7, 8))))
  assert job_from_json(body) == ([1, 2], 4, sampling, (7, 8))
  with pytest.raises(ValueError, match="prompt must be a list of token ids"):
    job_from_json({**body, "prompt": "12"})
  with pytest.raises(ValueError, match=r"unknown sampling fields \['colour'\]"):
    job_from_json({**body, "sampling": {"colour": 1}})
  with pytest.raises(ValueError, match="cannot leave this process"):
    SamplingParams(guide=object()).to_dict()
  for text in ("{", '{"uuid": 1}', '{"uuid": 1, "address": "a", "request": {}, "chunks": []}'):
    with pytest.raises(ValueError, match="not a K/V ticket") as e:
      Ticket.from_json(text)
    assert "\n" not in str(e.value)


# -- the fleet, as processes -------------------------------------------------------------------


def _port() -> int:
  with socket.create_server(("127.0.0.1", 0)) as s:
    return s.getsockname()[1]


class Fleet:
  """Server processes by name, each restartable at its port."""

  def __init__(self, tmp):
    self.tmp, self.procs, self.ports, self.flags = tmp, {}, {}, {}

  def url(self, name: str) -> str:
    return f"http://127.0.0.1:{self.ports[name]}"

  def start(self, name: str, *flags: str) -> None:
    self.ports.setdefault(name, _port())
    self.flags[name] = flags
    log = open(os.path.join(self.tmp, f"{name}.log"), "a")
    self.procs[name] = subprocess.Popen(
        [sys.executable, "-m", "jaxpipe.serve", *ENGINE, *flags, "--port", str(self.ports[name])],
        cwd=helpers.ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "PYTHONPATH": helpers.ROOT,
            "JAXPIPE_HOST_DEVICES": "1",
            "JAXPIPE_FLEET_SECRET": SECRET,
        },
    )

  def output(self, name: str) -> str:
    with open(os.path.join(self.tmp, f"{name}.log")) as f:
      return f.read()[-3000:]

  def wait(self, *names: str) -> None:
    for name in names:
      proc = self.procs[name]
      helpers.wait_healthy(
          self.url(name), lambda: proc.poll() is None, 300, lambda: self.output(name)
      )

  def restart(self, *names: str) -> None:
    for name in names:
      self.stop(name)
      self.start(name, *self.flags[name])
    self.wait(*names)
    time.sleep(1.0)  # the routers' next polls see them up

  def stop(self, name: str, sig=signal.SIGKILL) -> None:
    proc = self.procs[name]
    if proc.poll() is None:
      proc.send_signal(sig)
    proc.wait(60)

  def load(self, name: str) -> dict:
    return httpx.get(self.url(name) + "/fleet/load", headers=AUTH).json()

  def settled(self, *names: str, timeout: float = 10.0) -> dict[str, dict]:
    """Each server's load once it holds no page, no request and no offer (or fails)."""
    deadline = time.monotonic() + timeout
    while True:
      loads = {n: self.load(n) for n in names}
      if all(
          l["usage"]["pages_held"] == 0 and l["jobs"] == 0 and l["offers"] == 0
          for l in loads.values()
      ):
        return loads
      assert time.monotonic() < deadline, f"pages or requests still held: {loads}"
      time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  f = Fleet(str(tmp_path_factory.mktemp("fleet")))
  f.start("prefill", "--role", "prefill", "--offer_timeout_s", "4")
  # a batch of 2: tickets wait for a slot (the six requests at once of the first test)
  f.start(
      "decode", "--role", "decode", "--pull_timeout_s", "3", "--drain_s", "60", "--max_batch", "2"
  )
  f.start("replica", "--role", "replica")
  f.wait("prefill", "decode", "replica")
  urls = ["--prefill_urls", f.url("prefill"), "--decode_urls", f.url("decode")]
  f.start("router", "--role", "router", "--api_key", API_KEY, *urls)
  f.start("replicas", "--role", "router", "--replica_urls", f.url("replica"))
  f.wait("router", "replicas")
  yield f
  for name in f.procs:
    f.stop(name)


@pytest.fixture(scope="module")
def single():
  """The single-process engine the fleet must agree with (configs/tiny.py, fresh parameters)."""
  from configs import tiny
  from jaxpipe.serve.engine import Engine
  from jaxpipe.training import config as config_lib
  from jaxpipe.training import restore

  config = tiny.get_config()
  return Engine(
      config_lib.model_config(config),
      restore.fresh_params(config),
      page_size=16,
      num_pages=48,
      max_batch=8,
      max_seq_len=256,
      max_tokens_per_step=64,
      token_buckets=(16, 64),
      page_buckets=(16,),
  )


def _complete(url: str, key: str | None = API_KEY, **body) -> dict:
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  got = httpx.post(
      url + "/v1/completions", json={"model": "tiny", **body}, headers=headers, timeout=120
  )
  assert got.status_code == 200, got.text
  return got.json()


def _stream(url: str, key: str | None = API_KEY, **body):
  """The streamed completion's chunks (as JSON) as they come."""
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  body = {"model": "tiny", "stream": True, **body}
  with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        yield json.loads(line[len("data: ") :])


def _prefill_ticket(fleet) -> dict:
  """A ticket of the prefill server's, taken as a router would (its pages held until it lapses)."""
  body = job_json([48, 49, 50], 8, SamplingParams(), None)
  with httpx.stream("POST", fleet.url("prefill") + "/fleet/prefill", json=body, headers=AUTH) as r:
    return [json.loads(line) for line in r.iter_lines() if line][-1]["ticket"]


def _decode(fleet, ticket: dict) -> list[dict]:
  """A decode server's events for a ticket, to the end."""
  decode = fleet.url("decode") + "/fleet/decode"
  with httpx.stream("POST", decode, json={"ticket": ticket}, headers=AUTH, timeout=30) as r:
    return [json.loads(line) for line in r.iter_lines() if line]


def test_greedy_tokens_through_prefill_and_decode_servers_equal_one_engines(fleet, single):
  """Six requests at once through router -> prefill server -> decode server (a batch of 2: the
  tickets wait their turn there); then sampled (n=2, seeded), streamed and logprob requests agree
  with the replica's router; every page is back."""
  prompts = [[ord(c) for c in p] for p in PROMPTS]
  want = single.generate(prompts, 24)
  before = fleet.load("decode")["moved"]
  with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
    runs = [
        pool.submit(_complete, fleet.url("router"), prompt=p, max_tokens=24, temperature=0)
        for p in PROMPTS
    ]
    got = [r.result()["choices"][0]["token_ids"] for r in runs]
  assert got == want
  sampled = dict(prompt="0123", max_tokens=12, n=2, temperature=0.9, seed=5, logprobs=2)
  a = _complete(fleet.url("router"), **sampled)["choices"]
  b = _complete(fleet.url("replicas"), key=None, **sampled)["choices"]
  assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
  assert a[0]["token_ids"] != a[1]["token_ids"]
  assert a[0]["logprobs"]["token_logprobs"] == b[0]["logprobs"]["token_logprobs"]
  assert a[0]["logprobs"]["top_logprobs"] == b[0]["logprobs"]["top_logprobs"]
  echo = dict(prompt="0123", max_tokens=3, temperature=0, echo=True, logprobs=1)
  assert (
      _complete(fleet.url("router"), **echo)["choices"][0]["logprobs"]
      == _complete(fleet.url("replicas"), key=None, **echo)["choices"][0]["logprobs"]
  )
  chunks = list(_stream(fleet.url("router"), prompt="3210321", max_tokens=24, temperature=0))
  assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == want[1]
  loads = fleet.settled("prefill", "decode")
  assert loads["prefill"]["lapsed"] == 0  # every offer was released once pulled
  moved = {k: v - before[k] for k, v in loads["decode"]["moved"].items()}
  # each request's prompt pages moved, whole: 2 layers x 2 KV heads x 8 float32 values, K and V,
  # is 256 bytes a token, 4 KiB a page of 16
  pages = sum(-(-len(p) // 16) for p in PROMPTS) + 2 + 1 + 1  # and the n=2, echo and streamed
  assert moved["pulls"] == len(PROMPTS) + 4
  assert moved["bytes"] == 256 * 16 * pages
  assert moved["seconds"] > 0


def test_the_fleets_calls_need_its_secret_and_the_router_its_api_key(fleet):
  from jaxpipe.serve.fleet.router import FleetBackend

  for name, path in (("prefill", "/fleet/info"), ("decode", "/fleet/load")):
    assert httpx.get(fleet.url(name) + path).status_code == 401
    wrong = {"Authorization": f"Bearer {SECRET}x"}
    assert httpx.get(fleet.url(name) + path, headers=wrong).status_code == 401
    assert httpx.get(fleet.url(name) + path, headers=AUTH).status_code == 200
    assert httpx.get(fleet.url(name) + "/health").status_code == 200  # monitoring stays open
  body = {"prompt": [1, 2], "max_tokens": 2, "sampling": {}, "eos_id": None}
  refused = httpx.post(fleet.url("prefill") + "/fleet/prefill", json=body)
  assert refused.status_code == 401 and "fleet secret" in refused.json()["error"]["message"]
  assert httpx.get(fleet.url("router") + "/v1/models").status_code == 401
  good = {"Authorization": f"Bearer {API_KEY}"}
  assert httpx.get(fleet.url("router") + "/v1/models", headers=good).status_code == 200
  with pytest.raises(ValueError, match="refused the router's fleet secret"):
    FleetBackend(replica_urls=[fleet.url("replica")], fleet_secret="wrong")


def test_a_malformed_ticket_fails_its_request_and_the_decode_server_goes_on(fleet):
  ticket = _prefill_ticket(fleet)
  chunks = [
      {**c, "arrays": [[shape, "nonsense"] for shape, _ in c["arrays"]]} for c in ticket["chunks"]
  ]
  ended = _decode(fleet, {**ticket, "chunks": chunks})
  assert ended[-1]["finish"] == "error" and "malformed ticket" in ended[-1]["error"], ended
  bad = {**ticket, "request": {**ticket["request"], "max_tokens": "many"}}
  refused = httpx.post(fleet.url("decode") + "/fleet/decode", json={"ticket": bad}, headers=AUTH)
  assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
  assert httpx.get(fleet.url("decode") + "/health").status_code == 200
  assert _complete(fleet.url("router"), prompt="01", max_tokens=4)["choices"][0]["token_ids"]
  fleet.settled("decode")
  fleet.settled("prefill", timeout=10)  # the first ticket's offer lapses


def test_a_decode_server_killed_mid_stream_ends_the_request_and_its_restart_rejoins(fleet):
  """The request ends with an error naming the decode server; the prefill server had released
  the pages once pulled; the router stays up; the server restarted at its address serves."""
  chunks = _stream(fleet.url("router"), prompt="0", max_tokens=240, temperature=0)
  tokens = []
  while len(tokens) < 10:  # the first comes from the prefill server; then the decode server's
    tokens += next(chunks)["choices"][0]["token_ids"]
  os.kill(fleet.procs["decode"].pid, signal.SIGSTOP)  # frozen mid-stream, then killed
  os.kill(fleet.procs["decode"].pid, signal.SIGKILL)
  rest = list(chunks)
  tokens += [t for c in rest for t in (c.get("choices") or [{}])[0].get("token_ids") or []]
  assert 10 <= len(tokens) < 240
  assert "error" in rest[-1] and "decode server" in rest[-1]["error"]["message"], rest[-1]
  fleet.settled("prefill")
  assert httpx.get(fleet.url("router") + "/health").status_code == 200
  deadline = time.monotonic() + 5  # the router's polls find the decode server gone
  while (ready := httpx.get(fleet.url("router") + "/ready")).status_code != 503:
    assert time.monotonic() < deadline, ready.text
    time.sleep(0.1)
  assert "no decode server is up" in ready.json()["why"]
  fleet.restart("decode")
  assert httpx.get(fleet.url("router") + "/ready").json() == {"ready": True}
  out = _complete(fleet.url("router"), prompt="0123", max_tokens=8, temperature=0)
  assert out["choices"][0]["finish_reason"] == "length"
  fleet.settled("prefill", "decode")


def test_a_prefill_server_killed_holding_pages_fails_the_pull_and_no_page_is_kept(fleet):
  """As a router would: a ticket from the prefill server, which then dies; the decode server's
  pull fails in one line and its reservation is freed."""
  ticket = _prefill_ticket(fleet)
  assert fleet.load("prefill")["usage"]["pages_held"] == 1
  fleet.stop("prefill")
  start = time.monotonic()
  ended = _decode(fleet, ticket)
  assert ended[-1]["finish"] == "error" and "failed" in ended[-1]["error"], ended
  assert "\n" not in ended[-1]["error"] and time.monotonic() - start < 3
  fleet.settled("decode")
  fleet.restart("prefill")
  assert _complete(fleet.url("router"), prompt="01", max_tokens=4)["choices"][0]["token_ids"]
  fleet.settled("prefill", "decode")


def test_an_offer_nobody_pulls_lapses_and_a_pull_nobody_serves_times_out(fleet):
  """--offer_timeout_s 4 on the prefill server, --pull_timeout_s 3 on the decode server."""
  ticket = _prefill_ticket(fleet)
  lapsed = fleet.load("prefill")["lapsed"]
  assert fleet.load("prefill")["offers"] == 1
  never = {**ticket, "uuid": ticket["uuid"] + 10**6}  # an id the prefill server never offered
  start = time.monotonic()
  ended = _decode(fleet, never)
  assert 2.5 < time.monotonic() - start < 10
  assert ended[-1]["finish"] == "error" and "before the timeout" in ended[-1]["error"], ended
  fleet.settled("decode")
  loads = fleet.settled("prefill", timeout=10)
  assert loads["prefill"]["lapsed"] == lapsed + 1


def test_the_router_killed_mid_stream_frees_every_server_and_its_restart_serves(fleet):
  chunks = _stream(fleet.url("router"), prompt="0", max_tokens=240, temperature=0)
  next(chunks)
  fleet.stop("router")
  chunks.close()
  fleet.settled("prefill", "decode")  # the decode server saw its stream close and cancelled
  fleet.restart("router")
  out = _complete(fleet.url("router"), prompt="0123", max_tokens=8, temperature=0)
  assert len(out["choices"][0]["token_ids"]) == 8


def test_sigterm_drains_a_decode_server_what_runs_finishes_and_it_exits(fleet, single):
  """While a stream runs and a pull waits (for an offer never made: --pull_timeout_s 3), SIGTERM:
  the server takes nothing new (503), the stream ends with every token, the pull with its
  timeout, and the process exits 0."""
  ticket = _prefill_ticket(fleet)
  never = {**ticket, "uuid": ticket["uuid"] + 10**6}
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(_decode, fleet, never)
    deadline = time.monotonic() + 5
    while fleet.load("decode")["pulls"] < 1:  # the pull reached the server before its SIGTERM
      assert time.monotonic() < deadline
      time.sleep(0.02)
    chunks = _stream(fleet.url("router"), prompt="0", max_tokens=200, temperature=0)
    tokens = []
    while len(tokens) < 10:  # the decode server streams
      tokens += next(chunks)["choices"][0]["token_ids"]
    fleet.procs["decode"].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while httpx.get(fleet.url("decode") + "/ready").status_code != 503:
      assert time.monotonic() < deadline
      time.sleep(0.05)
    refused = httpx.post(
        fleet.url("decode") + "/fleet/decode", json={"ticket": ticket}, headers=AUTH
    )
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    for c in chunks:
      assert "choices" in c, c
      tokens += c["choices"][0].get("token_ids") or []
    assert tokens == single.generate([[ord("0")]], 200)[0]
    assert "before the timeout" in waiting.result()[-1]["error"]
  assert fleet.procs["decode"].wait(30) == 0
  assert "drained; exiting" in fleet.output("decode")
  fleet.restart("decode")
  fleet.settled("prefill", "decode")


def test_sigterm_drains_a_prefill_server_a_replica_and_a_router(fleet, single):
  """The prefill server keeps its offer until it lapses, taking nothing new, then exits 0; the
  router in front of the replica lets its stream finish (every token), then both exit 0."""
  ticket = _prefill_ticket(fleet)
  assert ticket and fleet.load("prefill")["offers"] == 1
  fleet.procs["prefill"].send_signal(signal.SIGTERM)
  chunks = _stream(fleet.url("replicas"), key=None, prompt="0", max_tokens=200, temperature=0)
  tokens = []
  while len(tokens) < 10:
    tokens += next(chunks)["choices"][0]["token_ids"]
  fleet.procs["replicas"].send_signal(signal.SIGTERM)
  deadline = time.monotonic() + 5
  while httpx.get(fleet.url("replicas") + "/ready").status_code != 503:
    assert time.monotonic() < deadline
    time.sleep(0.05)
  for c in chunks:
    assert "choices" in c, c
    tokens += c["choices"][0].get("token_ids") or []
  assert tokens == single.generate([[ord("0")]], 200)[0]
  assert fleet.procs["replicas"].wait(30) == 0
  fleet.procs["replica"].send_signal(signal.SIGTERM)
  assert (
      httpx.get(fleet.url("prefill") + "/ready").json()["why"].startswith("the server is draining")
  )
  body = job_json([48], 4, SamplingParams(), None)
  refused = httpx.post(fleet.url("prefill") + "/fleet/prefill", json=body, headers=AUTH)
  assert refused.status_code == 503
  assert fleet.procs["prefill"].wait(30) == 0  # once its offer lapsed (--offer_timeout_s 4)
  assert fleet.procs["replica"].wait(30) == 0
  for name in ("prefill", "replica", "replicas"):
    assert "drained; exiting" in fleet.output(name)
  fleet.restart("prefill", "replica", "replicas")
