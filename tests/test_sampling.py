"""Sampling: greedy generation against transformers, per-row stops, seeds, and top-k /
top-p on a distribution built to tell them apart."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gemma_jax as gj
from gemma_jax.inference import decoding, sampler, sampling
from gemma_jax.text import tokenizers
from test_hf import VOCAB, random_model

NEW = 8
PROBS = np.array([0.35, 0.25, 0.2, 0.1, 0.05, 0.03, 0.02])
ORDER = np.random.RandomState(0).permutation(len(PROBS))   # token ORDER[i] has PROBS[i]


def built_logits(rows):
  """[rows, 10] logits: PROBS on the tokens ORDER, the last three impossible."""
  logits = np.full((rows, 10), -np.inf, np.float32)
  logits[:, ORDER] = np.log(PROBS)
  return logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random transformers Gemma 3 (window 4, local-global-local: a scanned block and an
  unscanned layer) and its two right-padded prompts of 7 and 3 tokens."""
  model = random_model(3, num_hidden_layers=3, num_key_value_heads=2, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
  path = str(tmp_path_factory.mktemp("gemma3"))
  model.save_pretrained(path)
  config, params = gj.hf.load(path)
  prompts = np.random.RandomState(1).randint(3, VOCAB, (2, 7)).astype(np.int32)
  lengths = np.array([7, 3], np.int32)
  prompts = prompts * (np.arange(7) < lengths[:, None])
  return model, config, params, prompts, lengths, decoding.make_decoding(config)


def run(checkpoint, seed=0, eos=1, **options):
  _, _, params, prompts, lengths, dec = checkpoint
  return np.asarray(sampler.generate(
      dec, params, prompts, lengths, jax.random.key(seed),
      np.asarray([eos], np.int32), options=sampling.Sampling.of(**options),
      max_new_tokens=NEW, cache_length=7 + NEW - 1, cache_dtype="float32"))


def until_eos(row, eos):
  """The tokens up to and including the first `eos`."""
  stops = np.flatnonzero(row == eos)
  return row[:stops[0] + 1] if len(stops) else row


def test_greedy_equals_transformers_generate(checkpoint):
  model, config, _, prompts, lengths, _ = checkpoint
  eos = model.generation_config.eos_token_id
  eos = eos[0] if isinstance(eos, list) else eos
  ours = run(checkpoint, eos=eos)
  for b, length in enumerate(lengths):
    with torch.no_grad():
      theirs = model.generate(torch.as_tensor(prompts[b:b + 1, :length]), do_sample=False,
                              max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    np.testing.assert_array_equal(until_eos(ours[b], eos), theirs[0, length:].numpy())
  assert config.model.sliding_window < lengths[0] + NEW


def test_rows_stop_at_their_own_eos(checkpoint):
  free = run(checkpoint, eos=-1)
  stop = free[0, 0]                              # row 0 stops at once
  stopped = run(checkpoint, eos=stop)
  for b in range(2):
    kept = until_eos(free[b], stop)
    np.testing.assert_array_equal(stopped[b, :len(kept)], kept)
    np.testing.assert_array_equal(stopped[b, len(kept):], 0)
  assert stopped[0, 0] == stop and np.all(stopped[0, 1:] == 0)


def test_seeded_sampling_is_reproducible(checkpoint):
  options = dict(temperature=1.0, top_k=50, top_p=0.95, eos=-1)
  first, again, other = (run(checkpoint, seed=s, **options) for s in (0, 0, 1))
  np.testing.assert_array_equal(first, again)
  assert (first != other).any()


@pytest.mark.parametrize("options, allowed", [
    (dict(temperature=1.0, top_k=3), [0, 1, 2]),
    (dict(temperature=1.0, top_p=0.55), [0, 1]),            # 0.35 < 0.55 <= 0.35 + 0.25
    (dict(temperature=1.0, top_k=3, top_p=0.5), [0, 1]),    # top-p of the top-3 renormalised
    (dict(temperature=0.5, top_p=0.7), [0, 1]),             # temperature first: p^2, renormalised
    (dict(temperature=1.0), list(range(7))),
])
def test_top_k_and_top_p_emit_only_allowed_tokens(options, allowed):
  picks = np.asarray(jax.jit(sampling.choose)(
      built_logits(4000), jax.random.key(0), sampling.Sampling.of(**options)))
  assert set(picks.tolist()) == set(ORDER[allowed].tolist())
  expected = PROBS[allowed] ** (1 / options["temperature"])
  frequencies = [np.mean(picks == ORDER[i]) for i in allowed]
  np.testing.assert_allclose(frequencies, expected / expected.sum(), atol=0.03)


def test_greedy_is_the_argmax():
  assert sampling.choose(jnp.asarray(built_logits(1)), None, sampling.GREEDY)[0] == ORDER[0]


def nucleus_float64(logits, top_p):
  """The top-p nucleus of each row by sorting, in float64: [B, V] bool."""
  kept = np.zeros(logits.shape, bool)
  for b, row in enumerate(logits.astype(np.float64)):
    descending = np.sort(row)[::-1]
    probs = np.exp(descending - descending[0])
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    kept[b] = row >= descending[mass_before < top_p].min()
  return kept


@pytest.mark.parametrize("vocab", [10, 4099])
def test_nucleus_by_bisection_equals_sorting_in_float64(vocab):
  """Rows of many scales, with ties (rounded logits) and -inf; each top_p kept away from
  the rows' cumulative masses so that float32 rounding cannot decide a token."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, vocab)) * np.array([0.5, 1, 3, 8, 1, 3])[:, None]
  logits[4:] = np.round(logits[4:])
  logits[1, ::3] = -np.inf
  logits = logits.astype(np.float32)
  cut = jax.jit(sampling.nucleus)
  checked = 0
  for top_p in (0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
    expected = nucleus_float64(logits, top_p)
    got = np.isfinite(np.asarray(cut(logits, np.float32(top_p))))
    for b in range(len(logits)):
      row = logits[b].astype(np.float64)
      probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
      if np.min(np.abs(np.cumsum(np.sort(probs)[::-1]) - top_p)) < 1e-5:
        continue
      np.testing.assert_array_equal(got[b], expected[b], err_msg=f"row {b}, top_p {top_p}")
      checked += 1
  assert checked >= 30, checked


@pytest.mark.slow
def test_draws_follow_the_softmax_and_never_pick_impossible_tokens():
  """`sampling.draw` over 1300 ids (blocks of 512, the last partial): a block all -inf,
  holes, mass at both ends; frequencies of 200k draws within 4.5 standard deviations
  of the float64 softmax, and rows with one possible token (first, last) draw only it."""
  rng = np.random.default_rng(0)
  row = rng.normal(size=1300) * 2
  row[512:1024] = -np.inf
  row[::7] = -np.inf
  row[[3, 1299]] = 6.0
  probs = np.exp(row - row.max())
  probs /= probs.sum()
  draws = 200_000
  picks = np.asarray(jax.jit(sampling.draw)(
      np.tile(row.astype(np.float32), (draws, 1)), jax.random.key(5)))
  counts = np.bincount(picks, minlength=1300)
  assert counts[probs == 0].sum() == 0
  sigma = np.sqrt(draws * probs * (1 - probs))
  assert np.all(np.abs(counts - draws * probs) <= 4.5 * sigma + 1), np.max(
      np.abs(counts - draws * probs) / (sigma + 1e-9))
  single = np.full((2, 1300), -np.inf, np.float32)
  single[0, 0] = single[1, 1299] = 0.0
  for seed in range(20):
    np.testing.assert_array_equal(sampling.draw(single, jax.random.key(seed)), [0, 1299])


def test_options_share_a_program_across_values():
  """Temperatures, p values and k up to the same power of two (at least 64) reuse one
  compiled choice; greedy, no top-k and no nucleus are programs of their own. Each draw
  stays among the tokens its own options allow."""
  choose = jax.jit(lambda *args: sampling.choose(*args))   # a cache of its own
  logits = built_logits(2000)
  for temperature, top_k, top_p, allowed in ((1.0, 3, 0.999, [0, 1, 2]), (0.5, 2, 0.9, [0, 1]),
                                            (2.0, 5, 0.5, [0, 1]), (1.0, 1, 0.99, [0])):
    picks = np.asarray(choose(logits, jax.random.key(0),
                              sampling.Sampling.of(temperature, top_k, top_p)))
    assert set(picks.tolist()) == set(ORDER[allowed].tolist()), (temperature, top_k, top_p)
  assert choose._cache_size() == 1   # pylint: disable=protected-access
  for options in (sampling.GREEDY, sampling.Sampling.of(1.0, 0, 0.5),
                  sampling.Sampling.of(1.0, 3, 1.0), sampling.Sampling.of(1.0, 65, 0.5)):
    choose(logits, jax.random.key(0), options)
  assert choose._cache_size() == 5   # pylint: disable=protected-access
  greedy_with_others = sampling.Sampling.of(0.0, 40, 0.5)   # greedy ignores k and p
  assert jax.tree.structure(greedy_with_others) == jax.tree.structure(sampling.GREEDY)


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
])
def test_bad_options_name_themselves(options, message):
  with pytest.raises(ValueError, match=message):
    sampling.Sampling.of(**dict(dict(temperature=1.0, top_k=0, top_p=1.0), **options))


def gpt3_greedy_after_abc(new_tokens):
  """GPT-3 with a table of 16 positions and a byte tokenizer -> (config, params,
  tokenizer, the `new_tokens` greedy tokens after BOS + "abc", each the argmax of a full
  forward over the row so far)."""
  config = gj.get_config("gpt3-52k")
  config.model.trainable_position_size = config.data.seq_len = 16
  model = gj.transform(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  tokenizer = tokenizers.ByteTokenizer()
  row = np.zeros((1, 17), np.int32)
  row[0, :4] = [tokenizer.bos_id, *tokenizer.encode(["abc"])[0]]
  for p in range(3, 3 + new_tokens):   # the causal model's logits at p see only row[:, :p + 1]
    row[0, p + 1] = np.argmax(model.apply(params, jnp.asarray(row[:, :16]))[0, p])
  return config, params, tokenizer, row[0, 4:4 + new_tokens]


@pytest.mark.slow
def test_sampler_compiles_once_per_bucket_and_equals_the_exact_shapes(checkpoint):
  """Prompts of 3 to 5 ids and 17 or 18 new tokens share one program (16 positions, 32
  tokens, the loop bounded at the call's count); each sample equals greedy `generate`
  on the exact prompt and count, unpadded."""
  _, config, params, _, _, dec = checkpoint
  tokenizer = tokenizers.ByteTokenizer()
  sample = sampler.Sampler(config, params, tokenizer, cache_dtype="float32")
  stops = np.asarray(tokenizer.stop_ids, np.int32)
  for prompt, new in (("ab", 17), ("abcd", 18), ("abc", 17)):
    got = sample.sample([prompt], max_new_tokens=new).tokens[0]
    ids = np.asarray([[tokenizer.bos_id, *tokenizer.encode([prompt])[0]]], np.int32)
    exact = np.asarray(sampler.generate(
        dec, params, ids, np.asarray([ids.shape[1]], np.int32), jax.random.key(0), stops,
        max_new_tokens=new, cache_length=ids.shape[1] + new - 1, cache_dtype="float32"))[0]
    hit = np.isin(exact, stops)
    np.testing.assert_array_equal(got, exact[:np.argmax(hit)] if hit.any() else exact)
    assert len(got) > 8, got   # compared over many tokens, not a stop at once
  assert len(sample._compiled) == 1   # pylint: disable=protected-access
  assert [sampler.bucket(n) for n in (1, 16, 17, 256, 257, 600)] == [16, 16, 32, 256, 512, 768]


@pytest.mark.slow
def test_sampler_compiles_once_for_any_values_of_its_options(checkpoint):
  """New temperatures, p values and k of the same power of two reuse the Sampler's
  program; each draw repeats under its seed and matches `generate` given the same
  options."""
  _, config, params, _, _, dec = checkpoint
  tokenizer = tokenizers.ByteTokenizer()
  sample = sampler.Sampler(config, params, tokenizer, cache_dtype="float32")
  runs = [dict(temperature=0.7, top_k=40, top_p=0.9, seed=0),
          dict(temperature=1.3, top_k=50, top_p=0.8, seed=1),
          dict(temperature=1.0, top_k=3, top_p=0.99, seed=2)]
  got = [sample.sample(["abc"], max_new_tokens=12, **run).tokens[0] for run in runs]
  assert len(sample._compiled) == 1   # pylint: disable=protected-access
  ids = np.asarray([[tokenizer.bos_id, *tokenizer.encode(["abc"])[0]]], np.int32)
  stops = np.asarray(tokenizer.stop_ids, np.int32)
  for run, tokens in zip(runs, got):
    seed = run.pop("seed")
    again = sample.sample(["abc"], max_new_tokens=12, seed=seed, **run).tokens[0]
    np.testing.assert_array_equal(again, tokens)
    exact = np.asarray(sampler.generate(
        dec, params, np.pad(ids, ((0, 0), (0, 12))), np.asarray([4], np.int32),
        jax.random.key(seed), stops, options=sampling.Sampling.of(**run, vocab_size=VOCAB),
        max_new_tokens=16, cache_length=16 + 16 - 1, cache_dtype="float32"))[0, :12]
    hit = np.isin(exact, stops)
    np.testing.assert_array_equal(tokens, exact[:np.argmax(hit)] if hit.any() else exact)
  assert len({tuple(t) for t in got}) > 1


def test_sampler_refuses_new_tokens_past_the_learned_positions():
  """GPT-3 with a table of 16 positions, a byte-level prompt of BOS + 3 bytes: 13 new
  tokens reach position 15 and are the full forward's greedy ones; 14 would need
  position 16."""
  config, params, tokenizer, greedy = gpt3_greedy_after_abc(13)
  assert tokenizer.eos_id not in greedy   # so the sampler returns all 13
  sample = sampler.Sampler(config, params, tokenizer).sample
  np.testing.assert_array_equal(sample(["abc"], max_new_tokens=13).tokens[0], greedy)
  with pytest.raises(ValueError, match=r"max_new_tokens=14 after a 4-token prompt needs "
                     r"positions up to 16, .*config.model.trainable_position_size=16\)"):
    sample(["abc"], max_new_tokens=14)


def test_sampler_stops_at_the_end_of_turn_id_as_well_as_eos():
  """A tokenizer whose end-of-turn id is the first greedy token not sampled before it: the
  sample is the tokens before it; with no turn marker the sampler runs on past it."""
  config, params, tokenizer, greedy = gpt3_greedy_after_abc(6)
  first_new = next(k for k in range(1, 6) if greedy[k] not in greedy[:k])
  assert tokenizer.eos_id not in greedy, greedy
  tokenizer.end_of_turn_id = None
  np.testing.assert_array_equal(
      sampler.Sampler(config, params, tokenizer).sample(["abc"], max_new_tokens=6).tokens[0],
      greedy)
  tokenizer.end_of_turn_id = int(greedy[first_new])
  np.testing.assert_array_equal(
      sampler.Sampler(config, params, tokenizer).sample(["abc"], max_new_tokens=6).tokens[0],
      greedy[:first_new])


class MarkerTokenizer(tokenizers.ByteTokenizer):
  """Bytes, with "<img>" as the start-of-image id and "<soft>" as an image soft token."""

  def __init__(self, vision):
    self.special = {"<img>": vision.boi_token_id, "<soft>": vision.image_token_id}

  def encode(self, texts):
    out = []
    for text in texts:
      ids = []
      for piece in re.split(r"(<img>|<soft>)", text):
        ids += [self.special[piece]] if piece in self.special else list(
            super().encode([piece])[0])
      out.append(np.asarray(ids, np.int32))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prompts, images, message", [
    (["<img>a<img>b"], [["x"]], r"prompt 0 holds 2 image markers .* but 1 images"),
    (["<img>a"], [["x", "x"]], r"prompt 0 holds 1 image markers .* but 2 images"),
    (["a", "<img>b"], [["x"], []], r"prompt 1 holds 1 image markers .* but 0 images"),
    (["<soft>a"], [["x"]], r"tokens row 0 holds 2 image placeholder spans but 1 images"),
    # One image not wrapped in its prompt's list (a file name had been read letter by
    # letter, an array failed in numpy's truth test).
    (["a"], ["x"], r"images\[0\] must be a list of prompt 0's images, got ndarray"),
    (["a"], ["cat.png"], r"images\[0\] must be a list of prompt 0's images, got str"),
])
def test_sampler_refuses_images_that_do_not_match_the_markers(prompts, images, message):
  """Each image fills one marker: extra images, extra markers, a marker without images or
  a stray soft token are errors, not silently dropped images or padding pixels."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.num_layers = 1
  config.model.attention_pattern = ("global",)
  v = config.model.vision
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  picture = np.zeros((v.image_size, v.image_size, 3), np.uint8)
  images = [row if row == "cat.png" else picture if row == "x" else [picture for _ in row]
            for row in images]
  sample = sampler.Sampler(config, params, MarkerTokenizer(v)).sample
  with pytest.raises(ValueError, match=message):
    sample(prompts, max_new_tokens=2, images=images)


def test_top_k_past_the_vocabulary_is_named():
  with pytest.raises(ValueError, match=r"top_k=11 exceeds the vocabulary of 10 tokens"):
    sampling.Sampling.of(temperature=1.0, top_k=11, vocab_size=10)
  config = gj.get_config("gpt3-52k")
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  sample = sampler.Sampler(config, params, tokenizers.ByteTokenizer()).sample
  with pytest.raises(ValueError, match=rf"top_k={config.model.vocab_size + 1} exceeds"):
    sample(["abc"], max_new_tokens=2, temperature=1.0, top_k=config.model.vocab_size + 1)


@pytest.mark.parametrize("prompts, options, message", [
    ("abc", {}, r"prompts must be a non-empty sequence of strings, got 'abc' \(for one "
                r"prompt call the sampler itself"),
    ([], {}, r"prompts must be a non-empty sequence of strings, got \[\]"),
    (["abc"], dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
])
def test_sampler_refuses_bad_prompts_and_lengths(prompts, options, message):
  """A bare string would be read as one prompt per character; no prompt at all failed
  inside numpy."""
  config = gj.get_config("gpt3-52k")
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  sample = sampler.Sampler(config, params, tokenizers.ByteTokenizer()).sample
  with pytest.raises(ValueError, match=message):
    sample(prompts, **dict(dict(max_new_tokens=2), **options))
