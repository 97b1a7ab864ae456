"""notebooks/explore.ipynb runs top to bottom without an error, and is committed with the
outputs of its current cells."""

import os

import nbclient
import nbformat
import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "explore.ipynb")


def output_kinds(notebook):
  """Per code cell, the (type, mime types or stream name) of each of its outputs; a run
  of one stream is one output (the kernel splits a stream where its flushes fall, which
  depends on the machine's load)."""
  kinds = []
  for cell in notebook.cells:
    if cell.cell_type != "code":
      continue
    cell_kinds = []
    for o in cell.outputs:
      kind = (o.output_type, o.get("name") or sorted(o.get("data", {})))
      if not (o.output_type == "stream" and cell_kinds and cell_kinds[-1] == kind):
        cell_kinds.append(kind)
    kinds.append(cell_kinds)
  return kinds


@pytest.mark.slow
def test_explore_notebook_runs_and_its_committed_outputs_are_its_cells(tmp_path):
  committed = nbformat.read(NOTEBOOK, as_version=4)
  env = dict(os.environ, XLA_FLAGS="")   # one device is enough here
  client = nbclient.NotebookClient(nbformat.read(NOTEBOOK, as_version=4), timeout=300,
                                   kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  executed = client.execute(env=env)
  outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any(o.output_type == "display_data" and "image/png" in o.data for o in outputs)
  # Re-run `jupyter nbconvert --to notebook --execute --inplace` after editing a cell.
  assert output_kinds(committed) == output_kinds(executed)
  assert os.path.getsize(NOTEBOOK) < 256 * 1024
