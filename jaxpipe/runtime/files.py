"""Files that are read back (configs, cost files, results) are written whole or not at all."""

import json
import os
from typing import Any


def write_atomically(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` through a .tmp beside it and os.replace: a kill or a full disk
  mid-write leaves the old file (or none), never a cut one."""
  path = os.fspath(path)
  try:
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  finally:
    if os.path.exists(path + ".tmp"):  # the write failed: no stray .tmp
      os.remove(path + ".tmp")


def write_json(path: str | os.PathLike, data: Any, **dumps) -> None:
  """json.dumps(data, **dumps) and a newline, written atomically."""
  write_atomically(path, json.dumps(data, **dumps) + "\n")
