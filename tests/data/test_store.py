"""The token store's files: what the writer puts there is what the reader's memory maps give back,
in the dtype the vocabulary needs; a directory that is not a whole store is refused in one line."""

import json
import os

import numpy as np
import pytest

from jaxpipe.data import store as store_lib


def _docs(rng, n, vocab):
  return [rng.integers(0, vocab, size=rng.integers(1, 20)) for _ in range(n)]


def test_round_trip_with_a_mask_backfilled(tmp_path):
  rng = np.random.default_rng(0)
  docs = _docs(rng, 5, 300)
  masks = [None, None, rng.integers(0, 2, size=len(docs[2])), None, None]
  writer = store_lib.StoreWriter(tmp_path / "s", 300)
  for ids, mask in zip(docs, masks):
    writer.append(ids, mask)
  meta = writer.close({"tokenizer": {"kind": "bytes"}})
  assert meta["documents"] == 5 and meta["tokens"] == sum(map(len, docs))

  store = store_lib.TokenStore(tmp_path / "s")
  assert isinstance(store.tokens_N, np.memmap) and store.tokens_N.dtype == np.uint16
  assert isinstance(store.mask_N, np.memmap)
  flat = np.fromfile(tmp_path / "s" / store_lib.TOKENS_FILE, np.uint16)  # the layout, by hand
  np.testing.assert_array_equal(flat, np.concatenate(docs))
  np.testing.assert_array_equal(
      np.load(tmp_path / "s" / store_lib.OFFSETS_FILE), np.cumsum([0] + [len(d) for d in docs])
  )
  for d, (ids, mask) in enumerate(zip(docs, masks)):
    np.testing.assert_array_equal(store.ids(d), ids)
    np.testing.assert_array_equal(store.ids(d, 1, 3), ids[1:3])
    want = np.ones(len(ids)) if mask is None else mask  # unmasked documents count every token
    np.testing.assert_array_equal(store.mask(d), want)
  np.testing.assert_array_equal(store.lengths_D, [len(d) for d in docs])
  assert json.loads((tmp_path / "s" / store_lib.META_FILE).read_text())["tokenizer"] == {
      "kind": "bytes"
  }


def test_no_mask_file_without_masks_and_uint32_past_65536(tmp_path):
  writer = store_lib.StoreWriter(tmp_path / "s", 70_000)
  writer.append([69_999, 0, 65_536])
  writer.close({})
  assert not os.path.exists(tmp_path / "s" / store_lib.MASK_FILE)
  store = store_lib.TokenStore(tmp_path / "s")
  assert store.tokens_N.dtype == np.uint32 and store.mask(0) is None
  np.testing.assert_array_equal(store.ids(0), [69_999, 0, 65_536])


def test_writer_refusals(tmp_path):
  writer = store_lib.StoreWriter(tmp_path / "s", 10)
  with pytest.raises(ValueError, match=r"ids in \[0, 10\], outside the vocabulary of 10"):
    writer.append([0, 10])
  with pytest.raises(ValueError, match="non-empty"):
    writer.append([])
  writer.abort()
  with pytest.raises(ValueError, match="is not empty; write a store into a new directory"):
    store_lib.StoreWriter(tmp_path / "s", 10)


@pytest.fixture
def small_store(tmp_path):
  writer = store_lib.StoreWriter(tmp_path / "s", 256)
  writer.append(list(b"hello"))
  writer.append(list(b"world!"))
  writer.close({})
  return tmp_path / "s"


def test_reader_refusals(tmp_path, small_store):
  with pytest.raises(ValueError, match="no such directory; make a token store with python -m"):
    store_lib.TokenStore(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=r"is not a token store \(no meta.json\); make one with"):
    store_lib.TokenStore(tmp_path / "empty")
  with open(small_store / store_lib.TOKENS_FILE, "r+b") as f:  # a truncated copy
    f.truncate(4)
  with pytest.raises(ValueError, match="holds 4 bytes, not the 11 x uint16 of meta.json"):
    store_lib.TokenStore(small_store)


def test_reader_refuses_another_format(small_store):
  meta = json.loads((small_store / store_lib.META_FILE).read_text())
  meta["format_version"] = 99
  (small_store / store_lib.META_FILE).write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="format 99, this jaxpipe reads format 1; prepare it again"):
    store_lib.TokenStore(small_store)
