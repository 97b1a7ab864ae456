"""The real engine behind the real server: a tiny random Gemma 3 (test_decoding's, its
vocabulary the byte tokenizer's) in 4 slots of pages of 4, served by uvicorn on a free
local port and spoken to by the official `openai` client and httpx.

Every greedy reply is checked against the full forward pass's greedy continuation (the
model's `apply` over the whole sequence at each token), as text, finish and token count,
whatever else runs beside it; after a load of streamed requests, malformed ones and
clients that leave, the engine is idle (no request running or queued, no page held by
a request) and still answers."""

import asyncio
import base64
import io
import random
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from PIL import Image

import gemma_jax as gj
from gemma_jax.models import towers
from gemma_jax.serving import engine as engine_lib
from gemma_jax.serving import openai_api, server
from gemma_jax.text import chat
from test_decoding import random_params, tiny
from test_serving_server import TOKENIZER, async_client, prompt_ids, serving, wait_for
from test_serving_server import client   # pylint: disable=unused-import  (a fixture)

MODEL = "tiny-gemma3"
MAX_LENGTH = 64
STEPS = 12   # tokens of a reference continuation: the most a test asks for
ROWS = 8     # prompts a reference batch continues together
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs."
LOAD_SECONDS = 240


class PacedEngine(engine_lib.Engine):
  """The engine, each step `pace` seconds late (0: none), so that a client can leave
  while its request still runs."""
  pace = 0.0

  def step(self) -> None:
    time.sleep(self.pace)
    super().step()


@pytest.fixture(scope="module")
def model():
  """(config, params) of the tiny Gemma 3 over the byte tokenizer's ids."""
  config = tiny("gemma3")
  config.model.vocab_size = TOKENIZER.vocab_size
  return config, random_params(config)


@pytest.fixture(scope="module")
def running(model):
  engine = PacedEngine(*model, tokenizer=TOKENIZER, num_slots=4, page_size=4,
                       prefill_chunk=8, max_length=MAX_LENGTH)
  engine.start()
  try:
    with serving(server.make_app(engine, TOKENIZER, model_name=MODEL)) as url:
      yield engine, url
  finally:
    engine.shutdown(grace_seconds=5)


@pytest.fixture
def engine(running):
  return running[0]


@pytest.fixture
def url(running):
  return running[1]


def greedy_batch(apply, params, prompts):
  """(ids, log-probabilities) of the greedy continuation of each of `prompts` (ROWS at
  most) by the full forward pass: STEPS tokens, or up to its first stop id. Each token
  is the argmax of `apply`'s logits [ROWS, MAX_LENGTH, V] at its row's last position."""
  tokens = np.zeros((ROWS, MAX_LENGTH), np.int32)   # past a row's length: never attended
  lengths = np.ones((ROWS,), np.int32)
  for row, prompt in enumerate(prompts):
    assert len(prompt) + STEPS <= MAX_LENGTH
    tokens[row, :len(prompt)], lengths[row] = prompt, len(prompt)
  continuations = [([], []) for _ in prompts]
  for _ in range(STEPS):
    logits = apply(params, jnp.asarray(tokens))[jnp.arange(ROWS), lengths - 1]
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for row, (ids, chosen) in enumerate(continuations):
      if ids and ids[-1] in TOKENIZER.stop_ids:
        continue
      ids.append(int(np.argmax(logprobs[row])))
      chosen.append(float(logprobs[row, ids[-1]]))
      tokens[row, lengths[row]] = ids[-1]
      lengths[row] += 1
  return continuations


@pytest.fixture(scope="module")
def greedy(model):
  """prompts (tuples of ids) -> their `greedy_batch` continuations, each prompt's
  computed once a module."""
  config, params = model
  apply, known = gj.transform(config).apply, {}

  def continuations(prompts):
    missing = sorted(set(prompts) - set(known))
    for start in range(0, len(missing), ROWS):
      batch = missing[start:start + ROWS]
      known.update(zip(batch, greedy_batch(apply, params, batch)))
    return [known[prompt] for prompt in prompts]
  return continuations


def expected(continuation, max_tokens):
  """(text, finish_reason, completion tokens) of a greedy reply of at most `max_tokens`
  whose continuation is `continuation`."""
  ids = continuation[0][:max_tokens]
  return (TOKENIZER.decode(ids), "stop" if ids[-1] in TOKENIZER.stop_ids else "length",
          len(ids))


def answer(completion):
  """(text, finish_reason, completion tokens) of a completion's one choice."""
  (choice,) = completion.choices
  return choice.text, choice.finish_reason, completion.usage.completion_tokens


def streamed_answer(chunks):
  """answer() of a streamed completion's chunks (its usage asked for)."""
  texts = [c.choices[0].text for c in chunks if c.choices]
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[-1] and not any(finishes[:-1]) and chunks[-1].usage
  return "".join(texts), finishes[-1], chunks[-1].usage.completion_tokens


def greedy_request(prompt, max_tokens, stream=False):
  """The client's arguments for a greedy completion."""
  streaming = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
  return dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **streaming)


def assert_idle(engine):
  """No request runs or waits, and every page is free or held by the prefix cache alone."""
  assert wait_for(lambda: (engine.metrics()["running"], engine.metrics()["queued"]) == (0, 0)
                  ), engine.metrics()
  assert all(pool.available == pool.num_pages for pool in engine.pages.pools.values())


def assert_answers(client, greedy, text="Hello"):
  """A greedy completion of `text` is still its reference."""
  (continuation,) = greedy([tuple(prompt_ids(text))])
  assert answer(client.completions.create(**greedy_request(text, STEPS))) == expected(
      continuation, STEPS)


def test_greedy_replies_are_the_full_forward_pass_continuations(client, greedy):
  """Text and token-id prompts (one past the window and over many pages), streamed and
  not, logprobs, a stop string and chat: each reply is the reference's."""
  for text, max_tokens in (("Hello", STEPS), (TEXT[:45], 7), ("", 5)):
    ids = prompt_ids(text)
    (continuation,) = greedy([tuple(ids)])
    want = expected(continuation, max_tokens)
    completion = client.completions.create(**greedy_request(text, max_tokens), logprobs=1)
    assert answer(completion) == want
    np.testing.assert_allclose(completion.choices[0].logprobs.token_logprobs,
                               continuation[1][:max_tokens], atol=1e-4)
    chunks = list(client.completions.create(**greedy_request(ids, max_tokens, stream=True)))
    assert streamed_answer(chunks) == want
  whole = expected(greedy([tuple(prompt_ids("Hello"))])[0], STEPS)[0]
  stop = whole[1:3]
  completion = client.completions.create(**greedy_request("Hello", STEPS), stop=stop)
  assert completion.choices[0].text == whole[:whole.index(stop)]
  assert completion.choices[0].finish_reason == "stop"
  messages = [{"role": "user", "content": "What is 2 plus 3?"}]
  ids = chat.render(messages, TOKENIZER, add_generation_prompt=True).ids.tolist()
  text, finish, count = expected(greedy([tuple(ids)])[0], STEPS)
  reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=STEPS)
  assert (reply.choices[0].message.content, reply.choices[0].finish_reason,
          reply.usage.completion_tokens) == (text, finish, count)


@pytest.mark.parametrize("stream", [False, True])
def test_async_greedy_replies_among_sampled_ones(url, greedy, stream):
  """Greedy requests decoded together with sampled ones (seeded, temperature 1): each
  greedy reply is still its reference."""
  texts = [TEXT[:n] for n in (2, 9, 20, 33)]

  async def run():
    async with async_client(url) as async_openai:
      async def greedy_reply(text):
        completion = await async_openai.completions.create(
            **greedy_request(text, STEPS, stream))
        return streamed_answer([c async for c in completion]) if stream else answer(completion)

      async def sampled_reply(text, seed):
        await async_openai.completions.create(model=MODEL, prompt=text, max_tokens=STEPS,
                                              temperature=1.0, seed=seed)
      replies = await asyncio.gather(*map(greedy_reply, texts),
                                     *map(sampled_reply, texts, range(len(texts))))
      return replies[:len(texts)]

  continuations = greedy([tuple(prompt_ids(text)) for text in texts])
  assert asyncio.run(run()) == [expected(c, STEPS) for c in continuations]


def test_a_load_of_streamed_requests_leaves_the_engine_idle(engine, url, client, greedy):
  """200 streamed greedy requests, 16 at a time, within LOAD_SECONDS: prompts of 1 to 51
  tokens (some sharing prefixes, so reusing cached pages), 4 to 12 tokens each."""
  rng = random.Random(0)
  jobs = [(TEXT[start:start + rng.choice((0, 1, 3, 4, 7, 8, 11, 16, 19, 24, 31, 40, 50))],
           rng.randint(4, 12)) for start in rng.choices((0, 0, 5), k=200)]
  before = engine.metrics()

  async def run():
    gate = asyncio.Semaphore(16)
    async with async_client(url) as async_openai:
      async def one(text, max_tokens):
        async with gate:
          stream = await async_openai.completions.create(
              **greedy_request(text, max_tokens, stream=True))
          return streamed_answer([c async for c in stream])
      return await asyncio.wait_for(asyncio.gather(*(one(*job) for job in jobs)),
                                    LOAD_SECONDS)

  answers = asyncio.run(run())
  continuations = greedy([tuple(prompt_ids(text)) for text, _ in jobs])
  assert answers == [expected(c, n) for c, (_, n) in zip(continuations, jobs)]
  assert_idle(engine)
  after = engine.metrics()
  assert after["requests_finished"] - before["requests_finished"] == len(jobs)
  assert after["generated_tokens"] - before["generated_tokens"] == sum(a[2] for a in answers)
  assert_answers(client, greedy)


MALFORMED = [
    ({"prompt": "x" * MAX_LENGTH}, "prompt"),               # no room left to generate
    ({"prompt": "Hi", "max_tokens": MAX_LENGTH}, "max_tokens"),
    ({"prompt": [1, TOKENIZER.vocab_size]}, "prompt"),      # an id past the vocabulary
    ({"prompt": "Hi", "top_k": 100}, "top_k"),              # past the engine's top_k_limit
    ({"prompt": "Hi", "temperature": -1, "stream": True}, "temperature"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
]


def test_malformed_requests_are_400s_and_the_server_serves_on(engine, url, client, greedy):
  """Refused by the server's checks or the engine's (top_k): none is queued."""
  before = engine.metrics()
  for body, param in MALFORMED:
    response = httpx.post(f"{url}/v1/completions", json=dict(body, model=MODEL))
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), body
  response = httpx.post(f"{url}/v1/completions", content=b'{"prompt": ',
                        headers={"content-type": "application/json"})
  assert response.status_code == 400
  with pytest.raises(openai.BadRequestError):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
  after = engine.metrics()
  assert (after["prompt_tokens"], after["requests_finished"]) == (
      before["prompt_tokens"], before["requests_finished"])   # none reached the queue
  assert_idle(engine)
  assert_answers(client, greedy)


def test_clients_that_leave_cancel_their_requests(engine, url, client, greedy):
  """Four streams fill the slots and are closed after their first token; a plain request
  queued behind them times out. Each is cancelled mid-way: the slots, queue and pages
  are free again and the server answers as before."""
  before = engine.metrics()
  max_tokens = MAX_LENGTH - 8

  async def leave():
    async with async_client(url) as async_openai:
      streams = [await async_openai.completions.create(
          **greedy_request(TEXT[:i], max_tokens, stream=True)) for i in range(1, 5)]
      for stream in streams:
        await anext(stream)
      async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
          await http.post(f"{url}/v1/completions", timeout=0.5,
                          json=greedy_request("Hi", max_tokens))
      for stream in streams:
        await stream.close()

  engine.pace = 0.1   # a step: each reply would take over 5 s
  try:
    asyncio.run(leave())
    assert_idle(engine)
  finally:
    engine.pace = 0.0
  after = engine.metrics()
  assert after["requests_finished"] - before["requests_finished"] == 5
  assert after["generated_tokens"] - before["generated_tokens"] < 4 * max_tokens / 2
  assert_answers(client, greedy)


@pytest.mark.slow
def test_a_chat_with_an_image_url_is_the_full_forward_with_that_image():
  """A vision model (tiny Gemma 3 with images) served with `openai_api.attach_images`:
  an image_url data URL in a user message; the reply is the full forward pass's greedy
  one over the prompt with the image's span after BOS. A URL that is no data URL is a
  400 naming the part."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.update(num_layers=2, sliding_window=8)
  params = random_params(config, seed=4)
  pixels = np.random.RandomState(1).randint(0, 256, (30, 40, 3)).astype(np.uint8)
  png = io.BytesIO()
  Image.fromarray(pixels).save(png, format="PNG")
  url_of_image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
  question = [{"type": "text", "text": "What is this?"},
              {"type": "image_url", "image_url": {"url": url_of_image}}]
  ids = chat.render([{"role": "user", "content": "What is this?"}], TOKENIZER,
                    add_generation_prompt=True).ids
  rows, images = towers.prompts_with_images([np.asarray(ids)], [[pixels]], config.model,
                                            TOKENIZER.encode)
  apply = jax.jit(gj.transform(config).apply)
  want = []
  for _ in range(8):
    token = int(jnp.argmax(apply(params, jnp.asarray([rows[0].tolist() + want]),
                                 images=images)[0, -1]))
    if token in TOKENIZER.stop_ids:
      break
    want.append(token)
  assert len(want) >= 4, want   # a reply to compare, not a stop at once
  engine = engine_lib.Engine(config, params, tokenizer=TOKENIZER, num_slots=2, page_size=4,
                             prefill_chunk=16, max_length=96)
  engine.start()
  try:
    with serving(server.make_app(engine, TOKENIZER, model_name=MODEL,
                                 images_to_request=openai_api.attach_images)) as url:
      with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as vision:
        reply = vision.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8,
            temperature=0)
        assert reply.choices[0].message.content == TOKENIZER.decode(want)
        bad = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
        with pytest.raises(openai.BadRequestError, match="must be a data URL"):
          vision.chat.completions.create(model=MODEL, max_tokens=4,
                                         messages=[{"role": "user", "content": bad}])
  finally:
    engine.shutdown(grace_seconds=5)


def test_an_engine_that_fails_answers_500_not_silence(model):
  """The engine's thread raising mid-request: the waiting client gets a 500 naming the
  server's error, and later requests are refused the same way."""
  engine = engine_lib.Engine(*model, tokenizer=TOKENIZER, num_slots=1, page_size=4,
                             max_length=MAX_LENGTH)

  def broken():
    raise FloatingPointError("a broken step")

  engine.step = broken
  engine.start()
  try:
    with serving(server.make_app(engine, TOKENIZER, model_name=MODEL)) as url:
      with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as failing:
        for _ in range(2):
          with pytest.raises(openai.InternalServerError):
            failing.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
  finally:
    engine.shutdown(grace_seconds=1)
