"""OpenAI's wire format for the server (gemma_jax.serving.server): request bodies read and
checked into engine `Request`s, and the JSON of responses, errors and stream events.

Nothing here touches the engine or the event loop: a body's fields are checked in turn,
the first bad one answered as a 400 (`ApiError`) whose `param` names it.
"""

import base64
import dataclasses
import io
import json
from typing import List, Optional, Sequence, Tuple

import numpy as np
from fastapi import responses
from PIL import Image

from gemma_jax.serving import requests as requests_lib

# A chat message's roles, as the chat template names them ("developer" is OpenAI's newer
# name for the system message).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat: the context left

# OpenAI fields this server cannot honour, with the values that ask for nothing: any
# other value is refused (400) rather than ignored.
_UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,), "logit_bias": ({},),
                "tools": ([],), "functions": ([],), "response_format": ({"type": "text"},),
                "audio": ()}
_KINDS = {
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "an object": lambda v: isinstance(v, dict),
}
# Fields whose name starts an engine's ValueError (Request.check's words).
_REQUEST_FIELDS = frozenset(f.name for kind in (requests_lib.Request, requests_lib.SamplingOptions)
                            for f in dataclasses.fields(kind))


class ApiError(Exception):
  """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, param: Optional[str] = None, *,
               kind: str = "invalid_request_error", code: Optional[str] = None,
               headers: Optional[dict] = None):
    super().__init__(message)
    self.status, self.param, self.kind, self.code = status, param, kind, code
    self.headers = headers

  def response(self) -> responses.JSONResponse:
    error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
    return responses.JSONResponse({"error": error}, status_code=self.status,
                                  headers=self.headers)


def bad(param: str, message: str) -> ApiError:
  """A 400 naming `param`, its message starting with the name."""
  return ApiError(400, f"{param} {message}", param)


def no_such_model(model, model_name: str) -> ApiError:
  """The 404 of a request for `model` to a server of `model_name`."""
  return ApiError(404, f"The model {json.dumps(model)[:60]} does not exist: this server "
                  f"serves {model_name!r}", "model", code="model_not_found")


def field(body: dict, name: str, kind: str, default=None):
  """body[name], checked to be `kind` (a key of _KINDS); absent or null: `default`."""
  value = body.get(name)
  if value is None:
    return default
  if not _KINDS[kind](value):
    raise bad(name, f"must be {kind}, got {json.dumps(value)[:60]}")
  return value


def from_value_error(error: ValueError, renamed: dict) -> ApiError:
  """A ValueError that starts with a Request field's name (the engine's and
  Request.check's) -> a 400 naming the JSON field for it (`renamed`: Request field ->
  JSON field, where they differ)."""
  message = str(error)
  name = message.split(" ", 1)[0]
  if name not in _REQUEST_FIELDS:
    return ApiError(400, message)
  param = renamed.get(name, name)
  return ApiError(400, message if param == name else f"{param}: {message}", param)


def parse_body(data: bytes, model_name: str) -> dict:
  """The JSON object of a request's body, its model and unsupported fields checked."""
  try:
    body = json.loads(data)
  except ValueError as error:   # not JSON, or not UTF-8
    raise ApiError(400, f"the body is not JSON: {error}") from None
  if not isinstance(body, dict):
    raise ApiError(400, "the body must be a JSON object")
  if body.get("model") not in (None, model_name):
    raise no_such_model(body["model"], model_name)
  for name, defaults in _UNSUPPORTED.items():
    if body.get(name) not in (None, *defaults):
      raise bad(name, "is not supported by this server")
  return body


def sampling_options(body: dict) -> requests_lib.SamplingOptions:
  """The sampling fields of a body (ranges are Request.check's)."""
  number = lambda name, default: float(field(body, name, "a number", default))
  return requests_lib.SamplingOptions(
      temperature=number("temperature", 1.0), top_k=field(body, "top_k", "an integer", 0),
      top_p=number("top_p", 1.0), min_p=number("min_p", 0.0),
      repetition_penalty=number("repetition_penalty", 1.0),
      presence_penalty=number("presence_penalty", 0.0),
      frequency_penalty=number("frequency_penalty", 0.0))


def stop_strings(body: dict) -> tuple:
  """The stop strings of a body: "stop" is a string or a list of them."""
  stop = body.get("stop")
  if isinstance(stop, str):
    return (stop,)
  if not (stop is None or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
    raise bad("stop", "must be a string or a list of strings")
  return tuple(stop or ())


def streaming(body: dict) -> Tuple[bool, bool]:
  """(stream, include_usage) of a body."""
  stream = field(body, "stream", "a boolean", False)
  options = field(body, "stream_options", "an object")
  if options is not None and not stream:
    raise bad("stream_options", "is allowed only with stream: true")
  include_usage = (options or {}).get("include_usage")
  if include_usage is not None and not isinstance(include_usage, bool):
    raise bad("stream_options.include_usage", "must be a boolean")
  return stream, bool(include_usage)


def completion_prompt(body: dict, tokenizer) -> List[int]:
  """A completion's prompt ids: its "prompt" text encoded after BOS, or its token ids."""
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    return [tokenizer.bos_id, *tokenizer.encode([prompt])[0].tolist()]
  if not (isinstance(prompt, list) and all(_KINDS["an integer"](t) for t in prompt)):
    raise bad("prompt", "must be a string or a list of token ids")
  return prompt


def _content_text(content: list, where: str, takes_images: bool, model_name: str
                  ) -> Tuple[str, bool]:
  """(a message's text parts joined by newlines, whether it holds an image)."""
  texts, images = [], False
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
      texts.append(part["text"])
    elif kind == "image_url" and not takes_images:
      raise bad(f"{where}.content[{j}]", f"is an image, but {model_name} takes text only")
    elif kind == "image_url":
      images = True
    else:
      raise bad(f"{where}.content[{j}]", 'must be {"type": "text", "text": ...} or '
                '{"type": "image_url", "image_url": {"url": ...}}')
  return "\n".join(texts), images


def chat_messages(body: dict, takes_images: bool, model_name: str
                  ) -> Tuple[List[dict], bool]:
  """(the body's messages with text content and the template's roles, whether any holds
  an image). A content's text parts are joined by newlines."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad("messages", "must be a non-empty list of messages")
  rendered, images = [], False
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
      raise bad(where, "must be an object with a role and a content")
    role, content = message.get("role"), message.get("content")
    if role is None:
      raise bad(f"{where}.role", "is missing")
    if not isinstance(role, str) or role not in ROLES:
      raise bad(f"{where}.role", f"{json.dumps(role)[:60]} is not one of {', '.join(ROLES)}")
    if isinstance(content, list):
      content, has_image = _content_text(content, where, takes_images, model_name)
      images = images or has_image
    elif not isinstance(content, str):
      raise bad(f"{where}.content", "must be a string or a list of content parts")
    rendered.append({"role": ROLES[role], "content": content})
  return rendered, images


def attach_images(messages: List[dict], request: requests_lib.Request
                  ) -> requests_lib.Request:
  """`request` with the images of the messages' image_url parts, in order. Only data
  URLs (data:image/...;base64,...) are read: the server fetches nothing. The prompt
  holds no markers, so the images go after its BOS, before the conversation.

  Raises:
    ValueError naming the part whose URL is not an image's data URL.
  """
  images = []
  for i, message in enumerate(messages):
    content = message.get("content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
      if part.get("type") == "image_url":
        where = f"[{i}].content[{j}].image_url.url"
        url = (part.get("image_url") or {}).get("url") if isinstance(
            part.get("image_url"), dict) else None
        images.append(_data_url_image(url, where))
  return dataclasses.replace(request, images=tuple(images))


def _data_url_image(url, where: str) -> np.ndarray:
  """The RGB pixels [H, W, 3] uint8 of an image's base64 data URL."""
  if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
    raise ValueError(f"{where} must be a data URL: data:image/<type>;base64,<data>")
  try:
    data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    with Image.open(io.BytesIO(data)) as image:
      return np.asarray(image.convert("RGB"))
  except (ValueError, OSError) as error:
    raise ValueError(f"{where} holds no image that can be read ({error})") from None


def chat_logprobs_option(body: dict) -> Optional[int]:
  """A chat's `logprobs` for the engine: top_logprobs (0 when absent) with logprobs:
  true, else None."""
  wants_logprobs = field(body, "logprobs", "a boolean", False)
  top = field(body, "top_logprobs", "an integer")
  if top is not None and not wants_logprobs:
    raise bad("top_logprobs", "needs logprobs: true")
  return (top or 0) if wants_logprobs else None


@dataclasses.dataclass(frozen=True)
class Call:
  """A checked request: the engine requests of its choices and how to answer."""
  requests: List[requests_lib.Request]
  stream: bool
  include_usage: bool
  logprobs: bool


class Choice:
  """What one choice has received: its text, its outputs that carried a token and where
  each one's text starts, its finish."""

  def __init__(self):
    self.pieces, self.length = [], 0
    self.tokens: List[requests_lib.Output] = []
    self.offsets: List[int] = []
    self.finish: Optional[str] = None

  def add(self, output: requests_lib.Output) -> None:
    if output.token is not None:
      self.tokens.append(output)
      self.offsets.append(self.length)
    self.pieces.append(output.text)
    self.length += len(output.text)
    self.finish = output.finish

  @property
  def text(self) -> str:
    return "".join(self.pieces)


def usage(call: Call, choices: Sequence[Choice]) -> dict:
  """OpenAI's usage: the prompt counted once, the tokens of every choice."""
  prompt = len(call.requests[0].prompt)
  completion = sum(len(choice.tokens) for choice in choices)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def sse(data) -> str:
  """One server-sent event."""
  return f"data: {json.dumps(data)}\n\n"


def completion_logprobs(tokenizer, outputs: Sequence[requests_lib.Output],
                        offsets: Sequence[int]) -> dict:
  """A completion choice's logprobs: its tokens' texts, log-probabilities, top
  alternatives and where each text starts."""
  piece = lambda token: tokenizer.decode([token])
  return {"tokens": [piece(o.token) for o in outputs],
          "token_logprobs": [o.logprob for o in outputs],
          "top_logprobs": [{piece(i): p for i, p in o.top} for o in outputs],
          "text_offset": list(offsets)}


def chat_logprobs(tokenizer, outputs: Sequence[requests_lib.Output]) -> dict:
  """A chat choice's logprobs: an entry (text, log-probability, UTF-8 bytes) per token,
  with its top alternatives'."""
  def entry(token, logprob):
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
  return {"content": [dict(entry(o.token, o.logprob),
                           top_logprobs=[entry(i, p) for i, p in o.top]) for o in outputs],
          "refusal": None}
