"""The README's and the guides' Python blocks run as written, in the order a reader meets
them (the README, then docs/ in GUIDES order), in one namespace (each may use what the
ones before it defined), in an empty working directory."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The guides with Python blocks, in the order their blocks build on each other.
GUIDES = ("README.md", "docs/models.md", "docs/checkpoints.md", "docs/vision.md",
          "docs/fine-tuning.md", "docs/sampling.md", "docs/quantization.md",
          "docs/serving.md")
# Records of how the code came to be, whose snippets are of their day, not guides.
RECORDS = ("docs/decisions.md", "docs/performance.md")


def python_blocks():
  """(file, block) of every Python block of GUIDES, in order."""
  blocks = []
  for name in GUIDES:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
      blocks += [(name, block) for block in
                 re.findall(r"^```python\n(.*?)^```", f.read(), re.DOTALL | re.MULTILINE)]
  return blocks


def test_every_guide_lists_its_python_blocks_here():
  """A guide with Python blocks that GUIDES leaves out would go untested."""
  docs = os.path.join(REPO, "docs")
  with_blocks = {os.path.join("docs", name) for name in os.listdir(docs)
                 if "```python" in open(os.path.join(docs, name), encoding="utf-8").read()}
  assert with_blocks <= set(GUIDES + RECORDS)


@pytest.mark.slow
def test_every_python_block_of_the_guides_runs(tmp_path, monkeypatch):
  blocks = python_blocks()
  assert len(blocks) >= 12, f"found only {len(blocks)} Python blocks in {GUIDES}"
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "readme"}
  for i, (name, block) in enumerate(blocks):
    where = f"{name} Python block {i + 1} ({block.strip().splitlines()[0]})"
    try:
      exec(compile(block, where, "exec"), namespace)
    except Exception as error:
      raise AssertionError(f"{where} fails: {type(error).__name__}: {error}") from error
