"""Checkpoint directories written whole or not at all, and only where they are ours.

    directory.write(path, fill, kind=directory.MODEL, source=workdir)

`fill(staging)` writes the files into a new directory beside `path`; it is synced and
swapped into place in one step, so a reader or a crash sees the old directory or the
new, never a mix. A marker file (MARKER) records who wrote it: the kind, the workdir
exported (`source`; None for a plain `hf.save`) and the names written. `path` is
written only when it is new, empty, or an earlier export of the same kind and source
that holds nothing else; anything else is refused naming what is there, unless
`overwrite`, which replaces it whole. A training workdir, or a folder of them, is never
replaced.
"""

import ctypes
import json
import os
import re
import secrets
import shutil
import socket
import sys
from typing import Callable, List, Optional

from gemma_jax.checkpoints import CheckpointError

MARKER = ".gemma_jax_export.json"
MODEL, ADAPTERS = "a transformers model", "peft adapters"
# The file each kind of directory holds, by which one written elsewhere is recognised.
_KIND_FILES = {"config.json": MODEL, "adapter_config.json": ADAPTERS}
_RUN_DIR = "checkpoints"   # what makes a directory a training workdir
_OVERWRITE = "pass overwrite=True (export.py --overwrite) to replace it whole"


def write_json(file: str, value: dict) -> None:
  """Writes `value` as indented JSON to `file`, synced to disk."""
  with open(file, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.flush()
    os.fsync(f.fileno())


def fsync(path: str) -> None:
  """Flushes a file's or a directory's entries to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def read_marker(path: str) -> Optional[dict]:
  """What the marker of directory `path` says wrote it ({"kind", "source", "files"}), or
  None when it has no readable marker."""
  try:
    with open(os.path.join(path, MARKER), encoding="utf-8") as f:
      marker = json.load(f)
  except (OSError, ValueError, RecursionError):
    return None
  fields = isinstance(marker, dict) and {"kind", "source", "files"} <= marker.keys()
  if not fields or not isinstance(marker["files"], list):
    return None
  return marker


def _holds_run(path: str) -> bool:
  return os.path.isdir(os.path.join(path, _RUN_DIR))


def _unmarked(names: List[str]) -> str:
  """What a directory that no export marked holds, in a few words."""
  for name, kind in _KIND_FILES.items():
    if name in names:
      return f"holds {kind} ({name}) that no export of this kind and run wrote"
  shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
  return f"holds files no export wrote ({shown})"


def check_destination(path: str, kind: str, source: Optional[str] = None,
                      overwrite: bool = False) -> None:
  """CheckpointError unless `write` may put a directory of `kind` exported from `source`
  at `path`; see the module docstring. Nothing is written."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise CheckpointError(f"{path}: exists and is not a directory")
  if not os.path.isdir(path):
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
      raise CheckpointError(f"{path}: {parent} exists and is not a directory")
    return
  if _holds_run(path):
    raise CheckpointError(f"{path}: holds a training run's checkpoints, which an export "
                          "never replaces: export to a directory of its own")
  names = sorted(os.listdir(path))
  if overwrite:
    runs = [n for n in names if _holds_run(os.path.join(path, n))]
    if runs:
      raise CheckpointError(f"{path}: holds the training run {runs[0]}, which replacing the "
                            "directory would delete: export to a directory of its own")
    return
  if not names:
    return
  marker = read_marker(path)
  if marker is None:
    raise CheckpointError(f"{path}: {_unmarked(names)}: export to a new or empty "
                          f"directory, or {_OVERWRITE}")
  if marker["kind"] != kind:
    raise CheckpointError(f"{path}: holds {marker['kind']}, which this export of {kind} "
                          f"would mix with: export to a directory of its own, or "
                          f"{_OVERWRITE}")
  if marker["source"] != source:
    owner = marker["source"] or "a model saved by hf.save"
    raise CheckpointError(f"{path}: holds the export of {owner}, "
                          f"not of {source or 'this model'}: export to a directory of its "
                          f"own, or {_OVERWRITE}")
  foreign = [n for n in names if n != MARKER and n not in marker["files"]]
  if foreign:
    raise CheckpointError(f"{path}: holds {', '.join(foreign[:3])}, which the earlier "
                          f"export did not write: move it away, or {_OVERWRITE}")


def write(path: str, fill: Callable[[str], None], *, kind: str,
          source: Optional[str] = None, overwrite: bool = False) -> None:
  """A directory of `kind` at `path`, whole or not at all: `fill(staging)` writes its
  files into a new directory next to it, the marker is added, everything is synced and
  the directory replaces `path` (`_move_into_place`). `check_destination` first;
  staging that a killed write left in that parent is removed."""
  check_destination(path, kind, source, overwrite)
  path = os.path.realpath(path)   # a symlink to a directory: its directory is replaced
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  _remove_abandoned_staging(parent)
  staging = os.path.join(parent, f".hf-save-{os.getpid()}@{socket.gethostname()}-"
                                 f"{secrets.token_hex(8)}")
  os.mkdir(staging)   # the umask's mode, as a plain new directory (mkdtemp's is 0700)
  try:
    fill(staging)
    write_json(os.path.join(staging, MARKER), {
        "kind": kind, "source": source, "files": sorted(os.listdir(staging))})
    for folder, _, _ in os.walk(staging):
      fsync(folder)
    _move_into_place(staging, path)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def _exchange(a: str, b: str) -> bool:
  """Swaps two existing paths in one atomic step: Linux's renameat2(RENAME_EXCHANGE).

  False where it did not happen (not Linux, a libc without renameat2, a kernel or file
  system without the flag, or any other failure); the call then moved nothing.
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    return False
  renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                        ctypes.c_uint)
  at_fdcwd, rename_exchange = -100, 2   # from <fcntl.h> and <linux/fs.h>
  return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _move_into_place(staging: str, path: str) -> None:
  """Renames the complete, synced directory `staging` to `path`, replacing what is there.

  An existing `path` is swapped with `staging` in one atomic step where `_exchange` can,
  then the old copy (now at `staging`) is removed. Elsewhere two renames replace it,
  path -> `staging`-old and staging -> path, the first undone if the second fails; a
  crash between them leaves the old directory only at `staging`-old.
  """
  if not os.path.exists(path):
    os.rename(staging, path)
    old = None
  elif _exchange(staging, path):
    old = staging
  else:
    old = f"{staging}-old"
    os.rename(path, old)
    try:
      os.rename(staging, path)
    except BaseException:
      os.rename(old, path)
      raise
  fsync(os.path.dirname(os.path.abspath(path)))   # the renames themselves
  if old:
    shutil.rmtree(old)


_STAGING = re.compile(r"\.hf-save-(\d+)@(.*)-[0-9a-f]{16}")


def _remove_abandoned_staging(parent: str) -> None:
  """Removes the staging directories in `parent` that a killed write on this host left
  (`write` names each by process and host; one whose process is gone holds either an
  unfinished directory or, after the swap, the replaced one). A `-old` copy is kept: a
  kill between `_move_into_place`'s two renames leaves it as the only one."""
  for name in os.listdir(parent):
    match = _STAGING.fullmatch(name)
    if match and match[2] == socket.gethostname() and not _process_alive(int(match[1])):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:     # another user's
    pass
  return True
