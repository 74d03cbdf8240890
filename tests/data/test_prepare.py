"""`python -m jaxpipe.data prepare`: every input kind into the store, tokenized as transformers
tokenizes it (the oracle), Python's UTF-8 codec for bytes; the chat loss mask; each bad input's
one line; and nothing half-written when a run stops part-way."""

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest

from jaxpipe.data import __main__ as data_main
from jaxpipe.data import prepare as prepare_lib
from jaxpipe.data import store as store_lib
from jaxpipe.models import tokenizer as tokenizer_lib
from jaxpipe.runtime import cli
from tests import helpers

CORPUS = os.path.join(helpers.ROOT, "tests", "fixtures", "corpus")
TEXT = os.path.join(CORPUS, "text.jsonl")
CHAT = os.path.join(CORPUS, "chat.jsonl")
SMALL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now"},
]


def _lines(path, field):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)[field] for line in f]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  return helpers.write_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def oracle(llama):
  import transformers

  return transformers.AutoTokenizer.from_pretrained(llama)


def _docs(path):
  store = store_lib.TokenStore(path)
  return store, [store.ids(d).tolist() for d in range(store.documents)]


def _run(*args):
  """(exit status, stdout, stderr) of `python -m jaxpipe.data ARGS`, run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with redirect_stdout(out), redirect_stderr(err):
    status = cli.call(data_main.main, data_main.FLAGS, ["prepare", "--noprogress", *args])
  return status, out.getvalue(), err.getvalue()


# --- the chat mask (Tokenizer.chat_ids_and_mask) -------------------------------------------------


def test_chat_ids_equal_transformers(llama, oracle):
  tok = tokenizer_lib.HFTokenizer.from_dir(llama)
  for messages in _lines(CHAT, "messages") + [SMALL_CHAT]:
    ids, mask = tok.chat_ids_and_mask(messages)
    want = oracle.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    assert ids == list(want["input_ids"])
    assert len(mask) == len(ids)


def test_chat_mask_is_the_assistant_turns(llama, oracle):
  tok = tokenizer_lib.HFTokenizer.from_dir(llama)
  ids, mask = tok.chat_ids_and_mask(SMALL_CHAT)
  eot = oracle.convert_tokens_to_ids("<|eot_id|>")
  # By hand: each assistant turn is its content, the template's "\n" and <|eot_id|>, where the
  # content's tokens follow "<|start_header_id|>assistant<|end_header_id|>\n\n".
  text = oracle.apply_chat_template(SMALL_CHAT, tokenize=False, add_generation_prompt=False)
  header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
  spans, at = [], 0
  for content in ("Hello there", "Bye now"):
    at = text.index(header + content, at) + len(header)
    spans.append((at, text.index("<|eot_id|>", at) + len("<|eot_id|>")))
  offsets = oracle(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
  want = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
  assert mask == want
  masked = [i for i, m in zip(ids, mask) if m]
  assert oracle.decode(masked) == "Hello there\n<|eot_id|>Bye now\n<|eot_id|>"
  assert masked.count(eot) == 2


def test_chat_mask_assistant_first_and_no_assistant(llama):
  tok = tokenizer_lib.HFTokenizer.from_dir(llama)
  ids, mask = tok.chat_ids_and_mask([{"role": "assistant", "content": "Hi"}])
  assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hi\n<|eot_id|>"
  _, mask = tok.chat_ids_and_mask([{"role": "user", "content": "Hi"}])
  assert not any(mask)


# --- each input kind -------------------------------------------------------------------------


def test_jsonl_text_bytes(tmp_path):
  status, out, err = _run("--tokenizer", "bytes", "--input", TEXT, "--out", str(tmp_path / "s"))
  assert status == 0, err
  store, docs = _docs(tmp_path / "s")
  texts = _lines(TEXT, "text")
  assert docs == [list(t.encode("utf-8")) for t in texts]  # no EOS: boundaries only
  assert store.meta["tokenizer"]["kind"] == "bytes" and store.mask_N is None
  assert out.startswith(f"{tmp_path / 's'}: 40 documents, {sum(map(len, docs))} tokens, skipped:")
  assert "tokens/s" in out
  assert not [p for p in os.listdir(tmp_path) if p != "s"]  # no temporary left beside it


def test_jsonl_text_hf_and_workers(tmp_path, llama, oracle):
  for workers in (1, 2):
    args = ("--tokenizer", llama, "--input", TEXT, "--out", str(tmp_path / f"w{workers}"))
    assert _run(*args, "--workers", str(workers))[0] == 0
  store, docs = _docs(tmp_path / "w1")
  eos = oracle.convert_tokens_to_ids("</s>")
  assert docs == [oracle(t)["input_ids"] + [eos] for t in _lines(TEXT, "text")]  # BOS ... EOS
  meta = store.meta["tokenizer"]
  assert meta["vocab_size"] == 384 and meta["eos_ids"][0] == eos and meta["bos_id"] == 0
  for name in (store_lib.TOKENS_FILE, store_lib.OFFSETS_FILE):  # the pool changes nothing
    assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_jsonl_messages(tmp_path, llama, oracle):
  assert _run("--tokenizer", llama, "--input", CHAT, "--out", str(tmp_path / "s"))[0] == 0
  store, docs = _docs(tmp_path / "s")
  tok = tokenizer_lib.HFTokenizer.from_dir(llama)
  eos = oracle.convert_tokens_to_ids("</s>")
  for d, messages in enumerate(_lines(CHAT, "messages")):
    want = oracle.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    # the template ends with "<|eot_id|>\n": the document's EOS follows, not counted
    assert docs[d] == list(want["input_ids"]) + [eos]
    np.testing.assert_array_equal(store.mask(d), tok.chat_ids_and_mask(messages)[1] + [0])
    assert store.mask(d).sum() > 0


def test_text_files_and_parquet(tmp_path, oracle, llama):
  import pyarrow as pa
  import pyarrow.parquet as pq

  (tmp_path / "a.txt").write_bytes(b"first file\r\nline two\n")  # line endings kept
  (tmp_path / "b.md").write_text("# Title\n\nbody ünïcode")
  pq.write_table(pa.table({"text": ["row one", None, "row three"]}), tmp_path / "c.parquet")
  inputs = ["a.txt", "b.md", "c.parquet"]
  args = [a for p in inputs for a in ("--input", str(tmp_path / p))]
  status, out, err = _run("--tokenizer", "bytes", *args, "--out", str(tmp_path / "s"))
  assert status == 0, err
  store, docs = _docs(tmp_path / "s")
  want = ["first file\r\nline two\n", "# Title\n\nbody ünïcode", "row one", "row three"]
  assert docs == [list(t.encode()) for t in want]
  assert store.meta["skipped"] == {prepare_lib.EMPTY: 1} and "empty_text 1" in out


# --- bad input: one line, nothing written ------------------------------------------------------


def _refused(tmp_path, *args):
  status, _, err = _run(*args, "--out", str(tmp_path / "s"))
  assert status == 1 and err.count("\n") == 1 and err.startswith("error: "), err
  assert not os.path.exists(tmp_path / "s")
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".s.tmp")]
  return err


def test_bad_files(tmp_path):
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "nope.jsonl"))
  assert "nope.jsonl: no such file" in err
  (tmp_path / "empty.jsonl").write_text("")
  assert "empty.jsonl: the file is empty" in _refused(
      tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "empty.jsonl")
  )
  (tmp_path / "x.csv").write_text("a,b\n")
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "x.csv"))
  assert "unknown file type '.csv'; use JSONL (.jsonl, .ndjson), Parquet (.parquet)" in err
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "bad.jsonl"))
  assert f"{tmp_path / 'bad.jsonl'}:2: not a JSON line" in err
  (tmp_path / "none.jsonl").write_text('{"body": "x"}\n{"text": 3}\n')
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "none.jsonl"))
  assert "none.jsonl: none of its 2 lines is a document" in err
  err = _refused(tmp_path, "--tokenizer", str(tmp_path), "--input", TEXT)
  assert "neither" in err and "--tokenizer bytes" in err


def test_bytes_refuses_messages(tmp_path):
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", CHAT)
  assert f"{CHAT}:1: ByteTokenizer has no chat template" in err


def test_bad_lines_are_skipped_and_counted(tmp_path, llama):
  lines = [
      {"text": "kept"},
      {"title": "no text field"},
      {"messages": [{"role": "wizard", "content": "unknown role"}]},
      {"messages": [{"role": "user", "content": ["not", "a", "string"]}]},
      {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "yes"}]},
      {"text": ""},
  ]
  path = tmp_path / "mixed.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  status, out, err = _run("--tokenizer", llama, "--input", str(path), "--out", str(tmp_path / "s"))
  assert status == 0, err
  store = store_lib.TokenStore(tmp_path / "s")
  assert store.documents == 2
  assert store.meta["skipped"] == {
      prepare_lib.BAD_CHAT: 2,
      prepare_lib.EMPTY: 1,
      prepare_lib.NO_FIELD: 1,
  }
  assert "skipped: bad_messages 2, empty_text 1, no_text_or_messages 1;" in out


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
  (tmp_path / "c.parquet").write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
  err = _refused(tmp_path, "--tokenizer", "bytes", "--input", str(tmp_path / "c.parquet"))
  assert "pip install 'jaxpipe[data]'" in err


def test_existing_out_is_refused(tmp_path):
  (tmp_path / "s").mkdir()
  (tmp_path / "s" / "keep").write_text("x")
  with pytest.raises(ValueError, match="already exists; choose a new directory"):
    prepare_lib.prepare("bytes", [TEXT], str(tmp_path / "s"), workers=1, progress=False)
  assert os.listdir(tmp_path / "s") == ["keep"]


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
  append = store_lib.StoreWriter.append

  def append_then_fail(self, ids, mask=None):
    if self.documents == 3:
      raise KeyboardInterrupt  # as a Ctrl-C part-way
    append(self, ids, mask)

  monkeypatch.setattr(store_lib.StoreWriter, "append", append_then_fail)
  with pytest.raises(KeyboardInterrupt):
    prepare_lib.prepare("bytes", [TEXT], str(tmp_path / "s"), workers=1, progress=False)
  assert os.listdir(tmp_path) == []


def test_command_line(tmp_path):
  run = lambda *a: subprocess.run(
      [sys.executable, "-m", "jaxpipe.data", *a], capture_output=True, text=True, cwd=helpers.ROOT
  )
  done = run(  # one worker: spawned workers import JAX afresh, seconds this test need not spend
      "prepare", "--tokenizer=bytes", f"--input={TEXT}", f"--out={tmp_path / 's'}", "--workers=1"
  )
  assert done.returncode == 0 and ": 40 documents," in done.stdout, done.stderr
  bad = run("prepare", "--tokenizer=bytes", f"--input={TEXT}", "--workers=x")
  assert bad.returncode == cli.USAGE and bad.stderr.startswith("error: ")
  assert bad.stderr.count("\n") == 1


def test_a_directory_input_is_its_known_files_in_sorted_order(tmp_path):
  """A directory stands for the files under it that prepare reads, sorted, empty ones counted."""
  src = tmp_path / "src"
  (src / "pkg").mkdir(parents=True)
  (src / "b.md").write_text("second")
  (src / "a.txt").write_text("first")
  (src / "pkg" / "__init__.py").write_text("")  # empty: left out and counted
  (src / "pkg" / "c.py").write_text("third")
  (src / "notes.bin").write_bytes(b"\x00\x01")  # not a kind prepare reads: not an input
  (src / ".venv").mkdir()
  (src / ".venv" / "site.py").write_text("hidden")  # a hidden directory is not the corpus
  meta = prepare_lib.prepare("bytes", [str(src)], str(tmp_path / "out"), workers=1, progress=False)
  store = store_lib.TokenStore(str(tmp_path / "out"))
  docs = [bytes(store.ids(i).astype(np.uint8)).decode() for i in range(store.documents)]
  assert docs == ["first", "second", "third"]
  assert meta["skipped"] == {prepare_lib.EMPTY_FILE: 1}
  (tmp_path / "nothing").mkdir()
  with pytest.raises(ValueError, match="no file prepare reads"):
    prepare_lib.prepare("bytes", [str(tmp_path / "nothing")], str(tmp_path / "o2"), workers=1)
  (tmp_path / "nothing" / "e.txt").write_text("")
  with pytest.raises(ValueError, match="nothing: every file prepare reads in it is empty"):
    prepare_lib.prepare("bytes", [str(tmp_path / "nothing")], str(tmp_path / "o2"), workers=1)


def test_text_that_encodes_to_no_ids_is_skipped_and_counted(tmp_path):
  class NoIds(tokenizer_lib.ByteTokenizer):  # a normaliser that strips some texts entirely

    def encode(self, text):
      return [] if text == "strip me" else super().encode(text)

  chunk = [("text", "keep", "f:1"), ("text", "strip me", "f:2")]
  out = prepare_lib._tokenize(NoIds(), chunk)
  assert out[1] is None and list(out[0][0]) == list(b"keep")
