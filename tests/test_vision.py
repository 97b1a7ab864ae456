"""Gemma 3's vision tower and image inputs against transformers (PyTorch) and Pillow:
soft tokens, scan vs unrolled, remat, gradients, the weight mapping, preprocessing,
placeholder spans and the merge helpers."""

import functools
import os
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
from absl.testing import parameterized
from ml_collections import config_dict
from PIL import Image
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

import gemma_jax as gj
from gemma_jax import decoder
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.checkpoints import gemma3_tower
from gemma_jax.models.gemma3 import images as image_inputs
from gemma_jax import remat
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.config import ConfigError, vision_config
from gemma_jax.inference import sampler
from gemma_jax.layers.attention import Attention
from gemma_jax.models import towers
from gemma_jax.text import tokenizers
from gemma_jax.models.gemma3 import vision

TEXT_WIDTH = 48
VISION = dict(image_size=56, patch_size=14, width=32, num_layers=3, num_heads=4, mlp_dim=40,
              tokens_per_image=4)      # 4 x 4 patches pooled 2 x 2
BOI, EOI, IMAGE = 290, 291, 292


def tiny_config():
  c = vision_config()
  c.update(dict(VISION, enabled=True))
  return c


@functools.lru_cache(maxsize=None)
def reference():
  """A tiny transformers Gemma 3 with random vision weights (norms and projector included),
  three images and its vision outputs: (model, pixels NCHW, encoder output, soft tokens)."""
  torch.manual_seed(0)
  config = transformers.Gemma3Config(
      vision_config=dict(hidden_size=VISION["width"], intermediate_size=VISION["mlp_dim"],
                         num_hidden_layers=VISION["num_layers"],
                         num_attention_heads=VISION["num_heads"],
                         image_size=VISION["image_size"], patch_size=VISION["patch_size"],
                         vision_use_head=False),
      text_config=dict(vocab_size=300, hidden_size=TEXT_WIDTH, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16),
      mm_tokens_per_image=VISION["tokens_per_image"], boi_token_index=BOI,
      eoi_token_index=EOI, image_token_index=IMAGE)
  model = transformers.Gemma3ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "vision_tower" in name or "multi_modal_projector" in name:
        p.normal_(0.0, 0.2 if name.endswith("weight") and p.ndim > 1 else 0.5)
  pixels = torch.randn(3, 3, VISION["image_size"], VISION["image_size"])
  with torch.no_grad():
    out = model.model.get_image_features(pixels)
  return model, pixels, out.last_hidden_state.numpy(), out.pooler_output.numpy()


def nhwc(pixels):
  return jnp.asarray(pixels.numpy().transpose(0, 2, 3, 1))


@functools.lru_cache(maxsize=None)
def loaded(scan=True):
  """The reference model through save_pretrained and hf.load: (config, tower parameters)."""
  with tempfile.TemporaryDirectory() as path:
    reference()[0].save_pretrained(path)
    config, params = gj.hf.load(path, scan_layers=scan)
    return config, jax.tree.map(np.array, params["vision"])   # copied out of the mapped file


def our_params(scan=True):
  return {"params": loaded(scan)[1]}


def by_canonical_name(state):
  """{any transformers layout name: tensor} -> {canonical name: numpy array} (vision only)."""
  return {gemma3_tower.LAYOUT.canonical_name(k): np.asarray(v) for k, v in state.items()
          if gemma3_tower.LAYOUT.canonical_name(k)}


def ours_by_canonical_name(params):
  """Our scanned tower parameters (or their gradients) -> {canonical name: numpy array},
  as hf.save writes them."""
  unrolled = decoder.unstack_layers({"vision": params}, loaded()[0].model)["vision"]
  flat = flax.traverse_util.flatten_dict(unrolled)
  return by_canonical_name(dict(gemma3_tower.LAYOUT.to_hf(np.asarray(value), path)
                                for path, value in flat.items()))


class VisionTowerTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("scanned", True), ("unrolled", False))
  def test_matches_transformers(self, scan):
    _, pixels, ref_features, ref_tokens = reference()
    tower = vision.VisionTower(tiny_config(), out_width=TEXT_WIDTH, scan_layers=scan)
    encoder = vision.VisionEncoder(tiny_config(), scan_layers=scan)
    params = our_params(scan)
    tokens = self.variant(tower.apply)(params, nhwc(pixels))
    features = self.variant(encoder.apply)({"params": params["params"]["encoder"]},
                                           nhwc(pixels))
    chex.assert_shape(tokens, (3, 4, TEXT_WIDTH))
    chex.assert_shape(features, (3, 16, VISION["width"]))
    np.testing.assert_allclose(features, ref_features, rtol=0, atol=1e-5)
    np.testing.assert_allclose(tokens, ref_tokens, rtol=0, atol=1e-5)

  def test_jax_attention_kernel_matches_transformers(self):
    _, pixels, _, ref_tokens = reference()
    tower = vision.VisionTower(tiny_config(), out_width=TEXT_WIDTH, attention_kernel="jax")
    tokens = jax.jit(tower.apply)(our_params(), nhwc(pixels))
    np.testing.assert_allclose(tokens, ref_tokens, rtol=0, atol=1e-5)

  def test_scanned_equals_unrolled_and_keeps_leading_dims(self):
    _, pixels, _, ref_tokens = reference()
    outs = {}
    for scan in (True, False):
      tower = vision.VisionTower(tiny_config(), out_width=TEXT_WIDTH, scan_layers=scan)
      images = nhwc(pixels)[None]                                   # [B=1, I=3, S, S, C]
      outs[scan] = jax.jit(tower.apply)(our_params(scan), images)
      chex.assert_shape(outs[scan], (1, 3, 4, TEXT_WIDTH))
    chex.assert_trees_all_close(outs[True], outs[False], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[True][0], ref_tokens, rtol=0, atol=1e-5)

  @pytest.mark.slow
  def test_init_layout_and_logical_axes(self):
    boxed = vision.VisionTower(tiny_config(), out_width=TEXT_WIDTH).init(jax.random.key(0),
                                                               jnp.zeros((1, 56, 56, 3)))
    specs = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed["params"]))
    shapes = flax.traverse_util.flatten_dict(nn.meta.unbox(boxed["params"]))
    # Same shapes as the parameters converted from transformers.
    converted = flax.traverse_util.flatten_dict(our_params()["params"])
    self.assertEqual({k: v.shape for k, v in shapes.items()},
                     {k: v.shape for k, v in converted.items()})
    known = {"batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
             "expert", "layers", "norm", None}
    for path, spec in specs.items():
      self.assertEqual(len(spec), shapes[path].ndim, path)
      self.assertLessEqual(set(spec), known, path)
      if path[:2] == ("encoder", "layers"):
        self.assertEqual(spec[0], "layers", path)
    self.assertEqual(tuple(specs[("encoder", "layers", "attn", "q", "kernel")]),
                     ("layers", "embed", "heads", "head_dim"))


def test_model_attention_kernel_reaches_every_attention():
  """config.model.attention_kernel is the kernel of the text layers and of the tower."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.attention_kernel = "jax"
  kernels = {}

  def record(call, args, kwargs, context):
    if isinstance(context.module, Attention) and context.method_name == "__call__":
      kernels[context.module.path] = context.module.kernel
    return call(*args, **kwargs)

  with nn.intercept_methods(record):
    gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert any(path[0] == "vision" for path in kernels), kernels
  assert any(path[0] != "vision" for path in kernels), kernels
  assert set(kernels.values()) == {"jax"}, kernels


def test_stack_inverts_unstack_with_the_tower():
  """decoder.stack_layers / unstack_layers convert the tower's layers too: device arrays
  stacked on the device, host arrays on the host."""
  config = gj.get_config("gemma3-tiny-vision")
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  flat = decoder.unstack_layers(params, config.model)
  encoder = flat["vision"]["encoder"]
  assert "layers" not in encoder
  assert {f"layers_{i}" for i in range(config.model.vision.num_layers)} <= set(encoder)
  chex.assert_trees_all_equal(decoder.stack_layers(flat, config.model), params)
  on_host = decoder.stack_layers(jax.tree.map(np.asarray, flat), config.model)
  assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(on_host))
  assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(
      decoder.stack_layers(flat, config.model)))


def torch_grads(cotangent):
  """d<soft tokens, cotangent>/d(pixels, vision weights) by torch autograd."""
  model, pixels, _, _ = reference()
  pixels = pixels.clone().requires_grad_(True)
  model.zero_grad()
  out = model.model.get_image_features(pixels).pooler_output
  (out * torch.as_tensor(cotangent)).sum().backward()
  grads = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
  return pixels.grad.numpy(), grads


@functools.lru_cache(maxsize=None)
def remat_reference():
  """Loss, pixel and parameter gradients without remat (scanned)."""
  cotangent = np.random.RandomState(1).randn(3, 4, TEXT_WIDTH).astype(np.float32)
  pixels = nhwc(reference()[1])
  params = our_params()
  return cotangent, pixels, params, jax.jit(jax.value_and_grad(
      loss_fn("none", cotangent), argnums=(0, 1)))(params, pixels)


def loss_fn(remat_policy, cotangent):
  tower = vision.VisionTower(tiny_config(), out_width=TEXT_WIDTH, remat_policy=remat_policy)
  return lambda params, pixels: jnp.sum(tower.apply(params, pixels) * cotangent)


def test_gradients_match_torch_autograd():
  cotangent, _, _, (_, (grads, pixel_grads)) = remat_reference()
  torch_pixel_grads, torch_param_grads = torch_grads(cotangent)
  np.testing.assert_allclose(pixel_grads, torch_pixel_grads.transpose(0, 2, 3, 1), rtol=0,
                             atol=1e-5)
  ours = ours_by_canonical_name(grads["params"])
  theirs = by_canonical_name(torch_param_grads)
  assert set(ours) == set(theirs)
  for name, value in ours.items():
    scale = max(1.0, np.abs(theirs[name]).max())
    np.testing.assert_allclose(value, theirs[name], rtol=0, atol=1e-5 * scale, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(p for p in remat.POLICIES if p != "none"))
def test_remat_policy_keeps_output_and_grads(policy):
  cotangent, pixels, params, (loss, grads) = remat_reference()
  remat_loss, remat_grads = jax.jit(jax.value_and_grad(
      loss_fn(policy, cotangent), argnums=(0, 1)))(params, pixels)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  chex.assert_trees_all_close(remat_grads, grads, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- mapping


def layouts():
  """The reference model's tensors as transformers 5 holds them in memory, as it saves them,
  and as transformers 4 and the published checkpoints store them."""
  state = {k: v.numpy() for k, v in reference()[0].state_dict().items()}
  renames = {"saved": {"model.vision_tower.": "vision_tower.",
                       "model.multi_modal_projector.": "multi_modal_projector.",
                       "model.language_model.": "language_model.model."},
             "transformers4": {"model.vision_tower.": "vision_tower.vision_model.",
                               "model.multi_modal_projector.": "multi_modal_projector.",
                               "model.language_model.": "language_model.model."}}
  rename = lambda name, prefixes: next(
      (new + name[len(old):] for old, new in prefixes.items() if name.startswith(old)), name)
  return dict({layout: {rename(k, prefixes): v for k, v in state.items()}
               for layout, prefixes in renames.items()}, in_memory=state)


def write_checkpoint(path, tensors):
  """The reference model's config.json and `tensors` as model.safetensors in `path`."""
  os.makedirs(path, exist_ok=True)
  reference()[0].config.to_json_file(os.path.join(path, "config.json"))
  safetensors_io.write(os.path.join(path, "model.safetensors"),
                       {k: np.ascontiguousarray(v) for k, v in tensors.items()})


@pytest.mark.parametrize("layout", ["in_memory", "saved", "transformers4"])
def test_load_and_save_map_every_layout(layout, tmp_path):
  tensors = layouts()[layout]
  expected = by_canonical_name(tensors)
  published = {k for k in layouts()["transformers4"] if k.startswith(
      ("vision_tower.vision_model.", "multi_modal_projector."))}
  write_checkpoint(tmp_path / "in", tensors)
  for scan in (True, False):
    config, params = gj.hf.load(str(tmp_path / "in"), scan_layers=scan)
    gj.hf.save(str(tmp_path / "out"), config, params)
    saved = safetensors_io.read(str(tmp_path / "out" / "model.safetensors"))
    # Written in the published layout, whatever was read.
    assert {k for k in saved if gemma3_tower.LAYOUT.canonical_name(k)} == published
    got = by_canonical_name(saved)
    assert set(got) == set(expected)
    for name, value in got.items():
      np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_every_parameter_is_stored_in_param_dtype(tmp_path):
  """init under param_dtype=bfloat16 gives the tree (names, shapes, dtypes) that
  hf.load(param_dtype="bfloat16") gives: every leaf bfloat16, the tower's norms too."""
  write_checkpoint(tmp_path / "in", layouts()["in_memory"])
  config, loaded = gj.hf.load(str(tmp_path / "in"), param_dtype="bfloat16")
  assert config.model.param_dtype == "bfloat16"
  initialised = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  chex.assert_trees_all_equal_shapes_and_dtypes(initialised, loaded)
  assert {leaf.dtype for leaf in jax.tree.leaves(initialised)} == {jnp.dtype("bfloat16")}


def test_load_names_missing_and_misshapen_vision_tensors(tmp_path):
  state = layouts()["in_memory"]
  name = "model.vision_tower.encoder.layers.1.mlp.fc2.weight"
  write_checkpoint(tmp_path / "missing", {k: v for k, v in state.items() if k != name})
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"missing tensors: \['vision_tower.encoder.layers.1.mlp.fc2.weight'\]"):
    gj.hf.load(str(tmp_path / "missing"))
  write_checkpoint(tmp_path / "misshapen", dict(state, **{name: state[name][:, :-1]}))
  with pytest.raises(gj.hf.CheckpointError,
                     match=r"shape mismatches: \['vision_tower.encoder.layers.1.mlp.fc2.weight: "):
    gj.hf.load(str(tmp_path / "misshapen"))


def test_default_config_counts_as_transformers_gemma3_4b():
  """vision_config()'s defaults: SigLIP-So400m at 896 px and the 4B projector."""
  c = vision_config()
  hf = transformers.SiglipVisionConfig(
      hidden_size=c.width, intermediate_size=c.mlp_dim, num_hidden_layers=c.num_layers,
      num_attention_heads=c.num_heads, image_size=c.image_size, patch_size=c.patch_size,
      layer_norm_eps=c.layer_norm_eps, vision_use_head=False)
  with torch.device("meta"):
    tower = transformers.SiglipVisionModel(hf)
    projector = modeling_gemma3.Gemma3MultiModalProjector(transformers.Gemma3Config(
        vision_config=hf.to_dict(), text_config=dict(hidden_size=2560),
        mm_tokens_per_image=c.tokens_per_image))
  expected = sum(p.numel() for m in (tower, projector) for p in m.parameters())
  pixels = jax.ShapeDtypeStruct((1, c.image_size, c.image_size, c.num_channels), jnp.float32)
  shapes = nn.meta.unbox(jax.eval_shape(vision.VisionTower(c, out_width=2560).init,
                                        jax.random.key(0), pixels))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes)) == expected == 419_816_304
  assert projector.kernel_size == 4 and c.width // c.num_heads == 72
  hf_ids = transformers.Gemma3Config()
  assert (c.boi_token_id, c.eoi_token_id, c.image_token_id) == (
      hf_ids.boi_token_id, hf_ids.eoi_token_id, hf_ids.image_token_id)


@pytest.mark.parametrize("field,value", [
    ("patch_size", 15), ("num_heads", 5), ("tokens_per_image", 255),
    ("tokens_per_image", 49), ("tokens_per_image", 256), ("activation", "swish"),
    ("layer_norm_eps", 0.0), ("eoi_token_id", 508), ("image_token_id", 512),
    ("num_layers", 0),
])
def test_validate_names_the_field(field, value):
  config = gj.get_config("gemma3-tiny-vision")     # sliding_window 64, vocabulary 512
  gj.validate(config)
  config.model.vision[field] = value
  with pytest.raises(ConfigError) as error:
    gj.validate(config)
  assert error.value.field == f"model.vision.{field}"
  assert str(error.value).startswith(f"config.model.vision.{field}: ")


def test_vision_needs_a_gemma_block():
  config = gj.get_config("parallel-tiny")
  config.model.vision.enabled = True
  with pytest.raises(ConfigError, match="model.vision.enabled: vision towers are Gemma 3's "
                     "and Gemma 4's"):
    gj.validate(config)


# ----------------------------------------------------------------------------- pixels


def generated_image(h, w, channels=3, seed=0):
  """Smooth gradients plus noise, uint8."""
  rng = np.random.RandomState(seed)
  y, x = np.mgrid[:h, :w]
  base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                   ((x + y) * 7) % 256, np.full_like(x, 180)], -1)[..., :channels]
  return np.clip(base + rng.randint(-30, 31, base.shape), 0, 255).astype(np.uint8)


# (90, 70) and (120, 41): the height shrinks most, so Pillow resamples it first.
@pytest.mark.parametrize("h,w,out", [(30, 41, 28), (301, 203, 56), (9, 13, 56), (56, 56, 56),
                                     (90, 70, 56), (120, 41, 28)])
def test_resize_is_pillows(h, w, out):
  image = generated_image(h, w)
  ref = np.asarray(Image.fromarray(image).resize((out, out + 3), Image.BILINEAR))
  np.testing.assert_array_equal(image_inputs.resize_bilinear(image, out + 3, out), ref)
  floats = np.random.RandomState(h).rand(h, w, 3).astype(np.float32)
  ref = np.stack([np.asarray(Image.fromarray(floats[..., i], mode="F").resize(
      (out, out + 3), Image.BILINEAR)) for i in range(3)], -1)
  np.testing.assert_allclose(image_inputs.resize_bilinear(floats, out + 3, out), ref, rtol=0,
                             atol=1e-6)


def image_cases(tmp_path):
  """{name: (our input, transformers' processor input)} of one image each: RGBA, grey,
  PNG and .npy files, a PIL image."""
  png = generated_image(90, 70, seed=3)
  Image.fromarray(png).save(tmp_path / "image.png")
  np.save(tmp_path / "image.npy", png)
  return {
      "rgba": (generated_image(64, 80, 4), generated_image(64, 80, 4)),
      "grey": (generated_image(50, 60)[..., 0], Image.fromarray(generated_image(50, 60)[..., 0])),
      "png_file": (str(tmp_path / "image.png"), Image.open(tmp_path / "image.png")),
      "npy_file": (str(tmp_path / "image.npy"), png),
      "pil_image": (Image.fromarray(png), Image.fromarray(png)),
  }


def test_preprocessing_matches_transformers(tmp_path):
  processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
  cases = dict(image_cases(tmp_path),
               rgb_down=(generated_image(300, 200), generated_image(300, 200)),
               rgb_up=(generated_image(20, 33), generated_image(20, 33)))
  for name, (ours_in, theirs_in) in cases.items():
    ours = image_inputs.preprocess_image(ours_in, 56)
    theirs = processor(images=theirs_in, return_tensors="np")["pixel_values"][0]
    assert ours.dtype == np.float32 and ours.shape == (56, 56, 3), name
    np.testing.assert_allclose(ours, theirs.transpose(1, 2, 0), rtol=0, atol=1e-5,
                               err_msg=name)
  png = cases["npy_file"][1]
  batch = image_inputs.preprocess_images([png, png[:40]], 56)
  chex.assert_shape(batch, (2, 56, 56, 3))


def test_float_images_resize_without_quantisation():
  floats = np.random.RandomState(0).rand(40, 30, 3)
  ours = image_inputs.preprocess_image(floats, 28)
  ref = np.stack([np.asarray(Image.fromarray(floats[..., i].astype(np.float32), mode="F")
                             .resize((28, 28), Image.BILINEAR)) for i in range(3)], -1)
  np.testing.assert_allclose(ours, (ref.astype(np.float64) - 0.5) / 0.5, rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    image_inputs.preprocess_image(floats * 2, 28)


@pytest.mark.parametrize("image", [np.zeros((0, 5, 3), np.uint8), np.zeros((4, 0), np.float32),
                                   Image.new("RGB", (0, 5))], ids=["rows", "columns", "pil"])
def test_empty_images_are_named(image):
  """An image without pixels is one error naming its size (numpy's reduction failed)."""
  for preprocess in (functools.partial(image_inputs.preprocess_image, image_size=28),
                     gemma4_images.preprocess_image):
    with pytest.raises(ValueError, match=r"the image is empty: height x width \("):
      preprocess(image)


def test_no_images_preprocess_to_an_empty_batch_of_the_same_shape():
  """numpy's stack failed on an empty list ("need at least one array to stack")."""
  image = np.zeros((30, 40, 3), np.uint8)
  for preprocess in (functools.partial(image_inputs.preprocess_images, image_size=28),
                     gemma4_images.preprocess_images):
    empty, one = preprocess([]), preprocess([image])
    for got, want in zip(jax.tree.leaves(empty), jax.tree.leaves(one)):
      assert got.shape == (0,) + want.shape[1:] and got.dtype == want.dtype


# ----------------------------------------------------------------------------- prompts


NEWLINES = {k: 4 + k for k in range(1, 6)}   # ids of "\n" * k in the tiny vocabulary


@functools.lru_cache(maxsize=None)
def tiny_processor():
  """Gemma3Processor over a tiny Gemma tokenizer whose vocabulary holds newline runs of
  1..5 (as Gemma's holds runs up to 31) and the three image tokens."""
  vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
  vocab.update({"\n" * k: i for k, i in NEWLINES.items()})
  for piece in ("a", "b", "c", "▁", ".", "<start_of_image>", "<end_of_image>",
                "<image_soft_token>"):
    vocab[piece] = len(vocab)
  # Ranked so that every run of up to 5 newlines is one piece, as in Gemma's vocabulary.
  merges = [("\n", "\n"), ("\n\n", "\n\n"), ("\n\n", "\n"), ("\n\n\n\n", "\n")]
  tokenizer = transformers.GemmaTokenizer(
      vocab=vocab, merges=merges,
      extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                            "image_token": "<image_soft_token>"})
  return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28,
                                                                        "width": 28}),
                         tokenizer=tokenizer, image_seq_length=3)


PROMPTS = ["a<start_of_image>b", "a.\n<start_of_image>b", "ab<start_of_image>\nc",
           "<start_of_image><start_of_image>", "a\n\n<start_of_image>\n<start_of_image>.",
           "a b c", "<start_of_image>"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_placeholders_match_gemma3_processor(prompt):
  processor = tiny_processor()
  tok = processor.tokenizer
  count = prompt.count("<start_of_image>")
  images = [[generated_image(30, 30)] * count] if count else None
  expected = processor(text=[prompt], images=images, return_tensors="np")
  ids = expected["input_ids"][0].tolist()
  ids_args = dict(boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
                  image_token_id=tok.image_token_id, tokens_per_image=3)
  prompt_ids = tok(prompt)["input_ids"]
  # On ids, with the vocabulary's newline runs: exactly the processor's ids.
  assert image_inputs.insert_image_placeholders(prompt_ids, newline_ids=NEWLINES,
                                                **ids_args) == ids
  # On text, then tokenized: the same.
  assert tok(image_inputs.expand_image_markers(
      prompt, 3, boi_token=tok.boi_token, eoi_token=tok.eoi_token,
      image_token=tok.image_token))["input_ids"] == ids
  # The spans transformers makes bidirectional are the runs image_span_ids numbers.
  token_type_ids = torch.as_tensor(expected["token_type_ids"])
  blocks = modeling_gemma3.get_block_sequence_ids_for_mask(token_type_ids).numpy()
  spans = np.asarray(vision.image_span_ids(jnp.asarray([ids]), tok.image_token_id))
  np.testing.assert_array_equal(spans, blocks + 1)


@pytest.mark.parametrize("prompt", [p for p in PROMPTS if "<start_of_image>" in p])
def test_sampler_prompts_match_gemma3_processor(tmp_path, prompt):
  """What `Sampler.sample(prompts, images=...)` builds (our tokenizer's ids with each
  marker's id, then `towers.prompts_with_images` with its encode) equals the processor's
  ids, newline runs next to a marker merged (the chat template's
  "user\\n<start_of_image>": the runs had stayed two tokens)."""
  processor = tiny_processor()
  tok = processor.tokenizer
  tok.save_pretrained(str(tmp_path))
  ours = tokenizers.get_tokenizer(str(tmp_path), len(tok))
  count = prompt.count("<start_of_image>")
  images = [generated_image(30, 30)] * count
  expected = processor(text=[prompt], images=[images], return_tensors="np")["input_ids"][0]
  config = gj.get_config("gemma3-tiny-vision")
  config.model.vision.update(boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
                             image_token_id=tok.image_token_id, tokens_per_image=3,
                             double_newline_token_id=NEWLINES[2], image_size=28)
  row = np.concatenate([[ours.bos_id],
                        sampler.encode_image_prompts(ours, [prompt], config.model)[0]])
  rows, _ = towers.prompts_with_images([row], [images], config.model, ours.encode)
  assert rows[0].tolist() == [ours.bos_id] + expected.tolist()   # this tokenizer adds none


def test_placeholders_without_newline_runs_use_double_newline_id():
  """With only the "\\n\\n" id (Gemma's own tools): spans not next to newlines match."""
  tok = tiny_processor().tokenizer
  for prompt in ("a<start_of_image>b", "ab c<start_of_image>"):
    ids = tiny_processor()(text=[prompt], images=[[generated_image(30, 30)]])["input_ids"][0]
    got = image_inputs.insert_image_placeholders(
        tok(prompt)["input_ids"], boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
        image_token_id=tok.image_token_id, tokens_per_image=3, newline_ids=NEWLINES[2])
    assert got == list(ids)


def test_merge_soft_tokens_is_transformers_masked_scatter():
  rng = np.random.RandomState(0)
  m, d = 3, 8
  rows = [[7, BOI] + [IMAGE] * m + [EOI, 9, BOI] + [IMAGE] * m + [EOI, 1],
          [BOI] + [IMAGE] * m + [EOI, 5, 6, 7, 8, 9, 10, 11, 12]]
  tokens = np.asarray(rows)
  embeddings = rng.randn(2, tokens.shape[1], d).astype(np.float32)
  soft = rng.randn(2, 2, m, d).astype(np.float32)        # row 1's second image is padding
  used = np.concatenate([soft[0, 0], soft[0, 1], soft[1, 0]])
  mask = torch.as_tensor(tokens == IMAGE)[..., None].expand(-1, -1, d)
  expected = torch.as_tensor(embeddings).masked_scatter(mask, torch.as_tensor(used)).numpy()
  got = jax.jit(vision.merge_soft_tokens, static_argnums=3)(
      jnp.asarray(embeddings), jnp.asarray(tokens), jnp.asarray(soft), IMAGE)
  np.testing.assert_array_equal(got, expected)


class ShiftInADropoutDraw(nn.Module):
  """An encoder layer: x [N, 2] -> [x[:, 1], a uniform draw from its dropout stream]."""
  config: config_dict.ConfigDict
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  attention_kernel: str

  @nn.compact
  def __call__(self, x):
    return jnp.stack([x[:, 1], jax.random.uniform(self.make_rng("dropout"), x.shape[:1])],
                     -1), None


class DrawingEncoder(vision.TowerModule):

  @nn.compact
  def __call__(self, x):
    return vision.encoder_layers(self, ShiftInADropoutDraw, x)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_each_encoder_layer_draws_its_own_dropout(scan_layers):
  """Two layers leave their draws side by side: equal, they would drop the same features
  in every layer (LoRA's dropout on a vision tower did so with the layers scanned)."""
  encoder = DrawingEncoder(config_dict.ConfigDict(dict(num_layers=2)), scan_layers=scan_layers)
  x = jnp.zeros((4, 2))
  variables = encoder.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, x)
  draws = encoder.apply(variables, x, rngs={"dropout": jax.random.key(1)})
  assert np.all(draws[:, 0] != draws[:, 1])
