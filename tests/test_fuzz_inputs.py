"""Fuzzing what a user's files feed the library: generated malformed config.json files,
safetensors headers and JSONL lines, each of which must end in the library's own error
naming the file (hf.CheckpointError for a checkpoint, data.DataError for training data)
or be read, never raise anything else.

A fixed seed and a few hundred cases, each failing (or not) before any model is built
but for the few headers that stay valid; the whole file runs in seconds.
"""

import json
import os
import random
import shutil
import struct

import pytest

import gemma_jax as gj
from gemma_jax.checkpoints import gpt2
from gemma_jax.training import data
from test_hostile_checkpoints import saved   # pylint: disable=unused-import  (a fixture)

SEED = 67
CASES = 300            # of each kind
# Placeholders replaced in the JSON text: by arrays nested one of DEPTHS levels, and by
# an integer of more digits than Python converts.
DEEP, DIGITS = "__DEEP__", "__DIGITS__"
DEPTHS = (40, 150, 5000, 200_000)
# Keys the readers look up, put where the file may lack them.
KEYS = ("model_type", "text_config", "vision_config", "audio_config", "layer_types",
        "sliding_window_pattern", "rope_parameters", "rope_scaling", "rope_theta",
        "rope_local_base_freq", "per_layer_config", "global_head_dim",
        "num_global_key_value_heads", "attention_k_eq_v", "enable_moe_block", "num_experts",
        "hidden_size_per_layer_input", "num_kv_shared_layers", "use_bidirectional_attention",
        "query_pre_attn_scalar", "tie_word_embeddings", "n_inner", "n_positions",
        "sliding_attention", "full_attention", "rope_type", "factor", "partial_rotary_factor",
        "mm_tokens_per_image", "image_token_index", "pad_token_id", "hidden_activation")
# Values of every JSON kind, right in one place and wrong in another.
SCALARS = (None, True, False, 0, 1, -1, 2, 3, 6, 2**31, 2**63, 10**400, 0.5, -0.0, 1e308,
           float("nan"), float("inf"), "", "x", "8", "1e6", "gelu", "linear", "proportional",
           "sliding_attention", "full_attention", "vision", "gemma3", "gemma4_text", "gpt2",
           "05", "\u00b2", "x" * 5000)


def random_value(rng: random.Random, depth: int = 0):
  """A random JSON value: a scalar, or a small array or object of them."""
  kind = rng.random()
  if depth >= 3 or kind < 0.7:
    return rng.choice(SCALARS)
  if kind < 0.74:
    return rng.choice([DEEP, DEEP, DIGITS])
  if kind < 0.87:
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
  return {rng.choice(KEYS + ("0", "5")): random_value(rng, depth + 1)
          for _ in range(rng.randrange(4))}


def slots(value):
  """Every (container, key or index) in a JSON value, the value itself not included."""
  items = value.items() if isinstance(value, dict) else enumerate(value)
  for key, item in list(items):
    yield value, key
    if isinstance(item, (dict, list)):
      yield from slots(item)


def mutated(rng: random.Random, value: dict) -> dict:
  """`value` with one to three slots replaced, removed or added."""
  for _ in range(rng.randint(1, 3)):
    places = list(slots(value))
    objects = [value] + [c[k] for c, k in places if isinstance(c[k], dict)]
    action = rng.random()
    if action < 0.2 or not places:
      rng.choice(objects)[rng.choice(KEYS)] = random_value(rng)
      continue
    container, key = rng.choice(places)
    if action < 0.35 and isinstance(container, dict):
      del container[key]
    else:
      container[key] = random_value(rng)
  return value


def json_text(rng: random.Random, value) -> bytes:
  """`value` as JSON (NaN and Infinity as Python writes them), the placeholders
  replaced, and now and then a byte cut, changed or added."""
  text = json.dumps(value).replace(f'"{DIGITS}"', "9" * 5000)
  while f'"{DEEP}"' in text:
    depth = rng.choice(DEPTHS)
    text = text.replace(f'"{DEEP}"', "[" * depth + "]" * depth, 1)
  raw = text.encode()
  cut = rng.randrange(len(raw) + 1)
  edit = rng.random()
  if edit < 0.05:
    raw = raw[:cut]
  elif edit < 0.1:
    raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
  elif edit < 0.15:
    raw = raw[:cut] + rng.choice([b"\xff", b"\\ud800", b'"', b"{", b"]", b",", b"\x00"]) + raw[cut:]
  return raw


def _base_configs():
  """config.json dicts of each family the reader knows, as the library writes them, and
  Gemma 3's in transformers 4's form."""
  configs = [gj.hf.config_to_hf(gj.get_config(name)) for name in (
      "gemma3-tiny", "gemma3-tiny-vision", "gemma4-tiny", "gemma4-tiny-vision",
      "gemma4-moe-tiny", "gemma4-e2b-tiny")]
  configs.append(gpt2.config_to_hf(gj.get_config("gpt3-52k")))
  legacy = json.loads(json.dumps(configs[0]))
  del legacy["rope_parameters"], legacy["layer_types"]
  legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
  return [json.loads(json.dumps(c)) for c in configs + [legacy]]


def test_malformed_config_json_is_a_checkpoint_error_naming_it(tmp_path):
  """The directories hold no weights: every config ends in an error before a model is
  built, the config's own or, where it reads as a model, "no .safetensors files"."""
  rng = random.Random(SEED)
  bases = _base_configs()
  for case in range(CASES):
    path = str(tmp_path / str(case))
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "wb") as f:
      f.write(json_text(rng, mutated(rng, json.loads(json.dumps(rng.choice(bases))))))
    with pytest.raises(gj.hf.CheckpointError) as error:
      gj.hf.load(path)
    message = str(error.value)
    assert (message.startswith(f"{path}/config.json: ")
            or message == f"{path}: no .safetensors files"), (case, message)


def _header_and_data(file: str):
  with open(file, "rb") as f:
    raw = f.read()
  length = struct.unpack("<Q", raw[:8])[0]
  return json.loads(raw[8:8 + length]), raw[8 + length:]


def mutated_header(rng: random.Random, header: dict) -> dict:
  """A safetensors header with entries or their fields changed, moved or dropped."""
  names = [name for name in header if name != "__metadata__"]
  action = rng.random()
  name = rng.choice(names)
  if action < 0.5:
    header[name][rng.choice(["dtype", "shape", "data_offsets"])] = random_value(rng)
  elif action < 0.6:
    del header[name][rng.choice(["dtype", "shape", "data_offsets"])]
  elif action < 0.7:
    header[name] = random_value(rng)
  elif action < 0.8:
    start, end = header[name]["data_offsets"]
    shift = rng.choice([-8, -4, -1, 1, 4, 8])
    header[name]["data_offsets"] = rng.choice([[start + shift, end + shift], [start, end + shift],
                                               [start + shift, end]])
  elif action < 0.85:
    header[name]["dtype"] = rng.choice(["F16", "BF16", "I32", "U8", "BOOL", "F64", "F8_E4M3"])
  elif action < 0.9:
    other = rng.choice(names)
    header[name]["data_offsets"], header[other]["data_offsets"] = (
        header[other]["data_offsets"], header[name]["data_offsets"])
  else:
    header["__metadata__"] = random_value(rng)
  return header


def test_malformed_safetensors_header_is_a_checkpoint_error_naming_the_file(saved, tmp_path):
  """Beside a valid config.json: each file ends in an error naming it (or the directory,
  for tensors a valid file lacks or holds in another shape), or, unharmed, loads."""
  rng = random.Random(SEED)
  header, data_bytes = _header_and_data(os.path.join(saved, "model.safetensors"))
  for case in range(CASES):
    path = str(tmp_path / str(case))
    os.makedirs(path)
    shutil.copy(os.path.join(saved, "config.json"), path)
    encoded = json_text(rng, mutated_header(rng, json.loads(json.dumps(header))))
    length = len(encoded)
    if rng.random() < 0.1:
      length = rng.choice([0, 1, length - 1, length + 1, 2**63, 100_000_001])
    raw = struct.pack("<Q", length) + encoded + data_bytes
    if rng.random() < 0.05:
      raw = raw[:rng.randrange(len(raw))]
    file = os.path.join(path, "model.safetensors")
    with open(file, "wb") as f:
      f.write(raw)
    try:
      gj.hf.load(path)
    except gj.hf.CheckpointError as error:
      message = str(error)
      assert message.startswith((f"{file}: ", f"{path}: ")), (case, message)


def test_malformed_jsonl_line_is_a_data_error_naming_the_file(tmp_path):
  """Each line alone in a .jsonl file read as data.format "auto": read as text or a
  conversation, or a DataError naming the file and line."""
  rng = random.Random(SEED)
  for case in range(CASES):
    record = {"text": "a document"} if rng.random() < 0.5 else {
        "messages": [{"role": "user", "content": "hi"}, {"role": "model", "content": "hello"}]}
    file = str(tmp_path / f"{case}.jsonl")
    with open(file, "wb") as f:
      f.write(json_text(rng, mutated(rng, record)) + b"\n")
    try:
      data.read_documents(file, data_format="auto")
    except data.DataError as error:
      assert file in str(error), (case, str(error))
