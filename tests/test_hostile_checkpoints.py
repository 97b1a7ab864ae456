"""Checkpoints made to hurt: config.json values of the wrong kind or shape, JSON nested
past any parser's reach, safetensors files the reference library refuses, an index that
points outside its directory, files that are not regular files, a pickled .npy image.
Each is one CheckpointError (a ValueError for the image) naming the file and the field
or tensor, raised before any model is built; none is read as another model."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors import torch as st_torch

import gemma_jax as gj
from gemma_jax.models.gemma3 import images as image_inputs
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.checkpoints import gpt2, safetensors_io

# Two local layers; a vocabulary above sample.top_k's default, so the config validates.
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, num_hidden_layers=2, sliding_window=4)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A tiny transformers Gemma3ForCausalLM, saved once."""
  path = str(tmp_path_factory.mktemp("saved"))
  torch.manual_seed(0)
  transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)).save_pretrained(path)
  return path


@pytest.fixture
def checkpoint(saved, tmp_path):
  """A copy of the tiny checkpoint, to damage."""
  path = str(tmp_path / "checkpoint")
  shutil.copytree(saved, path)
  return path


def load_error(path: str) -> str:
  """The message of the CheckpointError hf.load(path) raises."""
  with pytest.raises(gj.hf.CheckpointError) as error:
    gj.hf.load(path)
  return str(error.value)


def edit_config(path: str, edit) -> None:
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  edit(config)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)


def write_raw(file: str, header: dict, data: bytes) -> None:
  """A safetensors file written byte by byte: the header's length, the header, the data."""
  encoded = json.dumps(header).encode()
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)) + encoded + data)


def end_to_end(tensors: dict):
  """(header, data) of numpy `tensors` laid end to end, in the given order."""
  header, data = {}, b""
  for name, array in tensors.items():
    header[name] = dict(dtype=safetensors_io.NAMES[array.dtype], shape=list(array.shape),
                        data_offsets=[len(data), len(data) + array.nbytes])
    data += np.ascontiguousarray(array).tobytes()
  return header, data


def stored_tensors(path: str) -> dict:
  return {name: np.asarray(value) for name, value in
          safetensors_io.read(os.path.join(path, WEIGHTS)).items()}


# ----------------------------------------------------------------------------- config.json


def _without_layer_types(**values):
  def edit(config):
    del config["layer_types"]
    config.update(values)
  return edit


def _set_rope_theta(config):
  config["rope_parameters"]["full_attention"]["rope_theta"] = "1e6"


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(hidden_size="16"),
     "hidden_size: expected a positive int below 2**31, got '16'"),
    (lambda c: c.update(hidden_activation=["gelu"]),
     "hidden_activation: expected one of ['gelu', 'gelu_pytorch_tanh', 'relu', 'silu'], "
     "got ['gelu']"),
    (lambda c: c.update(layer_types=5), "layer_types: expected a list of strings or null, got 5"),
    (lambda c: c.update(rope_parameters="x"),
     "rope_parameters: expected an object or null, got 'x'"),
    (_set_rope_theta,
     "rope_parameters.full_attention.rope_theta: expected a finite positive number, got '1e6'"),
    (_without_layer_types(sliding_window_pattern=0),
     "sliding_window_pattern: expected a positive int below 2**31, got 0"),
    (lambda c: c.update(query_pre_attn_scalar="x"),
     "query_pre_attn_scalar: expected a finite positive number, got 'x'"),
    (lambda c: c.update(rms_norm_eps=float("nan")),
     "rms_norm_eps: expected a finite positive number, got nan"),
    (lambda c: c.update(num_key_value_heads=0),
     "num_key_value_heads: expected a positive int below 2**31, got 0"),
    (lambda c: c.update(attention_bias="false"),
     "attention_bias: expected true or false, got 'false'"),
    # transformers refuses it too; read as given, it was another model (all local layers
    # stretched to 2 from a list of 1).
    (lambda c: c.update(layer_types=["sliding_attention"]),
     "layer_types: lists 1 layers; num_hidden_layers is 2"),
    (lambda c: c.update(num_attention_heads=3, num_key_value_heads=2),
     "describes a model gemma_jax does not build: config.model.num_kv_heads: num_heads=3 "
     "is not divisible by num_kv_heads=2"),
], ids=["int_as_string", "activation_list", "layer_types_int", "rope_parameters_string",
        "nested_rope_theta_string", "pattern_zero", "query_scalar_string", "eps_nan",
        "no_kv_heads", "bool_as_string", "layer_types_short", "heads_indivisible"])
def test_config_value_of_the_wrong_kind_names_file_and_field(checkpoint, edit, message):
  edit_config(checkpoint, edit)
  assert load_error(checkpoint) == f"{checkpoint}/config.json: {message}"


def _config_dir(tmp_path, hf_config, **files):
  """A directory holding only this config.json (and any other JSON `files`)."""
  for name, value in dict(files, config=hf_config).items():
    with open(tmp_path / f"{name}.json", "w") as f:
      json.dump(value, f)
  return str(tmp_path)


def _edited(hf_config, edit):
  edit(hf_config)
  return hf_config


@pytest.mark.parametrize("preset,edit,message", [
    ("gemma3-tiny-vision", lambda c: c["text_config"].update(head_dim="16"),
     "text_config.head_dim: expected a positive int below 2**31, got '16'"),
    ("gemma3-tiny-vision", lambda c: c["vision_config"].update(image_size=[64]),
     "vision_config.image_size: expected a positive int below 2**31, got [64]"),
    ("gemma3-tiny-vision", lambda c: c.update(mm_tokens_per_image=None),
     "mm_tokens_per_image: expected a positive int below 2**31, got None"),
    ("gemma4-tiny", lambda c: c.update(per_layer_config={"x": {}}),
     "per_layer_config.x: expected a layer index"),
    ("gemma4-tiny", lambda c: c.update(num_experts="8", enable_moe_block=True),
     "num_experts: expected a positive int below 2**31, got '8'"),
    ("gemma4-tiny-vision", lambda c: c["vision_config"].update(rope_parameters="x"),
     "vision_config.rope_parameters: expected an object or null, got 'x'"),
    ("gemma4-tiny-vision", lambda c: c["vision_config"].update(standardize="yes"),
     "vision_config.standardize: expected true or false, got 'yes'"),
    ("gpt3-52k", lambda c: c.update(n_layer="1"),
     "n_layer: expected an int in [1, 10000], got '1'"),
    ("gpt3-52k", lambda c: c.update(activation_function={"gelu": 1}),
     "activation_function: expected one of ['gelu', 'gelu_new', 'gelu_pytorch_tanh', "
     "'relu', 'silu'], got {'gelu': 1}"),
], ids=["gemma3_text_config", "gemma3_vision_config", "gemma3_image_tokens",
        "gemma4_per_layer_key", "gemma4_experts", "gemma4_vision_rope", "gemma4_vision_flag",
        "gpt2_layers", "gpt2_activation"])
def test_every_family_names_the_field_of_the_wrong_kind(tmp_path, preset, edit, message):
  config = gj.get_config(preset)
  to_hf = gpt2.config_to_hf if config.model.block_type == "gpt3" else gj.hf.config_to_hf
  path = _config_dir(tmp_path, _edited(json.loads(json.dumps(to_hf(config))), edit))
  assert load_error(path) == f"{path}/config.json: {message}"


def test_image_processor_setting_of_the_wrong_kind_names_its_file(tmp_path):
  hf_config = gj.hf.config_to_hf(gj.get_config("gemma4-tiny-vision"))
  path = _config_dir(tmp_path, hf_config, preprocessor_config={"max_soft_tokens": "70"})
  assert load_error(path) == (f"{path}/preprocessor_config.json: max_soft_tokens: expected "
                              "a positive int below 2**31, got '70'")


def test_more_layers_than_the_tensors_hold_is_named_before_tracing(checkpoint):
  """300 layers in config.json, 2 in the file: said in those numbers, before a model of
  300 layers is traced (which had ended in a list of 3,900 missing tensors)."""
  edit_config(checkpoint, _without_layer_types(num_hidden_layers=300))
  assert load_error(checkpoint) == (f"{checkpoint}/config.json: describes 300 layers; the "
                                    "tensors hold 2")


def test_a_layer_count_no_model_has_is_refused_as_the_config_is_read(checkpoint):
  """num_hidden_layers=200000 had run on with memory climbing: in a child process, so a
  regression fails the test instead of hanging it."""
  edit_config(checkpoint, _without_layer_types(num_hidden_layers=200_000))
  script = ("import gemma_jax as gj, sys\n"
            "try:\n  gj.hf.load(sys.argv[1])\n"
            "except gj.hf.CheckpointError as error:\n  print(error)\n")
  out = subprocess.run([sys.executable, "-c", script, checkpoint], capture_output=True,
                       text=True, timeout=120, check=True).stdout
  assert out == (f"{checkpoint}/config.json: num_hidden_layers: expected an int in "
                 "[1, 10000], got 200000\n")


@pytest.mark.parametrize("depth", [150, 100_000])
def test_config_nested_too_deeply_is_named(checkpoint, depth):
  """Deeper than any config nests: at 100,000 levels json's parser ran out of stack; at
  150 an unknown key this deep was read past."""
  file = os.path.join(checkpoint, "config.json")
  with open(file) as f:
    text = f.read().rstrip()[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
  with open(file, "w") as f:
    f.write(text)
  assert load_error(checkpoint) == f"{file}: arrays and objects nest deeper than 100 levels"


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_header_nested_too_deeply_is_named(checkpoint):
  file = os.path.join(checkpoint, WEIGHTS)
  header = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header)
  assert load_error(checkpoint) == (f"{file}: not a safetensors file: in its header arrays "
                                    "and objects nest deeper than 100 levels")


def test_header_longer_than_the_format_allows_is_refused(checkpoint):
  """A header may declare up to 100,000,000 bytes (the safetensors library's limit); one
  past it is refused, not read whole (a sparse file: nothing is written to disk)."""
  file = os.path.join(checkpoint, WEIGHTS)
  length = 100_000_001
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", length))
  os.truncate(file, 8 + length)
  assert load_error(checkpoint) == (
      f"{file}: not a safetensors file: its header length {length} exceeds the format's "
      "limit of 100000000 bytes")


def test_index_nested_too_deeply_is_named(checkpoint):
  index = os.path.join(checkpoint, INDEX)
  with open(index, "w") as f:
    f.write('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
  assert load_error(checkpoint) == f"{index}: arrays and objects nest deeper than 100 levels"


def test_tensors_sharing_bytes_are_refused_by_name(checkpoint):
  """Layer 1's norm pointed at layer 0's bytes had loaded as a copy of it."""
  tensors = stored_tensors(checkpoint)
  shared, alias = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
  header, data = end_to_end({k: v for k, v in tensors.items() if k != alias})
  header[alias] = dict(header[shared])
  file = os.path.join(checkpoint, WEIGHTS)
  write_raw(file, header, data)
  with pytest.raises(Exception):   # what the reference library says of this file
    st_torch.load_file(file)
  start, end = header[shared]["data_offsets"]
  assert load_error(checkpoint) == (
      f"{file}: tensor {alias}: data_offsets [{start}, {end}] overlap tensor {shared}'s, "
      f"which end at {end}")


@pytest.mark.parametrize("layout,message", [
    ({"a": [0, 8], "b": [4, 12]}, "tensor b: data_offsets [4, 12] overlap tensor a's, which "
                                  "end at 8"),
    ({"a": [0, 8], "b": [12, 20]}, "tensor b: data_offsets [12, 20] leave bytes [8, 12) to "
                                   "no tensor"),
    ({"a": [0, 8], "b": [8, 16]}, "data bytes [16, 20) belong to no tensor"),
], ids=["overlap", "gap", "tail"])
def test_bytes_not_laid_end_to_end_are_refused_as_the_reference_refuses_them(
    tmp_path, layout, message):
  file = str(tmp_path / "bad.safetensors")
  write_raw(file, {name: dict(dtype="F32", shape=[2], data_offsets=offsets)
                   for name, offsets in layout.items()}, bytes(20))
  with pytest.raises(Exception):
    st_torch.load_file(file)
  with pytest.raises(ValueError) as error:
    safetensors_io.read(file)
  assert str(error.value) == f"{file}: {message}"


def test_metadata_other_than_strings_is_refused_as_the_reference_refuses_it(tmp_path):
  file = str(tmp_path / "bad.safetensors")
  write_raw(file, {"__metadata__": {"format": ["pt"]},
                   "a": dict(dtype="F32", shape=[2], data_offsets=[0, 8])}, bytes(8))
  with pytest.raises(Exception):
    st_torch.load_file(file)
  with pytest.raises(ValueError, match=re.escape(f"{file}: __metadata__ is not an object of "
                                                 "strings")):
    safetensors_io.read(file)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_integer_weights_are_refused_naming_tensor_and_file(checkpoint, dtype):
  """An integer or bool tensor where the model needs a float weight had been cast."""
  tensors = stored_tensors(checkpoint)
  name = "model.layers.0.mlp.up_proj.weight"
  tensors[name] = np.ones(tensors[name].shape, dtype)
  file = os.path.join(checkpoint, WEIGHTS)
  write_raw(file, *end_to_end(tensors))
  assert load_error(checkpoint) == (
      f"{file}: tensor layers.0.mlp.up_proj.weight holds "
      f"{safetensors_io.NAMES[np.dtype(dtype)]} values; the model's weights are floats")


@pytest.mark.parametrize("outside", ["../outside.safetensors", "absolute"])
def test_index_naming_a_file_outside_its_directory_is_refused(checkpoint, outside):
  """The file is there and valid: it had been read from wherever the index pointed."""
  target = os.path.join(os.path.dirname(checkpoint), "outside.safetensors")
  os.replace(os.path.join(checkpoint, WEIGHTS), target)
  entry = target if outside == "absolute" else outside
  names = safetensors_io.read(target)
  with open(os.path.join(checkpoint, INDEX), "w") as f:
    json.dump({"weight_map": dict.fromkeys(sorted(names), entry)}, f)
  assert load_error(checkpoint) == (
      f"{checkpoint}/{INDEX}: weight_map names {entry!r} for {min(names)!r}, which is not a "
      f"file inside {checkpoint}")


def test_a_tensor_in_two_shards_is_refused(checkpoint):
  """Which of the two was read had depended on the shards' order."""
  tensors = stored_tensors(checkpoint)
  first = {k: v for k, v in tensors.items() if "layers.1." not in k}
  second = {k: v for k, v in tensors.items() if "layers.1." in k or k == "model.norm.weight"}
  os.remove(os.path.join(checkpoint, WEIGHTS))
  for name, part in (("a.safetensors", first), ("b.safetensors", second)):
    write_raw(os.path.join(checkpoint, name), *end_to_end(part))
  assert load_error(checkpoint) == (
      f"{checkpoint}/b.safetensors: holds tensor model.norm.weight, which "
      f"{checkpoint}/a.safetensors holds too")


# ----------------------------------------------------------------------------- files


def _fifo(file):
  os.mkfifo(file)


@pytest.mark.parametrize("make,message", [
    (_fifo, "not a regular file but a FIFO"),
    (lambda file: os.symlink("/dev/zero", file), "not a regular file but a character device"),
    (lambda file: os.symlink("gone.safetensors", file),
     "cannot be read (No such file or directory)"),
], ids=["fifo", "dev_zero", "dangling_link"])
def test_weights_that_are_not_a_regular_file_are_named(checkpoint, make, message):
  """A FIFO would block a read, /dev/zero never ends: neither is read, and the error names
  the file, not an index.json that is not there."""
  file = os.path.join(checkpoint, WEIGHTS)
  os.remove(file)
  make(file)
  assert load_error(checkpoint) == f"{file}: {message}"


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_json_that_is_not_a_regular_file_is_named(checkpoint, name):
  file = os.path.join(checkpoint, name)
  if os.path.exists(file):
    os.remove(file)
  os.symlink("/dev/null", file)
  assert load_error(checkpoint) == f"{file}: not a regular file but a character device"


def test_pickled_npy_image_is_refused_naming_the_file(tmp_path):
  file = str(tmp_path / "image.npy")
  np.save(file, np.array([{"pixels": 1}], dtype=object), allow_pickle=True)
  for read in (image_inputs.load_image, image_inputs.preprocess_image,
               gemma4_images.preprocess_image):
    with pytest.raises(ValueError, match=rf"^{re.escape(file)}: not a \.npy file of a plain "
                                         r"array \(Object arrays cannot be loaded"):
      read(file)
