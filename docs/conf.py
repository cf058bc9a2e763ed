"""Sphinx configuration of the gagar_jax documentation (``make docs``)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))
# Importing the package for autodoc must not grab devices or print XLA noise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "gagar_jax"
author = "gagar_jax authors"
copyright = "gagar_jax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
    "coverage_check",
]

# Markdown pages (MyST) and the notebooks in colab/ (linked under notebooks/).
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# The notebooks are executed by tests/test_notebooks.py; the docs render their source.
nb_execution_mode = "off"

exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints"]

autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# The browser judge drives playwright; the docs build does not need the browser extra.
autodoc_mock_imports = ["playwright"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "gagar_jax"


def _drop_builtin_type_docs(app, what, name, obj, options, lines):
    """A constant (a tuple, a dict) would show its type's docstring; show its value only."""
    if what in ("data", "attribute") and lines and type(obj).__module__ == "builtins":
        lines[:] = []


def setup(app):
    app.connect("autodoc-process-docstring", _drop_builtin_type_docs)
