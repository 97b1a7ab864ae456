"""Reading and writing the safetensors format with numpy, bfloat16 included.

The format: an 8-byte little-endian header length, a JSON header mapping each name
to {dtype, shape, data_offsets}, then the raw little-endian bytes, the tensors' end to
end. Reading refuses what the safetensors library refuses, and memory-maps the file, so
a tensor is only read when it is used. (The `safetensors` package's numpy path cannot
represent bfloat16, the dtype Gemma checkpoints are published in.)
"""

import json
import math
import os
import reprlib
import stat
import struct
from typing import Dict, Iterator, Mapping, Tuple

import jax.numpy as jnp
import numpy as np

from gemma_jax.checkpoints import bounded_json

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
FLOATS = frozenset(DTYPES[name] for name in ("F64", "F32", "F16", "BF16"))
# The safetensors library's limit on a header's length: a longer one is refused unread.
MAX_HEADER_SIZE = 100_000_000
_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket"}


def regular_file_size(path: str) -> int:
  """The size of `path`, a regular file (links followed). Raises ValueError naming it when
  it is anything else (a FIFO would block a read, a device such as /dev/zero never
  ends), OSError when it cannot be looked up."""
  info = os.stat(path)
  if not stat.S_ISREG(info.st_mode):
    raise ValueError(f"{path}: not a regular file but {_FILE_KINDS[stat.S_IFMT(info.st_mode)]}")
  return info.st_size


def _entry(path: str, name: str, entry, data_size: int) -> Tuple[np.dtype, list, int, int]:
  """One tensor's header entry -> (dtype, shape, start, end), checked against the data."""
  try:
    kind, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    start, end = offsets
    valid = (isinstance(kind, str) and isinstance(shape, list) and isinstance(offsets, list)
             and all(type(v) is int and v >= 0 for v in [*shape, start, end])
             and start <= end)
  except (KeyError, TypeError, ValueError):
    valid = False
  if not valid:
    raise ValueError(f"{path}: tensor {name}: malformed header entry {reprlib.repr(entry)}")
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


def _check_layout(path: str, spans: Dict[str, Tuple[int, int]], data_size: int) -> None:
  """ValueError naming the tensor where the tensors' bytes are not laid end to end from
  the start of the data to its end, as the safetensors library requires: an overlap
  would read one tensor's bytes as another's, a gap or a tail hides bytes in the file."""
  previous, end_of_previous = None, 0
  for (start, end), name in sorted((span, name) for name, span in spans.items()):
    if start < end_of_previous:
      raise ValueError(f"{path}: tensor {name}: data_offsets [{start}, {end}] overlap "
                       f"tensor {previous}'s, which end at {end_of_previous}")
    if start > end_of_previous:
      raise ValueError(f"{path}: tensor {name}: data_offsets [{start}, {end}] leave bytes "
                       f"[{end_of_previous}, {start}) to no tensor")
    previous, end_of_previous = name, end
  if end_of_previous != data_size:
    raise ValueError(f"{path}: data bytes [{end_of_previous}, {data_size}) belong to no "
                     "tensor")


def read(path: str) -> Dict[str, np.ndarray]:
  """All tensors of one .safetensors file, as read-only memory-mapped arrays.

  Raises ValueError naming the file (and the tensor) where it is not a regular file, or
  is refused as the safetensors library refuses it: a header too long, not a JSON object
  or with a malformed entry, or tensors' bytes that overlap, leave a gap, or do not fit
  in the file (a truncated file).
  """
  size = regular_file_size(path)
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")   # (a file under 8 bytes fails too)
    if header_len > MAX_HEADER_SIZE:
      raise ValueError(f"{path}: not a safetensors file: its header length {header_len} "
                       f"exceeds the format's limit of {MAX_HEADER_SIZE} bytes")
    if header_len > size - 8:
      raise ValueError(f"{path}: not a safetensors file, or truncated: its header length "
                       f"{header_len} exceeds its {size} bytes")
    raw = f.read(header_len)
  try:
    header = bounded_json.loads(raw) if raw.startswith(b"{") else None
  except bounded_json.NestedTooDeeply as error:
    raise ValueError(f"{path}: not a safetensors file: in its header {error}") from None
  except ValueError:   # invalid JSON or UTF-8
    header = None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: not a safetensors file: its header is not a JSON object")
  metadata = header.pop("__metadata__", None)
  if not (metadata is None or isinstance(metadata, dict)
          and all(isinstance(value, str) for value in metadata.values())):
    raise ValueError(f"{path}: __metadata__ is not an object of strings: "
                     f"{reprlib.repr(metadata)}")
  data_size = size - 8 - header_len
  entries = {name: _entry(path, name, entry, data_size) for name, entry in header.items()}
  _check_layout(path, {name: (start, end) for name, (_, _, start, end) in entries.items()},
                data_size)
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  return {name: data[start:end].view(dtype).reshape(shape)
          for name, (dtype, shape, start, end) in entries.items()}


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
