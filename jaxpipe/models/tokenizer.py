"""Text in and out of jaxpipe's models: one tokenizer interface, byte-level or Hugging Face.

  tok = tokenizer.for_workdir(workdir)          # WORKDIR/hf's tokenizer, else bytes
  tokenizer.check_vocab(tok, cfg.vocab_size)    # before serving: every id has an embedding row
  ids = tok.apply_chat_template(messages)       # or tok.encode(text)
  ids, mask = tok.chat_ids_and_mask(messages)   # training: 1 on the assistant turns' tokens
  dec = tok.decoder()
  for t in generated: send(dec.push(t))         # never half a character
  send(dec.flush())

`ByteTokenizer` is the tokenizer of jaxpipe's own models: a text's UTF-8 bytes are its ids.
`HFTokenizer` reads a directory that transformers' `save_pretrained` wrote (tokenizer.json with
the `tokenizers` library, the chat template with jinja2 as transformers renders it), from the
local disk only, so a checkpoint imported by `python -m jaxpipe.convert hf-to-orbax` speaks its
own vocabulary without transformers or the network at serving time.

An incremental decoder exists because a token is not a character: a byte-level BPE token may
hold half of a UTF-8 character, and a SentencePiece token's leading space depends on what came
before. Decoding token by token would send U+FFFD to a client; the decoder holds text back until
it is final.
"""

from __future__ import annotations

import abc
import bisect
import codecs
import datetime
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from jaxpipe.models import hf

HF_DIR = hf.HF_DIR  # WORKDIR/hf: the tokenizer of an imported checkpoint
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 writes the template here
BYTES = 256
_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
# The special tokens transformers passes to a chat template (its `special_tokens_map`).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Decoder(Protocol):
  """A stream of ids to text: `push` returns the text that became final with that id."""

  def push(self, token_id: int) -> str:
    """Feeds one id.

    Args:
      token_id: the next generated id.

    Returns:
      The text that became final with that id (possibly empty).
    """
    ...

  def flush(self) -> str:
    ...


class Tokenizer(abc.ABC):
  """What serving and evaluation need of a tokenizer, whatever its kind."""

  eos_ids: tuple[int, ...]  # any of them ends a generation
  bos_id: int | None
  vocab_size: int  # ids are below it; `check_vocab` holds it against the embedding
  special_ids: frozenset[int]  # added tokens marked special (BOS, EOS, chat headers)
  special_tokens: dict[str, str]  # bos_token, eos_token, ... -> their text (chat templates' names)
  chat_template: str | None  # the template's source, if the tokenizer has one

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """The ids of `text`, with whatever special tokens the tokenizer adds to a prompt (BOS).

    Args:
      text: the text to encode.

    Returns:
      The ids.
    """

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`, special tokens included (as transformers' decode does by default).

    Args:
      ids: the ids to decode.

    Returns:
      The text.
    """

  @abc.abstractmethod
  def decoder(self, context: Sequence[int] = ()) -> Decoder:
    """A fresh incremental decoder.

    SentencePiece drops the leading space of a text's first word; given the prompt's tail, the
    first generated word keeps its space as the whole decode would have it.

    Args:
      context: the prompt's last ids; they only shape the first text, and are not decoded.

    Returns:
      The `Decoder`.
    """

  @abc.abstractmethod
  def apply_chat_template(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      tools: list[dict[str, Any]] | None = None,
  ) -> list[int]:
    """The ids of a conversation as the model was tuned to read it.

    Args:
      messages: the conversation, a list of `{role, content, ...}`.
      add_generation_prompt: end with the header of an assistant turn for the model to write.
      tools: the functions the model may call (OpenAI's `tools`), for the template.

    Returns:
      The ids.

    Raises:
      ValueError: the tokenizer has no chat template.
    """

  @abc.abstractmethod
  def chat_ids_and_mask(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and its loss mask (1 on the assistant turns' tokens).

    Args:
      messages: the conversation, a list of `{role, content, ...}`.

    Returns:
      `(ids, mask)`, lists of the same length.

    Raises:
      ValueError: the tokenizer cannot tokenize conversations.
    """


class ByteTokenizer(Tokenizer):
  """jaxpipe's byte-level models: ids 0..255 are UTF-8 bytes; ids above, if any, are not text."""

  def __init__(self, vocab_size: int = BYTES, eos_id: int | None = None):
    if vocab_size < BYTES:
      raise ValueError(
          f"ByteTokenizer needs vocab_size >= {BYTES} (one id a byte), got {vocab_size}"
      )
    if eos_id is not None and not 0 <= eos_id < vocab_size:
      raise ValueError(f"ByteTokenizer eos_id {eos_id} is outside its vocabulary of {vocab_size}")
    self.vocab_size = vocab_size
    self.eos_ids = () if eos_id is None else (eos_id,)
    self.bos_id = None
    self.special_ids = frozenset()
    self.special_tokens = {}
    self.chat_template = None

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text` as ids.

    Args:
      text: the text to encode.

    Returns:
      The ids, each in 0..255.
    """
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`; ids that are not bytes are left out, invalid UTF-8 becomes U+FFFD.

    Args:
      ids: the ids to decode.

    Returns:
      The text.
    """
    return bytes(i for i in ids if 0 <= i < BYTES).decode("utf-8", errors="replace")

  def decoder(self, context: Sequence[int] = ()) -> Decoder:
    """A fresh incremental UTF-8 decoder.

    Args:
      context: unused: a byte's text does not depend on the bytes before a whole character.

    Returns:
      The `Decoder`.
    """
    del context  # a byte's text does not depend on the bytes before a whole character
    return _ByteDecoder()

  def apply_chat_template(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      tools: list[dict[str, Any]] | None = None,
  ) -> list[int]:
    """Refused: the byte tokenizer has no chat template.

    Args:
      messages: the conversation.
      add_generation_prompt: unused.
      tools: unused.

    Raises:
      ValueError: always; encode the prompt text instead.
    """
    raise ValueError("ByteTokenizer has no chat template: encode the prompt text instead")

  def chat_ids_and_mask(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Refused: the byte tokenizer has no chat template, so conversations cannot be tokenized.

    Args:
      messages: the conversation.

    Raises:
      ValueError: always; give 'text' documents or a Hugging Face tokenizer.
    """
    raise ValueError(
        "ByteTokenizer has no chat template, so conversations ('messages') cannot be tokenized; "
        "give 'text' documents or a Hugging Face tokenizer"
    )


class _ByteDecoder:
  """UTF-8 decoded a byte at a time: Python's incremental codec holds a partial character."""

  def __init__(self):
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, token_id: int) -> str:
    if not 0 <= token_id < BYTES:
      return ""
    return self._utf8.decode(bytes([token_id]))

  def flush(self) -> str:
    return self._utf8.decode(b"", final=True)


class IncrementalDecoder:
  """Any `decode(ids)` made incremental, the way vLLM and TGI stream text.

  Each push decodes the window from the last emitted token's predecessor (`_prefix`) to the end,
  and emits what the window adds past the already-emitted part (`_read`), unless that ends in
  U+FFFD (a character still incomplete) or adds nothing (a token that merges with the next).
  Decoding with one token of context keeps the leading-space rules of SentencePiece and friends
  as the whole decode applies them; the window resets at each emission, so a push costs the
  decode of a few tokens, not of the whole stream.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
    self._decode = decode
    self._ids = list(context)
    self._prefix = 0
    self._read = len(self._ids)

  def push(self, token_id: int) -> str:
    """Feeds one id and returns the text it makes final.

    Args:
      token_id: the next id.

    Returns:
      What the window adds past the already-emitted text; empty while that ends in U+FFFD (a
      character still incomplete) or adds nothing (a token that merges with the next).
    """
    self._ids.append(token_id)
    prefix_text = self._decode(self._ids[self._prefix : self._read])
    text = self._decode(self._ids[self._prefix :])
    if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return text[len(prefix_text) :]

  def flush(self) -> str:
    """Whatever is held back, incomplete characters written as U+FFFD as `decode` writes them."""
    prefix_text = self._decode(self._ids[self._prefix : self._read])
    text = self._decode(self._ids[self._prefix :])
    self._prefix = self._read = len(self._ids)
    return text[len(prefix_text) :]


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it.

  Templates written for transformers' assistant masks use the tag; here it renders its body.
  """

  tags = {"generation"}

  def parse(self, parser: Any) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller: Callable[[], str]) -> str:
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # transformers' filter: Jinja's own escapes HTML characters, which a prompt must not see.
  return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def compile_chat_template(source: str) -> jinja2.Template:
  """A chat template compiled as transformers compiles it (utils/chat_template_utils.py).

  Templates come from the Hub and are untrusted code: the environment is sandboxed and immutable.

  Args:
    source: the template's Jinja source.

  Returns:
    The compiled template.
  """
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def _read_json(path: str) -> dict[str, Any] | None:
  """The JSON object in `path`; None when there is no such file; one line when it is malformed."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable JSON file ({_one_line(e)})") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value


def _one_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__


def _token_text(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _eos_from(config: dict[str, Any] | None, path: str) -> tuple[int, ...] | None:
  if config is None or config.get("eos_token_id") is None:
    return None
  value = config["eos_token_id"]
  ids = value if isinstance(value, list) else [value]
  if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
  return tuple(ids)


class HFTokenizer(Tokenizer):
  """A transformers tokenizer directory, run by the `tokenizers` library and jinja2 alone."""

  def __init__(
      self,
      backend: tokenizers.Tokenizer,
      special_tokens: dict[str, str],
      chat_template: str | None,
      eos_ids: tuple[int, ...],
      source: str = "<memory>",
  ):
    self._backend = backend
    self.special_tokens = special_tokens  # bos_token, eos_token, ... -> text: template variables
    self.chat_template = chat_template
    self.special_ids = frozenset(
        i for i, t in backend.get_added_tokens_decoder().items() if t.special
    )
    self._compiled: jinja2.Template | None = None
    self._source = source
    self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
    bos = special_tokens.get("bos_token")
    self.bos_id = None if bos is None else backend.token_to_id(bos)
    self.eos_ids = eos_ids

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer `save_pretrained` wrote into `path`; local files only, never the network.

    eos_ids are generation_config.json's `eos_token_id` (the ids generation stops at: chat models
    list several), else config.json's, else the tokenizer's eos token.

    Args:
      path: the tokenizer's directory, holding `tokenizer.json`.

    Returns:
      The `HFTokenizer`.

    Raises:
      ValueError: no or an unreadable `tokenizer.json`, a malformed JSON file beside it, a bad
        `eos_token_id`, or a `chat_template` of the wrong form.
    """
    path = os.fspath(path)
    tokenizer_file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tokenizer_file):
      raise ValueError(
          f"{tokenizer_file}: no such file (a transformers 'fast' tokenizer is needed)"
      )
    try:
      backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # tokenizers raises its own (pyo3) exception types
      raise ValueError(f"{tokenizer_file}: not a tokenizers tokenizer file ({_one_line(e)})") from e

    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    special_file = os.path.join(path, SPECIAL_TOKENS_FILE)
    tokenizer_config = _read_json(config_file) or {}
    special_map = _read_json(special_file) or {}
    special_tokens = {}
    for name in _SPECIAL_TOKENS:
      text = _token_text(tokenizer_config.get(name)) or _token_text(special_map.get(name))
      if text is not None:
        special_tokens[name] = text

    chat_template = _chat_template(path, tokenizer_config, config_file)

    generation_file = os.path.join(path, GENERATION_CONFIG_FILE)
    model_file = os.path.join(path, hf.CONFIG_FILE)
    eos_ids = _eos_from(_read_json(generation_file), generation_file)
    if eos_ids is None:
      eos_ids = _eos_from(_read_json(model_file), model_file)
    if eos_ids is None:
      eos = special_tokens.get("eos_token")
      eos_id = None if eos is None else backend.token_to_id(eos)
      eos_ids = () if eos_id is None else (eos_id,)
    return cls(backend, special_tokens, chat_template, eos_ids, source=path)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids of `text`.

    Args:
      text: the text to encode.
      add_special_tokens: let the post-processor add BOS (or not) as the tokenizer was built to.

    Returns:
      The ids.
    """
    return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`, special tokens included.

    Args:
      ids: the ids to decode.

    Returns:
      The text.
    """
    return self._backend.decode(list(ids), skip_special_tokens=False)

  def to_json(self) -> str:
    """The `tokenizers` tokenizer as its tokenizer.json text (what other libraries load).

    Returns:
      The JSON text.
    """
    return self._backend.to_str()

  def decoder(self, context: Sequence[int] = ()) -> Decoder:
    """A fresh `IncrementalDecoder` over `decode`.

    Args:
      context: the prompt's last ids; they only shape the first text.

    Returns:
      The `Decoder`.
    """
    return IncrementalDecoder(self.decode, context)

  def render_chat(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      tools: list[dict[str, Any]] | None = None,
  ) -> str:
    """The conversation as text: the template rendered as transformers renders it.

    Keys whose value is None are dropped from each message before rendering.

    Args:
      messages: the conversation, a list of `{role, content, ...}`; at least one.
      add_generation_prompt: end with the header of an assistant turn.
      tools: the functions the model may call, as the template's `tools` (None: none).

    Returns:
      The rendered text.

    Raises:
      ValueError: the tokenizer has no chat template, or `messages` is empty.
    """
    if self.chat_template is None:
      raise ValueError(
          f"{self._source} has no chat template ({TOKENIZER_CONFIG_FILE} chat_template or "
          f"{CHAT_TEMPLATE_FILE})"
      )
    if not messages:
      raise ValueError("apply_chat_template needs at least one message")
    return self._render(messages, add_generation_prompt, tools)

  def _render(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool,
      tools: list[dict[str, Any]] | None = None,
  ) -> str:
    if self._compiled is None:
      self._compiled = compile_chat_template(self.chat_template)
    # transformers drops the keys whose value is None before rendering (`"tool_calls": None`).
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return self._compiled.render(
        messages=chat,
        tools=tools or None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **self.special_tokens,
    )

  def apply_chat_template(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      tools: list[dict[str, Any]] | None = None,
  ) -> list[int]:
    """The ids of a conversation as the model was tuned to read it.

    The template writes BOS itself where the model wants one: no special tokens are added.

    Args:
      messages: the conversation, a list of `{role, content, ...}`.
      add_generation_prompt: end with the header of an assistant turn.
      tools: the functions the model may call, as the template's `tools` (None: none).

    Returns:
      The ids.

    Raises:
      ValueError: the tokenizer has no chat template, or `messages` is empty.
    """
    text = self.render_chat(messages, add_generation_prompt, tools)
    return self.encode(text, add_special_tokens=False)

  def chat_ids_and_mask(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and a loss mask over them.

    The ids are `apply_chat_template`'s with add_generation_prompt=False; the mask is 1 on the
    tokens of the assistant turns, 0 elsewhere.

    Assistant message i's turn is the text the conversation through message i (rendered without
    the generation prompt) adds to the conversation up to message i rendered with it (the
    assistant header): the message and whatever the template writes after it (the end-of-turn
    token), less trailing whitespace. The two renderings are compared by their longest common
    prefix, since a template may end the generation prompt with whitespace that the message
    replaces. A token belongs to the turn whose character span holds the token's first character
    (the `tokenizers` offsets).

    Args:
      messages: the conversation, a list of `{role, content, ...}`.

    Returns:
      `(ids, mask)`, lists of the same length.

    Raises:
      ValueError: no chat template, an empty conversation, or a template whose renderings are not
        prefixes of the whole conversation.
    """
    text = self.render_chat(messages, add_generation_prompt=False)
    encoding = self._backend.encode(text, add_special_tokens=False)
    starts = [start for start, _ in encoding.offsets]
    mask = [0] * len(encoding.ids)
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      before = self._render(messages[:i], add_generation_prompt=True)
      through = self.render_chat(messages[: i + 1], add_generation_prompt=False)
      start = len(os.path.commonprefix([before, through]))  # the header is the prompt's
      if start < len(before.rstrip()) or not text.startswith(through):
        raise ValueError(
            f"{self._source}: the chat template does not render message {i}'s conversation "
            "prefix as a prefix of the whole conversation, so its assistant turns cannot be "
            "found; train on 'text' documents instead"
        )
      end_char = len(through.rstrip())  # not the whitespace that leads to the next message
      first, end = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end_char)
      mask[first:end] = [1] * (end - first)
    return list(encoding.ids), mask


def _chat_template(path: str, tokenizer_config: dict[str, Any], config_file: str) -> str | None:
  """tokenizer_config.json's `chat_template` (a string or named templates), or the .jinja file."""
  jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = tokenizer_config.get("chat_template")
  if template is None or isinstance(template, str):
    return template
  if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
  raise ValueError(f"{config_file}: chat_template must be a string or a list with a 'default'")


def recorded(workdir: str | os.PathLike) -> str | None:
  """The tokenizer a workdir's config.json records (`data.tokenizer`).

  Args:
    workdir: the run's workdir.

  Returns:
    `'bytes'` or `'hf'`; None where it has no config.json or one that predates the field.

  Raises:
    ValueError: a config.json that is not a readable JSON object.
  """
  config = _read_json(os.path.join(os.fspath(workdir), "config.json")) or {}
  data = config.get("data")
  return data.get("tokenizer") if isinstance(data, dict) else None


def for_workdir(workdir: str | os.PathLike) -> Tokenizer:
  """The tokenizer of a workdir, as its config records it (`data.tokenizer`).

  `'hf'`: the WORKDIR/hf directory's (a converted Hugging Face checkpoint); `'bytes'`: UTF-8 (a
  model trained by jaxpipe from scratch). A workdir whose config predates the field is read by
  what it holds: hf/ with a tokenizer, else bytes.

  Args:
    workdir: the run's workdir.

  Returns:
    An `HFTokenizer` or a `ByteTokenizer`.

  Raises:
    ValueError: config.json records `'hf'` but hf/tokenizer.json is missing; or a hf/ directory
      with a tokenizer that is not tokenizer.json (a SentencePiece model alone), refused rather
      than read as bytes, which would feed the model ids it never learned.
  """
  hf_dir = os.path.join(os.fspath(workdir), HF_DIR)
  kind = recorded(workdir)
  if kind == "bytes":
    return ByteTokenizer()
  if kind == "hf" and not os.path.isfile(os.path.join(hf_dir, TOKENIZER_FILE)):
    raise ValueError(
        f"{workdir}/config.json records data.tokenizer='hf' but {hf_dir}/{TOKENIZER_FILE} does "
        "not exist; copy the checkpoint's tokenizer files there (transformers' save_pretrained)"
    )
  if os.path.isfile(os.path.join(hf_dir, TOKENIZER_FILE)):
    return HFTokenizer.from_dir(hf_dir)
  for other in (TOKENIZER_CONFIG_FILE, "tokenizer.model"):
    if os.path.isfile(os.path.join(hf_dir, other)):
      raise ValueError(
          f"{hf_dir} has {other} but no {TOKENIZER_FILE}: save the tokenizer with transformers' "
          "fast tokenizer (save_pretrained) into it"
      )
  return ByteTokenizer()


def check_vocab(tokenizer: Tokenizer, embedding_rows: int) -> None:
  """Refuses a tokenizer whose ids may exceed the model's embedding (a gather out of bounds).

  A smaller vocabulary is fine: embeddings are often padded to a multiple of 64 or 128.

  Args:
    tokenizer: the tokenizer.
    embedding_rows: the model's embedding rows (its vocab size).

  Raises:
    ValueError: the tokenizer's vocabulary is larger than `embedding_rows`.
  """
  if tokenizer.vocab_size > embedding_rows:
    raise ValueError(
        f"{type(tokenizer).__name__} has {tokenizer.vocab_size} tokens but the model's embedding "
        f"has {embedding_rows} rows"
    )
