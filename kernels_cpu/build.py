"""Compiles a kernel's C++ source into a shared library, once per source, flags and machine.

The source is compiled with the machine's C++ compiler (`$CXX`, else `c++`), for this CPU
(`-march=native`), into a cache directory (`$JAXPIPE_KERNEL_CACHE`, else
`~/.cache/jaxpipe/kernels_cpu`, else one under the system's temporary directory) keyed by the
source, the flags, the compiler, the CPU and jaxlib, so that later processes load it in
milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib.version


def _cache_dir() -> Path:
  """$JAXPIPE_KERNEL_CACHE, else ~/.cache/jaxpipe/kernels_cpu, else (a home that cannot be
  written) a directory of this user's under the system's temporary directory, which must be
  this user's own and writable by no one else (it holds libraries this process loads)."""
  root = os.environ.get("JAXPIPE_KERNEL_CACHE")
  if root:
    return Path(root)
  home = Path.home() / ".cache" / "jaxpipe" / "kernels_cpu"
  try:
    home.mkdir(parents=True, exist_ok=True)
    if os.access(home, os.W_OK):
      return home
  except OSError:
    pass
  tmp = Path(tempfile.gettempdir()) / f"jaxpipe-kernels-cpu-{os.getuid()}"
  tmp.mkdir(mode=0o700, exist_ok=True)
  st = tmp.stat()
  if st.st_uid != os.getuid() or st.st_mode & 0o022:
    raise OSError(f"{tmp} is not this user's alone; set $JAXPIPE_KERNEL_CACHE to a directory")
  return tmp


def _cpu() -> str:
  """What -march=native compiles for: the CPU's model and features (x86 and Arm lines)."""
  keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
  try:
    with open("/proc/cpuinfo") as f:
      lines = [x for x in f if x.startswith(keys)]
    return platform.machine() + "".join(sorted(set(lines)))
  except OSError:
    return platform.machine() + platform.processor()


def _compiler() -> tuple[str, str]:
  """(the compiler's path, its --version) -> FileNotFoundError naming $CXX when there is none."""
  name = os.environ.get("CXX", "c++")
  path = shutil.which(name)
  if path is None:
    raise FileNotFoundError(f"no C++ compiler {name!r} on PATH (set $CXX or install g++)")
  version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
  return path, version.stdout


def library(source: Path, flags: Sequence[str], link: Sequence[str] = ()) -> Path:
  """The library compiled from `source`, built now unless the cache holds it.

  Args:
    source: the C++ file; XLA's FFI headers are on the include path.
    flags: the compiler's flags.
    link: flags after the source (libraries to link, their paths); part of the cache key.

  Returns:
    The library's path.

  Raises:
    FileNotFoundError: no compiler.
    RuntimeError: the compiler failed (the last lines of its errors).
  """
  compiler, version = _compiler()
  include = jax.ffi.include_dir()
  key = hashlib.sha256()
  for part in (source.read_bytes(), " ".join(flags).encode(), " ".join(link).encode(),
               version.encode(), _cpu().encode(), jaxlib.version.__version__.encode(),
               include.encode()):  # fmt: skip
    key.update(part)
  out = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed: processes that build at once (test workers) each
  # rename a whole library, never load a half-written one.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    run = subprocess.run(
        [compiler, *flags, f"-I{include}", str(source), "-o", tmp, *link],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode:
      tail = "\n".join(run.stderr.strip().splitlines()[-5:])
      raise RuntimeError(f"compiling {source.name} with {compiler} failed:\n{tail}")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o755 & ~umask)  # readable by whoever shares the cache, as the linker's output
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out
