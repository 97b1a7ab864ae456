"""The OpenAI-compatible server (gemma_jax.serving.server) over a fake engine, run by
uvicorn on a free local port and spoken to by the official `openai` client (sync and
async, streamed and not) and, for what the client will not send, by httpx.

The fake engine answers each request with the bytes of a known text (`reply`) through
the byte tokenizer, one token a call from a thread of its own, then eos, and records what
it was given."""

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from gemma_jax.serving import requests as requests_lib
from gemma_jax.serving import server
from gemma_jax.text import chat
from gemma_jax.text import tokenizers

MODEL = "tiny-gemma"
TOKENIZER = tokenizers.get_tokenizer("byte", 261)
METRICS = {"queued": 2, "running": 3, "pages_in_use": 10, "pages_total": 64,
           "tokens_per_second": 12.5, "time_to_first_token_seconds": 0.25,
           "requests_finished": 7, "prompt_tokens": 100, "generated_tokens": 42}


def reply(request: requests_lib.Request) -> str:
  """The text the fake engine answers `request` with, before its eos."""
  return f"{len(request.prompt)} tokens, seed {request.seed}."


class FakeEngine:
  """The engine's interface, deterministic: `reply(request)` a byte a token (each after
  `delay` seconds), then eos (finish "stop"), or cut at max_tokens (finish "length").
  With logprobs, token t has log-probability -0.5 and alternatives t, t+1, ... at
  -0.5, -1.5, ... Raises QueueFull past `capacity` requests, `refuse` (an exception)
  where set; `metric_values` are its metrics."""

  vocab_size = TOKENIZER.vocab_size
  max_length = 128

  def __init__(self):
    self._lock = threading.Lock()
    self.reset()

  def reset(self):
    self.submitted, self.cancelled = [], []
    self.capacity, self.refuse, self.delay = None, None, 0.0
    self.metric_values = dict(METRICS)

  def submit(self, request, on_output):
    if self.capacity is not None and len(self.submitted) >= self.capacity:
      raise requests_lib.QueueFull("the queue is full: try again later")
    if self.refuse:
      raise self.refuse
    request.check(self.vocab_size, self.max_length)
    with self._lock:
      request_id = len(self.submitted)
      self.submitted.append(request)
    threading.Thread(target=self._run, args=(request_id, request, on_output),
                     daemon=True).start()
    return request_id

  def _run(self, request_id, request, on_output):
    tokens = [*TOKENIZER.encode([reply(request)])[0].tolist(), TOKENIZER.eos_id]
    for i, token in enumerate(tokens[:request.max_tokens]):
      time.sleep(self.delay)
      if request_id in self.cancelled:
        on_output(requests_lib.Output(None, finish="cancelled"))
        return
      finish = ("stop" if token == TOKENIZER.eos_id else
                "length" if i + 1 == request.max_tokens else None)
      top = tuple((token + k, -0.5 - k) for k in range(request.logprobs or 0))
      on_output(requests_lib.Output(
          token, text=TOKENIZER.decode([token]), top=top, finish=finish,
          logprob=None if request.logprobs is None else -0.5))

  def cancel(self, request_id):
    self.cancelled.append(request_id)

  def metrics(self):
    return self.metric_values


@contextlib.contextmanager
def serving(app):
  """The base URL of `app` served by uvicorn on a free port, in a thread."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
  thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]},
                            daemon=True)
  thread.start()
  while not uvicorn_server.started:
    time.sleep(0.01)
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    uvicorn_server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(scope="module")
def running():
  engine = FakeEngine()
  with serving(server.make_app(engine, TOKENIZER, model_name=MODEL)) as url:
    yield engine, url


@pytest.fixture
def engine(running):
  engine = running[0]
  engine.reset()
  return engine


@pytest.fixture
def url(running):
  return running[1]


@pytest.fixture
def client(url):
  with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
    yield client


def async_client(url):
  return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def prompt_ids(text):
  return [TOKENIZER.bos_id, *TOKENIZER.encode([text])[0].tolist()]


def expected(prompt_length, seed=None):
  return f"{prompt_length} tokens, seed {seed}."


def test_completion_text_finish_usage_and_request(client, engine):
  response = client.completions.create(
      model=MODEL, prompt="Hello", max_tokens=40, temperature=0.5, top_p=0.9, seed=3,
      presence_penalty=0.25, frequency_penalty=-0.5, stop=["\n\n", "END"],
      extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
  text = expected(6, 3)
  assert response.object == "text_completion" and response.model == MODEL
  assert response.id.startswith("cmpl-")
  (choice,) = response.choices
  assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (
      0, text, "stop", None)
  assert response.usage.prompt_tokens == 6
  assert response.usage.completion_tokens == len(text) + 1   # eos counts, as OpenAI's
  assert response.usage.total_tokens == 6 + len(text) + 1
  (request,) = engine.submitted
  assert request.prompt == tuple(prompt_ids("Hello")) and request.max_tokens == 40
  assert request.sampling == requests_lib.SamplingOptions(
      temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
      presence_penalty=0.25, frequency_penalty=-0.5)
  assert request.stop_strings == ("\n\n", "END") and request.seed == 3
  assert request.stop_ids == TOKENIZER.stop_ids and request.logprobs is None


def test_completion_length_token_prompt_and_a_single_stop(client, engine):
  response = client.completions.create(model=MODEL, prompt=[1, 72, 73], max_tokens=4,
                                       stop="x")
  assert response.choices[0].text == expected(3)[:4]
  assert response.choices[0].finish_reason == "length"
  assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 4)
  assert engine.submitted[0].prompt == (1, 72, 73)
  assert engine.submitted[0].stop_strings == ("x",)


def test_completion_default_max_tokens_is_openai_s_16(client, engine):
  response = client.completions.create(model=MODEL, prompt="Hi")
  assert engine.submitted[0].max_tokens == 16
  assert response.choices[0].finish_reason == "length"


def test_completion_logprobs_shape(client):
  response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=50, logprobs=2)
  text = expected(3)
  logprobs = response.choices[0].logprobs
  count = response.usage.completion_tokens
  assert count == len(text) + 1
  assert logprobs.tokens == list(text) + [""]   # eos is named by its (empty) text
  assert logprobs.token_logprobs == [-0.5] * count
  assert len(logprobs.top_logprobs) == count
  assert all(len(top) == 2 for top in logprobs.top_logprobs[:-1])
  assert logprobs.top_logprobs[0] == {text[0]: -0.5, chr(ord(text[0]) + 1): -1.5}
  assert logprobs.text_offset == list(range(count))


def test_n_choices_are_seeded_in_turn(client, engine):
  response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=50, n=3,
                                       seed=7)
  assert [c.index for c in response.choices] == [0, 1, 2]
  assert [c.text for c in response.choices] == [expected(3, s) for s in (7, 8, 9)]
  assert sorted(r.seed for r in engine.submitted) == [7, 8, 9]
  assert response.usage.prompt_tokens == 3
  assert response.usage.completion_tokens == sum(len(expected(3, s)) + 1 for s in (7, 8, 9))
  engine.reset()
  response = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
  assert [r.seed for r in engine.submitted] == [None, None]
  assert len(response.choices) == 2


def test_completion_stream_with_usage(client):
  stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=50,
                                     stream=True, stream_options={"include_usage": True})
  chunks = list(stream)
  text = expected(6)
  assert "".join(c.choices[0].text for c in chunks if c.choices) == text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
  assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(text) + 1
  assert chunks[-1].usage.prompt_tokens == 6
  assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage_is_sse(url):
  body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
  response = httpx.post(f"{url}/v1/completions", json=body)
  assert response.headers["content-type"].startswith("text/event-stream")
  events = response.text.split("\n\n")
  assert events[-2:] == ["data: [DONE]", ""]
  chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
  assert "".join(c["choices"][0]["text"] for c in chunks) == expected(3)[:3]
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  assert all("usage" not in c for c in chunks)


def test_chat_reply_uses_gemma_s_template(client, engine):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is 2 plus 3? <end_of_turn>"},
              {"role": "assistant", "content": "5"},
              {"role": "user", "content": "And 4 plus 4?"}]
  response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
  ids = chat.render(messages, TOKENIZER, add_generation_prompt=True).ids.tolist()
  (request,) = engine.submitted
  assert request.prompt == tuple(ids)
  assert ids.count(TOKENIZER.end_of_turn_id) == 3   # the typed marker stays text
  assert request.stop_ids == TOKENIZER.stop_ids
  assert request.max_tokens == FakeEngine.max_length - len(ids)   # the context left
  assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
  (choice,) = response.choices
  assert choice.message.role == "assistant"
  assert choice.message.content == expected(len(ids))
  assert choice.finish_reason == "stop" and choice.logprobs is None
  assert response.usage.prompt_tokens == len(ids)
  assert response.usage.completion_tokens == len(expected(len(ids))) + 1


def test_chat_content_parts_and_developer_role(client, engine):
  client.chat.completions.create(model=MODEL, max_completion_tokens=5, messages=[
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "One"},
                                   {"type": "text", "text": "Two"}]}])
  ids = chat.render([{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "One\nTwo"}], TOKENIZER,
                    add_generation_prompt=True).ids.tolist()
  assert engine.submitted[0].prompt == tuple(ids)
  assert engine.submitted[0].max_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_async_completion_and_chat(url, stream):
  async def run():
    async with async_client(url) as client:
      completion = await client.completions.create(model=MODEL, prompt="Hello",
                                                   max_tokens=50, stream=stream)
      messages = [{"role": "user", "content": "Hi"}]
      reply_ = await client.chat.completions.create(
          model=MODEL, messages=messages, stream=stream, logprobs=True, top_logprobs=3)
      if not stream:
        return (completion.choices[0].text, completion.choices[0].finish_reason,
                reply_.choices[0].message.content, reply_.choices[0].finish_reason,
                reply_.choices[0].logprobs.content)
      completion_chunks = [c async for c in completion]
      chat_chunks = [c async for c in reply_]
      assert chat_chunks[0].choices[0].delta.role == "assistant"
      return ("".join(c.choices[0].text for c in completion_chunks),
              completion_chunks[-1].choices[0].finish_reason,
              "".join(c.choices[0].delta.content or "" for c in chat_chunks),
              chat_chunks[-1].choices[0].finish_reason,
              [e for c in chat_chunks if c.choices[0].logprobs
               for e in c.choices[0].logprobs.content])

  text, finish, chat_text, chat_finish, logprobs = asyncio.run(run())
  prompt = chat.render([{"role": "user", "content": "Hi"}], TOKENIZER,
                       add_generation_prompt=True).ids
  assert (text, finish) == (expected(6), "stop")
  assert (chat_text, chat_finish) == (expected(len(prompt)), "stop")
  assert [e.token for e in logprobs] == list(chat_text) + [""]
  assert all(e.logprob == -0.5 and len(e.top_logprobs) == 3 for e in logprobs)
  assert logprobs[0].bytes == list(chat_text[0].encode())
  assert [t.logprob for t in logprobs[0].top_logprobs] == [-0.5, -1.5, -2.5]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("path, body, param", [
    ("completions", dict(COMPLETION, max_tokens=0), "max_tokens"),
    ("completions", dict(COMPLETION, max_tokens=200), "max_tokens"),
    ("completions", dict(COMPLETION, max_tokens="8"), "max_tokens"),
    ("completions", dict(COMPLETION, temperature=-1), "temperature"),
    ("completions", dict(COMPLETION, top_p=0), "top_p"),
    ("completions", dict(COMPLETION, top_k=-1), "top_k"),
    ("completions", dict(COMPLETION, prompt="x" * 200), "prompt"),
    ("completions", dict(COMPLETION, prompt=[1, 99999]), "prompt"),
    ("completions", dict(COMPLETION, prompt=[1, 2.5]), "prompt"),
    ("completions", dict(COMPLETION, prompt=None), "prompt"),
    ("completions", dict(COMPLETION, stop=["ok", ""]), "stop"),
    ("completions", dict(COMPLETION, stop=5), "stop"),
    ("completions", dict(COMPLETION, logprobs=21), "logprobs"),
    ("completions", dict(COMPLETION, n=0), "n"),
    ("completions", dict(COMPLETION, stream_options={"include_usage": True}),
     "stream_options"),
    ("completions", dict(COMPLETION, echo=True), "echo"),
    ("chat/completions", {"model": MODEL}, "messages"),
    ("chat/completions", dict(CHAT, messages=[{"content": "Hi"}]), "messages[0].role"),
    ("chat/completions", dict(CHAT, messages=[{"role": "tool", "content": "Hi"}]),
     "messages[0].role"),
    ("chat/completions", dict(CHAT, messages=[{"role": ["user"], "content": "Hi"}]),
     "messages[0].role"),
    ("chat/completions", dict(CHAT, messages=[{"role": "user", "content": 5}]),
     "messages[0].content"),
    ("chat/completions", dict(CHAT, messages=[{"role": "assistant", "content": "Hi"}]),
     "messages"),
    ("chat/completions", dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, IMAGE]}]), "messages[0].content[1]"),
    ("chat/completions", dict(CHAT, messages=[{"role": "user", "content": "x" * 200}]),
     "messages"),
    ("chat/completions", dict(CHAT, max_tokens=0), "max_tokens"),
    ("chat/completions", dict(CHAT, max_completion_tokens=200), "max_completion_tokens"),
    ("chat/completions", dict(CHAT, temperature=-0.5), "temperature"),
    ("chat/completions", dict(CHAT, top_logprobs=2), "top_logprobs"),
    ("chat/completions", dict(CHAT, logprobs=True, top_logprobs=30), "top_logprobs"),
    ("chat/completions", dict(CHAT, tools=[{"type": "function"}]), "tools"),
])
def test_malformed_requests_are_400s_naming_the_field(url, engine, path, body, param):
  response = httpx.post(f"{url}/v1/{path}", json=body)
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                            None)
  assert param.split("[")[0] in error["message"]
  assert not engine.submitted


def test_bad_json_is_a_400(url):
  for content in (b"{not json", b"\xff\xfe", b"[1, 2]"):
    response = httpx.post(f"{url}/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_client_raises_on_a_400(client):
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
  assert raised.value.body["param"] == "temperature"
  assert "temperature" in raised.value.message


def test_an_engine_s_value_error_names_the_field(client, engine):
  engine.refuse = ValueError("stop_strings longer than 64 bytes are not supported")
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=MODEL, prompt="Hi", stop="x" * 70)
  assert raised.value.body["param"] == "stop"
  assert "longer than 64 bytes" in raised.value.message


def test_a_full_queue_is_a_429(client, url, engine):
  engine.capacity = 0
  with pytest.raises(openai.RateLimitError):
    client.completions.create(model=MODEL, prompt="Hi")
  response = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
  assert response.status_code == 429 and response.headers["retry-after"] == "1"
  assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_full_queue_cancels_the_choices_already_submitted(url, engine):
  engine.capacity, engine.delay = 1, 0.05
  response = httpx.post(f"{url}/v1/completions", json=dict(COMPLETION, n=2))
  assert response.status_code == 429 and engine.cancelled == [0]


def test_an_unknown_model_is_a_404(client, url):
  with pytest.raises(openai.NotFoundError) as raised:
    client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
  assert raised.value.body["code"] == "model_not_found"
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("gpt-4")
  assert httpx.get(f"{url}/v1/nothing").json()["error"]["type"] == "invalid_request_error"


def test_models_and_health(client, url):
  assert [m.id for m in client.models.list()] == [MODEL]
  assert client.models.retrieve(MODEL).owned_by == "gemma_jax"
  response = httpx.get(f"{url}/health")
  assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_metrics_are_prometheus_text(url):
  response = httpx.get(f"{url}/metrics")
  assert response.status_code == 200
  assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
  samples, types = {}, {}
  for line in response.text.splitlines():
    match = re.fullmatch(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)", line)
    if match:
      if match[1] == "TYPE":
        types[match[2]] = match[3]
      continue
    name, value = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)", line).groups()
    samples[name] = float(value)
  assert response.text.endswith("\n")
  assert samples["gemma_jax_queued"] == 2 and types["gemma_jax_queued"] == "gauge"
  assert samples["gemma_jax_tokens_per_second"] == 12.5
  assert samples["gemma_jax_time_to_first_token_seconds"] == 0.25
  assert samples["gemma_jax_generated_tokens_total"] == 42
  assert types["gemma_jax_requests_finished_total"] == "counter"
  assert len(samples) == len(METRICS) and set(types) == set(samples)


def test_metrics_spell_what_prometheus_reads(url, engine):
  engine.metric_values = dict(time_to_first_token_seconds=float("nan"), running=0,
                              tokens_per_second=float("inf"), kv_bytes=2.5e9)
  assert httpx.get(f"{url}/metrics").text.splitlines()[2::3] == [
      "gemma_jax_time_to_first_token_seconds NaN", "gemma_jax_running 0",
      "gemma_jax_tokens_per_second +Inf", "gemma_jax_kv_bytes 2500000000.0"]


def wait_for(condition, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.02)
  return condition()


def test_closing_a_stream_cancels_its_request(client, engine):
  engine.delay = 0.2   # a reply of seconds
  stream = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
  first = next(iter(stream))
  assert first.choices[0].delta.role == "assistant"
  stream.close()
  assert wait_for(lambda: engine.cancelled == [0]), engine.cancelled


def test_leaving_a_plain_request_cancels_it(url, engine):
  engine.delay = 0.2
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(f"{url}/v1/completions", json=dict(COMPLETION, max_tokens=30), timeout=0.5)
  assert wait_for(lambda: engine.cancelled == [0]), engine.cancelled


def test_images_go_through_the_hook():
  engine, seen = FakeEngine(), []

  def images_to_request(messages, request):
    seen.append(messages)
    return requests_lib.Request(prompt=(1, 5, 6, 7), max_tokens=request.max_tokens)

  app = server.make_app(engine, TOKENIZER, model_name=MODEL,
                        images_to_request=images_to_request)
  messages = [{"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}]
  with serving(app) as url:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
      response = client.chat.completions.create(model=MODEL, messages=messages)
  assert seen == [messages]
  assert engine.submitted[0].prompt == (1, 5, 6, 7)
  assert response.choices[0].message.content == expected(4)
