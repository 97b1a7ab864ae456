"""Text <-> token ids: bytes, a SentencePiece model, or a `tokenizers` tokenizer.json.

Every tokenizer exposes `vocab_size`, the special ids `pad_id`, `bos_id`, `eos_id`,
`start_of_turn_id`, `end_of_turn_id` (None when it has no turn markers), `stop_ids`,
`chat_style` ("gemma3": <start_of_turn>/<end_of_turn>; "gemma4": <|turn>/<turn|>),
`encode(texts) -> list of int32 arrays`, `decode(ids) -> str` (special ids skipped) and
`save(directory)`, which writes files that both `get_tokenizer(directory)` and
transformers' `AutoTokenizer.from_pretrained(directory)` load.

Text is text: `encode` gives a special token's name written in a text ("<end_of_turn>",
"<start_of_image>", "<bos>") the ids of its characters, never the special id, with every
kind of tokenizer. Only a caller that means them puts special ids in a sequence: the
chat template (gemma_jax.text.chat), or a Sampler placing images.
"""

import functools
import json
import os
import shutil
from typing import List, Optional, Sequence

import numpy as np
import sentencepiece
import tokenizers as hf_tokenizers

from gemma_jax.checkpoints import bounded_json
from gemma_jax.config import ConfigError
from gemma_jax.text import chat

# Names of the special tokens, by the marker style they belong to.
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TURN_MARKERS = {"gemma3": ("<start_of_turn>", "<end_of_turn>"), "gemma4": ("<|turn>", "<turn|>")}
JSON_FILE, MODEL_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"
# Names of control tokens that a text may spell but never stand for, besides a tokenizer's
# own bos, eos, pad and turn markers (and a tokenizer.json's tokens marked special):
# Gemma's mask, and the image and video markers of Gemma 3 and Gemma 4.
CONTROL_NAMES = ("<mask>", "[multimodal]", *TURN_MARKERS["gemma3"], *TURN_MARKERS["gemma4"],
                 "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<|image>",
                 "<image|>", "<|image|>", "<|video|>")


class _Tokenizer:
  """What every tokenizer shares: stop ids, text encoded as text, the highest id's check
  and the transformers config file.

  Every kind gives `path`, `_name` (id -> token name) and `_count` (how many ids are in
  use). One whose library's encoding may hold control ids encodes through `_as_text`
  and gives `_encode` (texts -> rows of ids, as the library encodes them), `_id` (token
  name -> id or None), `_decode_all` (ids -> text, special ids kept), `_marked_special`
  (ids its file marks special), `_unk_id`, `_has_pad` and a `_spelled` cache.
  """
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

  def encode(self, texts: Sequence[str]) -> list:
    """Texts -> int32 id arrays, each text encoded as text (see the module docstring)."""
    return [np.asarray(row, np.int32) for row in self._as_text(self._encode(list(texts)))]

  def _as_text(self, rows: List[List[int]]) -> List[List[int]]:
    """Rows of ids, each control id (a name the tokenizer matched in the text, or rebuilt
    from its characters by merges) replaced by the ids that spell its name."""
    return [row if self._protected.isdisjoint(row) else
            [j for i in row for j in (self._spelling(i) if i in self._protected else (i,))]
            for row in rows]

  @functools.cached_property
  def _protected(self) -> frozenset:
    """Ids of the control tokens a text must not produce; the unknown token, which
    stands for characters without a piece, is not one."""
    ids = {self.bos_id, self.eos_id, self.start_of_turn_id, self.end_of_turn_id,
           *(self._id(name) for name in CONTROL_NAMES), *self._marked_special()}
    if self._has_pad:   # else pad_id is an ordinary token's
      ids.add(self.pad_id)
    return frozenset(ids - {None, self._unk_id})

  def _spelling(self, token: int) -> tuple:
    """The ids of `token`'s name written character by character: each character's own
    piece, else its UTF-8 bytes as byte-fallback pieces or ByteLevel characters, else
    the unknown token; the first whose ids decode to the character."""
    if token in self._spelled:
      return self._spelled[token]
    ids = []
    for character in self._name(token):
      utf8 = character.encode("utf-8")
      for names in ([character], [f"<0x{b:02X}>" for b in utf8],
                    [_CHARACTER_OF_BYTE[b] for b in utf8]):
        spelled = [self._id(name) for name in names]
        if (None not in spelled and self._protected.isdisjoint(spelled)
            and self._decode_all(spelled) == character):
          ids += spelled
          break
      else:
        if self._unk_id is None:
          raise ValueError(f"{self.path}: {character!r} of {self._name(token)!r} has no "
                           "piece, byte piece or unknown token to be encoded as text")
        ids.append(self._unk_id)
    self._spelled[token] = tuple(ids)
    return self._spelled[token]

  def check_fits(self, model_vocab_size: int) -> None:
    """Raises ConfigError (field data.tokenizer) unless every id, the highest included,
    is below `model_vocab_size`: an id past the embedding table trains to a NaN loss."""
    highest = self.vocab_size - 1
    if highest < model_vocab_size:
      return
    where = f"{self.path!r} maps {self._name(highest)!r} to id {highest}"
    if self._count == self.vocab_size:
      raise ConfigError("data.tokenizer", f"vocabulary of {self.vocab_size} ids does not fit "
                        f"model.vocab_size={model_vocab_size} ({where})")
    raise ConfigError("data.tokenizer", f"{where}, past model.vocab_size={model_vocab_size} "
                      f"(ids must lie in [0, {model_vocab_size}))")

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
  path = "byte"
  pad_id, bos_id, eos_id = 0, 1, 2
  _offset = 3
  start_of_turn_id, end_of_turn_id = 256 + _offset, 257 + _offset
  vocab_size = 258 + _offset
  _count = vocab_size
  _names = {pad_id: PAD, bos_id: BOS, eos_id: EOS, start_of_turn_id: TURN_MARKERS["gemma3"][0],
            end_of_turn_id: TURN_MARKERS["gemma3"][1]}

  def encode(self, texts: Sequence[str]) -> list:
    # Bytes only: no text gives a special id.
    return [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self._offset
            for text in texts]

  def _name(self, token: int) -> str:
    return self._names[token]

  def decode(self, ids: Sequence[int]) -> str:
    # Special ids, and ids past the bytes (a model's vocabulary may be larger), are skipped.
    data = bytes(int(i) - self._offset for i in ids if self._offset <= i < 256 + self._offset)
    return data.decode("utf-8", errors="replace")

  def save(self, directory: str) -> None:
    """tokenizer.json (a byte-level BPE without merges, ids as ours) and its config."""
    os.makedirs(directory, exist_ok=True)
    names = self._names
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


_CHARACTER_OF_BYTE = {_byte_of_character(character): character
                      for character in hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()}


class SentencePieceTokenizer(_Tokenizer):
  """A SentencePiece model file, e.g. Gemma's tokenizer.model (pad 0, eos 1, bos 2)."""

  def __init__(self, path: str):
    self.path = path
    self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._processor.vocab_size()
    self._count = self.vocab_size
    self.bos_id = self._processor.bos_id()
    self.eos_id = self._processor.eos_id()
    # Padding is masked by segment id 0, so any valid id serves when the model has none.
    self._has_pad = self._processor.pad_id() >= 0
    self.pad_id = max(self._processor.pad_id(), 0)
    self._unk_id = self._processor.unk_id()
    self._spelled = {}
    self._set_turn_markers(self._id)

  def _id(self, piece: str) -> Optional[int]:
    i = self._processor.piece_to_id(piece)
    return i if self._processor.id_to_piece(i) == piece else None

  def _name(self, token: int) -> str:
    return self._processor.id_to_piece(token)

  def _marked_special(self) -> set:
    # A model file marks no token special beyond its control pieces, which no text gives.
    return set()

  def _encode(self, texts: List[str]) -> list:
    # SentencePiece matches user-defined pieces (Gemma's markers) in the text.
    return self._processor.encode(texts, num_threads=os.cpu_count() or 1)

  def _decode_all(self, ids: Sequence[int]) -> str:
    return self._processor.decode(list(ids))

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
    # Special tokens' names in a text go through the model as characters (transformers'
    # split_special_tokens=True); this is not saved with the file.
    self._tokenizer.encode_special_tokens = True
    vocabulary = self._tokenizer.get_vocab(with_added_tokens=True)
    # Ids may skip some: the model needs the highest, not the count.
    self.vocab_size = max(vocabulary.values(), default=-1) + 1
    self._count = len(vocabulary)
    lookup = self._id = self._tokenizer.token_to_id
    self.bos_id, self.eos_id = lookup(names["bos_token"]), lookup(names["eos_token"])
    self._has_pad = lookup(names["pad_token"]) is not None
    self.pad_id = lookup(names["pad_token"]) or 0
    self._unk_id = lookup(getattr(self._tokenizer.model, "unk_token", None) or "<unk>")
    self._spelled = {}
    self._set_turn_markers(lookup)

  def _name(self, token: int) -> str:
    return self._tokenizer.id_to_token(token)

  def _marked_special(self) -> set:
    return {i for i, token in self._tokenizer.get_added_tokens_decoder().items()
            if token.special}

  def _encode(self, texts: List[str]) -> list:
    # Merges may still build a special token from its characters: _as_text spells it.
    return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

  def _decode_all(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode(list(ids), skip_special_tokens=False)

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
      with open(path, "rb") as f:
        config = bounded_json.loads(f.read())
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
      file that does not parse, a tokenizer without a BOS or EOS token, or a token id
      (the highest, added tokens included) outside [0, `model_vocab_size`).
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
  tokenizer.check_fits(model_vocab_size)
  return tokenizer
