"""Gemma 4's vision tower, its weight mapping and its preprocessing against transformers
(PyTorch) and Pillow: soft tokens (plain, and with standardize and clipped linears), scan
vs unrolled, remat, the tensor names, pixels, positions, soft-token counts and prompt
spans."""

import atexit
import functools
import os
import shutil
import tempfile

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

import gemma_jax as gj
from gemma_jax import decoder
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.checkpoints import gemma4_tower
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.models.gemma4 import vision as gemma4_vision
from test_vision import generated_image, image_cases

LAYOUT = gemma4_tower.LAYOUT
TEXT_WIDTH = 48
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=64)
BUDGET = dict(patch_size=4, pooling_kernel=2, max_soft_tokens=70)    # 280 patch slots
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
IDS = dict(boi_token_id=290, eoi_token_id=291, image_token_id=292)   # in the 300 ids
# A tower tensor the error tests take away or cut short, as saved and canonically.
UP = "model.vision_tower.encoder.layers.1.mlp.up_proj.linear.weight"
UP_CANONICAL = "vision_tower.encoder.layers.1.mlp.up_proj.linear.weight"


def tiny_processor(**budget):
  budget = dict(BUDGET, **budget)
  return Gemma4ImageProcessorPil(patch_size=budget["patch_size"],
                                 pooling_kernel_size=budget["pooling_kernel"],
                                 max_soft_tokens=budget["max_soft_tokens"])


@functools.lru_cache(maxsize=None)
def reference(extras):
  """A tiny transformers Gemma 4 with random vision weights (with `extras`: standardize
  and clipped linears whose finite bounds clip), saved with save_pretrained, and two
  images of other aspect ratios, padded: (model, its directory, patches, positions, soft
  tokens per image)."""
  torch.manual_seed(int(extras))
  config = transformers.Gemma4Config(
      vision_config=dict(VISION, standardize=extras, use_clipped_linears=extras),
      text_config=dict(vocab_size=300, hidden_size=TEXT_WIDTH, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0,
                       layer_types=["full_attention"]),
      audio_config=None, **IDS)
  model = transformers.Gemma4ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "vision" in name:
        p.normal_(0.0, 0.2 if p.ndim > 1 else 0.5)
        if p.ndim == 1:       # norm weights around 1
          p.add_(1.0)
    for name, b in model.named_buffers():
      if name.endswith(("_min", "_max")):
        b.fill_((-1 if name.endswith("_min") else 1) * (0.5 + torch.rand(()).item()))
      elif name.endswith("std_bias"):
        b.normal_(0.0, 0.3)
      elif name.endswith("std_scale"):
        b.uniform_(0.5, 1.5)
  path = tempfile.mkdtemp(prefix="gemma4_vision_")
  atexit.register(shutil.rmtree, path, True)
  model.save_pretrained(path)
  images = [generated_image(50, 90, seed=1), generated_image(80, 40, seed=2)]
  inputs = tiny_processor()(images=images, return_tensors="pt")
  with torch.no_grad():
    tokens = model.model.get_image_features(inputs["pixel_values"],
                                            inputs["image_position_ids"]).pooler_output
  return (model, path, inputs["pixel_values"].numpy(), inputs["image_position_ids"].numpy(),
          [t.numpy() for t in tokens])


def state(extras):
  """The transformers model's tensors by their names in memory."""
  return {k: v.numpy() for k, v in reference(extras)[0].state_dict().items()}


def saved(extras):
  """The tensors save_pretrained wrote, by their names in the file."""
  return safetensors_io.read(os.path.join(reference(extras)[1], "model.safetensors"))


def our_config(extras):
  """Our vision section, read from the saved directory (a fresh copy each call)."""
  return gj.hf.load_config(reference(extras)[1]).model.vision


@functools.lru_cache(maxsize=None)
def loaded(extras, scan):
  return gj.hf.load(reference(extras)[1], scan_layers=scan)


def our_params(extras, scan):
  return {"params": loaded(extras, scan)[1]["vision"]}


def tower(extras, scan=True, **kwargs):
  return gemma4_vision.Gemma4VisionTower(our_config(extras), out_width=TEXT_WIDTH,
                                         scan_layers=scan, **kwargs)


def canonical(tensors):
  """The tower's tensors of one layout, by their canonical names."""
  return {LAYOUT.canonical_name(k): v for k, v in tensors.items() if LAYOUT.canonical_name(k)}


# ----------------------------------------------------------------------------- tower


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "standardize_clipped"])
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_soft_tokens_match_transformers(extras, scan):
  _, _, patches, positions, expected = reference(extras)
  tokens, valid = jax.jit(tower(extras, scan).apply)(our_params(extras, scan), patches,
                                                     positions)
  chex.assert_shape(tokens, (2, 70, TEXT_WIDTH))
  chex.assert_shape(valid, (2, 70))
  assert valid.dtype == jnp.bool_
  counts = [len(e) for e in expected]
  assert counts == [66, 55]                  # 12 x 22 and 22 x 10 patches, pooled 2 x 2
  # The valid slots are the first n: what transformers keeps.
  np.testing.assert_array_equal(valid, np.arange(70)[None] < np.array(counts)[:, None])
  for i, want in enumerate(expected):
    np.testing.assert_allclose(np.asarray(tokens[i])[:counts[i]], want, rtol=0, atol=1e-4)


def test_clip_bounds_and_standardize_take_effect():
  """Unclipped and unstandardized, the extras model's tokens differ: the test above
  exercised both."""
  _, _, patches, positions, expected = reference(True)
  params = flax.traverse_util.flatten_dict(our_params(True, False)["params"])
  neutral = {path: (np.full_like(v, np.inf if path[-1].endswith("max") else -np.inf)
                    if path[-2].endswith("_clip") else v) for path, v in params.items()}
  tokens, _ = tower(True, False).apply(
      {"params": flax.traverse_util.unflatten_dict(neutral)}, patches, positions)
  assert np.abs(np.asarray(tokens[0])[:66] - expected[0]).max() > 1e-2
  config = our_config(True)
  config.standardize = False
  plain = {k: v for k, v in params.items() if k[0] != "standardize"}
  plain_tower = gemma4_vision.Gemma4VisionTower(config, out_width=TEXT_WIDTH, scan_layers=False)
  tokens, _ = plain_tower.apply({"params": flax.traverse_util.unflatten_dict(plain)}, patches,
                                positions)
  assert np.abs(np.asarray(tokens[0])[:66] - expected[0]).max() > 1e-2


def test_jax_attention_kernel_and_leading_dims():
  _, _, patches, positions, expected = reference(False)
  tokens, valid = jax.jit(tower(False, attention_kernel="jax").apply)(
      our_params(False, True), patches[None], positions[None])
  chex.assert_shape(tokens, (1, 2, 70, TEXT_WIDTH))
  chex.assert_shape(valid, (1, 2, 70))
  np.testing.assert_allclose(np.asarray(tokens[0, 1])[:55], expected[1], rtol=0, atol=1e-4)


def test_remat_keeps_output_and_gradients():
  _, _, patches, positions, _ = reference(True)
  cotangent = np.random.RandomState(0).randn(2, 70, TEXT_WIDTH).astype(np.float32)

  def loss(policy):
    apply = tower(True, remat_policy=policy).apply
    return jax.jit(jax.value_and_grad(
        lambda params: jnp.sum(apply(params, patches, positions)[0] * cotangent)))

  value, grads = loss("none")(our_params(True, True))
  remat_value, remat_grads = loss("full")(our_params(True, True))
  np.testing.assert_allclose(remat_value, value, rtol=1e-6)
  chex.assert_trees_all_close(remat_grads, grads, rtol=1e-5, atol=1e-6)
  # The buffers of transformers are constants here.
  flat = flax.traverse_util.flatten_dict(grads["params"])
  for path, grad in flat.items():
    if path[0] == "standardize" or path[-2].endswith("_clip"):
      assert not np.any(grad), path


@pytest.mark.slow
def test_init_layout_and_logical_axes():
  for scan in (True, False):
    boxed = tower(True, scan).init(jax.random.key(0), jnp.zeros((1, 8, 48)),
                                   jnp.zeros((1, 8, 2), jnp.int32))
    shapes = flax.traverse_util.flatten_dict(nn.meta.unbox(boxed["params"]))
    specs = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed["params"]))
    converted = flax.traverse_util.flatten_dict(our_params(True, scan)["params"])
    assert {k: v.shape for k, v in shapes.items()} == {k: v.shape for k, v in converted.items()}
    known = {"batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",
             "norm", None}
    for path, spec in specs.items():
      assert len(spec) == shapes[path].ndim, path
      assert set(spec) <= known, path
      if scan and path[:2] == ("encoder", "layers"):
        assert spec[0] == "layers", path
  # Fresh bounds clip nothing; fresh statistics change nothing.
  params = nn.meta.unbox(boxed["params"])
  assert float(params["encoder"]["layers_0"]["attn"]["q_clip"]["input_min"]) == -np.inf
  np.testing.assert_array_equal(params["standardize"]["scale"], 1.0)


def test_default_tower_is_transformers_default():
  """The gemma4-e2b-vision preset's tower is transformers' Gemma4VisionConfig(), its ids
  Gemma4Config()'s."""
  preset = gj.get_config("gemma4-e2b-vision").model.vision
  ours = gemma4_tower.config_from_hf(transformers.Gemma4Config(
      vision_config=transformers.Gemma4VisionConfig().to_dict(), audio_config=None).to_dict(),
                                         ACTIVATIONS)
  assert ours == {k: preset[k] for k in gemma4_tower.FIELDS}


# ----------------------------------------------------------------------------- mapping


def test_layout_maps_every_layout_both_ways():
  """In-memory names, save_pretrained's file and Gemma4Model's names (no "model.") give
  the same canonical names and tensors, each of our parameters reads from them what
  hf.load gave, and LAYOUT.to_hf of our unrolled parameters gives back exactly the saved
  tensors."""
  tensors, file = state(True), saved(True)
  vision = canonical(tensors)
  assert len(vision) == 5 + 2 * (4 + 2 + 7 * 5)    # top, 2 x (norms, qk norms, 7 x clipped)
  assert all(name.startswith(("vision_tower.", "embed_vision.")) for name in vision)
  layouts = {"saved": file,
             "no_model": {k[len("model."):]: v for k, v in tensors.items()
                          if k.startswith("model.")}}
  for layout_name, layout in layouts.items():
    names = canonical(layout)
    assert set(names) == set(vision), layout_name
    for name, value in names.items():
      np.testing.assert_array_equal(value, vision[name], err_msg=f"{layout_name}: {name}")
  # Unrolled as loaded, and unrolled from the scanned load, alike.
  config, scanned = loaded(True, True)
  unrolled = loaded(True, False)[1]["vision"]
  chex.assert_trees_all_equal(
      decoder.unstack_layers({"vision": scanned["vision"]}, config.model)["vision"], unrolled)
  params = flax.traverse_util.flatten_dict(unrolled)
  assert len(params) == len(vision)
  for layout_name, layout in dict(layouts, memory=tensors).items():
    names = canonical(layout)
    for path, value in params.items():
      ours = LAYOUT.from_hf(names[LAYOUT.tensor_name(path)], path, value.shape)
      assert not isinstance(ours, str), (layout_name, path, ours)
      np.testing.assert_array_equal(ours, value, err_msg=f"{layout_name}: {path}")
  back = dict(LAYOUT.to_hf(np.asarray(value), path) for path, value in params.items())
  expected = {k: v for k, v in file.items() if LAYOUT.canonical_name(k)}
  assert set(back) == set(expected)
  for name, value in back.items():
    assert value.dtype == expected[name].dtype, name
    np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_config_round_trips_through_transformers():
  config = our_config(True)
  # What the reference's transformers config says, read back.
  assert {k: config[k] for k in ("width", "mlp_dim", "num_layers", "num_heads",
                                 "num_kv_heads", "head_dim", "patch_size", "pooling_kernel",
                                 "position_embedding_size")} == dict(
      zip(("width", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
           "patch_size", "pooling_kernel", "position_embedding_size"),
          (VISION[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim",
                               "patch_size", "pooling_kernel_size",
                               "position_embedding_size"))))
  assert config.enabled and config.standardize and config.use_clipped_linears
  # Fields away from transformers' defaults too.
  assert {k: config[k] for k in IDS} == IDS
  config.update(rope_base=123.0, layer_norm_eps=1e-5, boi_token_id=280, eoi_token_id=281,
                image_token_id=282)
  hf = gemma4_tower.config_to_hf(config, {v: k for k, v in ACTIVATIONS.items()})
  # pad_token_id is the text config's: hf.config_to_hf writes it there.
  rebuilt = transformers.Gemma4Config(
      **hf, text_config=dict(pad_token_id=config.pad_token_id), audio_config=None).to_dict()
  assert gemma4_tower.config_from_hf(rebuilt, ACTIVATIONS) == {
      k: config[k] for k in gemma4_tower.FIELDS}


def checkpoint_with(tensors, path):
  """A copy of the reference directory's config.json beside `tensors`."""
  os.makedirs(path)
  shutil.copy(os.path.join(reference(False)[1], "config.json"), path)
  safetensors_io.write(os.path.join(path, "model.safetensors"), tensors)
  return str(path)


def test_load_names_missing_and_misshapen_tensors(tmp_path):
  tensors = saved(False)
  assert UP in tensors
  gj.hf.load(checkpoint_with(tensors, tmp_path / "whole"))     # as written, it loads
  with pytest.raises(gj.hf.CheckpointError,
                     match=rf"missing tensors: \['{UP_CANONICAL}'\]"):
    gj.hf.load(checkpoint_with({k: v for k, v in tensors.items() if k != UP},
                               tmp_path / "missing"))
  with pytest.raises(gj.hf.CheckpointError, match=rf"shape mismatches: \['{UP_CANONICAL}: "):
    gj.hf.load(checkpoint_with(dict(tensors, **{UP: tensors[UP][:-1]}),
                               tmp_path / "truncated"))
  projector = "model.embed_vision.embedding_projection.weight"
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"shape mismatches: \['embed_vision.embedding_projection.weight: "):
    gj.hf.load(checkpoint_with(dict(tensors, **{projector: tensors[projector][:-1]}),
                               tmp_path / "projector"))
  extra = "model.vision_tower.encoder.layers.2.mlp.up_proj.linear.weight"
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"unexpected tensors: \['vision_tower.encoder.layers.2.mlp"):
    gj.hf.load(checkpoint_with(dict(tensors, **{extra: tensors[UP]}), tmp_path / "extra"))


# ----------------------------------------------------------------------------- pixels


# (90, 70) and (200, 41): the height shrinks most, so Pillow resamples it first.
@pytest.mark.parametrize("h,w,out_h,out_w", [(30, 41, 28, 24), (301, 203, 56, 48),
                                             (9, 13, 56, 72), (90, 70, 40, 60),
                                             (200, 41, 24, 40), (64, 64, 64, 32)])
def test_resize_is_pillows_bicubic(h, w, out_h, out_w):
  image = generated_image(h, w)
  expected = np.asarray(Image.fromarray(image).resize((out_w, out_h), Image.BICUBIC))
  np.testing.assert_array_equal(gemma4_images.resize_bicubic(image, out_h, out_w), expected)


SIZES = [(50, 90), (80, 40), (300, 200), (10, 13), (48, 88), (7, 300), (500, 9), (61, 67),
         (1000, 1000), (33, 250)]


@pytest.mark.parametrize("h,w", SIZES)
def test_preprocessing_matches_transformers(h, w):
  image = generated_image(h, w, seed=h + w)
  expected = tiny_processor()(images=image, return_tensors="np")
  ours = gemma4_images.preprocess_image(image, **BUDGET)
  chex.assert_shape(ours.patches, (280, 48))
  chex.assert_shape(ours.positions, (280, 2))
  assert ours.patches.dtype == np.float32 and ours.positions.dtype == np.int32
  np.testing.assert_array_equal(ours.patches, expected["pixel_values"][0])
  np.testing.assert_array_equal(ours.positions, expected["image_position_ids"][0])
  n = ours.num_soft_tokens(BUDGET["pooling_kernel"])
  assert n == expected["num_soft_tokens_per_image"][0]
  assert n == gemma4_images.num_soft_tokens(h, w, **BUDGET)


def test_preprocessing_of_files_modes_and_the_published_budget(tmp_path):
  for name, (ours_in, theirs_in) in image_cases(tmp_path).items():
    expected = tiny_processor()(images=theirs_in, return_tensors="np")
    ours = gemma4_images.preprocess_image(ours_in, **BUDGET)
    np.testing.assert_array_equal(ours.patches, expected["pixel_values"][0], err_msg=name)
  # The published budget: 16-pixel patches, 3 x 3 pooling, 280 soft tokens.
  images = [generated_image(480, 640, seed=4), generated_image(300, 1000, seed=5)]
  expected = Gemma4ImageProcessorPil()(images=images, return_tensors="np")
  ours = gemma4_images.preprocess_images(images)
  chex.assert_shape(ours.patches, (2, 2520, 768))
  np.testing.assert_array_equal(ours.patches, expected["pixel_values"])
  np.testing.assert_array_equal(ours.positions, expected["image_position_ids"])
  counts = ours.num_soft_tokens(3)
  np.testing.assert_array_equal(counts, expected["num_soft_tokens_per_image"])
  assert list(counts) == [266, 270]     # 14 x 19 and 9 x 30 soft tokens


def test_sizes_and_refusals():
  assert gemma4_images.resized_size(50, 90, **BUDGET) == (48, 88)
  assert gemma4_images.resized_size(2, 900, **BUDGET) == (8, 560)     # longest side: 70 * 8
  with pytest.raises(ValueError, match="0 x 0"):
    gemma4_images.resized_size(1, 1, max_soft_tokens=0)
  with pytest.raises(ValueError, match="integers"):
    gemma4_images.preprocess_image(np.zeros((20, 20, 3), np.float32), **BUDGET)
  with pytest.raises(ValueError, match=r"\[0, 255\]"):
    gemma4_images.preprocess_image(np.full((20, 20, 3), 256), **BUDGET)


# ----------------------------------------------------------------------------- prompts


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
  vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
  for piece in ("a", "b", "c", "▁", ".", "\n", "<|image>", "<image|>", "<|image|>"):
    vocab[piece] = len(vocab)
  return transformers.GemmaTokenizer(vocab=vocab, merges=[], extra_special_tokens={
      "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"})


def processor_text(prompt, counts):
  """Gemma4Processor's text expansion (its replacement strings, spliced in by
  ProcessorMixin), without the audio and video processors it needs to be built."""
  tok = tiny_tokenizer()
  processor = Gemma4Processor.__new__(Gemma4Processor)
  processor.image_token, processor.boi_token = tok.image_token, tok.boi_token
  processor.eoi_token = tok.eoi_token
  replacements = [processor.replace_image_token({"num_soft_tokens_per_image": counts}, i)
                  for i in range(len(counts))]
  return processor.get_text_with_replacements([prompt], replacements)[0][0]


@pytest.mark.parametrize("prompt,counts", [("a<|image|>b", [3]),
                                           ("a<|image|>b.<|image|>\nc", [3, 2]),
                                           ("<|image|><|image|>", [1, 4]), ("a b c", [])])
def test_placeholders_match_gemma4_processor(prompt, counts):
  tok = tiny_tokenizer()
  text = processor_text(prompt, counts)
  assert gemma4_images.expand_image_markers(prompt, counts) == text
  ids = gemma4_images.insert_image_placeholders(
      tok(prompt)["input_ids"], counts, image_token_id=tok.image_token_id,
      boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id)
  assert ids == tok(text)["input_ids"]
  assert ids.count(tok.image_token_id) == sum(counts)
  with pytest.raises(ValueError, match="markers"):
    gemma4_images.expand_image_markers(prompt, counts + [1])
  with pytest.raises(ValueError, match="markers"):
    gemma4_images.insert_image_placeholders(
        tok(prompt)["input_ids"], counts + [1], image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id)
