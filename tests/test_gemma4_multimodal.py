"""The Gemma 4 image model against transformers' Gemma4ForConditionalGeneration: logits
with two images in one row and one in the other (three aspect ratios), per-layer inputs
and shared key/value layers beside them; greedy decoding with images against
`generate`; the checkpoint both ways; the image rule of the masks; the vision presets'
parameter counts; bad image inputs; training on generated images."""

import atexit
import copy
import functools
import json
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

import gemma_jax as gj
from gemma_jax import decoder
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.inference import decoding, sampler
from gemma_jax.models.gemma3 import vision
from gemma_jax.training import optimizer as optimizer_lib
from test_gemma4_small import HF_SHAPES
from test_multimodal import train_on_images
from test_vision import generated_image

VOCAB, BOI, EOI, IMAGE = 300, 290, 291, 292
# transformers' smallest budget (its processor takes 70, 140, 280, 560 or 1120): 280 slots.
BUDGET = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
# 9 layers, pattern 5 local : 1 global, the last global; the last 3 (local, local,
# global) reuse earlier keys and values; 8-wide per-layer inputs; window 40, shorter
# than an image's span (up to 70 soft tokens, bidirectional only within the window).
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=9,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
            sliding_window=40, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=3, use_bidirectional_attention="vision")
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=64)


# Row 0: a wide and a tall image; row 1: a square one.
IMAGES = [[generated_image(30, 52, seed=1), generated_image(50, 22, seed=2)],
          [generated_image(33, 35, seed=3)]]


@functools.lru_cache(maxsize=None)
def reference():
  """(the transformers model, its directory, the processor's outputs for IMAGES)."""
  torch.manual_seed(0)
  config = transformers.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None,
                                     boi_token_id=BOI, eoi_token_id=EOI, image_token_id=IMAGE)
  model = transformers.Gemma4ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  path = tempfile.mkdtemp(prefix="gemma4_multimodal_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  model.save_pretrained(path)
  processor = Gemma4ImageProcessorPil(**BUDGET)
  processor.save_pretrained(path)
  flat = processor(images=[i for row in IMAGES for i in row], return_tensors="np")
  return model, path, flat


def prompts():
  """Both rows' ids (equal lengths) with each image's span, and our images [2, 2, ...]."""
  config, _ = loaded(True)
  text = [[2, 10, IMAGE, 11, 12, IMAGE, 13] + [14] * 3, [2, 15, 16, IMAGE, 17] + [18] * 4]
  rows, images = gemma4_images.prompts_with_images(text, IMAGES, config.model.vision)
  length = max(len(r) for r in rows)
  tokens = np.stack([np.concatenate([r, np.full(length - len(r), 19)]) for r in rows])
  return tokens.astype(np.int32), images


@functools.lru_cache(maxsize=None)
def loaded(scan):
  return gj.hf.load(reference()[1], scan_layers=scan)


def torch_logits(tokens, dtype=torch.float32):
  """transformers' logits of the rows `tokens` with IMAGES, computed in `dtype`."""
  model, _, flat = reference()
  model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens),
                 pixel_values=torch.as_tensor(flat["pixel_values"]).to(dtype),
                 image_position_ids=torch.as_tensor(flat["image_position_ids"]),
                 mm_token_type_ids=torch.as_tensor((tokens == IMAGE).astype(np.int64))
                 ).logits.numpy()


def test_config_reads_the_tower_and_the_processor_budget():
  config, _ = loaded(True)
  v = config.model.vision
  assert v.enabled and config.model.block_type == "gemma4"
  assert (v.width, v.num_layers, v.patch_size, v.pooling_kernel, v.max_soft_tokens) == (
      32, 2, 4, 2, 70)
  assert (v.boi_token_id, v.eoi_token_id, v.image_token_id, v.pad_token_id) == (
      BOI, EOI, IMAGE, 0)
  assert config.model.bidirectional_span_types == ("local",)


def test_the_budget_nested_in_processor_config_is_read_and_written_as_transformers_does(
    tmp_path):
  """transformers 5 saves a processor's image processor nested in processor_config.json
  and reads it there first: a budget of 140 there (70 in preprocessor_config.json) had
  loaded as 70, and a save of 280 over it left transformers reading 140."""
  _, path, _ = reference()
  shutil.copytree(path, tmp_path / "nested")
  processor = Gemma4ImageProcessorPil(**dict(BUDGET, max_soft_tokens=140))
  (tmp_path / "nested" / "processor_config.json").write_text(json.dumps(
      {"image_processor": processor.to_dict(), "processor_class": "Gemma4Processor"}))
  directory = str(tmp_path / "nested")
  theirs = transformers.AutoImageProcessor.from_pretrained(directory).max_soft_tokens
  config = gj.hf.load_config(directory)
  assert config.model.vision.max_soft_tokens == theirs == 140
  _, params = loaded(True)
  config.model.vision.max_soft_tokens = 280
  gj.hf.save(directory, config, params, overwrite=True)   # transformers' directory, not ours
  assert transformers.AutoImageProcessor.from_pretrained(directory).max_soft_tokens == 280
  assert json.loads((tmp_path / "nested" / "processor_config.json").read_text())[
      "processor_class"] == "Gemma4Processor"


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_logits_match_transformers(scan):
  """Two images in row 0, one in row 1 (its second image slot empty), three aspect
  ratios; 9 text layers with per-layer inputs and 3 shared key/value layers."""
  tokens, images = prompts()
  counts = images.num_soft_tokens(2)
  np.testing.assert_array_equal(
      counts[[0, 0, 1], [0, 1, 0]], reference()[2]["num_soft_tokens_per_image"])
  assert counts[1, 1] == 0 and len(set(counts[[0, 0, 1], [0, 1, 0]])) == 3
  # transformers in float64 is the reference: in float32 its own rounding (7e-5 here) is
  # as large as ours (2e-5 against float64).
  expected, theirs32 = torch_logits(tokens, torch.float64), torch_logits(tokens)
  config, params = loaded(scan)
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(tokens), images=images))
  diff = np.abs(ours - expected).max()
  print(f"scan={scan}: tokens {tokens.shape}, soft tokens {counts.tolist()}, max |logit diff| "
        f"{diff:.2e} (float32 transformers: {np.abs(ours - theirs32).max():.2e}; its own "
        f"float32 error {np.abs(theirs32 - expected).max():.2e}), max |logit| "
        f"{np.abs(expected).max():.2f}")
  assert np.abs(expected).max() > 1.0
  assert diff <= 1e-4


def test_images_change_the_logits_after_them():
  """Guards the parity test: other pixels change the logits of the rows' last tokens."""
  tokens, images = prompts()
  config, params = loaded(True)
  apply = gj.transform(config).apply
  other = gemma4_images.ImagePatches(1.0 - images.patches, images.positions)
  a = np.asarray(apply(params, jnp.asarray(tokens), images=images))
  b = np.asarray(apply(params, jnp.asarray(tokens), images=other))
  assert np.abs(a - b)[:, -1].max(axis=-1).min() > 1e-2   # the last token of each row


def test_save_round_trips_through_transformers(tmp_path):
  model, path, _ = reference()
  config, params = loaded(True)
  gj.hf.save(str(tmp_path), config, params)
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["architectures"] == ["Gemma4ForConditionalGeneration"]
  back = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  theirs, ours = model.state_dict(), back.state_dict()
  assert set(ours) == set(theirs)
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name].numpy(), value.numpy(), err_msg=name)
  again, _ = gj.hf.load(str(tmp_path))
  assert again.model.to_dict() == dict(config.model.to_dict(), name=again.model.name)


def test_audio_is_refused_unless_skipped(tmp_path):
  _, path, _ = reference()
  with open(f"{path}/config.json") as f:
    hf = json.load(f)
  hf["audio_config"] = transformers.Gemma4AudioConfig().to_dict()
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(gj.hf.CheckpointError, match="audio_config: Gemma 4's audio tower is "
                     "not read yet"):
    gj.hf.load_config(str(tmp_path))
  assert gj.hf.load_config(str(tmp_path), skip_audio=True).model.vision.enabled


NEW = 12


@pytest.mark.slow
def test_greedy_decoding_with_images_equals_transformers_generate():
  """Prefill with two images (row 0) and one (row 1), then 12 greedy tokens: the rows
  run past the 40-token window; each equals transformers' generate of that row alone."""
  tokens, images = prompts()
  config, params = loaded(True)
  lengths = np.array([tokens.shape[1], tokens.shape[1] - 3], np.int32)
  tokens = tokens * (np.arange(tokens.shape[1]) < lengths[:, None])
  ours = np.asarray(sampler.generate(
      decoding.make_decoding(config), params, tokens, lengths, jax.random.key(0),
      np.zeros((0,), np.int32), images, max_new_tokens=NEW,
      cache_length=tokens.shape[1] + NEW, cache_dtype="float32"))
  model, _, flat = reference()
  first = [0, 2]                            # row b's images in the flat processor output
  for b, length in enumerate(lengths):
    ids = tokens[b:b + 1, :length]
    pick = slice(first[b], first[b] + (2 if b == 0 else 1))
    with torch.no_grad():
      theirs = model.generate(
          input_ids=torch.as_tensor(ids), pixel_values=torch.as_tensor(flat["pixel_values"][pick]),
          image_position_ids=torch.as_tensor(flat["image_position_ids"][pick]),
          mm_token_type_ids=torch.as_tensor((ids == IMAGE).astype(np.int64)),
          do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(ours[b], theirs[0, length:].numpy())
  assert config.model.sliding_window < lengths.min()


def test_image_spans_are_bidirectional_in_local_layers_only():
  config = gj.get_config("gemma4-tiny-vision").model
  image = config.vision.image_token_id
  tokens = np.array([[1, 508, image, image, image, 509, 3, 508, image, image, 509, 5]])
  spans = vision.image_span_ids(jnp.asarray(tokens), image)
  masks = decoder.layer_masks(config, jnp.ones_like(jnp.asarray(tokens)), spans)
  first, second = range(2, 5), range(8, 10)
  local, full = np.asarray(masks["local"][0]), np.asarray(masks["global"][0])
  assert all(local[q, k] for q in first for k in first)   # an image sees all of itself
  assert not any(local[q, k] for q in first for k in second)
  assert not local[1, 2] and not local[2, 5]             # markers are text: causal
  assert not any(full[q, k] for q in first for k in first if k > q)   # global: causal
  small = gj.get_config("gemma4-e2b-tiny").model
  assert small.bidirectional_span_types == ()            # the small models: causal


@pytest.mark.slow
@pytest.mark.parametrize("size", ["e2b", "e4b"])
def test_vision_preset_parameter_counts_match_transformers(size):
  """The small models' text (test_gemma4_small's shapes) plus transformers' default
  tower and embedder."""
  text = dict(HF_SHAPES[f"gemma4-{size}"], vocab_size=262_144, head_dim=256,
              global_head_dim=512, hidden_size_per_layer_input=256,
              vocab_size_per_layer_input=262_144, sliding_window=512)
  hf_config = transformers.Gemma4Config(
      text_config=text, vision_config=transformers.Gemma4VisionConfig().to_dict(),
      audio_config=None)
  with torch.device("meta"):
    model = transformers.Gemma4ForConditionalGeneration(hf_config)
  theirs = (sum(p.numel() for p in model.parameters())
            + sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar")))
  for scan_layers in (True, False):
    config = gj.get_config(f"gemma4-{size}-vision")
    config.model.scan_layers = scan_layers
    shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 8), np.int32))
    assert sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(shapes)) == theirs
  gj.hf.config_to_hf(gj.get_config(f"gemma4-{size}-vision"))   # transformers reads it alike


@functools.lru_cache(maxsize=None)
def tiny_model(**vision_fields):
  config = gj.get_config("gemma4-tiny-vision")
  config.model.vision.update(vision_fields)
  model = gj.transform(config)
  return config, model, model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))


def tiny_prompts(config, text, images):
  rows, patches = gemma4_images.prompts_with_images(text, images, config.model.vision)
  return jnp.asarray(np.stack(rows)), patches


def test_bad_image_inputs_are_named():
  config, model, params = tiny_model()
  image = config.model.vision.image_token_id
  picture = generated_image(16, 16, seed=0)        # resized to the budget: 16 soft tokens
  tokens, patches = tiny_prompts(config, [[2, image, 7]], [[picture]])
  with pytest.raises(ValueError, match="tokens row 0 holds 1 image placeholder spans but 0 "
                     "images were given"):
    model.apply(params, tokens)
  with pytest.raises(ValueError, match=r"span 0 holds 15 image_token_id ids, but image 0 "
                     r"of the row gives 16 soft tokens"):
    model.apply(params, tokens.at[0, 2].set(5), images=patches)
  text, _ = tiny_prompts(config, [[2, 6, 7]], [[]])
  with pytest.raises(ValueError, match="image 0 is no padding: images without markers"):
    model.apply(params, text, images=patches)
  with pytest.raises(ValueError, match="gemma4_images.ImagePatches"):
    model.apply(params, tokens, images=patches.patches)
  with pytest.raises(ValueError, match=r"images.patches must be \[batch=1, images, patches "
                     r"\(a multiple of 4\), 48\]"):
    model.apply(params, tokens, images=gemma4_images.ImagePatches(
        patches.patches[..., :47], patches.positions))
  with pytest.raises(ValueError, match="prompt 0 holds 1 image markers"):
    tiny_prompts(config, [[2, image, 7]], [[picture, picture]])
  # Values the tower would embed silently: unscaled pixels, NaN, positions that are no
  # integers or lie past the table (they had given garbage, or an error from inside).
  size = config.model.vision.position_embedding_size
  patches = jax.tree.map(jnp.asarray, patches)
  for bad, message in [
      (patches._replace(patches=patches.patches * 255), r"images.patches row 0, image 0 "
       r"holds values in \[0, 2\d\d\], where \[0, 1\] is expected"),
      (patches._replace(patches=patches.patches.at[0, 0, 0, 0].set(jnp.nan)),
       r"holds values in \[0, 1\] and NaN or inf"),
      (patches._replace(positions=patches.positions.astype(jnp.float32)),
       "images.positions must hold integer columns and rows, got dtype float32"),
      (patches._replace(positions=patches.positions.at[0, 0, 0, 0].set(size)),
       rf"images.positions row 0, image 0 holds values in \[-?\d, {size}\], where \[-1, "
       rf"{size - 1}\] is expected")]:
    with pytest.raises(ValueError, match=message):
      model.apply(params, tokens, images=bad)


def test_config_fields_of_the_tower_are_checked():
  config = gj.get_config("gemma4-tiny-vision")
  config.model.vision.num_kv_heads = 3
  with pytest.raises(gj.config.ConfigError, match="vision.num_kv_heads"):
    gj.config.validate(config)
  config = gj.get_config("gemma4-tiny-vision")
  config.model.vision.head_dim = 18                 # the 2-D RoPE's halves rotate in pairs
  with pytest.raises(gj.config.ConfigError, match="vision.head_dim: the 2-D RoPE"):
    gj.config.validate(config)


@pytest.mark.slow
def test_training_on_generated_images_keeps_the_constants():
  """AdamW with weight decay (the preset's exclusions) on rows whose text after each
  image names its brightness: the loss falls, the tower learns, and its clip bounds
  (+-inf) and standardize statistics stay as they were (decay would make them NaN)."""
  config, model, params = tiny_model(use_clipped_linears=True, standardize=True)
  v = config.model.vision
  rng = np.random.RandomState(0)
  bright = rng.randint(0, 2, size=(8, 2))
  images = [[np.full((16, 24, 3), 200 if c else 40, np.uint8) + rng.randint(0, 20, (16, 24, 3))
             .astype(np.uint8) for c in row] for row in bright]
  text = [[2, v.image_token_id, 100 + c[0], 7, v.image_token_id, 100 + c[1]] for c in bright]
  tokens, patches = tiny_prompts(config, text, images)
  tokens = np.asarray(tokens)
  optimizer = optax.adamw(3e-3, weight_decay=0.1,
                          mask=optimizer_lib.decay_mask(config.optimizer.no_decay))
  after, losses = train_on_images(model, params, tokens, patches,
                                  (tokens[:, 1:] >= 100) & (tokens[:, 1:] < 102), optimizer, 10)
  assert losses[-1] < 0.5 * losses[0], losses
  layer = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), params["vision"],
                       after["vision"])
  assert layer["projector"]["kernel"] > 0 and layer["encoder"]["patch_embed"]["kernel"] > 0
  clip = after["vision"]["encoder"]["layers"]["attn"]["q_clip"]
  assert np.all(np.asarray(clip["input_min"]) == -np.inf)
  np.testing.assert_array_equal(after["vision"]["standardize"]["scale"], 1.0)
