"""Serving's token choice per row, against a float64 numpy reference: the penalties, the
distribution each row draws from (its support, its probabilities, the token drawn at each
key and the frequencies of many draws), greedy rows, log-probabilities, a row's token
independent of the rest of the batch, and one compiled program for all option values."""

import chex
import jax
import numpy as np
import pytest

from gemma_jax.serving import requests, sampling

VOCAB = 16
TOP_K_LIMIT = 8
OPTIONS = [   # one row each; all the options of a row apply together
    requests.SamplingOptions(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                             frequency_penalty=0.3),
    requests.SamplingOptions(),
    requests.SamplingOptions(temperature=0.7, top_k=4),
    requests.SamplingOptions(temperature=1.3, top_p=0.6),
    requests.SamplingOptions(min_p=0.2),
    requests.SamplingOptions(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1,
                             repetition_penalty=1.2, presence_penalty=0.4,
                             frequency_penalty=0.25),
    requests.SamplingOptions(top_k=3),                        # its logits tie (below)
    requests.SamplingOptions(temperature=2.0, repetition_penalty=0.8, presence_penalty=-0.5,
                             frequency_penalty=-0.2),
]
ROWS = len(OPTIONS)
SAMPLED = [r for r, o in enumerate(OPTIONS) if o.temperature > 0]
choose = jax.jit(sampling.choose_rows, static_argnames=("top_k_limit", "num_logprobs"))


def batch(seed=0, rows=ROWS):
  """logits [rows, V] float32 (row 6 whole numbers: ties; row 3 with -inf), prompt_seen
  [rows, V] and generated_counts [rows, V] of about a quarter of the tokens each."""
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(rows, VOCAB)) * 1.5).astype(np.float32)
  logits[6 % rows] = np.round(logits[6 % rows])
  logits[3 % rows, [2, 9]] = -np.inf
  seen = rng.random((rows, VOCAB)) < 0.25
  counts = np.where(rng.random((rows, VOCAB)) < 0.25, rng.integers(1, 4, (rows, VOCAB)), 0)
  return logits, seen, counts.astype(np.int32)


def penalized_float64(logits, options, seen, counts):
  """[S, V] float64: transformers' repetition penalty, then OpenAI's presence and
  frequency penalties."""
  x = logits.astype(np.float64)
  for r, o in enumerate(options):
    hit = seen[r] | (counts[r] > 0)
    x[r, hit] = np.where(x[r, hit] > 0, x[r, hit] / o.repetition_penalty,
                         x[r, hit] * o.repetition_penalty)
    x[r] -= counts[r] * o.frequency_penalty + (counts[r] > 0) * o.presence_penalty
  return x


def softmax(x):
  p = np.exp(x - x.max())
  return p / p.sum()


def probabilities_float64(row, o):
  """The distribution [V] a sampled row draws from, given its penalized logits [V] in
  float64, and the distance of its nearest decision (a cumulative mass from top_p, a
  probability ratio from min_p, a logit from the k-th) from its threshold."""
  x = row / o.temperature
  margins = [np.inf]
  if o.top_k:
    descending = np.sort(x)[::-1]
    kth = descending[o.top_k - 1]
    gaps = np.abs(x - kth)
    margins.append(gaps[gaps > 0].min())
    x = np.where(x < kth, -np.inf, x)
  if o.top_p < 1:
    descending = np.sort(x)[::-1]
    probs = softmax(descending)
    mass_before = np.cumsum(probs) - probs
    margins.append(np.abs(np.cumsum(probs) - o.top_p).min())
    x = np.where(x < descending[mass_before < o.top_p].min(), -np.inf, x)
  probs = softmax(x)
  if o.min_p:
    ratio = probs / probs.max()
    margins.append(np.abs(ratio[ratio > 0] - o.min_p).min())
    probs = np.where(ratio < o.min_p, 0.0, probs)
  return probs / probs.sum(), min(margins)


def reference(seed=0):
  """The batch, its penalized logits [S, V] and each sampled row's distribution [S, V]
  (greedy rows zero), all float64; the data keep every decision 1e-4 from its threshold,
  so that float32 rounding decides none."""
  logits, seen, counts = batch(seed)
  penalized = penalized_float64(logits, OPTIONS, seen, counts)
  probs = np.zeros_like(penalized)
  for r in SAMPLED:
    probs[r], margin = probabilities_float64(penalized[r], OPTIONS[r])
    assert margin > 1e-4, (r, margin)
  return logits, seen, counts, penalized, probs


def test_row_options_are_one_array_per_option():
  options = sampling.RowOptions.of(OPTIONS)
  for name, value in options._asdict().items():
    assert isinstance(value, np.ndarray), name
    chex.assert_shape(value, (ROWS,))
    assert value.dtype == (np.int32 if name == "top_k" else np.float32), name
    np.testing.assert_array_equal(value, np.asarray([getattr(o, name) for o in OPTIONS],
                                                    value.dtype), err_msg=name)
  idle = sampling.RowOptions.of([requests.SamplingOptions(temperature=0.0)] * 3)
  chex.assert_shape(list(idle), (3,))
  assert jax.tree.structure(idle) == jax.tree.structure(options)


def test_penalties_match_numpy():
  logits, seen, counts, penalized, _ = reference()
  got = np.asarray(sampling.penalize(logits, sampling.RowOptions.of(OPTIONS), seen, counts))
  np.testing.assert_allclose(got, penalized, rtol=1e-6, atol=1e-6)
  penalties = np.array([o.repetition_penalty != 1 for o in OPTIONS])   # with all three
  hit = (seen | (counts > 0)) & np.isfinite(logits) & penalties[:, None]
  assert (logits[hit] > 0).sum() >= 5 and (logits[hit] < 0).sum() >= 5
  np.testing.assert_array_equal(got[hit] != logits[hit], True)
  np.testing.assert_array_equal(got[~hit], logits[~hit])


def test_warped_logits_give_the_numpy_distribution():
  """The support (which tokens can be drawn, ties with the k-th kept) and the
  probabilities of every sampled row."""
  logits, seen, counts, _, probs = reference()
  options = sampling.RowOptions.of(OPTIONS)
  warped = np.asarray(sampling.warp(sampling.penalize(logits, options, seen, counts),
                                    options, TOP_K_LIMIT))
  for r in SAMPLED:
    np.testing.assert_array_equal(np.isfinite(warped[r]), probs[r] > 0, err_msg=f"row {r}")
    np.testing.assert_allclose(softmax(warped[r].astype(np.float64)), probs[r], atol=1e-6)
  supports = [int((probs[r] > 0).sum()) for r in SAMPLED]
  assert len(set(supports)) >= 4 and min(supports) >= 2, supports   # the cuts tell apart
  tied = np.sort(probs[6])[::-1]
  assert (probs[6] > 0).sum() > 3 and tied[2] == tied[3]   # top_k=3 kept a tie with the 3rd


@pytest.fixture(scope="module")
def draws():
  """Each row of the batch repeated 3000 times, one key per copy: the tokens [ROWS, 3000],
  the uniform number of each key [ROWS, 3000], the penalized logits and the
  distributions of `reference`."""
  count = 3000
  logits, seen, counts, penalized, probs = reference()
  tile = lambda a: np.repeat(a, count, axis=0)
  keys = jax.random.split(jax.random.key(7), ROWS * count)
  choice = choose(tile(logits), sampling.RowOptions.of(
      [o for o in OPTIONS for _ in range(count)]), tile(seen), tile(counts), keys,
                  top_k_limit=TOP_K_LIMIT, num_logprobs=0)
  uniform = jax.vmap(lambda key: jax.random.uniform(key, (1,))[0])(keys)
  return (np.asarray(choice.tokens).reshape(ROWS, count),
          np.asarray(uniform).reshape(ROWS, count), penalized, probs)


def test_each_draw_inverts_the_numpy_cdf_at_its_keys_uniform(draws):
  """`inference.sampling.draw` takes the first token whose cumulative probability
  exceeds the key's uniform number: the same token per key as numpy's, draws within 1e-5
  of a cumulative probability aside."""
  tokens, uniform, _, probs = draws
  checked = 0
  for r in SAMPLED:
    cdf = np.cumsum(probs[r])
    expected = np.searchsorted(cdf, uniform[r] * cdf[-1], side="right")
    clear = np.min(np.abs(uniform[r][:, None] - cdf[None, :]), axis=-1) > 1e-5
    np.testing.assert_array_equal(tokens[r][clear], expected[clear], err_msg=f"row {r}")
    checked += clear.sum()
  assert checked > 0.99 * len(SAMPLED) * tokens.shape[1]


def test_draw_frequencies_follow_the_numpy_probabilities(draws):
  """3000 draws per row: never a token outside the support; each token's count within 5
  standard deviations of numpy's."""
  tokens, _, _, probs = draws
  count = tokens.shape[1]
  for r in SAMPLED:
    seen = np.bincount(tokens[r], minlength=VOCAB)
    assert seen[probs[r] == 0].sum() == 0, r
    sigma = np.sqrt(count * probs[r] * (1 - probs[r]))
    assert np.all(np.abs(seen - count * probs[r]) <= 5 * sigma + 1), (
        r, seen, np.round(count * probs[r]))


def test_greedy_rows_take_the_argmax_after_penalties(draws):
  tokens, _, penalized, _ = draws
  np.testing.assert_array_equal(tokens[0], np.argmax(penalized[0]))
  options = [requests.SamplingOptions(temperature=0.0, repetition_penalty=2.0,
                                      presence_penalty=p, frequency_penalty=f)
             for p, f in ((0.0, 0.0), (1.5, 0.0), (0.0, 1.0), (2.0, 2.0))] * 4
  logits, seen, counts = batch(seed=3, rows=len(options))
  expected = np.argmax(penalized_float64(logits, options, seen, counts), axis=-1)
  got = choose(logits, sampling.RowOptions.of(options), seen, counts,
               jax.random.split(jax.random.key(0), len(options)),
               top_k_limit=TOP_K_LIMIT, num_logprobs=0).tokens
  np.testing.assert_array_equal(got, expected)
  assert np.sum(expected != np.argmax(logits, axis=-1)) >= 4   # the penalties decided some


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_logprobs_are_the_models_own_log_softmax(num_logprobs):
  logits, seen, counts, _, _ = reference()
  choice = choose(logits, sampling.RowOptions.of(OPTIONS), seen, counts,
                  jax.random.split(jax.random.key(1), ROWS), top_k_limit=TOP_K_LIMIT,
                  num_logprobs=num_logprobs)
  chex.assert_shape([choice.top_ids, choice.top_logprobs], (ROWS, num_logprobs))
  chex.assert_type([choice.tokens, choice.top_ids, choice.logprobs, choice.top_logprobs],
                   [np.int32, np.int32, np.float32, np.float32])
  x = logits.astype(np.float64)
  log_softmax = x - x.max(-1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
  rows = np.arange(ROWS)
  np.testing.assert_allclose(choice.logprobs, log_softmax[rows, choice.tokens], atol=1e-5)
  # likeliest first; ties (row 6's whole numbers) in either order
  np.testing.assert_allclose(choice.top_logprobs,
                             -np.sort(-log_softmax, axis=-1)[:, :num_logprobs], atol=1e-5)
  np.testing.assert_allclose(log_softmax[rows[:, None], choice.top_ids], choice.top_logprobs,
                             atol=1e-5)


def test_a_rows_token_depends_on_its_key_alone():
  """Each row, greedy or sampled, with or without cuts, chooses the same token and
  log-probability alone (where no other row samples or cuts) as among the batch's others
  and their options, keys and histories."""
  logits, seen, counts = batch()
  options = sampling.RowOptions.of(OPTIONS)
  for trial in range(12):
    keys = jax.random.split(jax.random.key(100 + trial), ROWS)
    together = choose(logits, options, seen, counts, keys, top_k_limit=TOP_K_LIMIT,
                      num_logprobs=2)
    for r in range(ROWS):
      alone = choose(logits[r:r + 1], jax.tree.map(lambda a: a[r:r + 1], options),
                     seen[r:r + 1], counts[r:r + 1], keys[r:r + 1],
                     top_k_limit=TOP_K_LIMIT, num_logprobs=2)
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b[r]), alone, together)


def test_one_program_serves_every_option_value():
  """Greedy, sampled and mixed batches, cuts on and off, other keys, histories and
  logits: one compilation."""
  step = jax.jit(lambda *args: sampling.choose_rows(*args, top_k_limit=TOP_K_LIMIT,
                                                    num_logprobs=3))
  mixes = [OPTIONS, OPTIONS[::-1], [requests.SamplingOptions(temperature=0.0)] * ROWS,
           [requests.SamplingOptions(temperature=0.5, top_k=8, top_p=0.3)] * ROWS,
           [requests.SamplingOptions(min_p=0.5, frequency_penalty=-1.0)] * ROWS]
  tokens = []
  for seed, mix in enumerate(mixes):
    logits, seen, counts = batch(seed)
    tokens.append(step(logits, sampling.RowOptions.of(mix), seen, counts,
                       jax.random.split(jax.random.key(seed), ROWS)).tokens)
  assert step._cache_size() == 1   # pylint: disable=protected-access
  assert len({tuple(np.asarray(t)) for t in tokens}) == len(mixes)


def test_counts_and_keys():
  counts = np.zeros((3, VOCAB), np.int32)
  counts[1, 4] = 2
  got = sampling.update_counts(counts, np.array([4, 4, 15], np.int32),
                               np.array([False, True, True]))
  expected = counts.copy()
  expected[1, 4] += 1
  expected[2, 15] += 1
  np.testing.assert_array_equal(got, expected)
  seeds, indices = np.array([0, 5, 2**31 - 1], np.int32), np.array([0, 3, 99], np.int32)
  keys = jax.jit(jax.vmap(sampling.row_key))(seeds, indices)
  for s, (seed, index) in enumerate(zip(seeds.tolist(), indices.tolist())):
    expected_key = jax.random.fold_in(jax.random.key(seed), index)
    np.testing.assert_array_equal(jax.random.key_data(keys[s]),
                                  jax.random.key_data(expected_key))
    np.testing.assert_array_equal(jax.random.key_data(sampling.row_key(seed, index)),
                                  jax.random.key_data(expected_key))
  assert len({tuple(np.asarray(jax.random.key_data(k))) for k in keys}) == 3
