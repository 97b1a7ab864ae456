"""experiments/sample.py end to end: from a transformers directory with a SentencePiece
tokenizer, and from a training workdir's checkpoint; greedy text against references
that share no decoding code with it."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece
import torch
from PIL import Image

import gemma_jax as gj
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.models.gemma3 import images as image_inputs
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.training import checkpoints, optimizer, steps
from gemma_jax.text import tokenizers
from test_hf import random_model

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
NEW = 6


def sample_app(*flags):
  """stdout of sample.py with greedy decoding; fails on a non-zero exit."""
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "sample.py"), "--temperature=0",
       f"--max_new_tokens={NEW}", *flags], capture_output=True, text=True, timeout=300,
      env=dict(os.environ, XLA_FLAGS=""), check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def sample_app_error(*flags):
  """The one line sample.py prints to stderr when it refuses its flags."""
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "sample.py"), *flags],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""),
      check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_cache_dtype_that_is_no_cache_dtype_is_one_error_line(tmp_path):
  """Not a dtype (jnp.dtype raised TypeError, a traceback), or neither float nor int8."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=8)
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  gj.hf.save(str(tmp_path / "hf"), config,
             jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
  for dtype in ("foo", "int4"):
    line = sample_app_error(f"--hf_dir={tmp_path / 'hf'}", "--tokenizer=byte",
                            f"--cache_dtype={dtype}")
    assert line == (f"sample.py: error: --cache_dtype: {dtype!r} is not one of "
                    "float32, bfloat16, float16, int8")
  # No tokenizer among the directory's files, or a --tokenizer that is none: the flag.
  assert sample_app_error(f"--hf_dir={tmp_path / 'hf'}").startswith(
      f"sample.py: error: --hf_dir (pass --tokenizer): '{tmp_path / 'hf'}' is a directory "
      "without tokenizer.json or tokenizer.model")
  assert sample_app_error(f"--hf_dir={tmp_path / 'hf'}", f"--tokenizer={tmp_path}").startswith(
      f"sample.py: error: --tokenizer: '{tmp_path}' is a directory without")


@pytest.mark.slow
def test_from_a_transformers_directory_with_a_sentencepiece_tokenizer(tmp_path):
  sentencepiece.SentencePieceTrainer.train(
      input=os.path.join(ROOT, "README.md"), model_prefix=str(tmp_path / "tokenizer"),
      vocab_size=100, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
  model = random_model(5, num_hidden_layers=2, num_key_value_heads=2, sliding_window=3)
  model.save_pretrained(str(tmp_path / "hf"))
  tokenizer = tokenizers.SentencePieceTokenizer(str(tmp_path / "tokenizer.model"))
  prompt = "Sampling with caches"
  ids = [tokenizer.bos_id, *tokenizer.encode([prompt])[0]]
  with torch.no_grad():
    out = model.generate(torch.as_tensor([ids]), do_sample=False, max_new_tokens=NEW,
                         eos_token_id=tokenizer.eos_id, pad_token_id=0)[0, len(ids):].tolist()
  expected = prompt + tokenizer.decode([i for i in out if i != tokenizer.eos_id])
  stdout = sample_app(f"--hf_dir={tmp_path / 'hf'}", f"--tokenizer={tmp_path / 'tokenizer.model'}",
                      f"--prompt={prompt}")
  assert stdout.startswith(expected + "\n")
  assert "tokens/s" in stdout.splitlines()[-1]


@pytest.mark.slow
def test_from_a_training_workdir(tmp_path):
  overrides = dict(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16,
                   mlp_dim=64, sliding_window=3, attention_pattern=("local", "global"))
  config = gj.get_config("gemma3-tiny")
  config.model.update(overrides)
  model = gj.transform(config)
  tx = optimizer.make_optimizer(
      config.optimizer, optimizer.learning_rate_schedule(config.optimizer, config.train.steps))
  rng = np.random.RandomState(0)
  state = jax.tree.map(
      lambda s: (jax.random.key(0) if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)
                 else jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype)),
      jax.eval_shape(lambda: steps.init_state(model, tx, config.seed, config.data.seq_len)))
  saver = checkpoints.Checkpointer(str(tmp_path / "checkpoints"), 1)
  saver.save(state, {})
  saver.wait()
  saver.close()

  # The reference: argmax over the full forward of a fixed-width row (causal, so the
  # zeros after position i do not change its logits).
  prompt = "def "
  tokenizer = tokenizers.ByteTokenizer()
  ids = [tokenizer.bos_id, *tokenizer.encode([prompt])[0]]
  row = np.zeros((1, len(ids) + NEW), np.int32)
  row[0, :len(ids)] = ids
  apply = jax.jit(model.apply)
  for i in range(len(ids), row.shape[1]):
    row[0, i] = np.argmax(apply(state.params, row)[0, i - 1])
  new = row[0, len(ids):].tolist()
  new = new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new

  # The workdir remembers its config (as train.py writes it): sample.py needs nothing else.
  config.data.tokenizer = "byte"
  workdir_lib.save_config(str(tmp_path), config)
  stdout = sample_app(f"--workdir={tmp_path}", f"--prompt={prompt}")
  assert stdout.startswith(prompt + tokenizer.decode(new) + "\n")


def prompt_with_image(config, image, ids):
  """(ids [BOS, image marker, ...] with the marker's span, the model's images), written
  from each family's preprocessing functions (not the Sampler's)."""
  v = config.model.vision
  if config.model.block_type == "gemma3":
    ids = image_inputs.insert_image_placeholders(
        ids, boi_token_id=v.boi_token_id, eoi_token_id=v.eoi_token_id,
        image_token_id=v.image_token_id, tokens_per_image=v.tokens_per_image,
        newline_ids=v.double_newline_token_id)
    return ids, jnp.asarray(image_inputs.preprocess_images([image], v.image_size)[None])
  budget = dict(patch_size=v.patch_size, pooling_kernel=v.pooling_kernel,
                max_soft_tokens=v.max_soft_tokens)
  ids = gemma4_images.insert_image_placeholders(
      ids, [gemma4_images.num_soft_tokens(*image.shape[:2], **budget)],
      image_token_id=v.image_token_id, boi_token_id=v.boi_token_id,
      eoi_token_id=v.eoi_token_id)
  patches, positions = gemma4_images.preprocess_images([image], **budget)
  return ids, gemma4_images.ImagePatches(patches[None], positions[None])


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma3-tiny-vision", "gemma4-tiny-vision"])
def test_describes_an_image_from_a_multimodal_checkpoint(tmp_path, preset):
  """--image with a tiny random image model (Gemma 3's or Gemma 4's tower) saved in
  transformers' layout: the greedy text equals an argmax loop over the full forward given
  the same image."""
  config = gj.get_config(preset)
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=8)
  v = config.model.vision
  rng = np.random.RandomState(1)
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  params = jax.tree.map(lambda s: rng.normal(0.0, 0.3, s.shape).astype(s.dtype), shapes)
  gj.hf.save(str(tmp_path / "hf"), config, params)
  image = rng.randint(0, 256, (70, 90, 3)).astype(np.uint8)
  Image.fromarray(image).save(tmp_path / "image.png")

  tokenizer = tokenizers.ByteTokenizer()
  prompt = "A picture of"
  marker = v.boi_token_id if config.model.block_type == "gemma3" else v.image_token_id
  ids, images = prompt_with_image(
      config, image, [tokenizer.bos_id, marker, *tokenizer.encode([prompt])[0]])
  row = np.zeros((1, len(ids) + NEW), np.int32)
  row[0, :len(ids)] = ids
  apply = jax.jit(gj.transform(config).apply)
  for i in range(len(ids), row.shape[1]):
    row[0, i] = np.argmax(apply(params, jnp.asarray(row), images=images)[0, i - 1])
  new = row[0, len(ids):].tolist()
  new = new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new

  stdout = sample_app(f"--hf_dir={tmp_path / 'hf'}", "--tokenizer=byte", f"--prompt={prompt}",
                      f"--image={tmp_path / 'image.png'}")
  assert stdout.startswith(prompt + tokenizer.decode(new) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sample", "eval", "chat"])
def test_an_apps_help_lists_its_model_flags(name):
  """They are defined in gemma_jax.apps, and absl's --help showed only --helpfull's."""
  result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", f"{name}.py"),
                           "--help"], capture_output=True, text=True, timeout=120, check=False)
  listed = {line.split(":")[0].strip() for line in result.stdout.splitlines()
            if line.startswith("  --")}
  assert {"--workdir", "--hf_dir", "--tokenizer", "--quant"} <= listed, result.stdout
