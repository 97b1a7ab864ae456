"""Preset parameter counts (jax.eval_shape) equal transformers' Gemma 3 text models."""

import jax
import numpy as np
import pytest
import torch
import transformers

import gemma_jax as gj

# The published Gemma 3 text configurations, written out independently of our presets.
HF_SHAPES = {
    "gemma3-270m": dict(num_hidden_layers=18, hidden_size=640, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, intermediate_size=2048),
    "gemma3-1b": dict(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, intermediate_size=6912),
    "gemma3-4b": dict(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=10240),
    "gemma3-12b": dict(num_hidden_layers=48, hidden_size=3840, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, intermediate_size=15360),
    "gemma3-27b": dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, intermediate_size=21504),
}


def count_ours(config):
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), np.int32))
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_parameter_count_matches_transformers(name):
  config = gj.get_config(name)
  hf_config = transformers.Gemma3TextConfig(vocab_size=262144, **HF_SHAPES[name])
  with torch.device("meta"):
    model = transformers.Gemma3ForCausalLM(hf_config)
  theirs = sum(p.numel() for p in model.parameters())
  assert count_ours(config) == theirs


def test_scan_does_not_change_parameter_count():
  config = gj.get_config("gemma3-4b")
  scanned = count_ours(config)
  config.model.scan_layers = False
  assert count_ours(config) == scanned
