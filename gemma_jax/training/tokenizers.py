"""Text <-> token ids: bytes, a SentencePiece model, or a `tokenizers` tokenizer.json.

Every tokenizer exposes `vocab_size`, the special ids `pad_id`, `bos_id`, `eos_id`,
`start_of_turn_id`, `end_of_turn_id` (None when it has no turn markers), `stop_ids`,
`chat_style` ("gemma3": <start_of_turn>/<end_of_turn>; "gemma4": <|turn>/<turn|>),
`encode(texts) -> list of int32 arrays`, `decode(ids) -> str` (special ids skipped) and
`save(directory)`, which writes files that both `get_tokenizer(directory)` and
transformers' `AutoTokenizer.from_pretrained(directory)` load.
"""

import json
import os
import shutil
from typing import Optional, Sequence

import numpy as np
import sentencepiece
import tokenizers as hf_tokenizers

from gemma_jax import chat
from gemma_jax.config import ConfigError
from gemma_jax.training import data

# Names of the special tokens, by the marker style they belong to.
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TURN_MARKERS = {"gemma3": ("<start_of_turn>", "<end_of_turn>"), "gemma4": ("<|turn>", "<turn|>")}
JSON_FILE, MODEL_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"


class _Tokenizer:
  """What every tokenizer shares: stop ids and the transformers config file."""
  start_of_turn_id: Optional[int] = None
  end_of_turn_id: Optional[int] = None
  chat_style = "gemma3"

  @property
  def stop_ids(self) -> tuple:
    """Ids that end a generation: eos, and end-of-turn where the tokenizer has one."""
    return tuple(i for i in (self.eos_id, self.end_of_turn_id) if i is not None)

  def _special_ids(self) -> set:
    return {i for i in (self.pad_id, self.bos_id, self.eos_id, self.start_of_turn_id,
                        self.end_of_turn_id) if i is not None}

  def _set_turn_markers(self, lookup) -> None:
    """Turn marker ids by name (lookup: name -> id or None), Gemma 3's first."""
    for style, (start, end) in TURN_MARKERS.items():
      if lookup(start) is not None and lookup(end) is not None:
        self.chat_style = style
        self.start_of_turn_id, self.end_of_turn_id = lookup(start), lookup(end)
        return

  def _write_config(self, directory: str, tokenizer_class: str, names: dict) -> None:
    """tokenizer_config.json: the special tokens by name and our chat template."""
    config = {"tokenizer_class": tokenizer_class, "bos_token": names[self.bos_id],
              "eos_token": names[self.eos_id], "pad_token": names[self.pad_id],
              "unk_token": None, "add_bos_token": True, "add_eos_token": False,
              "model_max_length": 1 << 30}
    if self.start_of_turn_id is not None:
      config["chat_template"] = chat.jinja_template(
          self.chat_style, names[self.start_of_turn_id], names[self.end_of_turn_id])
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)


class ByteTokenizer(_Tokenizer):
  """UTF-8 bytes shifted past three special ids: 0 pad, 1 bos, 2 eos, 3 + byte; then
  259 <start_of_turn>, 260 <end_of_turn>."""
  pad_id, bos_id, eos_id = 0, 1, 2
  _offset = 3
  start_of_turn_id, end_of_turn_id = 256 + _offset, 257 + _offset
  vocab_size = 258 + _offset

  def encode(self, texts: Sequence[str]) -> list:
    return [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self._offset
            for text in texts]

  def decode(self, ids: Sequence[int]) -> str:
    # Special ids, and ids past the bytes (a model's vocabulary may be larger), are skipped.
    data = bytes(int(i) - self._offset for i in ids if self._offset <= i < 256 + self._offset)
    return data.decode("utf-8", errors="replace")

  def save(self, directory: str) -> None:
    """tokenizer.json (a byte-level BPE without merges, ids as ours) and its config."""
    os.makedirs(directory, exist_ok=True)
    names = {self.pad_id: PAD, self.bos_id: BOS, self.eos_id: EOS,
             self.start_of_turn_id: TURN_MARKERS["gemma3"][0],
             self.end_of_turn_id: TURN_MARKERS["gemma3"][1]}
    # ByteLevel writes byte b as the printable character bytes_to_unicode()[b].
    alphabet = hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()
    printable = sorted(alphabet, key=_byte_of_character)
    vocab = {name: i for i, name in names.items()}
    vocab.update({character: _byte_of_character(character) + self._offset
                  for character in printable})
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, name in sorted(names.items())],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [self.bos_id], "tokens": [BOS]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    with open(os.path.join(directory, JSON_FILE), "w", encoding="utf-8") as f:
      json.dump(spec, f, ensure_ascii=False)
    self._write_config(directory, "PreTrainedTokenizerFast", names)


def _byte_of_character(character: str) -> int:
  """The byte that ByteLevel's printable alphabet writes as `character` (GPT-2's map)."""
  code = ord(character)
  if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
    return code
  shifted = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
  return shifted[code - 256]


class SentencePieceTokenizer(_Tokenizer):
  """A SentencePiece model file, e.g. Gemma's tokenizer.model (pad 0, eos 1, bos 2)."""

  def __init__(self, path: str):
    self.path = path
    self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._processor.vocab_size()
    self.bos_id = self._processor.bos_id()
    self.eos_id = self._processor.eos_id()
    # Padding is masked by segment id 0, so any valid id serves when the model has none.
    self.pad_id = max(self._processor.pad_id(), 0)
    self._set_turn_markers(self._piece_id)

  def _piece_id(self, piece: str) -> Optional[int]:
    i = self._processor.piece_to_id(piece)
    return i if self._processor.id_to_piece(i) == piece else None

  def encode(self, texts: Sequence[str]) -> list:
    ids = self._processor.encode(list(texts), num_threads=os.cpu_count() or 1)
    return [np.asarray(row, np.int32) for row in ids]

  def decode(self, ids: Sequence[int]) -> str:
    # Special ids and ids past the tokenizer's (a model's vocabulary may be larger) are skipped.
    special = self._special_ids()
    return self._processor.decode([int(i) for i in ids if 0 <= i < self.vocab_size
                                   and i not in special and not self._processor.is_control(i)])

  def save(self, directory: str) -> None:
    """tokenizer.model (this model file) and its config."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, MODEL_FILE)
    if not os.path.exists(target) or not os.path.samefile(self.path, target):
      shutil.copyfile(self.path, target)
    names = {i: self._processor.id_to_piece(i) for i in self._special_ids()}
    self._write_config(directory, "GemmaTokenizer", names)


class JsonTokenizer(_Tokenizer):
  """A `tokenizers` tokenizer.json; bos/eos/pad by the names in a tokenizer_config.json
  beside it, else <bos>, <eos>, <pad>."""

  def __init__(self, path: str, names: dict):
    self.path = path
    self._tokenizer = hf_tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    lookup = self._tokenizer.token_to_id
    self.bos_id, self.eos_id = lookup(names["bos_token"]), lookup(names["eos_token"])
    self.pad_id = lookup(names["pad_token"]) or 0
    self._names = names
    self._set_turn_markers(lookup)

  def encode(self, texts: Sequence[str]) -> list:
    encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def decode(self, ids: Sequence[int]) -> str:
    special = self._special_ids()
    return self._tokenizer.decode([int(i) for i in ids if 0 <= i < self.vocab_size
                                   and i not in special], skip_special_tokens=True)

  def save(self, directory: str) -> None:
    """tokenizer.json (this file) and its config."""
    os.makedirs(directory, exist_ok=True)
    self._tokenizer.save(os.path.join(directory, JSON_FILE))
    names = {i: self._tokenizer.id_to_token(i) for i in self._special_ids()}
    self._write_config(directory, "PreTrainedTokenizerFast", names)


def _token_names(directory: str) -> dict:
  """bos/eos/pad token names from directory/tokenizer_config.json, else Gemma's."""
  names = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
  path = os.path.join(directory, CONFIG_FILE)
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
      if data.json_too_deep(text):
        raise ValueError(f"arrays and objects nest deeper than {data.MAX_JSON_DEPTH} levels")
      config = json.loads(text)
    except (OSError, ValueError) as error:
      raise ConfigError("data.tokenizer", f"{path!r} is not JSON ({error})") from None
    for key in names:
      value = config.get(key) if isinstance(config, dict) else None
      value = value.get("content") if isinstance(value, dict) else value
      if isinstance(value, str):
        names[key] = value
  return names


def _load_file(path: str):
  if path.endswith(".json"):
    names = _token_names(os.path.dirname(path))
    try:
      return JsonTokenizer(path, names)
    except Exception as error:  # pylint: disable=broad-except
      # tokenizers raises its own Exception subclass for a file it cannot parse.
      raise ConfigError("data.tokenizer", f"{path!r} is not a tokenizers tokenizer.json "
                        f"({error})") from None
  try:
    return SentencePieceTokenizer(path)
  except (RuntimeError, OSError) as error:
    # sentencepiece raises RuntimeError for a file it cannot parse (or an empty one).
    raise ConfigError("data.tokenizer", f"{path!r} is not a SentencePiece model file "
                      f"({error})") from None


def get_tokenizer(name: str, model_vocab_size: int):
  """"byte", a tokenizer file or a directory -> tokenizer whose ids fit the model.

  A file ending in .json is a `tokenizers` tokenizer.json, any other a SentencePiece
  model. A directory (a transformers checkpoint) is read through its tokenizer.json
  when it has one, else its tokenizer.model: Gemma checkpoints ship both, converted
  from the same model, and the .json also holds tokens added after conversion.

  Raises:
    ConfigError (field data.tokenizer): no such file, a directory with neither file, a
      file that does not parse, a tokenizer without a BOS or EOS token, or a vocabulary
      larger than `model_vocab_size`.
  """
  if name == "byte":
    tokenizer = ByteTokenizer()
  elif os.path.isdir(name):
    found = [os.path.join(name, f) for f in (JSON_FILE, MODEL_FILE)
             if os.path.isfile(os.path.join(name, f))]
    if not found:
      raise ConfigError("data.tokenizer", f"{name!r} is a directory without {JSON_FILE} or "
                        f"{MODEL_FILE} (expected 'byte', a tokenizer file or such a directory)")
    tokenizer = _load_file(found[0])
  elif os.path.isfile(name):
    tokenizer = _load_file(name)
  else:
    raise ConfigError("data.tokenizer", f"no file at {name!r} (expected 'byte', a "
                      "SentencePiece .model, a tokenizer.json or a directory holding one)")
  for piece, piece_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
    if piece_id is None or piece_id < 0:
      raise ConfigError("data.tokenizer", f"{name!r} has no {piece.upper()} piece "
                        f"({piece}_id={piece_id}); training packs [bos] doc [eos]")
  if tokenizer.vocab_size > model_vocab_size:
    raise ConfigError("data.tokenizer",
                      f"vocabulary of {tokenizer.vocab_size} ids does not fit "
                      f"model.vocab_size={model_vocab_size}")
  return tokenizer
