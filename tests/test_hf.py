"""transformers interop: logits of loaded checkpoints, the save round trip, errors."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import torch as st_torch

import gemma_jax as gj
from gemma_jax import sharding
from gemma_jax.checkpoints import safetensors_io, sharded_read
from gemma_jax.decoder import layer_types
from gemma_jax.layers import chunked_loss
import test_gemma4
import torch_reference
from torch_reference import torch_logits

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_attention_heads=4,
            head_dim=16, rms_norm_eps=1e-6)

# Each shape exercises one thing the issue names; all run 23-token sequences.
SHAPES = {
    "8_layers_gqa_window_5": dict(num_hidden_layers=8, num_key_value_heads=2, sliding_window=5),
    "7_layers_mqa": dict(num_hidden_layers=7, num_key_value_heads=1, sliding_window=9),
    "mha_query_scalar_24": dict(num_hidden_layers=6, num_key_value_heads=4, sliding_window=64,
                                query_pre_attn_scalar=24),
    "13_layers_linear_rope_softcap": dict(
        num_hidden_layers=13, num_key_value_heads=2, sliding_window=4,
        final_logit_softcapping=3.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 10_000.0}}),
}


def random_model(seed, **shape):
  """A tiny transformers Gemma 3 with every weight random, norm scales included."""
  torch.manual_seed(seed)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**BASE, **shape))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.normal_(0.0, 0.5)
  return model.eval()


token_batch = functools.partial(torch_reference.token_batch, VOCAB)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
  model = random_model(len(request.param), **SHAPES[request.param])
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  return model, path


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_loaded_logits_match_transformers(checkpoint, scan_layers):
  model, path = checkpoint
  config, params = gj.hf.load(path, scan_layers=scan_layers)
  tokens = token_batch()
  ours = gj.transform(config).apply(params, jnp.asarray(tokens))
  assert np.abs(np.asarray(ours) - torch_logits(model, tokens)).max() <= 1e-4


@pytest.mark.slow
def test_loss_and_table_gradient_match_transformers_labels_loss(checkpoint, monkeypatch):
  """`model.loss` over chunks of 5 positions (the soft-capped shape included) against
  transformers' own `labels=` loss and its autograd gradient of the tied table."""
  model, path = checkpoint
  tokens = token_batch()
  ids = torch.as_tensor(tokens.astype(np.int64))
  model.zero_grad()
  theirs = model(ids, labels=ids).loss
  theirs.backward()
  their_grad = model.model.embed_tokens.weight.grad.numpy()

  monkeypatch.setattr(chunked_loss, "LOGITS_BYTES", 4 * tokens.shape[0] * VOCAB * 5)
  config, params = gj.hf.load(path)
  ours = gj.transform(config)

  def mean_loss(params):
    sums = ours.loss(params, jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
    return sums.cross_entropy / sums.weight

  value, grads = jax.value_and_grad(mean_loss)(params)
  np.testing.assert_allclose(value, theirs.item(), rtol=1e-5)
  our_grad = np.asarray(grads["embed"]["embedding"])
  assert np.abs(our_grad - their_grad).max() <= 1e-4 * np.abs(their_grad).max()


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_load_onto_a_mesh_reads_each_device_part_alone(checkpoint, scan_layers, monkeypatch):
  """hf.load(shardings=...) on 8 devices (fsdp 4 x tensor 2; fsdp 8 for one kv head)
  equals the whole host load,
  laid out by the shardings. Nothing is read before placement (every leaf handed to
  `sharded_read.place` is a view of the memory-mapped files), and each part read has the
  shape of one device's shard, never a whole tensor."""
  _, path = checkpoint
  config, host = gj.hf.load(path, scan_layers=scan_layers)
  tensor = min(2, config.model.num_kv_heads)
  config.mesh.update(data=1, fsdp=8 // tensor, tensor=tensor)
  shardings = sharding.param_shardings(config, sharding.make_mesh(config.mesh))
  views, parts = [], []
  place, make_array = sharded_read.place, jax.make_array_from_callback

  def recording_place(tree, tree_shardings, dtype):
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, sharded_read.LayerStack)):
      views.extend(leaf.layers if isinstance(leaf, sharded_read.LayerStack) else [leaf])
    return place(tree, tree_shardings, dtype)

  def recording_make_array(shape, layout, callback):
    def read(index):
      part = callback(index)
      parts.append((part.shape, layout.shard_shape(shape), shape))
      return part
    return make_array(shape, layout, read)

  monkeypatch.setattr(sharded_read, "place", recording_place)
  monkeypatch.setattr(jax, "make_array_from_callback", recording_make_array)
  _, placed = gj.hf.load(path, scan_layers=scan_layers, shardings=shardings)
  assert views and not any(view.flags.owndata for view in views)
  assert all(part == shard for part, shard, _ in parts)
  assert sum(part != whole for part, _, whole in parts) > len(parts) // 2   # most are split
  for ours, whole, layout in zip(jax.tree.leaves(placed), jax.tree.leaves(host),
                                 jax.tree.leaves(shardings)):
    assert ours.sharding == layout
    np.testing.assert_array_equal(np.asarray(ours), whole)


@pytest.mark.slow
def test_packed_segments_equal_separate_documents(checkpoint):
  """A row packing two documents gives each the logits transformers gives it alone."""
  model, path = checkpoint
  assert torch_reference.packed_row_gap(model, path, VOCAB) <= 1e-4


@pytest.mark.slow
def test_save_round_trip_through_transformers(checkpoint, tmp_path):
  model, path = checkpoint
  torch_reference.assert_save_round_trip(model, path, str(tmp_path / "saved"),
                                         transformers.Gemma3ForCausalLM, VOCAB)


def test_text_part_of_conditional_generation_checkpoint(tmp_path):
  text = dict(BASE, num_hidden_layers=7, num_key_value_heads=2, sliding_window=6)
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
  torch.manual_seed(3)
  model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
      text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
      boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)).eval()
  model.save_pretrained(str(tmp_path))
  config, params = gj.hf.load(str(tmp_path))
  tokens = token_batch(t=15) % (VOCAB - 3)          # text only: no image markers
  ours = gj.transform(config).apply(params, jnp.asarray(tokens))
  assert np.abs(np.asarray(ours) - torch_logits(model, tokens)).max() <= 1e-4


def test_bfloat16_checkpoint_loads(tmp_path):
  model = random_model(5, num_hidden_layers=2, num_key_value_heads=2, sliding_window=8)
  model.to(torch.bfloat16).save_pretrained(str(tmp_path))
  config, params = gj.hf.load(str(tmp_path))
  expected = model.model.embed_tokens.weight.detach().float().numpy()
  np.testing.assert_array_equal(params["embed"]["embedding"], expected)
  assert params["embed"]["embedding"].dtype == np.float32


def _edit_checkpoint(path, edit):
  file = os.path.join(path, "model.safetensors")
  tensors = st_torch.load_file(file)
  edit(tensors)
  st_torch.save_file(tensors, file, metadata={"format": "pt"})


def _transposed(name):
  """An edit storing tensor `name` with its last two dims swapped (as many elements)."""
  return lambda t: t.update({name: t[name].transpose(-1, -2).contiguous()})


_TWO_LAYERS = functools.partial(random_model, 0, num_hidden_layers=2, num_key_value_heads=2)
_MOE = functools.partial(test_gemma4.random_model, 0,
                         **test_gemma4.SHAPES["moe_6_layers_top1_same_head_dim"])


@pytest.mark.parametrize("model,edit,message", [
    (_TWO_LAYERS, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"),
    (_TWO_LAYERS, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(3)}),
     r"unexpected tensors: \['layers.9.extra.weight'\]"),
    (_TWO_LAYERS, lambda t: t.update({"model.norm.weight": torch.zeros(47)}),
     r"norm.weight: \(47,\) != expected \(48,\)"),
    (_TWO_LAYERS,
     lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(60, 48)}),
     r"layers.0.self_attn.q_proj.weight: \(60, 48\) != expected \(64, 48\)"),
    (_TWO_LAYERS, _transposed("model.layers.0.mlp.gate_proj.weight"),
     r"shape mismatches: \['layers.0.mlp.gate_proj.weight: \(48, 80\) != expected "
     r"\(80, 48\)'\]$"),
    (_MOE, _transposed("model.layers.0.experts.gate_up_proj"),
     r"shape mismatches: \['layers.0.experts.gate_up_proj: \(3, 32, 24\) != expected "
     r"\(3, 24, 32\)'\]$"),
], ids=["missing", "unexpected", "norm_size", "q_proj_size", "gate_proj_transposed",
        "experts_gate_up_transposed"])
def test_bad_checkpoint_names_offending_tensors(tmp_path, model, edit, message):
  """Each tensor named once, with its shape and the one expected (a transposed weight has
  the right size, not the right shape)."""
  model().save_pretrained(str(tmp_path))
  _edit_checkpoint(str(tmp_path), edit)
  with pytest.raises(gj.hf.CheckpointError, match=message):
    gj.hf.load(str(tmp_path))


def _truncate_weights(path):
  file = os.path.join(path, "model.safetensors")
  os.truncate(file, os.path.getsize(file) - 100)


def _write_index(path, text):
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    f.write(text)


@pytest.mark.parametrize("damage,message", [
    (_truncate_weights, r"model\.safetensors: tensor .* the file is truncated"),
    (lambda p: _write_index(p, '{"weight_map": {"lm.weight": "model-00002.safetensors"}}'),
     r"names model-00002\.safetensors, which is not in"),
    (lambda p: _write_index(p, '{"metadata": {}}'), r"index\.json: not an index"),
    (lambda p: _write_index(p, "{not json"), r"index\.json: not JSON"),
], ids=["truncated", "missing_shard", "no_weight_map", "bad_json"])
def test_unreadable_weights_are_a_checkpoint_error_naming_the_file(tmp_path, damage, message):
  random_model(0, num_hidden_layers=2, num_key_value_heads=2).save_pretrained(str(tmp_path))
  damage(str(tmp_path))
  with pytest.raises(gj.hf.CheckpointError, match=message):
    gj.hf.load(str(tmp_path))


def test_unsupported_config_is_named(tmp_path):
  random_model(0, num_hidden_layers=2, num_key_value_heads=2).save_pretrained(str(tmp_path))
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  config["model_type"] = "llama"
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(gj.hf.CheckpointError, match="model_type 'llama'"):
    gj.hf.load(str(tmp_path))


# The text_config of google/gemma-3-{4b,12b,27b}-it's config.json (written by transformers
# 4.50): it leaves out every key that has Gemma3TextConfig's default.
_PUBLISHED_TEXT_CONFIGS = {
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                num_attention_heads=16, num_key_value_heads=8),
    "27b": dict(head_dim=128, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                num_attention_heads=32, num_key_value_heads=16, query_pre_attn_scalar=168),
}


@pytest.mark.parametrize("size", sorted(_PUBLISHED_TEXT_CONFIGS))
def test_published_gemma3_config_reads_as_transformers_reads_it(size):
  hf = {
      "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
      "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
      "text_config": dict(_PUBLISHED_TEXT_CONFIGS[size], model_type="gemma3_text",
                          rope_scaling={"factor": 8.0, "rope_type": "linear"},
                          sliding_window=1024),
      "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
      "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                        "model_type": "siglip_vision_model", "num_attention_heads": 16,
                        "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
  m = gj.validate(gj.hf.config_from_hf(json.loads(json.dumps(hf)))).model
  t = transformers.Gemma3Config(**hf).text_config
  rope = t.rope_parameters
  assert t.hidden_activation == "gelu_pytorch_tanh" and m.activation == "gelu_tanh"
  assert t.final_logit_softcapping is None and m.final_logit_softcap is None
  assert layer_types(m) == tuple("global" if kind == "full_attention" else "local"
                                    for kind in t.layer_types)
  ours = (m.vocab_size, m.d_model, m.mlp_dim, m.num_layers, m.num_heads, m.num_kv_heads,
          m.head_dim, m.query_pre_attn_scalar, m.sliding_window, m.norm_eps,
          m.rope_local_base, m.rope_local_scale, m.rope_global_base, m.rope_global_scale)
  theirs = (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers,
            t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.query_pre_attn_scalar, t.sliding_window, t.rms_norm_eps,
            rope["sliding_attention"]["rope_theta"], 1.0,
            rope["full_attention"]["rope_theta"], rope["full_attention"]["factor"])
  assert ours == theirs


def test_config_key_without_a_default_is_named():
  hf = gj.hf.config_to_hf(gj.get_config("gemma4-tiny"))
  del hf["num_attention_heads"]
  with pytest.raises(gj.hf.CheckpointError,
                     match="config.json: num_attention_heads is missing and has no default"):
    gj.hf.config_from_hf(hf)


@pytest.mark.parametrize("kind", ["default", "linear"])
def test_a_partial_rotation_outside_proportional_rope_is_named(kind):
  """transformers' Gemma cannot run it (cos and sin of part of a head's width against the
  whole head); it had been read as whole-head rotation."""
  hf = gj.hf.config_to_hf(gj.get_config("gemma3-tiny"))
  hf["rope_parameters"]["full_attention"].update(rope_type=kind, factor=8.0,
                                                 partial_rotary_factor=0.5)
  with pytest.raises(gj.hf.CheckpointError, match=re.escape(
      f"rope_parameters.full_attention.partial_rotary_factor: 0.5 with rope_type {kind!r}")):
    gj.hf.config_from_hf(hf)


def test_save_refuses_a_training_workdir(tmp_path):
  """Exporting into a workdir replaced its config.json with transformers': the run could
  then no longer resume, export or sample."""
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "config.json").write_text('{"model": {}, "train": {}}')
  with pytest.raises(gj.hf.CheckpointError, match=re.escape(
      f"{tmp_path}: holds a training run's checkpoints")):
    gj.hf.save(str(tmp_path), gj.get_config("gemma3-tiny"), params={})
  assert (tmp_path / "config.json").read_text() == '{"model": {}, "train": {}}'
  assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.json"]


def test_save_refuses_a_path_under_a_file(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(gj.hf.CheckpointError, match=re.escape(
      f"{tmp_path / 'file' / 'out'}: {tmp_path / 'file'} exists and is not a directory")):
    gj.hf.save(str(tmp_path / "file" / "out"), gj.get_config("gemma3-tiny"), params={})


def test_unknown_layer_type_is_named():
  hf = gj.hf.config_to_hf(gj.get_config("gemma3-tiny"))
  hf["layer_types"] = ["sliding_attention"] * (hf["num_hidden_layers"] - 1) + ["chunked"]
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"config.json: layer_types holds \['chunked'\], not one of"):
    gj.hf.config_from_hf(hf)


@pytest.mark.parametrize("preset,architecture", [("gemma3-tiny", "Gemma3ForCausalLM"),
                                                  ("gemma4-tiny", "Gemma4ForCausalLM")])
@pytest.mark.parametrize("field,value,needed", [
    ("scale_embeddings", False, True), ("sinusoidal_position_embedding", True, False),
    ("logits_via_embedding", False, True), ("trainable_position_size", 300, 0)])
def test_save_names_an_embedding_option_gemma_cannot_represent(
    tmp_path, preset, architecture, field, value, needed):
  """Checked from the config alone, before any parameter is read or anything written."""
  config = gj.get_config(preset)
  config.model[field] = value
  message = (f"config.model.{field}: transformers' {architecture} cannot represent "
             rf"{value!r} \(it would read {needed!r}\)")
  with pytest.raises(gj.hf.CheckpointError, match=message):
    gj.hf.save(str(tmp_path / "out"), config, params={})
  assert not os.listdir(tmp_path)



def test_save_names_image_spans_gemma3_cannot_represent(tmp_path):
  """transformers' Gemma 3 lets an image's tokens see each other on every layer."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.bidirectional_span_types = ("local",)
  with pytest.raises(gj.hf.CheckpointError, match="config.model.bidirectional_span_types"):
    gj.hf.save(str(tmp_path / "out"), config, params={})
  assert not os.listdir(tmp_path)

def test_save_refuses_a_query_pre_attn_scalar_gemma3_cannot_read(tmp_path):
  """transformers' Gemma3TextConfig takes an integer query_pre_attn_scalar only."""
  with pytest.raises(Exception, match="query_pre_attn_scalar' expected int"):
    transformers.Gemma3TextConfig(query_pre_attn_scalar=20.5)
  config = gj.get_config("gemma3-tiny")
  config.model.query_pre_attn_scalar = 20.5
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"config\.model\.query_pre_attn_scalar: .* an integer, not 20\.5"):
    gj.hf.save(str(tmp_path / "out"), config, params={})
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("mode", ["int8_weights", "int4_weights"])
def test_save_refuses_stored_integer_weights(tmp_path, mode):
  """transformers' Gemma classes read float weights: a quantized model is refused from
  its config (its integer kernels and their scales have no names there)."""
  config = gj.get_config("gemma3-tiny")
  config.model.quant = mode
  with pytest.raises(gj.hf.CheckpointError, match=rf"^config\.model\.quant: '{mode}' .*"
                     r"quant\.float_config"):
    gj.hf.save(str(tmp_path / "out"), config, params={})
  assert not os.listdir(tmp_path)


def test_save_refuses_gpt2_with_sliding_window_layers(tmp_path):
  """GPT2LMHeadModel attends globally on every layer: a local layer is refused before
  anything is written."""
  config = gj.get_config("gpt3-52k")
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=4)
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(gj.hf.CheckpointError, match="config.model.attention_pattern"):
    gj.hf.save(str(tmp_path / "out"), config, params)
  assert not os.listdir(tmp_path)


def test_safetensors_io_agrees_with_the_safetensors_package(tmp_path):
  tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
             "c": torch.randn(2, 2, 2)}
  st_torch.save_file(tensors, str(tmp_path / "theirs.safetensors"))
  ours = safetensors_io.read(str(tmp_path / "theirs.safetensors"))
  for name, value in tensors.items():
    np.testing.assert_array_equal(np.asarray(ours[name], np.float64), value.double().numpy())
  safetensors_io.write(str(tmp_path / "ours.safetensors"), ours)
  back = st_torch.load_file(str(tmp_path / "ours.safetensors"))
  for name, value in tensors.items():
    assert torch.equal(back[name], value)
