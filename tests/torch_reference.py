"""transformers models as the reference: their logits, random token batches, and the
checks every family's checkpoint interop shares (packed rows, the save round trip)."""

import jax.numpy as jnp
import numpy as np
import torch

import gemma_jax as gj


def torch_logits(model, tokens, position_ids=None) -> np.ndarray:
  """[B, T] ids (and optional [B, T] positions) -> [B, T, V] logits of a torch model."""
  ids = None if position_ids is None else torch.as_tensor(position_ids)
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens)), position_ids=ids).logits.numpy()


def token_batch(vocab_size: int, b: int = 2, t: int = 23, seed: int = 0) -> np.ndarray:
  """[B, T] int32 ids drawn uniformly from the vocabulary."""
  return np.random.RandomState(seed).randint(0, vocab_size, (b, t)).astype(np.int32)


def packed_row_gap(model, path: str, vocab_size: int) -> float:
  """Max |ours - transformers'| when one row packs two documents (segment ids) and
  transformers runs each document alone; ours loaded from `path` by `gj.hf.load`."""
  config, params = gj.hf.load(path)
  doc_a, doc_b = token_batch(vocab_size, 1, 9, seed=1), token_batch(vocab_size, 1, 14, seed=2)
  segments = np.array([[1] * 9 + [2] * 14], np.int32)
  ours = np.asarray(gj.transform(config).apply(
      params, jnp.asarray(np.concatenate([doc_a, doc_b], axis=1)),
      segment_ids=jnp.asarray(segments)))
  expected = np.concatenate([torch_logits(model, doc_a), torch_logits(model, doc_b)], axis=1)
  return float(np.abs(ours - expected).max())


def assert_save_round_trip(model, path: str, out: str, model_class, vocab_size: int):
  """`gj.hf.load(path)` then `gj.hf.save(out)`: `model_class.from_pretrained(out)` gives
  exactly the logits of the original transformers `model`."""
  config, params = gj.hf.load(path)
  gj.hf.save(out, config, params)
  reloaded = model_class.from_pretrained(out).eval()
  tokens = token_batch(vocab_size)
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(model, tokens))
