"""data.source=tokens:DIR: batches are a pure function of (seed, split, index) and of the rows
asked for; rows hold whole documents (or row-sized pieces of long ones) exactly as a plain-Python
re-packing of the store's documents gives them; the held-out split is document-disjoint; the
config refuses a store that cannot serve the run; and a tiny model trains on one."""

import os
import shutil

import numpy as np
import pytest

from configs import tiny
from jaxpipe.data import prepare as prepare_lib
from jaxpipe.data import source as source_lib
from jaxpipe.data import store as store_lib
from jaxpipe.training import batches as data_lib
from jaxpipe.training import config as config_lib
from jaxpipe.training.trainer import Trainer
from tests import helpers

TEXT = os.path.join(helpers.ROOT, "tests", "fixtures", "corpus", "text.jsonl")
SEQ = 16
BATCH = 8


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  """A store of 60 random documents of 1 to 40 tokens (many longer than a row of 17), a third of
  them with a random loss mask; -> (path, documents, masks)."""
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("synthetic") / "s"
  writer = store_lib.StoreWriter(path, 300)
  docs, masks = [], []
  for d in range(60):
    ids = rng.integers(1, 300, size=rng.integers(1, 41))
    mask = rng.integers(0, 2, size=len(ids)) if d % 3 == 0 else None
    writer.append(ids, mask)
    docs.append(ids.tolist())
    masks.append([1] * len(ids) if mask is None else mask.tolist())
  writer.close({"tokenizer": {"kind": "test", "vocab_size": 300}})
  return str(path), docs, masks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """text.jsonl through the byte tokenizer."""
  path = tmp_path_factory.mktemp("corpus") / "s"
  prepare_lib.prepare("bytes", [TEXT], str(path), workers=1, progress=False)
  return str(path)


def _source(path, eval_fraction=0.2, seed=3):
  return source_lib.TokenSource(store_lib.TokenStore(path), eval_fraction, seed)


def _reference_rows(docs, masks, split_docs, seed, split, n_rows):
  """The first n_rows rows of a split, packed in plain Python from the documents (docstring of
  jaxpipe.data.source): [(tokens, loss mask) of each piece in the row]."""
  capacity, rows, epoch = SEQ + 1, [], 0
  while len(rows) < n_rows:
    perm = np.random.default_rng([seed, ("train", "eval").index(split), epoch]).permutation
    row, used = [], 0
    for d in np.asarray(split_docs)[perm(len(split_docs))]:
      for s in range(0, len(docs[d]), capacity):
        piece = (docs[d][s : s + capacity], masks[d][s : s + capacity])
        if used + len(piece[0]) > capacity:
          rows.append(row)
          row, used = [], 0
        row.append(piece)
        used += len(piece[0])
    rows.append(row)
    epoch += 1
  return rows[:n_rows]


def _expected(row):
  tokens, loss, segment, position = [], [], [], []
  for k, (ids, mask) in enumerate(row, 1):
    tokens += ids
    loss += mask
    segment += [k] * len(ids)
    position += list(range(len(ids)))
  pad = SEQ + 1 - len(tokens)
  tokens, loss, segment, position = (x + [0] * pad for x in (tokens, loss, segment, position))
  counted = [
      float(segment[j] > 0 and segment[j] == segment[j + 1] and loss[j + 1] == 1)
      for j in range(SEQ)
  ]
  return {
      "tokens": tokens[:-1],
      "targets": tokens[1:],
      "mask": counted,
      "segment_ids": segment[:-1],
      "positions": position[:-1],
  }


@pytest.mark.parametrize("split", ["train", "eval"])
def test_rows_equal_a_plain_repacking(synthetic, split):
  path, docs, masks = synthetic
  source = _source(path)
  n_batches = 12  # past the first epoch of either split
  want = _reference_rows(docs, masks, source.documents[split], 3, split, n_batches * BATCH)
  assert sum(len(r) for r in want) > len(source.documents[split])  # more than one epoch
  for i in range(n_batches):
    got = source.batch(split, i, BATCH, SEQ)
    assert {k: v.dtype for k, v in got.items()} == {
        "tokens": np.int32,
        "targets": np.int32,
        "mask": np.float32,
        "segment_ids": np.int32,
        "positions": np.int32,
    }
    for r in range(BATCH):
      for key, value in _expected(want[i * BATCH + r]).items():
        np.testing.assert_array_equal(got[key][r], value, err_msg=f"{split} {i} {r} {key}")


def test_pure_and_row_subsets(synthetic):
  path, _, _ = synthetic
  a, b = _source(path), _source(path)  # a fresh source: no cached tables
  whole = a.batch("train", 5, BATCH, SEQ)
  for key, value in b.batch("train", 5, BATCH, SEQ).items():
    np.testing.assert_array_equal(value, whole[key])
  rows = np.array([6, 1, 3])
  part = _source(path).batch("train", 5, BATCH, SEQ, rows=rows)
  for key, value in part.items():
    np.testing.assert_array_equal(value, whole[key][rows])
  assert not np.array_equal(a.batch("train", 6, BATCH, SEQ)["tokens"], whole["tokens"])
  other_seed = _source(path, seed=4).batch("train", 5, BATCH, SEQ)
  assert not np.array_equal(other_seed["tokens"], whole["tokens"])


def test_rows_read_only_their_own_tokens(synthetic, monkeypatch):
  path, _, _ = synthetic
  source = _source(path)
  whole = source.batch("train", 2, BATCH, SEQ)
  read = []
  ids = store_lib.TokenStore.ids
  monkeypatch.setattr(
      store_lib.TokenStore, "ids", lambda self, d, s=0, e=None: read.append(d) or ids(self, d, s, e)
  )
  source.batch("train", 2, BATCH, SEQ, rows=np.array([4]))
  assert len(read) == int(whole["segment_ids"][4].max())  # one read per piece of row 4


def test_split_is_document_disjoint(synthetic):
  path, docs, _ = synthetic
  source = _source(path)
  train, held = set(source.documents["train"]), set(source.documents["eval"])
  assert not train & held and train | held == set(range(len(docs))) and held
  # the same documents whatever the seed; about the fraction asked for over many documents
  assert set(_source(path, seed=9).documents["eval"]) == held
  assert abs(source_lib.eval_documents(20_000, 0.1).mean() - 0.1) < 0.01
  for i in range(4):  # every eval row piece is a slice of an eval document
    batch = source.batch("eval", i, BATCH, SEQ)
    for r in range(BATCH):
      for k in range(1, batch["segment_ids"][r].max() + 1):
        piece = batch["tokens"][r][batch["segment_ids"][r] == k].tolist()
        assert any(_contains(docs[d], piece) for d in held)
        assert not any(_contains(docs[d], piece) for d in train) or len(piece) < 3


def _contains(doc, piece):
  n = len(piece)
  return any(doc[s : s + n] == piece for s in range(len(doc) - n + 1))


def test_long_documents_are_counted(synthetic):
  path, docs, _ = synthetic
  source = _source(path)
  want = sum(len(docs[d]) > SEQ + 1 for d in source.documents["train"])
  assert source.long_documents("train", SEQ) == want > 0


# --- config -----------------------------------------------------------------------------------


def _config(source, **data):
  c = tiny.get_config()
  c.model.vocab = 256
  c.data.source = source
  c.data.seq_len = 32
  c.data.eval_fraction = 0.1
  c.data.update(data)
  return c


def test_config_refusals(tmp_path, corpus, synthetic):
  def refused(config, match):
    with pytest.raises(config_lib.ConfigError, match=match) as e:
      config_lib.validate(config, 8)
    assert "\n" not in str(e.value)

  refused(_config(f"tokens:{tmp_path}/none"), "no such directory; make a token store with")
  refused(_config(f"tokens:{tmp_path}"), r"is not a token store \(no meta.json\)")
  refused(_config("tokens:"), "names no directory; use tokens:DIR")
  refused(_config("bogus"), r"is unknown; use one of \('stdlib', 'synthetic'\) or 'tokens:DIR'")
  small = _config(f"tokens:{synthetic[0]}")
  refused(small, r"tokenizer of 300 ids but model.vocab=256 .*--config.model.vocab=300")
  refused(_config(f"tokens:{corpus}", eval_fraction=0.001), "gives the eval split none of the")
  quiet = _config(f"tokens:{corpus}", eval_fraction=0.001)
  quiet.train.eval_every = 0  # no evaluation: no eval split needed
  config_lib.validate(quiet, 8)
  config_lib.validate(_config(f"tokens:{corpus}"), 8)


def test_workdir_tokenizer_must_match(tmp_path, corpus):
  workdir = tmp_path / "work"
  (workdir / "hf").mkdir(parents=True)
  tok = helpers.tiny_bpe()
  tok.save(str(workdir / "hf" / "tokenizer.json"))
  data = _config(f"tokens:{corpus}").data
  with pytest.raises(
      config_lib.ConfigError, match="was made with the byte tokenizer, not with the workdir's"
  ):
    data_lib.make_source(data, 512, str(workdir))
  hf_made = tmp_path / "hf_made"  # the same tokenizer file: accepted
  shutil.copytree(corpus, hf_made)
  store = store_lib.TokenStore(hf_made)
  meta = dict(store.meta, tokenizer={"kind": "hf", "vocab_size": 384, "sha256": ""})
  meta["tokenizer"]["sha256"] = source_lib.tokenizer_sha256(str(workdir / "hf/tokenizer.json"))
  (hf_made / store_lib.META_FILE).write_text(__import__("json").dumps(meta))
  assert isinstance(
      data_lib.make_source(_config(f"tokens:{hf_made}").data, 512, str(workdir)),
      source_lib.TokenSource,
  )
  assert isinstance(data_lib.make_source(data, 256, None), source_lib.TokenSource)


# --- training on a token store ------------------------------------------------------------------


def test_trains_on_a_token_store(corpus):
  config = _config(f"tokens:{corpus}")
  config.train.steps = 30
  config.train.eval_every = 30
  assert source_lib.eval_documents(40, 0.1).any()
  trainer = Trainer(config)
  batch = trainer.batch(0)
  assert set(batch) == {"tokens", "targets", "mask", "segment_ids", "positions"}
  host = trainer.source.batch("train", 0, config.data.batch, config.data.seq_len)
  np.testing.assert_array_equal(np.asarray(batch["segment_ids"]), host["segment_ids"])
  summary = trainer.train(progress=False)
  first, last = summary["first_loss"], summary["last_loss"]
  assert np.isfinite([first, last, summary["eval_loss"]]).all()
  assert first > 5.0 and last < first - 2.0, (first, last)  # 5.9 -> 3.0 when written
