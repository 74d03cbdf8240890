"""Every test process sees 8 host CPU devices; the flag must be set before jax is imported."""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAGS = " --xla_force_host_platform_device_count=8"
if os.environ["JAX_PLATFORMS"] == "cpu":
  # The suite compiles over a thousand small programs and runs each a few times: compiling is
  # most of its CPU time. LLVM's optimisations took a third of it; XLA:CPU's MLIR fusion
  # emitters (an MLIR context and pass pipeline per fusion) over 40% of what was left, where its
  # older LLVM IR emitters compile the same fusions for a fraction. XLA's HLO passes all run.
  _FLAGS += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  _FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _FLAGS).strip()

# Tests and the runners they start as subprocesses compile many of the same programs: share one
# persistent compilation cache per test run, every program in it however fast it compiled (most
# take well under JAX's default 1 s floor; caching them all took 15% off tests/parallel and
# tests/training). The xdist workers inherit it from the controller (this file is loaded there
# first), which removes it when the run ends.
_CACHE = os.path.join(tempfile.gettempdir(), f"jaxpipe-tests-jax-cache-{os.getpid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


# Modules whose tests or fixtures run for a minute or more, started first so that under
# `pytest -n 2` neither worker is left with one of them at the end while the other sits idle.
_FIRST = (
    "test_multiprocess.py",
    "test_sweep.py",
    "test_notebooks.py",
    "test_losses_moe.py",
    "test_train.py",
    "test_hf.py",
)


# Tracing and lowering make millions of short-lived objects: at Python's default thresholds the
# cyclic collector ran thousands of times a module, each full pass over every object jax, flax,
# torch and transformers keep (5-6% of a module's time). Collected less often, and with what the
# imports and the collection made frozen out of its passes, it takes about a quarter of that.
gc.set_threshold(50_000, 20, 20)


def pytest_collection_finish(session):
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: order within kept


def pytest_sessionfinish(session, exitstatus):
  controller = not hasattr(session.config, "workerinput")  # after every worker is done
  if controller and os.environ["JAX_COMPILATION_CACHE_DIR"] == _CACHE:
    shutil.rmtree(_CACHE, ignore_errors=True)
