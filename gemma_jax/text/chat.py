"""Conversations -> token ids in Gemma's chat format, with the loss weights of a turn.

Gemma 3 ("gemma3" style, markers <start_of_turn>/<end_of_turn>) renders

  [bos] <sot>user\\n{system}\\n\\n{user}<eot>\\n <sot>model\\n{reply}<eot>\\n ... [<sot>model\\n]

folding a first system message, untrimmed, into the first user turn; turn contents are
stripped of surrounding whitespace and "assistant" is written "model". Gemma 4 ("gemma4"
style, markers <|turn>/<turn|>) gives the system message a turn of its own. The style
and the marker ids are the tokenizer's (see training/tokenizers.py). Text between two
special tokens is encoded on its own, as transformers' `apply_chat_template` does.

The template alone puts control ids in: a message's content is text, so a marker typed
in it ("<end_of_turn><start_of_turn>model") is encoded as its characters, where
`apply_chat_template` (which renders to a string, then tokenizes it) reads a new turn.

Weights are 1 on the tokens the model must learn to produce: a model turn's content and
its end-of-turn marker. The "\\n" after the marker is weighted 0: generation stops at the
marker, and whoever continues the conversation writes the "\\n".
"""

import dataclasses
from typing import List, Sequence

import numpy as np

ROLES = ("system", "user", "model", "assistant")


@dataclasses.dataclass(frozen=True)
class Rendered:
  """ids [L] int32 and weights [L] float32 (1 where ids[i] is a token to learn)."""
  ids: np.ndarray
  weights: np.ndarray


def check_messages(messages) -> None:
  """Raises ValueError naming what is wrong with a conversation (a list of messages)."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError("a conversation must be a non-empty list of messages")
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ValueError(f"message {i} is not an object with 'role' and 'content'")
    for key in ("role", "content"):
      if key not in message:
        raise ValueError(f"message {i} has no {key!r}")
    if message["role"] not in ROLES:
      raise ValueError(f"message {i} has unknown role {message['role']!r}; known: {ROLES}")
    if not isinstance(message["content"], str):
      raise ValueError(f"message {i} has {type(message['content']).__name__} content, "
                       "not a string")
  start = 1 if messages[0]["role"] == "system" else 0
  if start == len(messages):
    raise ValueError("the conversation has a system message but no user turn")
  for i in range(start, len(messages)):
    expected = "user" if (i - start) % 2 == 0 else "model"
    if _role(messages[i]["role"]) != expected:
      raise ValueError(f"message {i} has role {messages[i]['role']!r} where {expected!r} "
                       "belongs: after an optional first system message, roles must "
                       "alternate user, model (or assistant), user, ...")


def _role(role: str) -> str:
  return "model" if role == "assistant" else role


def _markers(tokenizer):
  if tokenizer.start_of_turn_id is None or tokenizer.end_of_turn_id is None:
    raise ValueError(f"{type(tokenizer).__name__} has no turn markers (<start_of_turn> and "
                     "<end_of_turn>, or <|turn> and <turn|>): it cannot render chat")
  return tokenizer.start_of_turn_id, tokenizer.end_of_turn_id


def _encode(tokenizer, text: str) -> List[int]:
  return [int(i) for i in tokenizer.encode([text])[0]] if text else []


def _turn(tokenizer, role: str, prefix: str, text: str):
  """(ids, weights) of one turn: <sot>role\\n{prefix}{text stripped}<eot>\\n."""
  start, end = _markers(tokenizer)
  role = _role(role)
  header = f"{role}\n{prefix}"
  body = _encode(tokenizer, header + text.strip())
  learn = 1.0 if role == "model" else 0.0
  # Content starts where the body's ids part from the header's (a token may straddle).
  head = _encode(tokenizer, header)
  split = 0
  while split < min(len(head), len(body)) and head[split] == body[split]:
    split += 1
  ids = [start, *body, end, *_encode(tokenizer, "\n")]
  weights = [0.0] * (1 + split) + [learn] * (len(body) - split + 1)
  weights += [0.0] * (len(ids) - len(weights))
  return ids, weights


def turn_ids(tokenizer, role: str, text: str) -> np.ndarray:
  """The ids of one more turn (not the first) of a conversation: what a chat session
  appends after a conversation's ids so far."""
  if role not in ROLES or role == "system":
    raise ValueError(f"a later turn has role user, model or assistant, not {role!r}")
  return np.asarray(_turn(tokenizer, role, "", text)[0], np.int32)


def generation_prompt_ids(tokenizer) -> np.ndarray:
  """<sot>model\\n: the ids that open the model's turn."""
  start, _ = _markers(tokenizer)
  return np.asarray([start, *_encode(tokenizer, "model\n")], np.int32)


def render(messages: Sequence[dict], tokenizer, *, add_generation_prompt: bool = False
           ) -> Rendered:
  """A conversation -> its ids (from bos) and loss weights; see the module docstring.

  Raises:
    ValueError: a malformed conversation (check_messages) or a tokenizer without markers.
  """
  check_messages(messages)
  _markers(tokenizer)
  ids, weights = [tokenizer.bos_id], [0.0]
  prefix, turns = "", list(messages)
  if turns[0]["role"] == "system":
    system = turns.pop(0)["content"]
    if tokenizer.chat_style == "gemma4":
      turn = _turn(tokenizer, "system", "", system)
      ids, weights = ids + turn[0], weights + turn[1]
    else:
      prefix = system + "\n\n"
  for i, message in enumerate(turns):
    turn = _turn(tokenizer, message["role"], prefix if i == 0 else "", message["content"])
    ids, weights = ids + turn[0], weights + turn[1]
  if add_generation_prompt:
    prompt = generation_prompt_ids(tokenizer)
    ids, weights = ids + list(prompt), weights + [0.0] * len(prompt)
  return Rendered(np.asarray(ids, np.int32), np.asarray(weights, np.float32))


def jinja_template(style: str, start: str, end: str) -> str:
  """The same format as a jinja chat template (for a saved tokenizer_config.json), with
  turn markers named `start` and `end`; it does not validate (render does)."""
  if style == "gemma4":
    system = ("{{ '" + start + "system\\n' + (m['content'] | trim) + '" + end + "\\n' }}")
  else:
    system = "{% set state.prefix = m['content'] + '\\n\\n' %}"
  return (
      "{{ bos_token }}{% set state = namespace(prefix='') %}"
      "{% for m in messages %}{% if m['role'] == 'system' %}" + system + "{% else %}"
      "{{ '" + start + "' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
      "+ state.prefix + (m['content'] | trim) + '" + end + "\\n' }}"
      "{% set state.prefix = '' %}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '" + start + "model\\n' }}{% endif %}")
