"""Serving: a paged KV cache, PagedAttention and a continuous-batching engine on the training model.

  from jaxpipe.serve import Engine, EngineConfig
  engine = Engine(model_cfg, params, EngineConfig(page_size=16, num_pages=256, max_batch=16))
  engine.generate([[1, 2, 3], [4, 5]], max_tokens=32)

`python -m jaxpipe.serve --workdir DIR --prompt "def "` serves a training run's newest checkpoint.
`Colocated` and `Disaggregated` (serve/deploy.py) run several engines, prefill and decode apart.

The engine and the simulator (serve/sim.py) schedule with one `Scheduler` (serve/scheduler.py),
deployments and the simulator route with one router (serve/placement.py), and TTFT / TPOT are
`serve/slo.py`'s; serve/http/ is the OpenAI-compatible server (`CompletionServer`).
"""


def __getattr__(name):
  # Lazy, so that `python -m jaxpipe.serve` can set up host devices before JAX is imported.
  if name in ("Engine", "EngineConfig"):
    from jaxpipe.serve import engine

    return getattr(engine, name)
  if name in ("Request", "KVState"):
    from jaxpipe.serve import request

    return getattr(request, name)
  if name in ("Colocated", "Disaggregated"):
    from jaxpipe.serve import deploy

    return getattr(deploy, name)
  if name == "SamplingParams":
    from jaxpipe.serve.sampling import SamplingParams

    return SamplingParams
  if name == "Scheduler":
    from jaxpipe.serve.scheduler import Scheduler

    return Scheduler
  if name == "CompletionServer":
    from jaxpipe.serve.http import CompletionServer

    return CompletionServer
  raise AttributeError(name)
