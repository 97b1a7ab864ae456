"""Reading and writing the safetensors format with numpy, bfloat16 included.

The format: an 8-byte little-endian header length, a JSON header mapping each name
to {dtype, shape, data_offsets}, then the raw little-endian bytes. Reading memory-maps
the file, so a tensor is only read when it is used. (The `safetensors` package's numpy
path cannot represent bfloat16, the dtype Gemma checkpoints are published in.)
"""

import json
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


def read(path: str) -> Dict[str, np.ndarray]:
  """All tensors of one .safetensors file, as read-only memory-mapped arrays."""
  with open(path, "rb") as f:
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    if entry["dtype"] not in DTYPES:
      raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
    start, end = entry["data_offsets"]
    tensors[name] = data[start:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
  return tensors


def _layout(tensors: Mapping[str, np.ndarray]) -> Iterator[Tuple[str, np.ndarray, dict]]:
  offset = 0
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    if array.dtype not in NAMES:
      raise ValueError(f"tensor {name} has unsupported dtype {array.dtype}")
    entry = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
             "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
    yield name, array, entry


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = None):
  """Writes tensors to `path` (a temporary file first, synced and renamed when complete)."""
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
      f.write(array.tobytes())
    f.flush()
    os.fsync(f.fileno())   # on disk before the rename can make it visible
  os.replace(tmp, path)
