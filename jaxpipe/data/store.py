"""A token store on disk: documents' ids concatenated, their boundaries, memory-mapped reads.

  DIR/tokens.bin     every document's ids, one after another (uint16 when the vocabulary has at
                     most 65,536 ids, else uint32)
  DIR/offsets.npy    int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
  DIR/loss_mask.bin  uint8, one per token (1 = trained on), only when some document has a mask
                     (chat data: the assistant turns); documents without one are all 1
  DIR/meta.json      format version, dtype, counts, the tokenizer it was made with (kind, vocab
                     size, eos/bos ids, sha256 of tokenizer.json), the inputs, what was skipped

This is Megatron's indexed dataset in spirit, not Grain or ArrayRecord (neither is a
dependency): training asks for batch i of a split as a pure function of (seed, split, i), which
needs random access by document, not a stream of records; a document is a slice of one flat
array, so a batch row is a few zero-copy `np.memmap` slices and nothing is ever loaded whole;
and the files are plain arrays that numpy, or any other reader, opens without a schema.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
MASK_FILE = "loss_mask.bin"
META_FILE = "meta.json"
PREPARE = "python -m jaxpipe.data prepare"  # the command that writes stores (for messages)


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned dtype holding every id below `vocab_size`.

  Args:
    vocab_size: the tokenizer's number of ids.

  Returns:
    `uint16` when `vocab_size` is at most 65,536, else `uint32`.
  """
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class StoreWriter:
  """Appends documents to a new store in `path` (a directory that must be empty or absent).

  `append(ids, mask=None)` per document, then `close(meta)` writes offsets and meta.json. A
  mask that first appears after unmasked documents gets ones written for those documents.
  """

  def __init__(self, path: str | os.PathLike, vocab_size: int):
    self.path = os.fspath(path)
    os.makedirs(self.path, exist_ok=True)
    if os.listdir(self.path):
      raise ValueError(f"{self.path} is not empty; write a store into a new directory")
    self.vocab_size = vocab_size
    self.dtype = token_dtype(vocab_size)
    self._tokens = open(os.path.join(self.path, TOKENS_FILE), "wb")
    self._mask = None
    self._offsets = [0]

  @property
  def documents(self) -> int:
    return len(self._offsets) - 1

  @property
  def tokens(self) -> int:
    return self._offsets[-1]

  @property
  def lengths_D(self) -> np.ndarray:
    """The lengths of the documents appended so far (int64)."""
    return np.diff(np.asarray(self._offsets, np.int64))

  def append(self, ids_N: Sequence[int] | np.ndarray, mask_N: Sequence[int] | None = None) -> None:
    """Adds one document: its ids and, for chat data, its loss mask.

    Args:
      ids_N: the document's token ids, [tokens], non-empty, each in `[0, vocab_size)`.
      mask_N: its loss mask, [tokens] (1 = trained on); None counts every token.

    Raises:
      ValueError: `ids_N` is empty or not 1-D, holds ids outside the vocabulary, or `mask_N` has
        another shape.
    """
    ids_N = np.asarray(ids_N)
    if ids_N.ndim != 1 or not len(ids_N):
      raise ValueError(f"a document needs a non-empty list of ids, got shape {ids_N.shape}")
    if ids_N.min() < 0 or ids_N.max() >= self.vocab_size:
      raise ValueError(
          f"document {self.documents} has ids in [{ids_N.min()}, {ids_N.max()}], outside the "
          f"vocabulary of {self.vocab_size}"
      )
    if mask_N is not None:
      mask_N = np.asarray(mask_N, np.uint8)
      if mask_N.shape != ids_N.shape:
        raise ValueError(f"document {self.documents}: mask {mask_N.shape} != ids {ids_N.shape}")
      if self._mask is None:
        self._mask = open(os.path.join(self.path, MASK_FILE), "wb")
        self._mask.write(np.ones(self.tokens, np.uint8).tobytes())
    self._tokens.write(ids_N.astype(self.dtype).tobytes())
    if self._mask is not None:
      self._mask.write((np.ones(len(ids_N), np.uint8) if mask_N is None else mask_N).tobytes())
    self._offsets.append(self.tokens + len(ids_N))

  def close(self, meta: dict[str, Any]) -> dict[str, Any]:
    """Writes the offsets and `meta.json`, finishing the store.

    Args:
      meta: entries added to the ones written here (format version, dtype, document and token
        counts, whether there is a loss mask).

    Returns:
      The meta written to `meta.json`.
    """
    self._tokens.close()
    if self._mask is not None:
      self._mask.close()
    np.save(os.path.join(self.path, OFFSETS_FILE), np.asarray(self._offsets, np.int64))
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": self.dtype.name,
        "documents": self.documents,
        "tokens": self.tokens,
        "loss_mask": self._mask is not None,
        **meta,
    }
    with open(os.path.join(self.path, META_FILE), "w") as f:
      json.dump(meta, f, indent=1)
    return meta

  def abort(self) -> None:
    """Closes the files without finishing the store (the caller removes the directory)."""
    self._tokens.close()
    if self._mask is not None:
      self._mask.close()


class TokenStore:
  """A store opened for reading: every array memory-mapped, nothing read until sliced.

  ValueError (one line, naming the directory and the fix) when `path` is not a whole store.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self.meta = read_meta(self.path)
    self.dtype = np.dtype(self.meta["dtype"])
    n_docs, n_tokens = self.meta["documents"], self.meta["tokens"]
    self.offsets_D1 = np.load(os.path.join(self.path, OFFSETS_FILE), mmap_mode="r")
    if self.offsets_D1.shape != (n_docs + 1,) or int(self.offsets_D1[-1]) != n_tokens:
      raise ValueError(
          f"{self.path}/{OFFSETS_FILE} does not match meta.json ({n_docs} documents, {n_tokens} "
          f"tokens): the store is damaged; prepare it again ({PREPARE})"
      )
    self.tokens_N = self._memmap(TOKENS_FILE, self.dtype, n_tokens)
    self.mask_N = self._memmap(MASK_FILE, np.uint8, n_tokens) if self.meta["loss_mask"] else None

  def _memmap(self, name: str, dtype: np.dtype, n: int) -> np.ndarray:
    path = os.path.join(self.path, name)
    size = os.path.getsize(path) if os.path.isfile(path) else None
    if size != n * np.dtype(dtype).itemsize:
      raise ValueError(
          f"{path} holds {size} bytes, not the {n} x {np.dtype(dtype).name} of meta.json: the "
          f"store is damaged; prepare it again ({PREPARE})"
      )
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))

  @property
  def documents(self) -> int:
    return len(self.offsets_D1) - 1

  @property
  def lengths_D(self) -> np.ndarray:
    """Every document's length in tokens (int64)."""
    return np.diff(self.offsets_D1)

  def ids(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
    """Tokens `[start, end)` of document `doc`.

    Args:
      doc: the document's index.
      start: the first token, relative to the document's start.
      end: one past the last token, relative to the document's start; None: the document's end.

    Returns:
      A zero-copy view of the memory map, [end - start], of the store's dtype.
    """
    lo, hi = int(self.offsets_D1[doc]), int(self.offsets_D1[doc + 1])
    return self.tokens_N[lo + start : hi if end is None else lo + end]

  def mask(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray | None:
    """The loss mask of the same tokens as `ids(doc, start, end)`.

    Args:
      doc: the document's index.
      start: the first token, relative to the document's start.
      end: one past the last token, relative to the document's start; None: the document's end.

    Returns:
      A zero-copy uint8 view, [end - start] (1 = trained on); None when the store has no mask
      (every token counted).
    """
    if self.mask_N is None:
      return None
    lo, hi = int(self.offsets_D1[doc]), int(self.offsets_D1[doc + 1])
    return self.mask_N[lo + start : hi if end is None else lo + end]


def read_meta(path: str) -> dict[str, Any]:
  """Reads a store's `meta.json`, checked.

  Args:
    path: the store's directory.

  Returns:
    The parsed `meta.json`.

  Raises:
    ValueError: one line naming the directory when it is not a token store (no directory, no or
      an unreadable `meta.json`, another format version).
  """
  if not os.path.isdir(path):
    raise ValueError(f"{path}: no such directory; make a token store with {PREPARE}")
  meta_file = os.path.join(path, META_FILE)
  if not os.path.isfile(meta_file):
    raise ValueError(f"{path} is not a token store (no {META_FILE}); make one with {PREPARE}")
  try:
    with open(meta_file) as f:
      meta = json.load(f)
    version = meta["format_version"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(
        f"{meta_file} is not a token store's meta.json ({e}); make the store again with {PREPARE}"
    ) from None
  if version != FORMAT_VERSION:
    raise ValueError(
        f"{path} is a token store of format {version}, this jaxpipe reads format "
        f"{FORMAT_VERSION}; prepare it again with {PREPARE}"
    )
  return meta
