"""Structured output: a grammar that every sampled token of a request must follow.

A `Guide` is a compiled grammar (a JSON schema, any JSON object, a regular expression, a choice
among strings, or a Lark grammar) over one tokenizer, through llguidance, the grammar library
vLLM's `guidance` backend runs. Each constrained request follows it with its own `Matcher`: before
a step, the matcher fills the request's row of a token bitmask (bit i of word i // 32: token i
may come next), which the step applies to the logits on the device (`sampling.apply_mask`); after
it, the matcher takes the sampled token. A request whose grammar is complete ends with finish
reason "eos"; the EOS ids may be sampled wherever the grammar may end. A model without EOS ids
ends where its grammar must.

A constrained request's next mask needs its last token, which under async scheduling is still
on the device when the next step is built. Such a step dispatches its model first; the host
reads the previous step's tokens, advances the matchers and fills the masks while the model
runs, then dispatches the sampling (`Engine.launch`), as vLLM's async scheduling does it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpipe.models import tokenizer as tokenizer_lib

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_BYTES = 256


def _llguidance():
  try:
    import llguidance  # noqa: PLC0415 -- optional: only structured output needs it
  except ImportError:
    raise ValueError(
        "structured output needs llguidance: pip install 'jaxpipe[serve]' (or llguidance)"
    ) from None
  return llguidance


def words(vocab: int) -> int:
  """Int32 words of a token bitmask row over `vocab` ids.

  Args:
    vocab: the vocabulary size.

  Returns:
    ceil(vocab / 32).
  """
  return (vocab + 31) // 32


class Matcher:
  """One request's place in its grammar."""

  def __init__(self, matcher: Any, vocab: int, width: int):
    """vocab: the model's ids; width: the words of llguidance's rows (one more id, the stand-in
    EOS, when the model has none)."""
    self._m, self.vocab, self.width = matcher, vocab, width

  def fill(self, row_W: np.ndarray) -> None:
    """Writes the tokens that may come next into a bitmask row.

    Args:
      row_W: a C-contiguous int32 [width] row, overwritten.
    """
    self._m.unsafe_compute_mask_ptr(row_W.ctypes.data, row_W.nbytes)

  def accept(self, token: int) -> bool:
    """Takes the sampled token.

    Args:
      token: the token.

    Returns:
      False if the grammar refuses it (the matcher is then in error).
    """
    return bool(self._m.consume_token(int(token)))

  @property
  def done(self) -> bool:
    """Whether the grammar is complete: nothing more may follow."""
    return bool(self._m.is_stopped())

  @property
  def error(self) -> str:
    """The matcher's error, or ''."""
    return self._m.get_error() if self._m.is_error() else ""

  def copy(self) -> Matcher:
    """An independent matcher at the same place (a forked request's)."""
    return Matcher(self._m.deep_copy(), self.vocab, self.width)


@dataclasses.dataclass(frozen=True, eq=False)
class Guide:
  """A compiled grammar over one tokenizer: what a request's `SamplingParams.guide` holds."""

  kind: str  # one of KINDS
  grammar: str  # llguidance's serialized grammar
  vocab: int  # the ids the masks cover: the model's vocabulary
  tokenizer: Any  # llguidance.LLTokenizer

  def matcher(self, output: Sequence[int] = ()) -> Matcher:
    """A matcher at the grammar's start, then past `output`.

    Args:
      output: tokens the request has already generated (a moved or re-imported request).

    Returns:
      The `Matcher`.

    Raises:
      ValueError: the grammar refuses one of `output`.
    """
    llg = _llguidance()
    m = Matcher(
        llg.LLMatcher(self.tokenizer, self.grammar, log_level=0),
        self.vocab,
        words(self.tokenizer.vocab_size),
    )
    for i, t in enumerate(output):
      if not m.accept(t):
        raise ValueError(f"output token {i} ({t}) does not follow the grammar: {m.error}")
    return m


def fill_masks(rows: Sequence[tuple[int, Matcher]], r_max: int, vocab: int) -> np.ndarray:
  """The step's token bitmask: each listed row filled by its matcher, every other row all ones.

  Args:
    rows: (row, matcher) of the constrained rows.
    r_max: rows of the mask.
    vocab: the model's vocabulary size.

  Returns:
    Int32 [r_max, words(vocab)].
  """
  mask_RxW = np.full((r_max, max(m.width for _, m in rows)), -1, np.int32)
  for j, m in rows:
    m.fill(mask_RxW[j])
  return np.ascontiguousarray(mask_RxW[:, : words(vocab)])


class Compiler:
  """Compiles requests' grammars for one tokenizer and model vocabulary (cached by text)."""

  def __init__(
      self, tok: tokenizer_lib.Tokenizer, vocab: int, eos_ids: Sequence[int], json_spaces=False
  ):
    """tok: the model's tokenizer; vocab: the model's vocabulary (the masks' width); eos_ids:
    the ids that end a choice, allowed where the grammar may end (none: llguidance gets a
    stand-in id past the vocabulary, which is never sampled); json_spaces: let JSON hold
    whitespace between tokens (llguidance's `whitespace_flexible`; off: compact JSON)."""
    self.tok, self.vocab = tok, vocab
    self.eos_ids = list(eos_ids) or [vocab]
    self._ids = vocab if eos_ids else vocab + 1  # llguidance's vocabulary
    self.json_spaces = json_spaces

  @functools.cached_property
  def tokenizer(self) -> Any:
    """The llguidance tokenizer (built once: about a second for a 100k vocabulary)."""
    llg = _llguidance()
    if isinstance(self.tok, tokenizer_lib.HFTokenizer):
      return llg.LLTokenizer(self.tok.to_json(), n_vocab=self._ids, eos_token=self.eos_ids)
    if isinstance(self.tok, tokenizer_lib.ByteTokenizer):
      return llg.LLTokenizer(
          llg.TokenizerWrapper(_Bytes(self._ids, self.eos_ids[0])),
          n_vocab=self._ids,
          eos_token=self.eos_ids,
      )
    raise ValueError(f"structured output does not know the tokenizer {type(self.tok).__name__}")

  def compile(self, kind: str, spec: Any) -> Guide:
    """A request's grammar, compiled.

    Args:
      kind: one of KINDS.
      spec: a JSON schema (dict or JSON text) for json_schema; None for json_object; the
        pattern for regex; a list of strings for choice; Lark (or GBNF) text for grammar.

    Returns:
      The `Guide`.

    Raises:
      ValueError: an unknown kind, or a spec llguidance refuses (its message, one line).
    """
    if kind not in KINDS:
      raise ValueError(f"structured output kind {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "choice":
      if not (isinstance(spec, list) and spec and all(isinstance(s, str) and s for s in spec)):
        raise ValueError(f"choice={spec!r:.80} must be a non-empty list of non-empty strings")
      text = json.dumps(spec)
    elif kind == "json_schema":
      text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
    elif kind == "json_object":
      text = ""
    else:
      if not isinstance(spec, str) or not spec:
        raise ValueError(f"{kind}={spec!r:.80} must be a non-empty string")
      text = spec
    return self._compile(kind, text)

  @functools.lru_cache(maxsize=256)  # noqa: B019 -- one Compiler per server, kept for its life
  def _compile(self, kind: str, text: str) -> Guide:
    llg = _llguidance()
    options = {"whitespace_flexible": self.json_spaces}
    try:
      if kind == "json_schema":
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=options)
      elif kind == "json_object":
        grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
      else:
        grammar = llg.grammar_from({"grammar": "lark"}.get(kind, kind), text)
    except ValueError as e:
      raise ValueError(f"{kind}: {_one_line(e)}") from None
    error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
    if error and not error.startswith("WARNING"):
      raise ValueError(f"{kind}: {_one_line(error)}")
    return Guide(kind, grammar, self.vocab, self.tokenizer)


def _one_line(e: Any) -> str:
  return " ".join(str(e).split())


class _Bytes:
  """A byte tokenizer as llguidance's `TokenizerWrapper` reads one: id i < 256 is byte i; ids
  above have no text (llguidance's special-token form)."""

  bos_token_id = None

  def __init__(self, vocab: int, eos: int):
    self.eos_token_id = eos
    self.tokens = [bytes([i]) if i < _BYTES else b"\xff[%d]" % i for i in range(vocab)]
    self.special_token_ids = list(range(_BYTES, vocab))

  def __call__(self, text: bytes) -> list[int]:
    return list(text)
