"""Shared fixtures, and eight simulated CPU devices for every test: the XLA flag must
be set before jax is imported, and conftest.py is imported before any test module."""

import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  """Eight real documents (the heads of stdlib modules) as .txt files; their glob."""
  from gemma_jax.training import data  # pylint: disable=import-outside-toplevel
  directory = tmp_path_factory.mktemp("corpus")
  for i, filename in enumerate(data.stdlib_files()[:8]):
    with open(filename, encoding="utf-8") as f:
      (directory / f"{i}.txt").write_text(f.read()[:3000], encoding="utf-8")
  return str(directory / "*.txt")
