"""Every test process sees 8 host CPU devices; the flag must be set before jax is imported."""
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Tests and the runners they start as subprocesses compile many of the same programs: share one
# persistent compilation cache per test run. The xdist workers inherit it from the controller
# (this file is loaded there first), which removes it when the run ends.
_CACHE = os.path.join(tempfile.gettempdir(), f"jaxpipe-tests-jax-cache-{os.getpid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)


def pytest_sessionfinish(session, exitstatus):
  controller = not hasattr(session.config, "workerinput")  # after every worker is done
  if controller and os.environ["JAX_COMPILATION_CACHE_DIR"] == _CACHE:
    shutil.rmtree(_CACHE, ignore_errors=True)
