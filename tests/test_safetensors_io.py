"""safetensors_io.read on bad files: one ValueError naming the file and the tensor."""

import json
import re
import struct

import numpy as np
import pytest
import torch
from safetensors import torch as st_torch

from gemma_jax.checkpoints import safetensors_io


def _raw_file(path, header, data=b""):
  """A file in the safetensors layout with this header, written by hand."""
  encoded = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
  return str(path)


def _read_error(path):
  with pytest.raises(ValueError) as error:
    safetensors_io.read(path)
  assert str(error.value).startswith(f"{path}: ")
  return str(error.value)


def test_truncated_file_names_the_tensor_cut_off(tmp_path):
  path = tmp_path / "cut.safetensors"
  st_torch.save_file({"a": torch.ones(4), "b": torch.ones(64, 64)}, str(path))
  path.write_bytes(path.read_bytes()[:-100])
  message = _read_error(str(path))
  assert re.search(r"tensor b: data_offsets \[16, 16400\] run past the 16300 data bytes",
                   message)


@pytest.mark.parametrize("content", [
    b"not a safetensors file, just some text\n" * 3,   # a header length of ~8e18 bytes
    b"abc",                                            # shorter than the length field
    struct.pack("<Q", 5) + b"\xff\xfe{}x",             # a header that is not UTF-8 JSON
    struct.pack("<Q", 2) + b"[]",                      # JSON, but not an object
], ids=["text", "short", "not_utf8", "json_list"])
def test_file_that_is_not_safetensors_is_named(tmp_path, content):
  path = tmp_path / "garbage.safetensors"
  path.write_bytes(content)
  assert "not a safetensors file" in _read_error(str(path))


@pytest.mark.parametrize("entry,message", [
    (dict(dtype="F32", shape=[2, 2], data_offsets=[0, 12]),
     r"tensor w: data_offsets \[0, 12\] hold 12 bytes, F32 \[2, 2\] needs 16"),
    (dict(dtype="F32", shape=[2, 2], data_offsets=[8, 24]),
     r"tensor w: data_offsets \[8, 24\] run past the 16 data bytes"),
    (dict(dtype="F32", shape=[2, 2], data_offsets=[16, 0]),
     r"tensor w: malformed header entry"),
    (dict(dtype="F32", shape=[2, 2], data_offsets=[-4, 12]), r"tensor w: malformed header entry"),
    (dict(dtype="F32", shape=[2, 2]), r"tensor w: malformed header entry"),
    (dict(dtype="C64", shape=[2], data_offsets=[0, 16]), r"tensor w has unsupported dtype C64"),
    (dict(dtype=["F32"], shape=[4], data_offsets=[0, 16]), r"tensor w: malformed header entry"),
    (dict(dtype="F32", shape=[True, 4], data_offsets=[0, 16]),
     r"tensor w: malformed header entry"),
], ids=["short_range", "past_the_end", "reversed", "negative", "no_offsets", "dtype",
        "dtype_list", "bool_dim"])
def test_wrong_header_entry_names_the_tensor(tmp_path, entry, message):
  path = _raw_file(tmp_path / "bad.safetensors", {"w": entry}, np.ones(4, np.float32).tobytes())
  assert re.search(message, _read_error(path))


def test_hand_written_file_with_right_offsets_reads(tmp_path):
  """The layout the error tests edit is valid: read as the safetensors package reads it."""
  data = np.arange(6, dtype=np.float32)
  path = _raw_file(tmp_path / "ok.safetensors",
                   {"a": dict(dtype="F32", shape=[2], data_offsets=[0, 8]),
                    "b": dict(dtype="F32", shape=[2, 2], data_offsets=[8, 24])}, data.tobytes())
  ours, theirs = safetensors_io.read(path), st_torch.load_file(path)
  assert sorted(ours) == sorted(theirs) == ["a", "b"]
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name], value.numpy())
