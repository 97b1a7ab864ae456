"""The README's Python blocks run as written, in order, in one namespace (each may use
what the ones before it defined), in an empty working directory."""

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks():
  with open(README, encoding="utf-8") as f:
    return re.findall(r"^```python\n(.*?)^```", f.read(), re.DOTALL | re.MULTILINE)


def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
  blocks = python_blocks()
  assert len(blocks) >= 9, f"found only {len(blocks)} Python blocks in {README}"
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "readme"}
  for i, block in enumerate(blocks):
    first_line = block.strip().splitlines()[0]
    try:
      exec(compile(block, f"README.md Python block {i + 1} ({first_line})", "exec"), namespace)
    except Exception as error:
      raise AssertionError(f"README.md Python block {i + 1} ({first_line}) fails: "
                           f"{type(error).__name__}: {error}") from error
