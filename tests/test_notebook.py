"""notebooks/explore.ipynb runs top to bottom without an error."""

import os

import nbclient
import nbformat

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "explore.ipynb")


def test_explore_notebook_runs(tmp_path):
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  env = dict(os.environ, XLA_FLAGS="")   # one device is enough here
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  executed = client.execute(env=env)
  outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any(o.output_type == "display_data" and "image/png" in o.data for o in outputs)
