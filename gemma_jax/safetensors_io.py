"""Reading and writing the safetensors format with numpy, bfloat16 included.

The format: an 8-byte little-endian header length, a JSON header mapping each name
to {dtype, shape, data_offsets}, then the raw little-endian bytes. Reading memory-maps
the file, so a tensor is only read when it is used. (The `safetensors` package's numpy
path cannot represent bfloat16, the dtype Gemma checkpoints are published in.)
"""

import json
import math
import os
import struct
from typing import Dict, Iterator, Mapping, Tuple

import jax.numpy as jnp
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _entry(path: str, name: str, entry, data_size: int) -> Tuple[np.dtype, list, int, int]:
  """One tensor's header entry -> (dtype, shape, start, end), checked against the data."""
  try:
    kind, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    valid = (isinstance(kind, str) and start <= end
             and all(type(v) is int and v >= 0 for v in [*shape, start, end]))
  except (KeyError, TypeError, ValueError):
    valid = False
  if not valid:
    raise ValueError(f"{path}: tensor {name}: malformed header entry {entry!r}")
  if kind not in DTYPES:
    raise ValueError(f"{path}: tensor {name} has unsupported dtype {kind}")
  if end > data_size:
    raise ValueError(f"{path}: tensor {name}: data_offsets [{start}, {end}] run past the "
                     f"{data_size} data bytes; the file is truncated")
  nbytes = math.prod(shape) * DTYPES[kind].itemsize
  if end - start != nbytes:
    raise ValueError(f"{path}: tensor {name}: data_offsets [{start}, {end}] hold "
                     f"{end - start} bytes, {kind} {shape} needs {nbytes}")
  return DTYPES[kind], shape, start, end


def read(path: str) -> Dict[str, np.ndarray]:
  """All tensors of one .safetensors file, as read-only memory-mapped arrays.

  Raises ValueError naming the file (and the tensor) where the header or a tensor's
  bytes do not fit in it: a truncated file, or not a safetensors file.
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")   # (a file under 8 bytes fails too)
    if header_len > size - 8:
      raise ValueError(f"{path}: not a safetensors file, or truncated: its header length "
                       f"{header_len} exceeds its {size} bytes")
    try:
      header = json.loads(f.read(header_len))
    except ValueError:   # invalid JSON or UTF-8
      header = None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: not a safetensors file: its header is not a JSON object")
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    dtype, shape, start, end = _entry(path, name, entry, size - 8 - header_len)
    tensors[name] = data[start:end].view(dtype).reshape(shape)
  return tensors


def _layout(tensors: Mapping[str, np.ndarray]) -> Iterator[Tuple[str, np.ndarray, dict]]:
  offset = 0
  for name in sorted(tensors):
    array = np.asarray(tensors[name])
    if array.dtype not in NAMES:
      raise ValueError(f"tensor {name} has unsupported dtype {array.dtype}")
    entry = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
             "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
    yield name, array, entry


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = None):
  """Writes tensors to `path` (a temporary file first, synced and renamed when complete).
  Each tensor is put in C order only as it is written (one at a time, not all at once)
  and written from its own buffer."""
  layout = list(_layout(tensors))
  header = {name: entry for name, _, entry in layout}
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for _, array, _ in layout:
      f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    f.flush()
    os.fsync(f.fileno())   # on disk before the rename can make it visible
  os.replace(tmp, path)
