"""Documents -> token stream -> packed rows -> batches: deterministic and resumable.

A batch is a dict of [B, T] arrays (B rows, T = data.seq_len):

  tokens       int32 token ids (any valid id in padding)
  segment_ids  int32 document id of each token, 0 for padding; a token attends only
               to tokens of its own document
  positions    int32 index of the token within its document's part of the row
  targets      int32 the next token (meaningful where weights > 0)
  weights      float32 1 where the target is the next token of the same document
               (and, for chat, a token of a model turn)

Documents are shuffled by the seed, split by token count into a held-out eval part
and a train part, and each part is concatenated ([bos] doc [eos] [bos] doc ...) and
cut into rows of T tokens, so rows hold several documents and documents may span
rows; nothing is padded but the last row. Training batch i is a pure function of
(seed, i): rows are read in a fresh permutation every epoch, and the iterator's
state is just the index of the next batch. With several processes each one reads
its own contiguous slice of every global batch.

Chat data (data.format "chat", or "auto" where a JSONL line holds "messages") are
conversations rendered by gemma_jax.text.chat, with a per-token loss mask that keeps only the
model's turns. When the data hold any conversation, every example (conversation or text
document) is packed whole: shuffled, then laid into rows of T in order, a new row when
the next example does not fit; an example longer than T is cut to T. The eval split is
then data.eval_fraction of the examples (at least 1), not of the tokens.
"""

import dataclasses
import glob
import json
import os
import sysconfig
from typing import Iterator, List, Optional

from absl import logging
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax.checkpoints import bounded_json
from gemma_jax.config import ConfigError
from gemma_jax.text import chat


class DataError(ConfigError):
  """The data a config names is missing, empty or malformed."""


@dataclasses.dataclass(frozen=True)
class Rows:
  """Packed rows: tokens and segment_ids, both [R, T] int32, and an optional loss_mask
  [R, T] float32 (1 where a token is one to learn; None: every token)."""
  tokens: np.ndarray
  segment_ids: np.ndarray
  loss_mask: Optional[np.ndarray] = None

  def __len__(self):
    return self.tokens.shape[0]


def stdlib_files() -> List[str]:
  """The .py files of the running interpreter's standard library, sorted."""
  root = sysconfig.get_paths()["stdlib"]
  files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
  return sorted(f for f in files if "site-packages" not in os.path.relpath(f, root).split(os.sep))


def _read_text(filename: str) -> str:
  with open(filename, encoding="utf-8", errors="replace") as f:
    return f.read()


def _read_jsonl(filename: str, text_field: str, data_format: str) -> list:
  examples = []
  with open(filename, "rb") as f:
    for line_number, raw in enumerate(f, 1):
      where = f"{filename}:{line_number}"
      try:   # a byte-order mark may open the file
        line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
      except UnicodeDecodeError as error:
        raise DataError("data.path", f"{where} is not UTF-8 ({error})") from None
      if not line.strip():
        continue
      try:
        record = bounded_json.loads(line)
        # JSON's \uXXXX escapes can spell half of a UTF-16 pair, which no text holds.
        json.dumps(record, ensure_ascii=False).encode("utf-8")
      except json.JSONDecodeError as error:
        # Where in this line (the decoder's own "line 2" counts the line's newline).
        text = line.rstrip("\r\n")
        at = f"column {error.pos + 1}" if error.pos < len(text) else "the end of the line"
        message = error.msg[:-3] if error.msg.endswith(" at") else error.msg
        raise DataError("data.path", f"{where} is not JSON ({message} at {at})") from None
      except UnicodeEncodeError as error:
        raise DataError("data.path", f"{where} holds a lone UTF-16 surrogate "
                        f"{error.object[error.start]!r}, which is not text") from None
      except bounded_json.NestedTooDeeply as error:
        raise DataError("data.path", f"{where}: {error}") from None
      except ValueError as error:   # a number too long for an int
        raise DataError("data.path", f"{where} is not JSON that can be read ({error})") from None
      if data_format != "text" and isinstance(record, dict) and "messages" in record:
        try:
          chat.check_messages(record["messages"])
        except ValueError as error:
          raise DataError("data.path", f"{where}: {error}") from None
        examples.append(list(record["messages"]))
      elif data_format == "chat":
        raise DataError("data.format", f"{where} has no 'messages' list; data.format='chat' "
                        "takes only conversations ('auto' mixes them with text)")
      else:
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
          raise DataError("data.text_field", f"{where} is not a JSON object "
                          f"with a {text_field!r} string")
        examples.append(text)
  return examples


def read_documents(path: Optional[str], text_field: str = "text",
                   data_format: str = "text") -> list:
  """The non-empty examples of `path` (comma-separated globs; None: the stdlib source).

  A .jsonl file holds one example per line: a conversation (a list of messages) where
  the line holds "messages" and `data_format` is "chat" or "auto", else a document (its
  `text_field`, a string); a line that is not UTF-8 is an error. Any other file is one
  document, its invalid UTF-8 replaced (the standard library holds a few Latin-1 files);
  "chat" takes only .jsonl files of conversations.
  """
  if path is None:
    files = stdlib_files()
  else:
    patterns = [p.strip() for p in path.split(",") if p.strip()]
    files = sorted({f for p in patterns for f in glob.glob(os.path.expanduser(p), recursive=True)
                    if os.path.isfile(f)})
    if not files:
      raise DataError("data.path", f"no file matches {path!r}")
  documents = []
  for filename in files:
    if filename.endswith(".jsonl"):
      documents.extend(_read_jsonl(filename, text_field, data_format))
    elif data_format == "chat":
      raise DataError("data.format", f"{filename} is not a .jsonl file; data.format='chat' "
                      "takes only JSONL conversations")
    else:
      documents.append(_read_text(filename))
  documents = [d for d in documents if not isinstance(d, str) or d.strip()]
  if not documents:
    raise DataError("data.path", f"the {len(files)} file(s) matching {path!r} hold no text")
  return documents


def concatenate(documents: List[np.ndarray], bos_id: int, eos_id: int):
  """Token arrays -> (tokens [N], segment_ids [N]) of [bos] doc [eos] ..., ids from 1."""
  tokens = np.concatenate([np.concatenate([[bos_id], d, [eos_id]]) for d in documents])
  lengths = [len(d) + 2 for d in documents]
  segment_ids = np.repeat(np.arange(1, len(documents) + 1), lengths)
  return tokens.astype(np.int32), segment_ids.astype(np.int32)


def pack(tokens: np.ndarray, segment_ids: np.ndarray, seq_len: int, pad_id: int) -> Rows:
  """A stream [N] -> rows [ceil(N / T), T]; the last row is padded (segment id 0)."""
  pad = -len(tokens) % seq_len
  tokens = np.concatenate([tokens, np.full(pad, pad_id, np.int32)])
  segment_ids = np.concatenate([segment_ids, np.zeros(pad, np.int32)])
  return Rows(tokens.reshape(-1, seq_len), segment_ids.reshape(-1, seq_len))


def pack_whole(examples: List[np.ndarray], masks: List[np.ndarray], seq_len: int,
               pad_id: int) -> Rows:
  """Examples [L_i <= T] and their loss masks -> rows [R, T], each example whole in one
  row, in order; segment ids count the examples from 1."""
  rows, row = [], []
  for i, (ids, mask) in enumerate(zip(examples, masks), 1):
    if sum(len(x[0]) for x in row) + len(ids) > seq_len:
      rows.append(row)
      row = []
    row.append((ids, mask, np.full(len(ids), i, np.int32)))
  rows.append(row)
  def fill(part: int, pad) -> np.ndarray:
    return np.stack([np.concatenate([x[part] for x in row] + [
        np.full(seq_len - sum(len(x[0]) for x in row), pad)]) for row in rows])
  return Rows(fill(0, pad_id).astype(np.int32), fill(2, 0).astype(np.int32),
              fill(1, 0).astype(np.float32))


def make_batch(tokens: np.ndarray, segment_ids: np.ndarray,
               loss_mask: Optional[np.ndarray] = None) -> dict:
  """tokens, segment_ids [B, T] (and a loss mask [B, T], 1 on the tokens to learn) ->
  the batch dict (see the module docstring)."""
  b, t = tokens.shape
  index = np.broadcast_to(np.arange(t), (b, t))
  starts = np.ones((b, t), bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  same_document = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  targets = np.zeros_like(tokens)
  targets[:, :-1] = np.where(same_document, tokens[:, 1:], 0)
  weights = np.zeros((b, t), np.float32)
  weights[:, :-1] = same_document
  if loss_mask is not None:
    weights[:, :-1] *= loss_mask[:, 1:]
  return dict(tokens=tokens.astype(np.int32), segment_ids=segment_ids.astype(np.int32),
              positions=positions.astype(np.int32), targets=targets.astype(np.int32),
              weights=weights)


def load_splits(config: config_dict.ConfigDict, tokenizer, seed: int):
  """(train Rows, eval Rows) for `config.data`, examples shuffled by `seed`.

  Raises:
    DataError (field data.eval_fraction): the eval split holds no target token.
    ConfigError (field data.tokenizer): chat data and a tokenizer without turn markers.
  """
  examples = read_documents(config.path, config.text_field, config.format)
  if any(not isinstance(e, str) for e in examples):
    return _conversation_splits(config, tokenizer, examples, seed)
  documents = tokenizer.encode(examples)
  order = np.random.default_rng(seed).permutation(len(documents))
  tokens, segment_ids = concatenate([documents[i] for i in order], tokenizer.bos_id,
                                    tokenizer.eos_id)
  n_eval = min(max(round(config.eval_fraction * len(tokens)), 1), len(tokens) - 1)
  split = lambda part: pack(tokens[part], segment_ids[part], config.seq_len, tokenizer.pad_id)
  held_out = split(slice(0, n_eval))
  if not make_batch(held_out.tokens, held_out.segment_ids)["weights"].any():
    raise DataError("data.eval_fraction", f"{config.eval_fraction} holds out {n_eval} of the "
                    f"{len(tokens)} tokens, none followed by another of its document to "
                    "predict: raise it")
  return split(slice(n_eval, None)), held_out


def _rendered(config: config_dict.ConfigDict, tokenizer, examples: list):
  """Data holding conversations -> (ids, loss masks) per example, each cut to seq_len."""
  if tokenizer.start_of_turn_id is None:
    raise ConfigError("data.tokenizer", f"{type(tokenizer).__name__} has no turn markers "
                      "(<start_of_turn>, <end_of_turn>): it cannot render the chat data")
  ids, masks = [], []
  for example in examples:
    if isinstance(example, str):
      ids.append(np.concatenate([[tokenizer.bos_id], tokenizer.encode([example])[0],
                                 [tokenizer.eos_id]]).astype(np.int32))
      masks.append(np.ones(len(ids[-1]), np.float32))
    else:
      rendered = chat.render(example, tokenizer)
      ids.append(rendered.ids)
      masks.append(rendered.weights)
  cut = sum(len(x) > config.seq_len for x in ids)
  if cut:
    logging.warning("%d of %d examples are longer than data.seq_len=%d and were cut to it",
                    cut, len(examples), config.seq_len)
  return [x[:config.seq_len] for x in ids], [x[:config.seq_len] for x in masks]


def _conversation_splits(config: config_dict.ConfigDict, tokenizer, examples: list,
                         seed: int):
  """load_splits for data holding conversations: whole examples, split by count."""
  if len(examples) < 2:
    raise DataError("data.path", f"{config.path!r} holds 1 example: an eval split needs "
                    "another")
  ids, masks = _rendered(config, tokenizer, examples)
  order = np.random.default_rng(seed).permutation(len(examples))
  n_eval = min(max(round(config.eval_fraction * len(examples)), 1), len(examples) - 1)
  split = lambda part: pack_whole([ids[i] for i in part], [masks[i] for i in part],
                                  config.seq_len, tokenizer.pad_id)
  held_out = split(order[:n_eval])
  if not make_batch(held_out.tokens, held_out.segment_ids, held_out.loss_mask)["weights"].any():
    raise DataError("data.eval_fraction", f"{config.eval_fraction} holds out {n_eval} of the "
                    f"{len(examples)} examples, with no model turn to predict: raise it")
  return split(order[n_eval:]), held_out


def load_all(config: config_dict.ConfigDict, tokenizer) -> Rows:
  """Every example of `config.path` as rows, in file order and unsplit (what an
  evaluation reads): text packed as in training, conversations whole with their loss
  masks (model turns only)."""
  examples = read_documents(config.path, config.text_field, config.format)
  if any(not isinstance(e, str) for e in examples):
    ids, masks = _rendered(config, tokenizer, examples)
    return pack_whole(ids, masks, config.seq_len, tokenizer.pad_id)
  tokens, segment_ids = concatenate(tokenizer.encode(examples), tokenizer.bos_id,
                                    tokenizer.eos_id)
  return pack(tokens, segment_ids, config.seq_len, tokenizer.pad_id)


def _process_slice(global_rows: np.ndarray, process_index: int, process_count: int):
  """This process's contiguous share of a global batch's row indices."""
  if len(global_rows) % process_count:
    raise ConfigError("train.batch_size", f"{len(global_rows)} rows do not split over "
                      f"{process_count} processes")
  share = len(global_rows) // process_count
  return global_rows[process_index * share:(process_index + 1) * share]


class TrainBatches:
  """Endless training batches; batch i is a pure function of (rows, seed, i).

  The global batch i holds rows i * B ... (i + 1) * B - 1 of the endless sequence
  that visits every row once per epoch, in a permutation seeded by (seed, epoch).
  `state()` / `restore(state)` save and set the position, as rows taken, so that a run
  resumed with another batch size goes on from the next row.
  """

  def __init__(self, rows: Rows, batch_size: int, seed: int,
               process_index: Optional[int] = None, process_count: Optional[int] = None):
    self.rows, self.batch_size, self.seed = rows, batch_size, seed
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    _process_slice(np.arange(batch_size), self.process_index, self.process_count)
    self.next_row = 0
    self._epoch, self._permutation = None, None

  def _row(self, j: int) -> int:
    epoch, i = divmod(j, len(self.rows))
    if epoch != self._epoch:
      self._epoch = epoch
      self._permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
    return self._permutation[i]

  def batch(self, index: int) -> dict:
    """This process's share [B / processes, T] of global batch `index`."""
    return self._batch_from(index * self.batch_size)

  def _batch_from(self, start: int) -> dict:
    """This process's share of the B rows of the endless sequence from `start`."""
    global_rows = np.arange(start, start + self.batch_size)
    rows = np.array([self._row(j) for j in
                     _process_slice(global_rows, self.process_index, self.process_count)])
    mask = None if self.rows.loss_mask is None else self.rows.loss_mask[rows]
    return make_batch(self.rows.tokens[rows], self.rows.segment_ids[rows], mask)

  def state(self) -> dict:
    return {"next_row": self.next_row, "seed": self.seed, "rows": len(self.rows)}

  def restore(self, state: dict) -> None:
    """Goes on from a position `state()` gave; raises ValueError naming what is wrong
    with one it cannot go on from (a checkpoint's, damaged or written by hand)."""
    if not isinstance(state, dict):
      raise ValueError(f"the data position is {state!r}, not a JSON object")
    # Checkpoints written before positions were rows count batches of this size.
    position = "next_batch" if "next_batch" in state and "next_row" not in state else "next_row"
    for key in (position, "seed", "rows"):
      if key not in state:
        raise ValueError(f"the data position {state!r} has no {key}")
      value = state[key]
      if isinstance(value, bool) or not isinstance(value, int) or (key != "seed" and value < 0):
        raise ValueError(f"the data position {state!r} has {key} {value!r}, not an int"
                         + (" >= 0" if key != "seed" else ""))
    if (state["seed"], state["rows"]) != (self.seed, len(self.rows)):
      logging.warning("the checkpoint's data position was taken with seed %s over %s rows; "
                      "now seed %s over %s rows: batches will differ from the first run",
                      state["seed"], state["rows"], self.seed, len(self.rows))
    self.next_row = state[position] * (self.batch_size if position == "next_batch" else 1)

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    batch = self._batch_from(self.next_row)
    self.next_row += self.batch_size
    return batch


def eval_batches(rows: Rows, batch_size: int, num_batches: int,
                 process_index: Optional[int] = None,
                 process_count: Optional[int] = None) -> List[dict]:
  """The first `num_batches` batches of the eval rows in order (this process's share).

  A split smaller than that gives fewer batches, the last one filled with padding rows.
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  n = min(len(rows), batch_size * num_batches)
  total = -(-n // batch_size) * batch_size
  pad = ((0, total - n), (0, 0))
  tokens = np.pad(rows.tokens[:n], pad)
  segment_ids = np.pad(rows.segment_ids[:n], pad)
  mask = None if rows.loss_mask is None else np.pad(rows.loss_mask[:n], pad)
  batches = []
  for start in range(0, total, batch_size):
    local = _process_slice(np.arange(start, start + batch_size), process_index, process_count)
    batches.append(make_batch(tokens[local], segment_ids[local],
                              None if mask is None else mask[local]))
  return batches
