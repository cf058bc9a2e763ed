"""Every notebook in colab/ executes top to bottom against the installed package."""

import os
import pathlib

import nbclient
import nbformat
import pytest

# Each notebook runs in its own kernel process (make test-unit skips them).
pytestmark = pytest.mark.e2e

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "colab").glob("*.ipynb"))


def test_notebooks_exist():
    assert NOTEBOOKS, "colab/ has no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # `from configs import ...` in the kernel: this checkout's configs package (its root first).
    root = str(pathlib.Path(__file__).parents[1])
    path_entries = [root, os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path_entries)))
    monkeypatch.setenv("XLA_FLAGS", "")  # one device: what a notebook user has
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3")
    client.execute(cwd=str(path.parent))
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
