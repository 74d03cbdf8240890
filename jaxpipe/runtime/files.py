"""Files that are read back (configs, cost files, results) are written whole or not at all."""

import json
import os
from typing import Any


def write_atomically(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` whole or not at all.

  Writes through a `.tmp` file beside `path` and `os.replace`: a kill or a full disk mid-write
  leaves the old file (or none), never a cut one. A failed write leaves no stray `.tmp`.

  Args:
    path: the file to write.
    text: its new contents.
  """
  path = os.fspath(path)
  try:
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  finally:
    if os.path.exists(path + ".tmp"):  # the write failed: no stray .tmp
      os.remove(path + ".tmp")


def write_json(path: str | os.PathLike, data: Any, **dumps) -> None:
  """Writes `json.dumps(data, **dumps)` and a newline to `path`, atomically.

  Args:
    path: the file to write.
    data: a JSON-serialisable value.
    **dumps: keyword arguments for `json.dumps` (`indent`, `sort_keys`, ...).
  """
  write_atomically(path, json.dumps(data, **dumps) + "\n")
