"""Process set-up that must happen before JAX is imported."""
import os
import sys


def host_device_count() -> int:
  """$JAXPIPE_HOST_DEVICES (default 8); ValueError naming the value if it is not a positive integer."""
  text = os.environ.get("JAXPIPE_HOST_DEVICES", "8")
  try:
    count = int(text)
  except ValueError:
    count = 0
  if count < 1:
    raise ValueError(f"JAXPIPE_HOST_DEVICES={text!r} must be a positive integer (the number of CPU "
                     "host devices, e.g. 8); unset it for the default of 8")
  return count


def use_host_devices(count: int | None = None) -> None:
  """Gives the CPU platform `count` devices (default $JAXPIPE_HOST_DEVICES or 8).

  Without an accelerator this is what makes a real multi-device mesh; with one it only adds CPU
  devices that nothing uses. XLA reads the flag when JAX starts, hence the import check.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" in flags:
    return
  if "jax" in sys.modules:
    raise RuntimeError("use_host_devices() must run before `import jax`; call it at the top of the "
                       "entry point, or set XLA_FLAGS=--xla_force_host_platform_device_count=N")
  count = count or host_device_count()
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
