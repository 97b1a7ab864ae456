"""The Gemma 3 image model against transformers' Gemma3ForConditionalGeneration: logits with
one and two images per row, the bidirectional image mask, checkpoints both ways, preset
parameter counts, input errors, the default targets, and training on generated images."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import decoder
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.models.gemma3 import vision
from gemma_jax.training import steps

VOCAB, BOI, EOI, IMAGE = 300, 290, 291, 292
M, S = 4, 56                     # soft tokens per image, image side


def checkpoint(tmp_dir):
  """A tiny random Gemma3ForConditionalGeneration saved in `tmp_dir`: 7 text layers (one
  scanned period and one more), a 3-layer SigLIP tower; every weight perturbed."""
  torch.manual_seed(0)
  config = transformers.Gemma3Config(
      text_config=dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                       num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, sliding_window=6, query_pre_attn_scalar=16),
      vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                         num_attention_heads=4, image_size=S, patch_size=14,
                         vision_use_head=False),
      mm_tokens_per_image=M, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
  model = transformers.Gemma3ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(tmp_dir)
  return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gemma3_mm"))
  return checkpoint(path), path


def image_row(rng, length, image_starts):
  """Text ids with an image span (boi, M placeholders, eoi) at each start."""
  row = rng.randint(0, BOI, size=length)
  for start in image_starts:
    row[start:start + M + 2] = [BOI] + [IMAGE] * M + [EOI]
  return row


def torch_logits(model, tokens, pixels_per_row):
  """transformers' logits; the images of all rows flattened in order, NCHW."""
  pixels = np.concatenate([p.transpose(0, 3, 1, 2) for p in pixels_per_row])
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(tokens), pixel_values=torch.as_tensor(pixels),
                token_type_ids=torch.as_tensor((tokens == IMAGE).astype(np.int64)))
  return out.logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("images_per_row", [1, 2])
def test_logits_match_transformers(reference, images_per_row):
  model, path = reference
  rng = np.random.RandomState(images_per_row)
  starts = {1: [[3], [10]], 2: [[1, 12], [8]]}[images_per_row]    # row 1 of 2: one padding
  tokens = np.stack([image_row(rng, 22, s) for s in starts])
  pixels = rng.uniform(-1, 1, (2, images_per_row, S, S, 3)).astype(np.float32)
  theirs = torch_logits(model, tokens, [pixels[b, :len(s)] for b, s in enumerate(starts)])
  for scan in (True, False):
    config, params = gj.hf.load(path, scan_layers=scan)
    assert config.model.vision.enabled
    ours = gj.transform(config).apply(params, jnp.asarray(tokens), images=jnp.asarray(pixels))
    diff = np.abs(np.asarray(ours) - theirs).max()
    print(f"images_per_row={images_per_row} scan={scan}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4


def test_save_round_trips_through_transformers(reference, tmp_path):
  model, path = reference
  config, params = gj.hf.load(path)
  gj.hf.save(str(tmp_path), config, params)
  back = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  theirs, ours = model.state_dict(), back.state_dict()
  assert set(ours) == set(theirs)
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name].numpy(), value.numpy(), err_msg=name)
  assert back.config.mm_tokens_per_image == M and back.config.image_token_id == IMAGE
  config2, _ = gj.hf.load(str(tmp_path))
  assert config2.model.to_dict() == config.model.to_dict()


def test_image_mask_is_bidirectional_within_each_image():
  config = gj.get_config("gemma3-tiny-vision").model
  image = config.vision.image_token_id
  tokens = np.array([[1, 2, image, image, image, image, 3, 4, image, image, image, image, 5]])
  spans = vision.image_span_ids(jnp.asarray(tokens), image)
  masks = decoder.layer_masks(config, jnp.ones_like(jnp.asarray(tokens)), spans)
  first, second = range(2, 6), range(8, 12)
  for kind, mask in masks.items():
    mask = np.asarray(mask[0])
    for q in first:
      assert all(mask[q, k] for k in first), kind           # an image sees all of itself
      assert not any(mask[q, k] for k in second), kind      # but not a later image
    assert all(mask[6, k] for k in first), kind             # text after the image sees it
    assert not any(mask[1, k] for k in first), kind         # text before it does not
    assert not mask[2, 6] and mask[6, 2], kind               # image -> later text: causal
    assert all(mask[q, k] for q in second for k in first), kind


@pytest.mark.parametrize("name,layers", [("gemma3-4b-vision", 34), ("gemma3-12b-vision", 48),
                                         ("gemma3-27b-vision", 62)])
def test_preset_parameter_counts_match_transformers(name, layers):
  """The published configs, written out independently (text as in test_presets)."""
  text = {34: dict(hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   intermediate_size=10240),
          48: dict(hidden_size=3840, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=256, intermediate_size=15360),
          62: dict(hidden_size=5376, num_attention_heads=32, num_key_value_heads=16,
                   head_dim=128, intermediate_size=21504)}[layers]
  hf_config = transformers.Gemma3Config(
      text_config=dict(text, vocab_size=262_208, num_hidden_layers=layers),
      vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                         num_attention_heads=16, image_size=896, patch_size=14,
                         vision_use_head=False), mm_tokens_per_image=256)
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.Gemma3ForConditionalGeneration(
        hf_config).parameters())
  shapes = jax.eval_shape(gj.transform(gj.get_config(name)).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), np.int32))
  assert sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(shapes)) == theirs


@functools.lru_cache(maxsize=None)
def tiny_model():
  config = gj.get_config("gemma3-tiny-vision")
  model = gj.transform(config)
  return config, model, model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))


@pytest.mark.slow
def test_bad_image_inputs_are_named():
  config, model, params = tiny_model()
  image = config.model.vision.image_token_id
  tokens = jnp.asarray([[1, 508] + [image] * 4 + [509, 7]])
  pixels = jnp.zeros((1, 1, 56, 56, 3))
  with pytest.raises(ValueError, match=r"images must be \[batch=1, images, 56, 56, 3\]"):
    model.apply(params, tokens, images=jnp.zeros((1, 1, 28, 28, 3)))
  with pytest.raises(ValueError, match="holds 1 image placeholder spans but 0 images"):
    model.apply(params, tokens)
  with pytest.raises(ValueError, match="span 0 holds 3 image_token_id ids, not "
                     "tokens_per_image=4"):
    model.apply(params, tokens.at[0, 2].set(5), images=pixels)
  # Unscaled or NaN pixels, and inputs of another type (they had given garbage logits,
  # or an AttributeError from inside).
  for bad, message in [(pixels + 200.0, r"images row 0, image 0 holds values in \[200, 200\], "
                        r"where \[-1, 1\] is expected"),
                       (pixels.at[0, 0, 3].set(jnp.nan), r"holds values in \[0, 0\] and NaN"),
                       ([np.zeros((1, 56, 56, 3))], "pixels .* got list"),
                       (gemma4_images.ImagePatches(pixels, pixels), "got ImagePatches")]:
    with pytest.raises(ValueError, match=message):
      model.apply(params, tokens, images=bad)
  text_only = gj.transform(gj.get_config("gemma3-tiny"))
  with pytest.raises(ValueError, match="vision.enabled is False"):
    text_only.apply(text_only.init(jax.random.key(0), tokens), tokens % 500, images=pixels)


def test_default_targets_skip_image_placeholders():
  """model.loss(params, tokens, images=...): the next tokens, none of them an image
  placeholder, equal to targets written out by hand with those positions at -100."""
  config, model, params = tiny_model()
  v = config.model.vision
  span = [v.boi_token_id] + [v.image_token_id] * 4 + [v.eoi_token_id]
  tokens = np.array([[1, 5] + span + [9, 7, 3], [2] + span + [8, 6, 4, 11]], np.int32)
  images = np.random.RandomState(0).uniform(-1, 1, (2, 1, 56, 56, 3)).astype(np.float32)
  targets = np.concatenate([tokens[:, 1:], np.full((2, 1), -100)], axis=1)
  targets[targets == v.image_token_id] = -100
  got = model.loss(params, jnp.asarray(tokens), images=jnp.asarray(images))
  want = model.loss(params, jnp.asarray(tokens), jnp.asarray(targets),
                    images=jnp.asarray(images))
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  assert float(got.weight) == 2 * (tokens.shape[1] - 1) - 2 * 4


def train_on_images(model, params, tokens, images, learn, optimizer, count):
  """`count` jitted training steps on rows `tokens` [B, T] with `images` (the model's
  kind), learning the next token where `learn` [B, T - 1] holds: (params after, the
  losses)."""
  inputs = tokens[:, :-1]
  batch = jax.tree.map(jnp.asarray, dict(
      tokens=inputs, targets=tokens[:, 1:], weights=np.asarray(learn, np.float32),
      positions=np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape),
      segment_ids=np.ones_like(inputs), images=images))
  state = steps.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                           jax.random.key(1))
  train_step = jax.jit(steps.make_train_step(steps.model_forward(model), optimizer,
                                             lambda step: 3e-3))
  losses = []
  for _ in range(count):
    state, metrics = train_step(state, batch)
    losses.append(float(metrics["loss"]))
  return state.params, losses


@pytest.mark.slow
def test_training_on_generated_images():
  """A few AdamW steps on rows whose text after each image names its colour: the loss
  falls, and the tower's parameters receive gradients."""
  config, model, params = tiny_model()
  v = config.model.vision
  rng = np.random.RandomState(0)
  colours = rng.randint(0, 2, size=(8, 2))                       # [B, I]: dark or light
  images = np.where(colours[..., None, None, None], 0.8, -0.8) + rng.normal(
      0, 0.1, (8, 2, 56, 56, 3))
  span = [v.boi_token_id] + [v.image_token_id] * 4 + [v.eoi_token_id]
  tokens = np.stack([[1] + span + [100 + c[0], 7] + span + [100 + c[1], 2] for c in colours])
  params_after, losses = train_on_images(model, params, tokens, images.astype(np.float32),
                                         (tokens[:, 1:] >= 100), optax.adam(3e-3), 8)
  assert losses[-1] < 0.5 * losses[0], losses
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), params["vision"],
                       params_after["vision"])
  assert min(jax.tree_util.tree_leaves(moved)) > 0
