"""Gemma 4 against transformers' Gemma4ForCausalLM: logits of loaded checkpoints (dense
and MoE), the save round trip, preset parameter counts; layer types and masks."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import decoder
from gemma_jax.training import optimizer
import torch_reference
from torch_reference import torch_logits

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_attention_heads=4,
            head_dim=8, hidden_size_per_layer_input=0, rms_norm_eps=1e-6)
MOE = dict(enable_moe_block=True, moe_intermediate_size=12)

# Each shape exercises what the issue names; all run 19-token sequences.
SHAPES = {
    # 8 layers: a scanned block, a local layer and the last layer forced global.
    "moe_8_layers_k_eq_v_top2": dict(
        MOE, num_hidden_layers=8, num_key_value_heads=2, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
        final_logit_softcapping=15.0, num_experts=4, top_k_experts=2),
    "moe_6_layers_top1_same_head_dim": dict(
        MOE, num_hidden_layers=6, num_key_value_heads=2, global_head_dim=8,
        attention_k_eq_v=False, sliding_window=4, num_experts=3, top_k_experts=1),
    "dense_7_layers_k_eq_v_mqa": dict(
        num_hidden_layers=7, num_key_value_heads=1, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
        final_logit_softcapping=30.0),
    "dense_13_layers_rope_half": dict(
        num_hidden_layers=13, num_key_value_heads=2, global_head_dim=16, attention_k_eq_v=False,
        sliding_window=3,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 5000.0,
                                            "partial_rotary_factor": 0.5}}),
}


def random_model(seed, **shape):
  """A tiny transformers Gemma 4 with every weight random: norm, router and per-expert
  scales and the per-layer scalars around 1, a decisive router, larger embeddings."""
  torch.manual_seed(seed)
  model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dict(BASE, **shape)))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("scale"):
        p.normal_(1.0, 0.4)
      elif "router.proj" in name:
        p.normal_(0.0, 1.0)
      elif "embed_tokens" in name:
        p.normal_(0.0, 0.3)
    for name, buffer in model.named_buffers():
      if name.endswith("layer_scalar"):
        buffer.uniform_(0.5, 1.5)
  return model.eval()


token_batch = functools.partial(torch_reference.token_batch, VOCAB, t=19)


def saved_checkpoint(name, shape, tmp_path_factory):
  """(name, a random transformers model of `shape`, its save_pretrained directory, its
  logits on token_batch())."""
  model = random_model(len(name), **shape)
  path = str(tmp_path_factory.mktemp(name))
  model.save_pretrained(path)
  return name, model, path, torch_logits(model, token_batch())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
  return saved_checkpoint(request.param, SHAPES[request.param], tmp_path_factory)


@pytest.mark.slow
def test_loaded_logits_match_transformers(checkpoint):
  name, _, path, expected = checkpoint
  config, params = gj.hf.load(path, scan_layers=name != "dense_7_layers_k_eq_v_mqa")
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(token_batch())))
  assert np.abs(expected).max() > 1.0      # logits large enough for 1e-4 to mean something
  assert np.abs(ours - expected).max() <= 1e-4


@pytest.mark.slow
def test_save_round_trip_through_transformers(checkpoint, tmp_path):
  _, model, path, expected = checkpoint
  config, params = gj.hf.load(path)
  gj.hf.save(str(tmp_path), config, params)
  reloaded = transformers.Gemma4ForCausalLM.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_array_equal(torch_logits(reloaded, token_batch()), expected)
  assert reloaded.config.layer_types == model.config.layer_types


def test_config_of_each_checkpoint(checkpoint):
  name, model, path, _ = checkpoint
  config, _ = gj.hf.load(path)
  m = config.model
  assert list(decoder.layer_types(m)) == [
      {"sliding_attention": "local", "full_attention": "global"}[t]
      for t in model.config.layer_types]
  assert m.attention_pattern == ("local",) * 5 + ("global",)
  assert (m.num_experts, m.experts_per_token) == (
      (model.config.num_experts, model.config.top_k_experts) if "moe" in name else (0, 1))
  assert m.global_head_dim == SHAPES[name]["global_head_dim"]


def test_legacy_global_head_keys_load_alike(tmp_path):
  """Configs written before per_layer_config name the global head dim and kv heads."""
  shape = SHAPES["dense_7_layers_k_eq_v_mqa"]
  random_model(0, **shape).save_pretrained(str(tmp_path))
  expected, _ = gj.hf.load(str(tmp_path))
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  del hf["per_layer_config"]
  hf.update(global_head_dim=16, num_global_key_value_heads=1)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  config, _ = gj.hf.load(str(tmp_path))
  assert config.model.to_dict() == expected.model.to_dict()


def test_config_to_hf_writes_presets_and_refuses_what_transformers_cannot_read():
  hf = gj.hf.config_to_hf(gj.get_config("gemma4-26b-a4b"))
  assert hf["architectures"] == ["Gemma4ForCausalLM"]
  assert hf["per_layer_config"]["29"] == {"head_dim": 512, "num_key_value_heads": 2}
  assert (hf["num_experts"], hf["top_k_experts"], hf["moe_intermediate_size"]) == (128, 8, 704)
  config = gj.get_config("gemma4-tiny")
  config.model.norm_plus_one = True
  with pytest.raises(gj.hf.CheckpointError, match=r"config.model.norm_plus_one"):
    gj.hf.config_to_hf(config)


# Preset parameter counts: the published Gemma 4 text configurations, written out
# independently of our presets.
HF_SHAPES = {
    "gemma4-31b": dict(num_hidden_layers=60, hidden_size=5376, intermediate_size=21504,
                       num_attention_heads=32, num_key_value_heads=16,
                       num_global_key_value_heads=4),
    "gemma4-26b-a4b": dict(num_hidden_layers=30, hidden_size=2816, intermediate_size=2112,
                           num_attention_heads=16, num_key_value_heads=8,
                           num_global_key_value_heads=2, enable_moe_block=True,
                           num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    "gemma4-tiny": dict(vocab_size=512, num_hidden_layers=8, hidden_size=128,
                        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                        sliding_window=64),
    "gemma4-moe-tiny": dict(vocab_size=512, num_hidden_layers=8, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
                            sliding_window=64, enable_moe_block=True, num_experts=8,
                            top_k_experts=2, moe_intermediate_size=128),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_parameter_count_matches_transformers(name):
  shape = dict(dict(vocab_size=262144, head_dim=256, global_head_dim=512, sliding_window=1024,
                    attention_k_eq_v=True, hidden_size_per_layer_input=0,
                    final_logit_softcapping=30.0), **HF_SHAPES[name])
  with torch.device("meta"):
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**shape))
  # The per-layer scalar is a buffer there (in the checkpoint) and a parameter here.
  theirs = (sum(p.numel() for p in model.parameters())
            + sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar")))
  shapes = jax.eval_shape(gj.transform(gj.get_config(name)).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), np.int32))
  assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes)) == theirs


@pytest.mark.parametrize("num_layers,pattern,blocks,types", [
    (8, ("local",) * 5 + ("global",), 1, "LLLLLGLG"),
    (6, ("local",) * 5 + ("global",), 1, "LLLLLG"),
    (6, ("local", "local", "global", "local", "local", "local"), 0, "LLGLLG"),
    (5, ("local", "global"), 2, "LGLGG"),
])
def test_last_layer_global_and_scanned_blocks(num_layers, pattern, blocks, types):
  m = gj.get_config("gemma4-tiny").model
  m.update(num_layers=num_layers, attention_pattern=pattern)
  assert "".join(t[0].upper() for t in decoder.layer_types(m)) == types
  assert decoder.scanned_block_count(m) == blocks


def test_image_spans_are_bidirectional_in_local_layers_only():
  m = gj.get_config("gemma4-tiny").model
  m.sliding_window = 3
  segments = np.array([[1, 1, 1, 1, 1, 1, 2, 2]], np.int32)
  spans = np.array([[0, 4, 4, 4, 0, 0, 0, 0]], np.int32)
  masks = decoder.layer_masks(m, jnp.asarray(segments), jnp.asarray(spans))
  q, k = np.arange(8)[:, None], np.arange(8)[None, :]
  same_segment = segments[0][:, None] == segments[0][None, :]
  causal = (k <= q) & same_segment
  in_span = (spans[0][:, None] == spans[0][None, :]) & (spans[0][:, None] > 0)
  np.testing.assert_array_equal(masks["global"][0], causal)
  np.testing.assert_array_equal(masks["local"][0], ((causal & (q - k < 3)) | in_span)
                                & same_segment)


@pytest.mark.slow
def test_presets_keep_multiplicative_scales_out_of_weight_decay():
  """Gemma 4's norms, router scales and per-layer scalars start at 1 (decay would pull
  them to 0); kernels, expert weights and the tables are decayed."""
  config = gj.get_config("gemma4-moe-tiny")
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), np.int32))
  decayed = {optimizer.param_path(path): flag for path, flag in
             jax.tree_util.tree_flatten_with_path(optimizer.decay_mask(
                 config.optimizer.no_decay)(shapes))[0]}
  kept = sorted(path for path, flag in decayed.items() if not flag)
  assert kept and all(re.search(r"(norm/scale|layer_scalar|router/scale|per_expert_scale)$",
                                path) for path in kept), kept
  assert decayed["embed/embedding"] and decayed["blocks/layer_0/moe/experts/gate"]
  assert gj.get_config("gemma3-tiny").optimizer.no_decay == ("norm",)
