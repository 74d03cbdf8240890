"""Process set-up that must happen before JAX is imported."""

import gc
import os
import sys


def host_device_count() -> int:
  """$JAXPIPE_HOST_DEVICES (default 8);
  ValueError naming the value if it is not a positive integer."""
  text = os.environ.get("JAXPIPE_HOST_DEVICES", "8")
  try:
    count = int(text)
  except ValueError:
    count = 0
  if count < 1:
    raise ValueError(
        f"JAXPIPE_HOST_DEVICES={text!r} must be a positive integer (the number of CPU "
        "host devices, e.g. 8); unset it for the default of 8"
    )
  return count


def use_host_devices(count: int | None = None) -> None:
  """Gives the CPU platform `count` devices.

  Without an accelerator this is what makes a real multi-device mesh; with one it only adds CPU
  devices that nothing uses. XLA reads the flag when JAX starts, hence the import check. Does
  nothing when `XLA_FLAGS` already sets `--xla_force_host_platform_device_count`.

  Args:
    count: the number of CPU devices; default `$JAXPIPE_HOST_DEVICES`, or 8.

  Raises:
    RuntimeError: JAX is already imported.
    ValueError: `$JAXPIPE_HOST_DEVICES` is not a positive integer.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" in flags:
    return
  if "jax" in sys.modules:
    raise RuntimeError(
        "use_host_devices() must run before `import jax`; call it at the top of the "
        "entry point, or set XLA_FLAGS=--xla_force_host_platform_device_count=N"
    )
  count = count or host_device_count()
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


# What jaxpipe.launch sets for each rank, and a Kubernetes JobSet or any other launcher can.
COORDINATOR_ENV, PROCESSES_ENV, PROCESS_ID_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)
HEARTBEAT_ENV = "JAXPIPE_HEARTBEAT_TIMEOUT"  # seconds before a silent process counts as dead


def _env_int(name: str) -> int | None:
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"${name}={text!r} must be an integer") from None


def _cluster_processes() -> int:
  """Processes that SLURM (srun) or Open MPI (mpirun) started for this job, as JAX detects them;
  1 outside one."""
  if all(
      v in os.environ
      for v in (
          "SLURM_JOB_ID",
          "SLURM_STEP_NODELIST",
          "SLURM_NTASKS",
          "SLURM_PROCID",
          "SLURM_LOCALID",
      )
  ):
    return _env_int("SLURM_NTASKS") or 1
  if "OMPI_MCA_orte_hnp_uri" in os.environ:
    return _env_int("OMPI_COMM_WORLD_SIZE") or 1
  return 1


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int | None = None,
) -> bool:
  """Joins a multi-process run (`jax.distributed`) if one is described.

  Call it before the first device is touched. The run is described by the arguments, else by
  `$JAX_COORDINATOR_ADDRESS`, `$JAX_NUM_PROCESSES` and `$JAX_PROCESS_ID` (what `jaxpipe.launch`
  sets), else by SLURM (srun) or Open MPI (mpirun), whose variables JAX reads itself.
  `$JAX_NUM_CPU_DEVICES` sets each process's CPU device count (JAX reads it; it overrides
  `XLA_FLAGS`); CPU collectives across processes use gloo.

  Args:
    coordinator_address: process 0's `host:port`.
    num_processes: the processes of the run, one per host.
    process_id: this process's index, in `0..num_processes - 1`.
    heartbeat_timeout_s: seconds without heartbeats after which a process counts as dead and the
      others stop; default `$JAXPIPE_HEARTBEAT_TIMEOUT`, else JAX's 100 s.

  Returns:
    True if this process joined (or had joined) a multi-process run; False if it runs alone.

  Raises:
    ValueError: a bad value (named in the message), or a run described only in part.
  """
  import jax  # noqa: PLC0415 -- after use_host_devices() has set XLA_FLAGS

  if jax.distributed.is_initialized():
    return True
  address = coordinator_address or os.environ.get(COORDINATOR_ENV) or None
  count = num_processes if num_processes is not None else _env_int(PROCESSES_ENV)
  index = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
  heartbeat = heartbeat_timeout_s if heartbeat_timeout_s is not None else _env_int(HEARTBEAT_ENV)
  if count is not None and count < 1:
    raise ValueError(
        f"--num_processes={count} must be a positive integer (the processes of the "
        "run, one per host)"
    )
  explicit = address is not None or (count or 1) > 1 or index is not None
  if not explicit and _cluster_processes() == 1:
    return False
  if explicit:
    missing = [
        flag
        for flag, v in (
            ("--coordinator_address", address),
            ("--num_processes", count),
            ("--process_id", index),
        )
        if v is None
    ]
    if missing and _cluster_processes() == 1:
      raise ValueError(
          f"a multi-process run needs {', '.join(missing)} as well (or ${COORDINATOR_ENV}, "
          f"${PROCESSES_ENV}, ${PROCESS_ID_ENV}); python -m jaxpipe.launch sets them all"
      )
    if count is not None and index is not None and not 0 <= index < count:
      raise ValueError(f"--process_id={index} must be in 0..{count - 1} (--num_processes={count})")
    if address is not None and ":" not in address:
      raise ValueError(
          f"--coordinator_address={address!r} must be host:port, e.g. "
          "10.0.0.1:1234 (process 0's host)"
      )
  if heartbeat is not None and heartbeat < 1:
    raise ValueError(f"${HEARTBEAT_ENV}={heartbeat} must be a positive number of seconds")
  # SIGTERM stays with jaxpipe.runtime.preemption (the loop agrees on it); JAX's preemption notifier
  # would otherwise catch it from here on and a SIGTERM before the loop would do nothing.
  jax.config.update("jax_enable_preemption_service", False)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {} if heartbeat is None else {"heartbeat_timeout_seconds": heartbeat}
  jax.distributed.initialize(address, count, index, **kwargs)
  return True


def _glibc():
  """glibc through ctypes, or None where this C library is another."""
  import ctypes  # noqa: PLC0415 -- only the runners that set the allocator load libc

  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None


def pool_host_memory() -> bool:
  """glibc: serve every allocation from the heap and never give freed memory back to the OS, so
  that no step maps and faults its temporaries in again (benchmarks; the arenas stay one per
  thread, a single one would serialise XLA's compile threads); False where libc refuses."""
  libc = _glibc()
  if libc is None:
    return False
  m_trim_threshold, m_mmap_max = -1, -4
  return all(
      libc.mallopt(opt, val) == 1 for opt, val in ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1))
  )


def trim_host_memory() -> bool:
  """glibc: give the heap's free memory back to the OS now (`malloc_trim`).

  A pooled heap (`pool_host_memory`) keeps what a load freed: a checkpoint read in float32 and
  served in bfloat16 would hold its float32 copy's pages for good. Called once the weights are
  where they stay, the steps that follow still pool their temporaries.

  Returns:
    Whether glibc's `malloc_trim` ran (False off glibc).
  """
  libc = _glibc()
  if libc is None:
    return False
  gc.collect()  # arrays held only by reference cycles are freed first
  libc.malloc_trim(0)
  return True
