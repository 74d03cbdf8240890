"""Step-indexed input pipelines: batch `i` of a split is a pure function of (seed, split, i).

Because nothing depends on how many batches were drawn before, a run resumed at step s sees
exactly the batches an uninterrupted run would have seen. Batches are numpy dicts:
`tokens` and `targets` int32 [batch, seq_len], `mask` float32 [batch, seq_len] (1 = counted);
a token store's (`data.source=tokens:DIR`, `jaxpipe.data.source`) adds `segment_ids` and
`positions` int32 [batch, seq_len] (documents packed into a row).
`rows` asks for some rows of the batch only (what one process of a multi-process run feeds its
devices), equal to those rows of the whole batch.
"""

import functools
import pathlib
import sysconfig
from typing import Protocol

import ml_collections
import numpy as np

from jaxpipe.data import source as data_source
from jaxpipe.training import config as config_lib

SPLITS = ("train", "eval")


class Source(Protocol):

  def batch(
      self, split: str, index: int, batch: int, seq_len: int, rows: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """Batch number `index` of `split` (only its `rows`, in that order, when given).

    Args:
      split: 'train' or 'eval'.
      index: the batch's number, >= 0; the batch is a function of (seed, split, index) only.
      batch: B, sequences in the whole batch.
      seq_len: L, tokens per sequence.
      rows: the rows to return, in that order; None: all B.

    Returns:
      `tokens` and `targets` int32 [R, L], `mask` float32 [R, L] (1 = counted), R the rows asked
      for; a token store adds `segment_ids` and `positions` int32 [R, L].
    """


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
  if split not in SPLITS:
    raise ValueError(f"split={split!r} is unknown; use one of {SPLITS}")
  if index < 0:
    raise ValueError(f"batch index {index} must be >= 0")
  return np.random.default_rng([seed, SPLITS.index(split), index])


def _rows(per_row_B: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
  """The entries of the batch's rows asked for (all when `rows` is None)."""
  return per_row_B if rows is None else per_row_B[rows]


@functools.lru_cache(maxsize=1)
def stdlib_bytes() -> np.ndarray:
  """The bytes of the Python standard library's .py files, in sorted path order, NUL-separated."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(
      p
      for p in root.rglob("*.py")
      if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)
  )
  if not files:
    raise FileNotFoundError(
        f"no .py files under the standard library directory {root}; use "
        "--config.data.source=synthetic"
    )
  return np.frombuffer(b"\0".join(p.read_bytes() for p in files), np.uint8)


class ByteCorpus:
  """Byte-level language modelling on a byte string: windows at step-indexed random offsets."""

  def __init__(self, data_N: np.ndarray, eval_fraction: float, seed: int):
    n_eval = int(len(data_N) * eval_fraction)
    self.splits = {"train": data_N[: len(data_N) - n_eval], "eval": data_N[len(data_N) - n_eval :]}
    self.seed = seed

  def batch(
      self, split: str, index: int, batch: int, seq_len: int, rows: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """Windows of seq_len + 1 bytes at step-indexed random offsets of the split.

    Args:
      split: 'train' or 'eval'.
      index: the batch's number, >= 0; the batch is a function of (seed, split, index) only.
      batch: B, sequences in the whole batch.
      seq_len: L, tokens per sequence.
      rows: the rows to return, in that order; None: all B.

    Returns:
      `tokens` and `targets` int32 [R, L] (a window's first L bytes and its last L), `mask`
      float32 [R, L] of ones.

    Raises:
      ValueError: an unknown split, a negative index, or a split shorter than seq_len + 1 bytes.
    """
    rng = _rng(self.seed, split, index)
    data = self.splits[split]
    if len(data) < seq_len + 1:
      raise ValueError(
          f"the {split} split has {len(data)} bytes, fewer than seq_len + 1 = "
          f"{seq_len + 1}; shorten data.seq_len or enlarge data.eval_fraction"
      )
    start_R = _rows(rng.integers(0, len(data) - seq_len, size=batch), rows)
    window_RxL1 = data[start_R[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {
        "tokens": window_RxL1[:, :-1],
        "targets": window_RxL1[:, 1:],
        "mask": np.ones((len(start_R), seq_len), np.float32),
    }


class Synthetic:
  """Learnable random sequences for tests: arithmetic progressions mod vocab, right-padded.

  Each row counts up from a random start by a random stride; a random-length tail is padding
  (mask 0), so the number of valid tokens varies between rows and batches.
  """

  def __init__(self, vocab: int, seed: int):
    self.vocab, self.seed = vocab, seed

  def batch(
      self, split: str, index: int, batch: int, seq_len: int, rows: np.ndarray | None = None
  ) -> dict[str, np.ndarray]:
    """Arithmetic progressions mod vocab, each row right-padded after a random length.

    Args:
      split: 'train' or 'eval'.
      index: the batch's number, >= 0; the batch is a function of (seed, split, index) only.
      batch: B, sequences in the whole batch.
      seq_len: L, tokens per sequence.
      rows: the rows to return, in that order; None: all B.

    Returns:
      `tokens` and `targets` int32 [R, L] (targets 0 on padding), `mask` float32 [R, L], 1 on the
      first L/2 to L positions of a row, 0 on its padding.

    Raises:
      ValueError: an unknown split or a negative index.
    """
    rng = _rng(self.seed, split, index)
    start_R = _rows(rng.integers(0, self.vocab, size=batch), rows)
    stride_R = _rows(rng.integers(1, 4, size=batch), rows)
    seq_RxL1 = (start_R[:, None] + stride_R[:, None] * np.arange(seq_len + 1)) % self.vocab
    length_R = _rows(rng.integers(seq_len // 2, seq_len + 1, size=batch), rows)
    mask_RxL = (np.arange(seq_len)[None, :] < length_R[:, None]).astype(np.float32)
    seq_RxL1 = seq_RxL1.astype(np.int32)
    return {
        "tokens": seq_RxL1[:, :-1],
        "targets": seq_RxL1[:, 1:] * mask_RxL.astype(np.int32),
        "mask": mask_RxL,
    }


def make_source(data: ml_collections.ConfigDict, vocab: int, workdir: str | None = None) -> Source:
  """The source named by `data.source`.

  A token store is checked against the run's `workdir`'s tokenizer (hf/, a converted
  checkpoint's) when it has one.

  Args:
    data: the config's `data` section: source ('stdlib', 'synthetic' or 'tokens:DIR'),
      eval_fraction and seed.
    vocab: the model's vocabulary size.
    workdir: the run's workdir, or None.

  Returns:
    The `Source`.

  Raises:
    ConfigError: a token store that does not fit the run.
    ValueError: an unknown source.
    FileNotFoundError: 'stdlib' where the standard library has no .py files.
  """
  if data.source == "stdlib":
    return ByteCorpus(stdlib_bytes(), data.eval_fraction, data.seed)
  if data.source == "synthetic":
    return Synthetic(vocab, data.seed)
  if data_source.store_dir(data.source) is not None:
    try:
      store = data_source.check(data.source, vocab, data.eval_fraction, False, workdir)
    except ValueError as e:  # a config error: the runner's one line and usage status
      raise config_lib.ConfigError(str(e)) from None
    return data_source.TokenSource(store, data.eval_fraction, data.seed)
  raise ValueError(
      f"data.source={data.source!r} is unknown; use 'stdlib', 'synthetic' or "
      f"'{data_source.PREFIX}DIR' (a token store: python -m jaxpipe.data prepare)"
  )
