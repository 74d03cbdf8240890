"""Tokenizers against transformers itself: a tiny BPE tokenizer saved by `save_pretrained`.

transformers loads the saved directory (AutoTokenizer, offline) and is the oracle for encode,
decode and the chat template; Python's UTF-8 codec is the oracle of the byte tokenizer.
"""

import json
import os
import shutil

import jinja2
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from jaxpipe.models import tokenizer as tokenizer_lib

CORPUS = [
    "naïve café 東京 🙂",
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "東京は大きい 🙂🙂 café au lait",
    "You are a helpful assistant. What is the capital of Japan?",
]
TEXTS = [
    "naïve café 東京 🙂",
    "Hello world",
    "unseen: ß 漢字 ∑ 🎉🙂 ok",  # characters the merges never saw: one byte-level token each byte
    "",
]
SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, shape and whitespace: trim_blocks/lstrip_blocks decide what it renders.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
  {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
  {{- message['content'] | trim }}
  {%- if 'tool_calls' in message %} (calls: {{ message['tool_calls'] | tojson }}){% endif %}
<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
  {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. 🙂"},
    {"role": "user", "content": "What is the capital of Japan? naïve question"},
    {
        "role": "assistant",
        "content": "東京 (Tokyo).",
        "tool_calls": None,
    },  # dropped, as transformers does
    {"role": "user", "content": "Merci, café?"},
]


def _bpe() -> tokenizers.Tokenizer:
  """Byte-level BPE (GPT-2, Llama 3): a token may hold a fraction of a UTF-8 character."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(CORPUS * 4, trainer=trainer)
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
  )
  return tok


def _sentencepiece_like() -> tokenizers.Tokenizer:
  """Metaspace BPE (Llama 2): the decode of a text drops its first word's leading space."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
  tok.decoder = decoders.Metaspace(prepend_scheme="first")
  tok.train_from_iterator(
      CORPUS * 4, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"])
  )
  return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=_bpe(), bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
  )
  fast.save_pretrained(path)
  eot = fast.convert_tokens_to_ids("<|eot_id|>")
  eos = fast.convert_tokens_to_ids("</s>")
  transformers.GenerationConfig(eos_token_id=[eos, eot], bos_token_id=0).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def oracle(hf_dir):
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def tok(hf_dir):
  return tokenizer_lib.HFTokenizer.from_dir(hf_dir)


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


# --- HFTokenizer against transformers ----------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, oracle, text):
  with_bos = oracle(text)["input_ids"]
  assert with_bos[0] == oracle.convert_tokens_to_ids("<s>")  # the post-processor adds BOS
  assert tok.encode(text) == with_bos
  assert (
      tok.encode(text, add_special_tokens=False)
      == oracle(text, add_special_tokens=False)["input_ids"]
  )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok, oracle, text):
  ids = oracle(text)["input_ids"]
  assert tok.decode(ids) == oracle.decode(ids)
  assert oracle.decode(ids, skip_special_tokens=True) == text  # the fixture is lossless


def test_special_ids_and_vocab(tok, oracle):
  assert tok.bos_id == oracle.bos_token_id
  assert tok.vocab_size == len(oracle)
  # generation_config.json's list: both stop generation, in its order.
  eos = oracle.convert_tokens_to_ids(["</s>", "<|eot_id|>"])
  assert tok.eos_ids == tuple(eos)
  assert oracle.eos_token_id == eos[0]


@pytest.mark.parametrize("text", TEXTS[:3])
def test_incremental_decode_never_splits_a_character(tok, oracle, text):
  ids = oracle(text)["input_ids"] + oracle.convert_tokens_to_ids(["<|eot_id|>"])
  dec = tok.decoder()
  pieces = [dec.push(i) for i in ids]
  tail = dec.flush()
  assert all("\ufffd" not in p for p in pieces), pieces
  assert "".join(pieces) + tail == oracle.decode(ids)
  assert tail == ""  # the text is whole: nothing held back at the end


def test_incremental_decode_holds_partial_bytes(tok, oracle):
  """The test above means something: some emoji tokens alone are half a character."""
  ids = oracle("unseen: 🎉", add_special_tokens=False)["input_ids"]
  partial = [i for i in ids if "\ufffd" in oracle.decode([i])]
  assert len(partial) >= 2
  dec = tok.decoder()
  pieces = [dec.push(i) for i in ids]
  assert "" in pieces and pieces[-1].endswith("🎉")
  assert "".join(pieces) == oracle.decode(ids)


def test_incremental_decode_flush_writes_incomplete_bytes(tok, oracle):
  ids = oracle("🎉", add_special_tokens=False)["input_ids"][:-1]  # the emoji cut short
  dec = tok.decoder()
  assert [dec.push(i) for i in ids] == [""] * len(ids)
  assert dec.flush() == oracle.decode(ids)


def test_incremental_decode_context_keeps_leading_space(tmp_path):
  """SentencePiece-like decoding: with the prompt as context the first word keeps its space."""
  transformers.PreTrainedTokenizerFast(tokenizer_object=_sentencepiece_like()).save_pretrained(
      tmp_path
  )
  oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  tok = tokenizer_lib.HFTokenizer.from_dir(tmp_path)
  ids = oracle("Hello world, the quick brown fox")["input_ids"]
  assert tok.encode("Hello world, the quick brown fox") == ids
  k = 2
  prompt_text = oracle.decode(ids[:k])
  dec = tok.decoder(context=ids[:k])
  streamed = "".join(dec.push(i) for i in ids[k:]) + dec.flush()
  assert streamed == oracle.decode(ids)[len(prompt_text) :]
  assert streamed.startswith(" ")
  fresh = tok.decoder()  # no context: the decode of the continuation alone
  assert "".join(fresh.push(i) for i in ids[k:]) + fresh.flush() == oracle.decode(ids[k:])


def test_chat_template_matches_transformers(tok, oracle):
  calls = [{"role": "assistant", "content": "", "tool_calls": [{"name": "café", "x": "<b>&"}]}]
  for messages in (CONVERSATION, CONVERSATION[:3], CONVERSATION[:2] + calls):
    for prompt in (True, False):
      want = oracle.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
      if not isinstance(want, list):  # transformers 5 returns a BatchEncoding by default
        want = want["input_ids"]
      assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == want
      text = oracle.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
      assert tok.render_chat(messages, add_generation_prompt=prompt) == text
  assert tok.apply_chat_template(CONVERSATION[:2]) == tok.apply_chat_template(
      CONVERSATION[:2], add_generation_prompt=True
  )
  bos = oracle.convert_tokens_to_ids("<s>")
  assert tok.apply_chat_template(CONVERSATION)[:2] != [bos, bos]  # the template's BOS only


def test_chat_template_raise_exception(tok, oracle):
  bad = [{"role": "wizard", "content": "hi"}]
  with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role wizard"):
    oracle.apply_chat_template(bad, tokenize=False)
  with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role wizard"):
    tok.apply_chat_template(bad)


def test_chat_template_in_tokenizer_config(hf_dir, oracle, tmp_path):
  """Older save_pretrained wrote the template into tokenizer_config.json, not a .jinja file."""
  path = _copy(hf_dir, tmp_path / "old")
  template = (path / tokenizer_lib.CHAT_TEMPLATE_FILE).read_text()
  (path / tokenizer_lib.CHAT_TEMPLATE_FILE).unlink()
  config = json.loads((path / tokenizer_lib.TOKENIZER_CONFIG_FILE).read_text())
  config["chat_template"] = template
  (path / tokenizer_lib.TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))
  want = oracle.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
  assert tokenizer_lib.HFTokenizer.from_dir(path).render_chat(CONVERSATION) == want


def test_no_chat_template(hf_dir, tmp_path):
  path = _copy(hf_dir, tmp_path / "plain")
  (path / tokenizer_lib.CHAT_TEMPLATE_FILE).unlink()
  with pytest.raises(ValueError, match="has no chat template") as e:
    tokenizer_lib.HFTokenizer.from_dir(path).apply_chat_template(CONVERSATION)
  assert "\n" not in str(e.value)


def test_eos_fallbacks(hf_dir, oracle, tmp_path):
  path = _copy(hf_dir, tmp_path / "eos")
  (path / tokenizer_lib.GENERATION_CONFIG_FILE).unlink()
  (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
  assert tokenizer_lib.HFTokenizer.from_dir(path).eos_ids == (7,)
  (path / "config.json").unlink()
  assert tokenizer_lib.HFTokenizer.from_dir(path).eos_ids == (oracle.eos_token_id,)


@pytest.mark.parametrize(
    "name, content",
    [
        (tokenizer_lib.TOKENIZER_FILE, '{"version": "1.0", "model": '),
        (tokenizer_lib.TOKENIZER_FILE, '{"version": "1.0", "model": {"type": "Nonesuch"}}'),
        (tokenizer_lib.TOKENIZER_CONFIG_FILE, "{bos_token: <s>}"),
        (tokenizer_lib.GENERATION_CONFIG_FILE, '{"eos_token_id": "</s>"}'),
        (tokenizer_lib.GENERATION_CONFIG_FILE, "[1, 2]"),
    ],
)
def test_malformed_file_one_line(hf_dir, tmp_path, name, content):
  path = _copy(hf_dir, tmp_path / "bad")
  (path / name).write_text(content)
  with pytest.raises(ValueError) as e:
    tokenizer_lib.HFTokenizer.from_dir(path)
  assert str(path / name) in str(e.value)
  assert "\n" not in str(e.value)


def test_missing_tokenizer_file(tmp_path):
  with pytest.raises(ValueError, match="tokenizer.json: no such file") as e:
    tokenizer_lib.HFTokenizer.from_dir(tmp_path)
  assert str(tmp_path) in str(e.value)


# --- ByteTokenizer -------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
  tok = tokenizer_lib.ByteTokenizer()
  assert tok.encode(text) == list(text.encode("utf-8"))
  assert tok.decode(list(text.encode("utf-8"))) == text
  assert (tok.vocab_size, tok.bos_id, tok.eos_ids) == (256, None, ())


def test_byte_ids_past_256_decode_to_nothing():
  tok = tokenizer_lib.ByteTokenizer(vocab_size=260, eos_id=256)
  assert tok.eos_ids == (256,)
  assert tok.decode([104, 256, 105, 259]) == "hi"
  dec = tok.decoder()
  assert [dec.push(i) for i in (104, 256, 105)] == ["h", "", "i"]


def test_byte_decoder_never_splits_an_emoji():
  emoji = list("🙂".encode())
  assert len(emoji) == 4
  tok = tokenizer_lib.ByteTokenizer()
  dec = tok.decoder()
  assert [dec.push(b) for b in list(b"a") + emoji + list(b"b")] == ["a", "", "", "", "🙂", "b"]
  assert dec.flush() == ""
  dec = tok.decoder()
  assert [dec.push(b) for b in emoji[:2]] == ["", ""]
  assert dec.flush() == bytes(emoji[:2]).decode("utf-8", errors="replace")


def test_byte_no_chat_template():
  with pytest.raises(ValueError, match="no chat template") as e:
    tokenizer_lib.ByteTokenizer().apply_chat_template(CONVERSATION)
  assert "\n" not in str(e.value)


def test_byte_vocab_too_small():
  with pytest.raises(ValueError, match="vocab_size >= 256"):
    tokenizer_lib.ByteTokenizer(vocab_size=128)


# --- for_workdir, check_vocab --------------------------------------------------


def test_for_workdir(hf_dir, oracle, tmp_path):
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  assert type(tokenizer_lib.for_workdir(scratch)) is tokenizer_lib.ByteTokenizer
  (scratch / "hf").mkdir()
  (scratch / "hf" / "config.json").write_text("{}")
  assert type(tokenizer_lib.for_workdir(scratch)) is tokenizer_lib.ByteTokenizer

  imported = tmp_path / "imported"
  _copy(hf_dir, imported / "hf")
  tok = tokenizer_lib.for_workdir(imported)
  assert type(tok) is tokenizer_lib.HFTokenizer
  assert tok.encode(TEXTS[0]) == oracle(TEXTS[0])["input_ids"]

  (imported / "hf" / tokenizer_lib.TOKENIZER_FILE).unlink()  # tokenizer_config.json alone
  with pytest.raises(ValueError, match="but no tokenizer.json"):
    tokenizer_lib.for_workdir(imported)


def test_check_vocab(tok, oracle):
  rows = len(oracle)
  tokenizer_lib.check_vocab(tok, rows)
  tokenizer_lib.check_vocab(tok, rows + 64)  # padded embeddings are fine
  with pytest.raises(ValueError, match=f"{rows} tokens but the model's embedding has {rows - 1}"):
    tokenizer_lib.check_vocab(tok, rows - 1)
  tokenizer_lib.check_vocab(tokenizer_lib.ByteTokenizer(), 256)
  with pytest.raises(ValueError, match="256 tokens"):
    tokenizer_lib.check_vocab(tokenizer_lib.ByteTokenizer(), 255)


def test_for_workdir_follows_the_tokenizer_the_config_records(hf_dir, oracle, tmp_path):
  """data.tokenizer in WORKDIR/config.json decides, over what the directory happens to hold."""
  imported = tmp_path / "imported"
  _copy(hf_dir, imported / "hf")
  config = lambda kind: json.dumps({"data": {"source": "stdlib", "tokenizer": kind}})
  (imported / "config.json").write_text(config("bytes"))
  assert type(tokenizer_lib.for_workdir(imported)) is tokenizer_lib.ByteTokenizer
  (imported / "config.json").write_text(config("hf"))
  assert tokenizer_lib.for_workdir(imported).encode(TEXTS[0]) == oracle(TEXTS[0])["input_ids"]
  (imported / "config.json").write_text(json.dumps({"data": {"source": "stdlib"}}))  # older
  assert type(tokenizer_lib.for_workdir(imported)) is tokenizer_lib.HFTokenizer
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  (scratch / "config.json").write_text(config("hf"))
  with pytest.raises(ValueError, match="records data.tokenizer='hf' but .*tokenizer.json"):
    tokenizer_lib.for_workdir(scratch)
