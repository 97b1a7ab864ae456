"""Sampling from a model, the whole loop inside jit (token choice: `sampling`).

    sampler = Sampler(config, params, tokenizer)
    text = sampler("def ", max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0)

`generate` is the jitted loop on token ids: prefill the prompts, then a
`lax.while_loop` of decode steps, each row stopping at its first end-of-sequence id,
until every row has stopped or `max_new_tokens` are out.

Dims: B batch, P prompt length, N new tokens, V vocab.
"""

import functools
import time
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax.inference import decode_jit
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.inference import sampling
from gemma_jax.layers import kv_cache
from gemma_jax.models import towers


# Per family, the name that places an image in a text prompt given with images, and the
# vision config field holding its id.
IMAGE_MARKERS = {"gemma3": ("<start_of_image>", "boi_token_id"),
                 "gemma4": ("<|image|>", "image_token_id")}


def encode_image_prompts(tokenizer, texts: Sequence[str],
                         model: config_dict.ConfigDict) -> list:
  """Text prompts given with images -> their ids (no BOS): each image marker's name
  (`IMAGE_MARKERS`, by `model.block_type`) is the marker's id, the text around it
  encoded as text."""
  name, field = IMAGE_MARKERS[model.block_type]
  encoded = []
  for text in texts:
    first, *rest = tokenizer.encode(text.split(name))
    encoded.append(np.asarray([*first, *[i for ids in rest for i in (model.vision[field], *ids)]],
                              np.int32))
  return encoded


def check_max_new_tokens(max_new_tokens: int) -> None:
  """Raises ValueError unless `max_new_tokens` is an integer >= 1."""
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


@functools.partial(decode_jit.jit, static_argnames=(
    "decoding", "max_new_tokens", "pad_id", "cache_length", "cache_dtype"))
def generate(decoding: decoding_lib.Decoding, params, prompts: jax.Array, lengths: jax.Array,
             rng: jax.Array, eos_ids: jax.Array, images: Optional[jax.Array] = None,
             limit: Optional[jax.Array] = None, options: sampling.Sampling = sampling.GREEDY,
             *, max_new_tokens: int, pad_id: int = 0, cache_length: int,
             cache_dtype: str) -> jax.Array:
  """Continues right-padded prompts [B, P] of `lengths` [B] tokens: [B, N] int32.

  Row b holds its new tokens up to and including its first id in `eos_ids` [E] (E may
  be 0), then `pad_id`. The caches cover `cache_length` positions: with fewer than
  max(lengths) + N - 1, global layers forget their oldest keys as in `prefill` (`Sampler`
  always sizes them to fit). `options` (`sampling.Sampling`; greedy by default) pick
  each token, their values traced; `rng` is split once per step. `images` (see
  `Transformed.apply`) fill the prompts' image placeholder spans (a model with vision).
  `limit` (an int scalar, traced: one program serves every value) stops the loop after
  that many tokens, the rest of the N columns `pad_id`.
  """
  params = decoding.unrolled(params)   # once, not in every step of the loop
  # The loop's first step feeds each prompt's last token: one decode step in the program.
  token, cache = decoding.fill(params, prompts, lengths, cache_length=cache_length,
                               cache_dtype=cache_dtype, images=images)
  eos = jnp.asarray(eos_ids, jnp.int32)
  bound = max_new_tokens if limit is None else jnp.minimum(limit, max_new_tokens)

  def unfinished(carry):
    index, _, _, _, done, _ = carry
    return (index < bound) & ~jnp.all(done)

  def step(carry):
    index, token, cache, out, done, rng = carry
    logits, cache = decoding.decode_step(params, token, cache)
    rng, key = jax.random.split(rng)
    token = jnp.where(done, pad_id, sampling.choose(logits, key, options))
    out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], index, axis=1)
    return index + 1, token, cache, out, done | jnp.isin(token, eos), rng

  out = jnp.full((prompts.shape[0], max_new_tokens), pad_id, jnp.int32)
  carry = (jnp.asarray(0), token, cache, out, jnp.zeros(prompts.shape[:1], bool), rng)
  return jax.lax.while_loop(unfinished, step, carry)[3]


def bucket(n: int) -> int:
  """The size a prompt width or token count `n` is compiled for: the next power of two
  from 16 up to 256, then the next multiple of 256 (at most 2x the prefill's positions,
  and under 256 more past 256); `Sampler` compiles once per bucket."""
  if n <= 256:
    return max(16, 1 << (n - 1).bit_length())
  return -(-n // 256) * 256


class Samples(NamedTuple):
  """texts: the continuations; tokens: their ids (each up to its first stop id,
  excluded); seconds: the generation's time, compilation excluded; compile_seconds."""
  texts: list
  tokens: list
  seconds: float
  compile_seconds: float


class Sampler:
  """Text in, text out: config, params and a tokenizer (`encode`, `decode`, `bos_id`,
  `stop_ids`, `pad_id`, e.g. `gemma_jax.text.tokenizers`).

  A prompt is text, encoded as text: a control token's name typed in it
  ("<end_of_turn>", "<bos>") stays characters. A prompt that needs control tokens (a
  chat prompt: `gemma_jax.text.chat.render(messages, tokenizer, add_generation_prompt=True)
  .ids`) is given as its token ids.

  Args:
    config: the experiment config (its `model` section is used).
    params: the model's parameters.
    tokenizer: text prompts are encoded after its BOS id; generation stops at its
      `stop_ids` (EOS and the end-of-turn marker).
    cache_dtype: dtype of cached keys and values, one of `kv_cache.CACHE_DTYPES` (int8:
      with per-token, per-head scales); default `decoding.default_cache_dtype(config)`.
  """

  def __init__(self, config: config_dict.ConfigDict, params, tokenizer,
               cache_dtype: Optional[str] = None):
    self.config, self.params, self.tokenizer = config, params, tokenizer
    self.decoding = decoding_lib.make_decoding(config)
    self.cache_dtype = kv_cache.check_dtype(cache_dtype or
                                            decoding_lib.default_cache_dtype(config))
    self._compiled = {}

  def __call__(self, prompt: str, **options) -> str:
    """The continuation of one prompt; options as in `sample`."""
    return self.sample([prompt], **options).texts[0]

  def sample(self, prompts: Sequence[Union[str, Sequence[int]]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             images: Optional[Sequence[Sequence]] = None) -> Samples:
    """Continues each prompt by up to `max_new_tokens` tokens; options as in
    `sampling.Sampling.of` (any values share a program: only greedy or not, top_k's
    power of two and whether top_p < 1 compile anew).

    prompts: each a text (encoded after the BOS id), or token ids taken as they are
      (BOS included, as `chat.render` gives them).
    images: per prompt, its images (files, PIL images or arrays; a model with vision).
      Each fills the prompt's next image marker (Gemma 3: `vision.boi_token_id`,
      "<start_of_image>"; Gemma 4: `vision.image_token_id`, "<|image|>"; a prompt holds
      as many markers as images, a text prompt by the marker's name, which stands for
      the marker only where images are given); a prompt without markers gets one per
      image in front of its text.
    """
    options = sampling.Sampling.of(temperature, top_k, top_p, self.config.model.vocab_size)
    check_max_new_tokens(max_new_tokens)
    if isinstance(prompts, str) or not len(prompts):
      raise ValueError(f"prompts must be a non-empty sequence of strings, got {prompts!r}"
                       + (" (for one prompt call the sampler itself: sampler(prompt))"
                          if isinstance(prompts, str) else ""))
    t = self.tokenizer
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    encoded = iter(t.encode(texts) if images is None else
                   encode_image_prompts(t, texts, self.config.model))
    rows = [np.concatenate([[t.bos_id], next(encoded)]) if isinstance(prompt, str)
            else np.asarray(prompt, np.int32) for prompt in prompts]
    pixels = None
    if images is not None:
      rows, pixels = towers.prompts_with_images(rows, images, self.config.model, t.encode)
    lengths = np.asarray([len(row) for row in rows], np.int32)
    width = int(lengths.max())
    table = self.config.model.trainable_position_size
    if table and width + max_new_tokens - 1 > table:
      raise ValueError(f"max_new_tokens={max_new_tokens} after a {width}-token prompt "
                       f"needs positions up to {width + max_new_tokens - 2}, past the learned "
                       f"position table [0, config.model.trainable_position_size={table})")
    # One program serves every width and token count of a bucket: the prompts are
    # right-padded to it, and the loop stops at max_new_tokens (a traced bound).
    padded, new_tokens = bucket(width), bucket(max_new_tokens)
    if table and padded + new_tokens - 1 > table:
      padded, new_tokens = width, max_new_tokens
    tokens = np.full((len(rows), padded), t.pad_id, np.int32)
    for b, row in enumerate(rows):
      tokens[b, :len(row)] = row
    cache_length = padded + new_tokens - 1
    decoding_lib.check_prompts(tokens, lengths, cache_length, self.config.model.vocab_size)
    towers.check_image_inputs(tokens, pixels, self.config.model)   # ids concrete here
    static = dict(max_new_tokens=new_tokens, pad_id=t.pad_id, cache_length=cache_length,
                  cache_dtype=self.cache_dtype)
    stops = np.asarray(t.stop_ids, np.int32)
    args = (self.params, tokens, lengths, jax.random.key(seed), stops, pixels,
            np.int32(max_new_tokens), options)
    start = time.perf_counter()
    key = (tokens.shape, jax.tree.map(np.shape, pixels), jax.tree.structure(options),
           tuple(sorted(static.items())))
    if key not in self._compiled:
      self._compiled[key] = generate.lower(self.decoding, *args, **static).compile()
    compiled = time.perf_counter()
    out = np.asarray(self._compiled[key](*args))[:, :max_new_tokens]
    seconds = time.perf_counter() - compiled
    stopped = np.isin(out, stops)
    new = [row[:np.argmax(hit)] if hit.any() else row for row, hit in zip(out, stopped)]
    return Samples([t.decode(ids.tolist()) for ids in new], new, seconds, compiled - start)
