"""Input pipelines: batch i is a pure function of (seed, split, i)."""

import pathlib
import sysconfig

import numpy as np
import pytest

from jaxpipe.training import batches as data


def _same(a, b):
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_stdlib_corpus_is_the_sorted_stdlib_sources():
  corpus = data.stdlib_bytes()
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  # Independent listing: walk the tree, keep .py files outside third-party/cache folders.
  files = sorted(
      p
      for p in root.rglob("*.py")
      if not any(
          part in ("site-packages", "dist-packages", "__pycache__")
          for part in p.relative_to(root).parts
      )
  )
  assert len(corpus) == sum(p.stat().st_size for p in files) + len(files) - 1
  first, last = files[0].read_bytes(), files[-1].read_bytes()
  assert corpus[: len(first)].tobytes() == first and corpus[len(first)] == 0
  assert corpus[len(corpus) - len(last) :].tobytes() == last
  assert corpus.dtype == np.uint8 and len(corpus) > 1_000_000


def test_byte_corpus_batches_are_step_indexed():
  a = data.ByteCorpus(data.stdlib_bytes(), 0.02, seed=3)
  b = data.ByteCorpus(data.stdlib_bytes(), 0.02, seed=3)
  # Drawn in a different order, by a different instance: the same batches.
  first = [a.batch("train", i, 4, 32) for i in (0, 1, 7)]
  later = [b.batch("train", i, 4, 32) for i in (7, 1, 0)][::-1]
  assert all(_same(x, y) for x, y in zip(first, later))
  assert not _same(first[0], first[1])
  assert not _same(
      first[0], data.ByteCorpus(data.stdlib_bytes(), 0.02, seed=4).batch("train", 0, 4, 32)
  )
  x = first[0]
  assert x["tokens"].shape == x["targets"].shape == x["mask"].shape == (4, 32)
  assert x["tokens"].dtype == np.int32 and x["mask"].dtype == np.float32
  np.testing.assert_array_equal(x["tokens"][:, 1:], x["targets"][:, :-1])
  assert x["mask"].min() == 1


def test_train_and_eval_windows_come_from_disjoint_parts():
  # Values equal to positions, so every window says where it was cut from.
  corpus = data.ByteCorpus(np.arange(1000), eval_fraction=0.1, seed=0)
  for i in range(20):
    train, ev = corpus.batch("train", i, 8, 16), corpus.batch("eval", i, 8, 16)
    assert train["targets"].max() < 900 <= ev["tokens"].min()
    np.testing.assert_array_equal(np.diff(train["tokens"], axis=1), 1)
  with pytest.raises(ValueError, match="fewer than seq_len"):
    corpus.batch("eval", 0, 2, 200)
  with pytest.raises(ValueError, match="split='test' is unknown"):
    corpus.batch("test", 0, 2, 8)


def test_synthetic_source_is_deterministic_and_masked():
  s = data.Synthetic(vocab=64, seed=1)
  a, b = s.batch("train", 5, 16, 24), data.Synthetic(64, 1).batch("train", 5, 16, 24)
  assert _same(a, b) and not _same(a, s.batch("train", 6, 16, 24))
  assert not _same(a, s.batch("eval", 5, 16, 24))
  counts = a["mask"].sum(1)
  assert counts.min() >= 12 and counts.max() <= 24 and len(set(counts)) > 1
  valid = a["mask"] == 1
  # The target is the next element of the row's arithmetic progression.
  stride = (a["tokens"][:, 1] - a["tokens"][:, 0]) % 64
  np.testing.assert_array_equal(a["targets"][valid], ((a["tokens"] + stride[:, None]) % 64)[valid])
  assert np.all(a["targets"][~valid] == 0)


@pytest.mark.parametrize(
    "source",
    [data.ByteCorpus(np.arange(5000) % 251, 0.1, seed=2), data.Synthetic(vocab=64, seed=1)],
    ids=["bytes", "synthetic"],
)
def test_some_rows_equal_those_rows_of_the_whole_batch(source):
  """What one process of a multi-process run reads: its rows only, the whole batch's rows."""
  whole = source.batch("train", 3, 16, 24)
  rows = np.array([2, 3, 10, 11])
  part = source.batch("train", 3, 16, 24, rows=rows)
  assert _same(part, {k: v[rows] for k, v in whole.items()})
