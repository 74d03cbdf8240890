"""`data.source=tokens:DIR`: training batches packed from the whole documents of a token store.

Batch i of a split is a pure function of (seed, split, i), as for every source of
`jaxpipe.training.batches`, so a resumed run is bit-exact. How:

- The split. Each document goes to eval when a hash of its index (splitmix64, no seed) falls
  below `data.eval_fraction`, else to train: documents, never parts of one, are held out, and
  the same documents whatever the seed, the batch size or the sequence length.
- The order. Epoch e of a split visits its documents in a permutation drawn from
  (seed, split, e). A document longer than a row (seq_len + 1 tokens) is cut into row-sized
  pieces, kept in order; the train split's count of such documents is logged.
- The packing. Pieces fill rows of seq_len + 1 tokens greedily, in that order: a piece that does
  not fit in what is left of the row starts the next row, and the rest of the row is padding.
  Global row g = i * batch + r of batch i is row g of the concatenated epochs; an epoch's row
  table (which pieces each row holds) is computed once from the document lengths alone, so a
  batch reads only its own rows' tokens (`rows`: those of one process).

Each row gives `tokens` (its first seq_len tokens) and `targets` (the next token), int32
[rows, seq_len], and `mask` float32: 1 where the target is counted, 0 on padding, 0 where the
target is the first token of the next document (attention and prediction never cross a
boundary), 0 where the store's loss mask (chat data: the assistant turns) is 0 for the target.
`segment_ids` int32 numbers the pieces of a row 1, 2, 3, ... (0 on padding) and `positions`
int32 counts from 0 at the start of each piece.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
from absl import logging

from jaxpipe.data import store as store_lib
from jaxpipe.models import tokenizer as tokenizer_lib

PREFIX = "tokens:"  # data.source = "tokens:DIR"
SPLITS = ("train", "eval")  # as jaxpipe.training.batches.SPLITS


def store_dir(source: str) -> str | None:
  """The directory of a `tokens:DIR` source.

  Args:
    source: the value of `data.source`.

  Returns:
    DIR of a `tokens:DIR` source; None for any other source.
  """
  return source[len(PREFIX) :] if source.startswith(PREFIX) else None


def eval_documents(documents: int, eval_fraction: float) -> np.ndarray:
  """Which documents the eval split holds.

  A document goes to eval when a hash of its index (splitmix64, no seed) falls below
  `eval_fraction`.

  Args:
    documents: the number of documents in the store.
    eval_fraction: the fraction of documents held out for eval, in [0, 1].

  Returns:
    bool [documents]: True for the eval split's documents.
  """
  z = np.arange(documents, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
  with np.errstate(over="ignore"):  # splitmix64: arithmetic modulo 2^64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < eval_fraction


def tokenizer_sha256(path: str) -> str:
  """The sha256 of a `tokenizer.json` file.

  This is what a store records of the tokenizer it was made by.

  Args:
    path: the `tokenizer.json` file.

  Returns:
    Its sha256, as a hex string.
  """
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _made_with(meta: dict) -> str:
  t = meta.get("tokenizer", {})
  if t.get("kind") == "bytes":
    return "the byte tokenizer"
  return f"the tokenizer of {t.get('path')} (sha256 {str(t.get('sha256'))[:12]}...)"


def check(
    source: str,
    vocab: int,
    eval_fraction: float,
    need_eval: bool,
    workdir: str | None = None,
) -> store_lib.TokenStore:
  """Opens the store of a `tokens:DIR` source, checked against the run.

  Args:
    source: the value of `data.source`, `tokens:DIR`.
    vocab: the model's embedding rows (`model.vocab`).
    eval_fraction: `data.eval_fraction`.
    need_eval: whether the run evaluates, so the eval split must hold documents.
    workdir: the run's workdir; a tokenizer it holds (`hf/tokenizer.json`) must be the store's.

  Returns:
    The opened `TokenStore`.

  Raises:
    ValueError: in one line naming the value and the fix, when `source` is not a store, when its
      tokenizer's ids exceed the `vocab` embedding rows, when a split the run needs is empty, or
      when `workdir` holds a tokenizer (hf/) other than the store's.
  """
  path = store_dir(source)
  if not path:
    raise ValueError(f"data.source={source!r} names no directory; use {PREFIX}DIR")
  try:
    store = store_lib.TokenStore(path)
  except ValueError as e:
    raise ValueError(f"data.source={source!r}: {e}") from None
  made = store.meta.get("tokenizer", {})
  if made.get("vocab_size", 0) > vocab:
    raise ValueError(
        f"data.source={source!r} was made by a tokenizer of {made['vocab_size']} ids but "
        f"model.vocab={vocab} embedding rows; set --config.model.vocab={made['vocab_size']} (or "
        "more) or prepare the store with the model's tokenizer"
    )
  in_eval_D = eval_documents(store.documents, eval_fraction)
  if not (~in_eval_D).any():
    raise ValueError(
        f"data.source={source!r}: data.eval_fraction={eval_fraction} leaves the train split none "
        f"of the store's {store.documents} documents; lower data.eval_fraction"
    )
  if need_eval and not in_eval_D.any():
    raise ValueError(
        f"data.source={source!r}: data.eval_fraction={eval_fraction} gives the eval split none "
        f"of the store's {store.documents} documents; raise data.eval_fraction or set "
        "--config.train.eval_every=0"
    )
  if workdir is not None:
    hf_file = os.path.join(workdir, tokenizer_lib.HF_DIR, tokenizer_lib.TOKENIZER_FILE)
    if os.path.isfile(hf_file) and made.get("sha256") != tokenizer_sha256(hf_file):
      raise ValueError(
          f"data.source={source!r} was made with {_made_with(store.meta)}, not with the "
          f"workdir's {hf_file}; prepare the corpus with python -m jaxpipe.data prepare "
          f"--tokenizer {workdir} ..."
      )
  return store


def _pack(lengths_P: np.ndarray, capacity: int) -> np.ndarray:
  """int64 [rows + 1]: row r holds pieces [starts[r], starts[r + 1]) (greedy, in order)."""
  starts, used = [0], 0
  for p, n in enumerate(lengths_P.tolist()):
    if used + n > capacity:
      starts.append(p)
      used = 0
    used += n
  starts.append(len(lengths_P))
  return np.asarray(starts, np.int64)


class TokenSource:
  """The `Source` of data.source=tokens:DIR (module docstring)."""

  def __init__(self, store: store_lib.TokenStore, eval_fraction: float, seed: int):
    self.store, self.seed = store, seed
    in_eval_D = eval_documents(store.documents, eval_fraction)
    self.documents = {"train": np.flatnonzero(~in_eval_D), "eval": np.flatnonzero(in_eval_D)}
    self._rows: dict[tuple[str, int], list[int]] = {}  # (split, capacity) -> rows per epoch
    self._logged = False

  def long_documents(self, split: str, seq_len: int) -> int:
    """How many of the split's documents are longer than a row and are cut into pieces.

    Args:
      split: `"train"` or `"eval"`.
      seq_len: tokens per row, less one (a row holds `seq_len + 1` tokens).

    Returns:
      The number of the split's documents longer than `seq_len + 1` tokens.
    """
    return int(np.sum(self.store.lengths_D[self.documents[split]] > seq_len + 1))

  @functools.lru_cache(maxsize=8)  # noqa: B019 -- a source lives as long as its run
  def _epoch(self, split: str, capacity: int, epoch: int) -> tuple[np.ndarray, ...]:
    """Epoch `epoch`'s pieces (document, start, length) in order, and its row table."""
    docs = self.documents[split]
    rng = np.random.default_rng([self.seed, SPLITS.index(split), epoch])
    order_D = docs[rng.permutation(len(docs))]
    length_D = self.store.lengths_D[order_D]
    count_D = -(-length_D // capacity)  # pieces per document
    doc_P = np.repeat(order_D, count_D)
    first_P = np.repeat(np.cumsum(count_D) - count_D, count_D)
    start_P = (np.arange(len(doc_P)) - first_P) * capacity
    len_P = np.minimum(capacity, np.repeat(length_D, count_D) - start_P)
    return doc_P, start_P, len_P, _pack(len_P, capacity)

  def _locate(self, split: str, capacity: int, row: int) -> tuple[int, int]:
    """(epoch, row within it) of global row `row`."""
    counts = self._rows.setdefault((split, capacity), [])
    epoch, first = 0, 0
    while True:
      if epoch == len(counts):
        counts.append(len(self._epoch(split, capacity, epoch)[3]) - 1)
      if row < first + counts[epoch]:
        return epoch, row - first
      first += counts[epoch]
      epoch += 1

  def batch(
      self, split: str, index: int, batch: int, seq_len: int, rows: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """Batch `index` of `split`, packed as the module docstring describes.

    A pure function of (seed, split, index). The first train batch logs how many documents are cut
    into row-sized pieces.

    Args:
      split: `"train"` or `"eval"`.
      index: the batch's index, >= 0.
      batch: rows in the global batch.
      seq_len: tokens per row.
      rows: which of the batch's rows to read (those of one process); default all `batch` rows.

    Returns:
      A dict of `tokens`, `targets`, `segment_ids` and `positions` (int32 [rows, seq_len]) and
      `mask` (float32 [rows, seq_len]).

    Raises:
      ValueError: an unknown split, a negative `index`, or a split with no documents.
    """
    if split not in SPLITS:
      raise ValueError(f"split={split!r} is unknown; use one of {SPLITS}")
    if index < 0:
      raise ValueError(f"batch index {index} must be >= 0")
    if not len(self.documents[split]):
      raise ValueError(f"the {split} split holds no documents; change data.eval_fraction")
    if not self._logged and split == "train":
      self._logged = True
      long = self.long_documents(split, seq_len)
      if long:
        logging.warning(
            "%d of the train split's %d documents are longer than a row of seq_len + 1 = %d "
            "tokens; each is cut into row-sized pieces",
            long,
            len(self.documents[split]),
            seq_len + 1,
        )
    capacity = seq_len + 1
    rows_R = np.arange(batch) if rows is None else np.asarray(rows)
    row_RxC = np.zeros((len(rows_R), capacity), np.int32)
    segment_RxC = np.zeros((len(rows_R), capacity), np.int32)
    position_RxC = np.zeros((len(rows_R), capacity), np.int32)
    counted_RxC = np.zeros((len(rows_R), capacity), bool)
    for i, r in enumerate(rows_R.tolist()):
      epoch, local = self._locate(split, capacity, index * batch + r)
      doc_P, start_P, len_P, starts = self._epoch(split, capacity, epoch)
      at = 0
      for segment, p in enumerate(range(starts[local], starts[local + 1]), 1):
        doc, start, n = int(doc_P[p]), int(start_P[p]), int(len_P[p])
        row_RxC[i, at : at + n] = self.store.ids(doc, start, start + n)
        mask = self.store.mask(doc, start, start + n)
        counted_RxC[i, at : at + n] = True if mask is None else mask.astype(bool)
        segment_RxC[i, at : at + n] = segment
        position_RxC[i, at : at + n] = np.arange(n)
        at += n
    same_RxL = (segment_RxC[:, 1:] == segment_RxC[:, :-1]) & (segment_RxC[:, :-1] > 0)
    return {
        "tokens": np.ascontiguousarray(row_RxC[:, :-1]),
        "targets": np.ascontiguousarray(row_RxC[:, 1:]),
        "mask": (same_RxL & counted_RxC[:, 1:]).astype(np.float32),
        "segment_ids": np.ascontiguousarray(segment_RxC[:, :-1]),
        "positions": np.ascontiguousarray(position_RxC[:, :-1]),
    }
