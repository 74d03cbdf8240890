"""A user's corpus into a token store with the model's tokenizer (`python -m jaxpipe.data prepare`).

Inputs, one kind per file suffix:
  .jsonl / .ndjson   one JSON object a line: `text` (a string), or `messages` (a chat: a list of
                     {role, content}; the ids are the tokenizer's chat template with
                     add_generation_prompt=False and the loss mask is 1 on the assistant turns,
                     end-of-turn token included, `Tokenizer.chat_ids_and_mask`)
  .parquet           a `text` column (pyarrow, the `data` extra)
  .txt, .md, .py ... a whole file is one document (TEXT_SUFFIXES)
  a directory        every file under it with one of these suffixes, in sorted order (its empty
                     files left out and counted)

Each document ends with the tokenizer's first EOS id unless it already ends with one of them (a
chat's last end-of-turn token); a Hugging Face tokenizer also starts it with BOS where its
post-processor adds one. The byte tokenizer has no EOS: its documents are only separated by the
store's boundaries, which the training source never packs across.

Records that cannot be a document are skipped and counted (a JSONL line with neither field, a
null or empty text, a chat with an unknown role or non-string content); a file of which nothing
is usable, a missing, empty, malformed or unknown file stops the command with one line. Files are
checked before anything is written, the tokens go to a temporary directory beside --out, renamed
into place at the end: an interrupted or refused run leaves no half-written store. Tokenizing runs
in a pool of worker processes, in input order (the store does not depend on --workers).
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import tqdm

from jaxpipe.data import source as source_lib
from jaxpipe.data import store as store_lib
from jaxpipe.models import tokenizer as tokenizer_lib

BYTES = "bytes"  # --tokenizer bytes: jaxpipe's byte-level models
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".java",
    ".js",
    ".ts",
    ".go",
    ".rs",
    ".sh",
    ".html",
    ".tex",
)
ROLES = ("system", "user", "assistant", "tool")
CHUNK = 64  # records sent to a worker at a time
# Why records are skipped: the counts go to meta.json and the summary line.
NO_FIELD = "no_text_or_messages"  # a JSONL line without a 'text' string or a 'messages' list
BAD_CHAT = "bad_messages"  # a message that is not {role in ROLES, content: str}
EMPTY = "empty_text"  # an empty text (or a null in a Parquet column)
EMPTY_FILE = "empty_file"  # an empty file found in an --input directory


def default_workers() -> int:
  return min(os.cpu_count() or 1, 8)


def load_tokenizer(spec: str) -> tuple[tokenizer_lib.Tokenizer, dict[str, Any]]:
  """Loads the tokenizer `--tokenizer` names.

  A workdir whose config records a byte-level model gets the byte tokenizer.

  Args:
    spec: `'bytes'`, a workdir with `hf/tokenizer.json`, or a directory with `tokenizer.json`.

  Returns:
    The tokenizer, and what `meta.json` records of it (kind, vocab size, EOS ids, BOS id; for a
    Hugging Face tokenizer also its directory and the sha256 of its `tokenizer.json`).

  Raises:
    ValueError: `spec` is none of these.
  """
  if spec == BYTES:
    tok = tokenizer_lib.ByteTokenizer()
    return tok, {"kind": BYTES, "vocab_size": tok.vocab_size, "eos_ids": [], "bos_id": None}
  hf_dir = os.path.join(spec, tokenizer_lib.HF_DIR)
  if tokenizer_lib.recorded(spec) == "bytes":  # a workdir whose config says its model reads bytes
    return load_tokenizer(BYTES)
  for d in (hf_dir, spec):
    if os.path.isfile(os.path.join(d, tokenizer_lib.TOKENIZER_FILE)):
      tok = tokenizer_lib.HFTokenizer.from_dir(d)
      path = os.path.abspath(os.path.join(d, tokenizer_lib.TOKENIZER_FILE))
      return tok, {
          "kind": "hf",
          "path": os.path.abspath(d),
          "sha256": source_lib.tokenizer_sha256(path),
          "vocab_size": tok.vocab_size,
          "eos_ids": list(tok.eos_ids),
          "bos_id": tok.bos_id,
      }
  raise ValueError(
      f"--tokenizer {spec}: neither {hf_dir}/{tokenizer_lib.TOKENIZER_FILE} (a converted "
      f"workdir) nor {spec}/{tokenizer_lib.TOKENIZER_FILE}; pass such a directory, or "
      "--tokenizer bytes for jaxpipe's byte-level models"
  )


def _walk_visible(path: str):
  """os.walk without hidden directories (.git, .venv, .tox: not a corpus)."""
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    yield root, dirs, names


def expand_inputs(inputs: list[str]) -> tuple[list[str], int]:
  """The files of `inputs`, each directory replaced by the files under it.

  A directory contributes the files whose suffix is one `prepare` reads, recursively, in sorted
  order, hidden files and directories left out. Its empty files are left out and counted (as a
  package's empty `__init__.py` would be); an empty file named itself is kept here and refused
  by `check_inputs`.

  Args:
    inputs: the `--input` paths, files or directories.

  Returns:
    The files, in order, and how many empty files the directories held.

  Raises:
    ValueError: a directory holds no file `prepare` reads, or only empty ones.
  """
  known = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
  files, empty = [], 0
  for path in inputs:
    if not os.path.isdir(path):
      files.append(path)
      continue
    found = sorted(
        os.path.join(root, name)
        for root, _, names in _walk_visible(path)
        for name in names
        if os.path.splitext(name)[1].lower() in known and not name.startswith(".")
    )
    if not found:
      raise ValueError(
          f"--input {path}: a directory with no file prepare reads (suffixes "
          f"{', '.join(known)}); name the files or another directory"
      )
    kept = [f for f in found if os.path.getsize(f) > 0]
    if not kept:
      raise ValueError(f"--input {path}: every file prepare reads in it is empty")
    empty += len(found) - len(kept)
    files += kept
  return files, empty


def check_inputs(inputs: list[str]) -> None:
  """Refuses, in one line, the first input that is missing, empty or of an unknown kind.

  Also checks that pyarrow is installed when a Parquet file is among the inputs.

  Args:
    inputs: the input files (directories already expanded).

  Raises:
    ValueError: no inputs; an input is missing, empty or of an unknown kind; or a Parquet input
      without pyarrow.
  """
  if not inputs:
    raise ValueError("give at least one --input FILE")
  known = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
  for path in inputs:
    suffix = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
      raise ValueError(f"--input {path}: no such file")
    if suffix not in known:
      raise ValueError(
          f"--input {path}: unknown file type {suffix or '(no suffix)'!r}; use JSONL "
          f"({', '.join(JSONL_SUFFIXES)}), Parquet (.parquet) or text ({', '.join(TEXT_SUFFIXES)})"
      )
    if os.path.getsize(path) == 0:
      raise ValueError(f"--input {path}: the file is empty")
    if suffix in PARQUET_SUFFIXES:
      _pyarrow()


def _pyarrow():
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ValueError(
        "Parquet input needs pyarrow, which is not installed; pip install 'jaxpipe[data]'"
    ) from None
  return pq


def _message_ok(m: Any) -> bool:
  return isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)


def _jsonl(path: str, skipped: collections.Counter) -> Iterator[tuple[str, Any, str]]:
  lines = used = 0
  with open(path, encoding="utf-8") as f:
    try:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        lines += 1
        where = f"{path}:{number}"
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{where}: not a JSON line ({e})") from None
        if not isinstance(record, dict):
          raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object")
        messages, text = record.get("messages"), record.get("text")
        if isinstance(messages, list):
          if not messages or not all(_message_ok(m) for m in messages):
            skipped[BAD_CHAT] += 1
            continue
          used += 1
          yield "messages", [{"role": m["role"], "content": m["content"]} for m in messages], where
        elif isinstance(text, str):
          if not text:
            skipped[EMPTY] += 1
            continue
          used += 1
          yield "text", text, where
        else:
          skipped[NO_FIELD] += 1
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not UTF-8 text ({e})") from None
  if not lines:
    raise ValueError(f"--input {path}: no JSON lines in the file")
  if not used:
    raise ValueError(
        f"--input {path}: none of its {lines} lines is a document (each needs a non-empty 'text' "
        "string or a 'messages' list of {role, content} with a role among "
        f"{', '.join(ROLES)} and string content)"
    )


def _parquet(path: str, skipped: collections.Counter) -> Iterator[tuple[str, Any, str]]:
  pq = _pyarrow()
  try:
    table = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 -- pyarrow raises its own exception types
    raise ValueError(f"--input {path}: not a Parquet file ({e})") from None
  names = table.schema_arrow.names
  if "text" not in names:
    raise ValueError(f"--input {path}: no 'text' column (its columns: {names})")
  used = row = 0
  for batch in table.iter_batches(columns=["text"]):
    for text in batch.column(0).to_pylist():
      row += 1
      if not isinstance(text, str) or not text:
        skipped[EMPTY] += 1
        continue
      used += 1
      yield "text", text, f"{path}: row {row}"
  if not used:
    raise ValueError(f"--input {path}: none of its {row} rows has a non-empty 'text'")


def _text_file(path: str) -> Iterator[tuple[str, Any, str]]:
  try:
    with open(path, encoding="utf-8", newline="") as f:  # the file's own line endings
      text = f.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"--input {path}: not UTF-8 text ({e})") from None
  yield "text", text, path


def records(inputs: list[str], skipped: collections.Counter) -> Iterator[tuple[str, Any, str]]:
  """Every document of the inputs, in order.

  Args:
    inputs: the input files.
    skipped: counts, by reason, the records that cannot be a document; updated in place.

  Yields:
    `(kind, value, where)`: `"text"` and its string, or `"messages"` and the chat's list of
    `{role, content}`; `where` names the file (and the line or row).

  Raises:
    ValueError: a malformed or undecodable file, or one of which no record is a document.
  """
  for path in inputs:
    suffix = os.path.splitext(path)[1].lower()
    if suffix in JSONL_SUFFIXES:
      yield from _jsonl(path, skipped)
    elif suffix in PARQUET_SUFFIXES:
      yield from _parquet(path, skipped)
    else:
      yield from _text_file(path)


_WORKER: tokenizer_lib.Tokenizer | None = None  # a worker process's tokenizer


def _init_worker(spec: str) -> None:
  global _WORKER
  _WORKER = load_tokenizer(spec)[0]


def _tokenize(
    tok: tokenizer_lib.Tokenizer, chunk: list[tuple[str, Any, str]]
) -> list[tuple[np.ndarray, np.ndarray | None] | None]:
  """Each record's ids (EOS-terminated) and loss mask (chats; None for text); None for a record
  that has no ids."""
  out = []
  eos = tok.eos_ids[0] if tok.eos_ids else None
  for kind, value, where in chunk:
    try:
      if kind == "messages":
        ids, mask = tok.chat_ids_and_mask(value)
      else:
        ids, mask = tok.encode(value), None
    except Exception as e:  # noqa: BLE001 -- a template's own error, named with its record
      first = str(e).strip().splitlines()
      raise ValueError(f"{where}: {first[0] if first else type(e).__name__}") from None
    if not ids:  # text the tokenizer turns into nothing (its normaliser strips it all)
      out.append(None)
      continue
    if eos is not None and ids[-1] not in tok.eos_ids:
      ids = [*ids, eos]
      mask = None if mask is None else [*mask, 0]
    out.append((np.asarray(ids, np.int64), None if mask is None else np.asarray(mask, np.uint8)))
  return out


def _tokenize_in_worker(chunk):
  return _tokenize(_WORKER, chunk)


def _chunks(it: Iterator, size: int) -> Iterator[list]:
  while chunk := list(itertools.islice(it, size)):
    yield chunk


def prepare(
    tokenizer: str,
    inputs: list[str],
    out: str,
    workers: int | None = None,
    eval_fraction: float = 0.02,
    progress: bool = True,
) -> dict[str, Any]:
  """Writes the store of `inputs` into `out`, as the module docstring describes.

  Args:
    tokenizer: the `--tokenizer` spec (see `load_tokenizer`).
    inputs: the `--input` files or directories.
    out: the store's directory; must not exist yet (or be empty).
    workers: tokenizing processes; default `min(CPU count, 8)`.
    eval_fraction: the `data.eval_fraction` whose eval split size is reported, in [0, 1); the
      store is the same whatever it is.
    progress: show a progress bar on stderr.

  Returns:
    The store's `meta.json`, with the seconds it took and the eval split's documents and tokens at
    `eval_fraction` added.

  Raises:
    ValueError: a bad argument, tokenizer or input, or an existing `out` (one line each).
  """
  t0 = time.perf_counter()
  workers = default_workers() if workers is None else workers
  if workers < 1:
    raise ValueError(f"--workers {workers} must be >= 1")
  if not 0 <= eval_fraction < 1:
    raise ValueError(f"--eval_fraction {eval_fraction} must lie in [0, 1)")
  tok, tokenizer_meta = load_tokenizer(tokenizer)
  inputs, empty_files = expand_inputs(inputs)
  check_inputs(inputs)
  out = os.path.abspath(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(f"--out {out} already exists; choose a new directory or remove it")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{os.getpid()}")
  skipped: collections.Counter = collections.Counter()
  if empty_files:
    skipped[EMPTY_FILE] = empty_files
  writer = store_lib.StoreWriter(tmp, tok.vocab_size)
  pool = None
  try:
    chunks = _chunks(records(inputs, skipped), CHUNK)
    if workers == 1:
      tokenized = (_tokenize(tok, c) for c in chunks)
    else:
      os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker encodes serially
      # spawn, not fork: the tokenizer's module imports JAX, whose threads a fork would copy
      # mid-lock (a worker could deadlock); a spawned worker imports it afresh (about 2 s)
      pool = multiprocessing.get_context("spawn").Pool(
          workers, initializer=_init_worker, initargs=(tokenizer,)
      )
      tokenized = pool.imap(_tokenize_in_worker, chunks)
    bar = tqdm.tqdm(unit=" docs", disable=not progress, file=sys.stderr, mininterval=0.5)
    with bar:
      for docs in tokenized:
        for doc in docs:
          if doc is None:
            skipped[EMPTY] += 1
          else:
            writer.append(*doc)
        bar.update(len(docs))
    in_eval = source_lib.eval_documents(writer.documents, eval_fraction)
    lengths = writer.lengths_D
    meta = writer.close(
        {
            "tokenizer": tokenizer_meta,
            "inputs": [os.path.abspath(p) for p in inputs],
            "skipped": dict(sorted(skipped.items())),
        }
    )
    os.rename(tmp, out)
  except BaseException:
    writer.abort()
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    if pool is not None:
      pool.terminate()
  return {
      **meta,
      "seconds": time.perf_counter() - t0,
      "eval_fraction": eval_fraction,
      "eval_documents": int(in_eval.sum()),
      "eval_tokens": int(lengths[in_eval].sum()),
  }


def summary(out: str, result: dict[str, Any]) -> str:
  """The one line `prepare` prints at the end.

  Args:
    out: the store's directory.
    result: what `prepare` returned.

  Returns:
    Documents, tokens, what was skipped, seconds, tokens/s and the eval split's size.
  """
  skipped = ", ".join(f"{k} {v}" for k, v in result["skipped"].items()) or "none"
  rate = result["tokens"] / max(result["seconds"], 1e-9)
  return (
      f"{out}: {result['documents']} documents, {result['tokens']} tokens, skipped: {skipped}; "
      f"{result['seconds']:.1f} s, {rate:,.0f} tokens/s; data.eval_fraction="
      f"{result['eval_fraction']} holds out {result['eval_documents']} documents "
      f"({result['eval_tokens']} tokens)"
  )
