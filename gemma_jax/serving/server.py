"""An OpenAI-compatible HTTP server over a serving engine, on FastAPI (run by uvicorn).

    app = server.make_app(engine, tokenizer, model_name="gemma-3-1b-it")
    uvicorn.run(app, host="127.0.0.1", port=8000)      # experiments/serve.py does this

Endpoints: POST /v1/completions and POST /v1/chat/completions (with "stream": true as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Requests take OpenAI's fields, and top_k, min_p and repetition_penalty besides (the
official client's `extra_body`); `n` choices are n engine requests seeded seed, seed + 1,
... A malformed request is answered 400 in OpenAI's error shape, its `param` naming the
field; a full queue 429; an unknown model 404. A client that disconnects cancels its
requests.

The engine calls `on_output` from its own thread, once a token; the call only hands the
Output to the event loop (`call_soon_threadsafe`), where the response is written. What
a body may hold and how a response is spelled is OpenAI's wire format (openai_api).
"""

import asyncio
import dataclasses
import functools
import math
import time
import uuid
from typing import Callable, List, Optional, Sequence, Tuple

import fastapi
from fastapi import responses
from starlette import exceptions as starlette_exceptions

from gemma_jax.serving import openai_api
from gemma_jax.serving import requests as requests_lib
from gemma_jax.text import chat

RETRY_AFTER_SECONDS = 1   # a 429's Retry-After, which the official client honours
# engine.metrics() key -> (Prometheus type, help); a counter's name ends in _total.
_METRICS = {
    "queued": ("gauge", "Requests waiting for a slot."),
    "running": ("gauge", "Requests being decoded."),
    "pages_in_use": ("gauge", "KV cache pages held by requests or the prefix cache."),
    "pages_total": ("gauge", "KV cache pages in all."),
    "tokens_per_second": ("gauge", "Tokens generated per second."),
    "time_to_first_token_seconds": ("gauge", "Mean seconds from a request's submission to "
                                    "its first token."),
    "requests_finished": ("counter", "Requests finished."),
    "prompt_tokens": ("counter", "Prompt tokens of the requests admitted."),
    "generated_tokens": ("counter", "Tokens generated."),
    "preemptions": ("counter", "Requests whose pages were taken back, to wait again."),
}


class _Generation:
  """The engine requests behind one HTTP request (one per choice), their outputs queued
  on the event loop."""

  def __init__(self, engine, requests: Sequence[requests_lib.Request]):
    self._engine = engine
    self._loop = asyncio.get_running_loop()
    self._queue = asyncio.Queue()
    self._running = {}   # choice index -> engine request id, until its last output
    try:
      for index, request in enumerate(requests):
        self._running[index] = engine.submit(request, functools.partial(self._put, index))
    except BaseException:
      self.cancel()   # all the choices or none
      raise

  def _put(self, index: int, output: requests_lib.Output) -> None:
    """on_output, in the engine's thread."""
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, output))
    except RuntimeError:   # the loop is closed: the server has stopped, nobody reads
      pass

  async def outputs(self):
    """(choice index, Output) as they come, until every request has finished. Requests
    still running when the reader stops (a client gone) are cancelled."""
    try:
      while self._running:
        index, output = await self._queue.get()
        if output.finish is not None:
          self._running.pop(index, None)
        yield index, output
    finally:
      self.cancel()

  def cancel(self) -> None:
    for request_id in self._running.values():
      self._engine.cancel(request_id)
    self._running.clear()


async def _until_disconnected(http_request: fastapi.Request, work):
  """The result of the coroutine `work`, or None when the client disconnects first (then
  `work` is cancelled)."""
  task = asyncio.ensure_future(work)
  gone = asyncio.ensure_future(_disconnected(http_request))
  await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
  gone.cancel()
  if task.done():
    return task.result()
  task.cancel()
  return None


async def _disconnected(http_request: fastapi.Request) -> None:
  """Returns when the client disconnects (the body has been read)."""
  while (await http_request.receive())["type"] != "http.disconnect":
    pass


def _prometheus(metrics: dict) -> str:
  """engine.metrics() in Prometheus' text exposition format, names prefixed gemma_jax_."""
  lines = []
  for key, value in metrics.items():
    kind, note = _METRICS.get(key, ("gauge", f"The engine's {key}."))
    name = f"gemma_jax_{key}" + ("_total" if kind == "counter" else "")
    lines += [f"# HELP {name} {note}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
  return "\n".join(lines) + "\n"


def _number(value) -> str:
  if isinstance(value, int):
    return str(int(value))
  value = float(value)
  if math.isnan(value):
    return "NaN"
  return repr(value) if math.isfinite(value) else ("+Inf" if value > 0 else "-Inf")


class _Api:
  """The endpoints' work over one engine (see make_app)."""

  def __init__(self, engine, tokenizer, model_name: str, chat_prompt, images_to_request):
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    self.chat_prompt, self.images_to_request = chat_prompt, images_to_request
    self.stop_ids = tuple(tokenizer.stop_ids)
    self.created = int(time.time())

  async def read_body(self, http_request: fastapi.Request) -> dict:
    """The JSON object of a request, its model and unsupported fields checked."""
    return openai_api.parse_body(await http_request.body(), self.model_name)

  def start(self, body: dict, request: requests_lib.Request, renamed: dict
            ) -> Tuple[openai_api.Call, _Generation]:
    """Checks `request` as the engine will, and submits it once per choice (`n`, seeded
    seed, seed + 1, ...). renamed: Request field -> the body's, where they differ."""
    try:
      request.check(self.engine.vocab_size, self.engine.max_length)
    except ValueError as error:
      raise openai_api.from_value_error(error, renamed) from None
    n = openai_api.field(body, "n", "an integer", 1)
    if n < 1:
      raise openai_api.bad("n", f"must be >= 1, got {n}")
    stream, include_usage = openai_api.streaming(body)
    seed = request.seed
    call = openai_api.Call(
        [dataclasses.replace(request, seed=None if seed is None else seed + i)
         for i in range(n)], stream, include_usage, request.logprobs is not None)
    try:
      return call, _Generation(self.engine, call.requests)
    except requests_lib.QueueFull as error:
      raise openai_api.ApiError(
          429, str(error) or "the queue is full: try again later", kind="rate_limit_error",
          code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
      ) from None
    except ValueError as error:
      raise openai_api.from_value_error(error, renamed) from None

  def request(self, body: dict, prompt: List[int], max_tokens: int,
              logprobs: Optional[int]) -> requests_lib.Request:
    return requests_lib.Request(
        prompt=tuple(prompt), max_tokens=max_tokens,
        sampling=openai_api.sampling_options(body), stop_ids=self.stop_ids,
        stop_strings=openai_api.stop_strings(body),
        seed=openai_api.field(body, "seed", "an integer"), logprobs=logprobs)

  async def completions(self, http_request: fastapi.Request):
    """POST /v1/completions."""
    body = await self.read_body(http_request)
    prompt = openai_api.completion_prompt(body, self.tokenizer)
    default = max(1, min(openai_api.COMPLETION_MAX_TOKENS,
                         self.engine.max_length - len(prompt)))
    request = self.request(body, prompt,
                           openai_api.field(body, "max_tokens", "an integer", default),
                           openai_api.field(body, "logprobs", "an integer"))
    call, generation = self.start(body, request, {"stop_strings": "stop"})
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model_name}
    if call.stream:
      def chunks(index, output, choice):
        logprobs = None
        if call.logprobs and output.token is not None:
          logprobs = openai_api.completion_logprobs(self.tokenizer, [output],
                                                    choice.offsets[-1:])
        if output.text or logprobs or output.finish:
          yield {"index": index, "text": output.text, "logprobs": logprobs,
                 "finish_reason": output.finish}
      return _event_stream(call, generation, head, chunks)
    return await _answer(http_request, call, generation, head, lambda index, choice: {
        "index": index, "text": choice.text, "finish_reason": choice.finish,
        "logprobs": (openai_api.completion_logprobs(self.tokenizer, choice.tokens,
                                                    choice.offsets)
                     if call.logprobs else None)})

  def chat_request(self, body: dict) -> Tuple[requests_lib.Request, str]:
    """A chat body's request (through images_to_request where a message holds an image),
    and the body's name for max_tokens."""
    messages, images = openai_api.chat_messages(body, self.images_to_request is not None,
                                                self.model_name)
    try:
      prompt = [int(i) for i in self.chat_prompt(messages)]
    except ValueError as error:   # roles out of turn (chat.check_messages)
      raise openai_api.ApiError(400, f"messages: {error}", "messages") from None
    max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    logprobs = openai_api.chat_logprobs_option(body)
    request = self.request(
        body, prompt, openai_api.field(body, max_name, "an integer",
                                       max(1, self.engine.max_length - len(prompt))),
        logprobs)
    if images:
      try:
        request = self.images_to_request(body["messages"], request)
      except ValueError as error:
        raise openai_api.ApiError(400, f"messages: {error}", "messages") from None
    return request, max_name

  async def chat_completions(self, http_request: fastapi.Request):
    """POST /v1/chat/completions."""
    body = await self.read_body(http_request)
    request, max_name = self.chat_request(body)
    call, generation = self.start(body, request, {
        "stop_strings": "stop", "prompt": "messages", "logprobs": "top_logprobs",
        "max_tokens": max_name})
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name}
    if call.stream:
      def chunks(index, output, choice):
        if len(choice.pieces) == 1:   # the choice's first output: the role first
          yield {"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}
        logprobs = None
        if call.logprobs and output.token is not None:
          logprobs = openai_api.chat_logprobs(self.tokenizer, [output])
        if output.text or logprobs:
          yield {"index": index, "delta": {"content": output.text}, "logprobs": logprobs,
                 "finish_reason": None}
        if output.finish:
          yield {"index": index, "delta": {}, "logprobs": None,
                 "finish_reason": output.finish}
      return _event_stream(call, generation, dict(head, object="chat.completion.chunk"),
                           chunks)
    return await _answer(http_request, call, generation, head, lambda index, choice: {
        "index": index, "message": {"role": "assistant", "content": choice.text},
        "finish_reason": choice.finish,
        "logprobs": (openai_api.chat_logprobs(self.tokenizer, choice.tokens)
                     if call.logprobs else None)})

  def model_card(self) -> dict:
    return {"id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "gemma_jax"}

  async def models(self):
    """GET /v1/models."""
    return {"object": "list", "data": [self.model_card()]}

  async def model(self, model: str):
    """GET /v1/models/{model}."""
    if model != self.model_name:
      raise openai_api.no_such_model(model, self.model_name)
    return self.model_card()

  async def health(self):
    """GET /health."""
    return {"status": "ok"}

  async def metrics(self):
    """GET /metrics."""
    return responses.PlainTextResponse(_prometheus(self.engine.metrics()),
                                       media_type="text/plain; version=0.0.4")


async def _answer(http_request: fastapi.Request, call: openai_api.Call, generation: _Generation,
                  head: dict, choice_json: Callable[[int, openai_api.Choice], dict]):
  """The whole response, once every choice has finished (`choice_json(index, choice)`
  gives each); when the client leaves first, its requests are cancelled."""

  async def collect():
    choices = [openai_api.Choice() for _ in call.requests]
    async for index, output in generation.outputs():
      choices[index].add(output)
    return choices

  choices = await _until_disconnected(http_request, collect())
  if choices is None:
    return responses.Response(status_code=499)   # nobody is there to read it
  if any(choice.finish == "error" for choice in choices):
    raise openai_api.ApiError(500, "the serving engine failed; see the server's log",
                              kind="server_error")
  return dict(head, choices=[choice_json(i, c) for i, c in enumerate(choices)],
              usage=openai_api.usage(call, choices))


def _event_stream(call: openai_api.Call, generation: _Generation, head: dict, chunks
                  ) -> responses.StreamingResponse:
  """A streamed response, as server-sent events: `chunks(index, output, choice)` gives
  the choice chunks of each output; then the usage chunk where asked, and [DONE]. When
  the client leaves, Starlette closes the stream, which cancels the requests."""

  async def events():
    extra = {"usage": None} if call.include_usage else {}
    choices = [openai_api.Choice() for _ in call.requests]
    async for index, output in generation.outputs():
      choices[index].add(output)
      for chunk in chunks(index, output, choices[index]):
        yield openai_api.sse(dict(head, choices=[chunk], **extra))
    if call.include_usage:
      yield openai_api.sse(dict(head, choices=[], usage=openai_api.usage(call, choices)))
    yield "data: [DONE]\n\n"

  return responses.StreamingResponse(events(), media_type="text/event-stream")


def make_app(engine, tokenizer, *, model_name: str,
             chat_prompt: Optional[Callable[[List[dict]], Sequence[int]]] = None,
             images_to_request: Optional[Callable[[List[dict], requests_lib.Request],
                                                  requests_lib.Request]] = None
             ) -> fastapi.FastAPI:
  """The server's app over `engine` (gemma_jax.serving.engine; the caller starts it).

  Args:
    engine: gives vocab_size, max_length, submit, cancel and metrics.
    tokenizer: encodes a text prompt (after its BOS) and names tokens in logprobs; its
      stop_ids (eos, end of turn) end every request, as they end a ChatSession reply.
    model_name: the model's id in /v1/models; a request naming another gets a 404.
    chat_prompt: messages [{"role", "content": str}] -> prompt ids, ending with the
      model's opening; raises ValueError for a malformed conversation. Default: Gemma's
      chat template (gemma_jax.text.chat) with this tokenizer, user text encoded as text.
    images_to_request: for a model with vision: (the messages as the client sent them,
      image parts included; the request built from their text) -> the request to submit;
      raises ValueError for an image it cannot take. None: an image is refused (400).
  """
  if chat_prompt is None:
    def chat_prompt(messages):
      return chat.render(messages, tokenizer, add_generation_prompt=True).ids.tolist()
  api = _Api(engine, tokenizer, model_name, chat_prompt, images_to_request)
  app = fastapi.FastAPI(title=f"gemma_jax: {model_name}")
  app.add_exception_handler(openai_api.ApiError, lambda _, error: error.response())
  # FastAPI's own errors (no such path, a wrong method) in OpenAI's shape too.
  app.add_exception_handler(starlette_exceptions.HTTPException, lambda _, error: (
      openai_api.ApiError(error.status_code, str(error.detail)).response()))
  app.add_api_route("/v1/completions", api.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
  app.add_api_route("/v1/models", api.models, methods=["GET"])
  app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
  app.add_api_route("/health", api.health, methods=["GET"])
  app.add_api_route("/metrics", api.metrics, methods=["GET"])
  return app
