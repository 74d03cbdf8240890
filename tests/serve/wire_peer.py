"""The sending process of tests/serve/test_kv_wire.py: an engine (a model of `helpers.CONFIGS`)
that serves the test's prompts until one of them has been preempted and resumed, then offers
every running request over a `KVWire` (`jaxpipe.serve.kv_wire`).

  python -m tests.serve.wire_peer MODEL KV_CACHE_DTYPE OUT_DIR [DEVICES]

Writes each offered request's K/V as `export_request` gives them, as bytes (OUT_DIR/<i>.npz,
i: the prompt's index), prints one ticket per line (`<i> <ticket JSON>`), then `ready`, and exits at
the first line on stdin.
"""

import os
import sys

import jax
import numpy as np

from jaxpipe.serve.engine import Engine
from jaxpipe.serve.kv_wire import KVWire
from tests import helpers

PROMPTS = helpers.prompts(seed=8, n=4)
MAX_TOKENS = 12


def main(name: str, kv_cache_dtype: str, out: str, devices: str = "1") -> None:
  """name: a model of `helpers.CONFIGS`; devices: the engine's, tensor-parallel over them."""
  engine = Engine(
      helpers.CONFIGS[name],
      helpers.engine_params(name),
      devices=jax.devices()[: int(devices)],
      num_pages=12,
      async_scheduling=False,
      kv_cache_dtype=kv_cache_dtype,
      **helpers.ENGINE_ARGS,
  )
  ids = [engine.add_request(p, MAX_TOKENS, eos_id=None) for p in PROMPTS]
  reqs = [engine.requests[i] for i in ids]
  for _ in range(100):  # until a preempted request runs again, with tokens to go
    engine.step()
    if any(r.preemptions and r.state == "running" and r.computed for r in reqs):
      break
  wire = KVWire()
  for i, r in enumerate(reqs):
    if r.state != "running":
      continue
    state = engine.transfer.export_request(r.id)
    leaves = [np.asarray(x).view(np.uint8) for x in jax.tree.leaves((state.k, state.v))]
    np.savez(os.path.join(out, f"{i}.npz"), *leaves, preemptions=r.preemptions)
    print(i, wire.offer(engine, r.id).to_json(), flush=True)
  print("ready", flush=True)
  sys.stdin.readline()


if __name__ == "__main__":
  main(*sys.argv[1:])
