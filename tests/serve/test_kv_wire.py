"""K/V pages between two processes over JAX's transfer server (`jaxpipe.serve.kv_wire`): a
sending process (tests/serve/wire_peer.py) serves prompts until one was preempted and resumed,
then offers its running requests; this process pulls each into its own engine. The pages arrive
bit for bit (float32, int8 and fp8 pools, scales included; DeepSeek-V3's latent cache; engines
tensor-parallel over two devices), and the
requests continue to the
tokens a single engine serves. A pull of a transfer never offered, or from a sender that died,
fails in one line within its timeout, and the receiver keeps no page of it."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpipe.serve.engine import Engine
from jaxpipe.serve.kv_wire import KVWire, Ticket
from tests import helpers
from tests.serve import wire_peer


def _sender(name, dtype, out, devices=1):
  """The sending process, its tickets by prompt index."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "tests.serve.wire_peer", name, dtype, out, str(devices)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=helpers.ROOT,
      env={**os.environ, "PYTHONPATH": helpers.ROOT, "JAXPIPE_HOST_DEVICES": str(devices)},
  )
  tickets = {}
  for line in proc.stdout:
    if line.strip() == "ready":
      return proc, tickets
    i, text = line.split(" ", 1)
    tickets[int(i)] = Ticket.from_json(text)
  proc.wait(timeout=30)
  raise AssertionError(proc.stderr.read()[-3000:])


def _engine(name, dtype, **fields):
  return Engine(
      helpers.CONFIGS[name],
      helpers.engine_params(name),
      kv_cache_dtype=dtype,
      async_scheduling=False,
      prefix_caching=False,  # every page of a finished request comes back to the free list
      **{**helpers.ENGINE_ARGS, **fields},
  )


@pytest.mark.parametrize(
    "name, dtype, tp",
    [
        ("dense", "auto", 1),
        ("dense", "int8", 1),
        ("dense", "fp8", 1),
        ("mla", "auto", 1),
        ("dense", "int8", 2),
    ],
)
def test_pages_cross_processes_bit_for_bit_and_the_requests_continue(name, dtype, tp, tmp_path):
  """mla: DeepSeek-V3's latent cache, whose V pool is empty (made by the receiver, not sent).
  tp 2: both engines tensor-parallel over two devices (KV heads split over them)."""
  proc, tickets = _sender(name, dtype, str(tmp_path), tp)
  try:
    receiver = _engine(name, dtype, num_pages=40, devices=jax.devices()[:tp])
    wire = KVWire()
    free = receiver.allocator.num_free
    ids = {i: wire.receive(receiver, t) for i, t in tickets.items()}
    preempted = 0
    for i, rid in ids.items():
      sent = np.load(tmp_path / f"{i}.npz")
      preempted += int(sent["preemptions"])
      state = receiver.transfer.export_request(rid)
      got = [np.asarray(x).view(np.uint8) for x in jax.tree.leaves((state.k, state.v))]
      assert len(got) == (2 if dtype == "auto" else 4)
      for j, x in enumerate(got):
        np.testing.assert_array_equal(x, sent[f"arr_{j}"])
      assert receiver.requests[rid].computed == tickets[i].request["computed"] > 0
    assert len(ids) >= 2 and preempted >= 1
    while receiver.has_work():
      receiver.step()
    single = _engine(name, dtype, num_pages=40)
    want = single.generate(wire_peer.PROMPTS, wire_peer.MAX_TOKENS)
    for i, rid in ids.items():
      assert receiver.requests[rid].output == want[i], i
    receiver.finished()
    assert receiver.allocator.num_free == free
    helpers.check_pages(receiver)
  finally:
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=60)


def test_a_pull_that_cannot_complete_fails_in_one_line_and_keeps_no_page(tmp_path):
  proc, tickets = _sender("dense", "auto", str(tmp_path))
  receiver = _engine("dense", "auto", num_pages=40)
  wire = KVWire()
  free = receiver.allocator.num_free
  first, ticket = list(tickets.values())[:2]
  done = wire.receive(receiver, first)  # served to its end, not yet collected
  while receiver.has_work():
    receiver.step()
  never = Ticket(ticket.uuid + 1000, ticket.address, ticket.request, ticket.chunks)
  with pytest.raises(ValueError, match=f"pulling request K/V {never.uuid} from .* failed"):
    wire.receive(receiver, never, timeout_s=2)
  assert receiver.allocator.num_free == free and not receiver.incoming
  proc.kill()  # the sender dies holding the offer
  proc.wait(timeout=30)
  with pytest.raises(ValueError, match=f"from {ticket.address} failed"):
    wire.receive(receiver, ticket, timeout_s=5)
  assert receiver.allocator.num_free == free and not receiver.incoming
  assert not receiver.has_work()
  assert [r.id for r in receiver.finished()] == [done]  # the failed pulls left it there
