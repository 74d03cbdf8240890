"""runtime.process.trim_host_memory: the heap's free memory goes back to the OS."""

import ctypes
import os

import pytest

from jaxpipe.runtime import process


def _resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_trim_returns_a_freed_middle_of_the_heap():
  """160 MB of small blocks freed below a block still held stay resident (glibc trims only the
  heap's top on its own) until trim_host_memory gives them back."""
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    pytest.skip("not glibc")
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  size, count = 4096, 40_000  # below the mmap threshold: every block from the heap
  blocks = [libc.malloc(size) for _ in range(count)]
  for b in blocks:
    ctypes.memset(b, 1, size)  # resident
  guard = libc.malloc(size)  # the freed blocks are not the heap's top
  try:
    for b in blocks:
      libc.free(b)
    held = _resident_bytes()
    assert process.trim_host_memory()
    returned = held - _resident_bytes()
  finally:
    libc.free(guard)
  assert returned > 0.75 * size * count, returned
