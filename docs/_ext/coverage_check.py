"""Fails the docs build when a public symbol is undocumented.

A public symbol is a name in a package's ``__all__``. It is documented when an API page lists it
(an ``autosummary`` entry under the page's ``currentmodule``) and, for modules, classes and
functions, when it carries its own docstring. Each miss is a Sphinx warning, so the ``-W`` build
of ``make docs`` fails and names every missing symbol.
"""

import importlib
import inspect
import os
import re

from sphinx.util import logging

logger = logging.getLogger(__name__)

# The packages whose __all__ is the public API.
PUBLIC_PACKAGES = (
    "gagar_jax.advantages",
    "gagar_jax.analysis",
    "gagar_jax.envs",
    "gagar_jax.grading",
    "gagar_jax.losses",
    "gagar_jax.models",
    "gagar_jax.rollout",
    "gagar_jax.update",
    "gagar_jax.verify",
)

_CURRENT = re.compile(r"^\.\. currentmodule:: (\S+)\s*$")
_ENTRY = re.compile(r"^\s{3,}~?([A-Za-z_][\w.]*)\s*$")


def listed_symbols(api_dir):
    """Fully qualified names listed in the autosummary blocks of the API pages."""
    names = set()
    for fname in sorted(os.listdir(api_dir)):
        if not fname.endswith((".md", ".rst")):
            continue
        module, in_summary = None, False
        with open(os.path.join(api_dir, fname), encoding="utf-8") as f:
            for line in f:
                m = _CURRENT.match(line.strip())
                if m:
                    module = m.group(1)
                    continue
                if line.strip().startswith(".. autosummary::"):
                    in_summary = True
                    continue
                if in_summary:
                    if line.strip().startswith(":") or not line.strip():
                        continue
                    m = _ENTRY.match(line)
                    if m and module:
                        names.add(f"{module}.{m.group(1)}")
                    else:
                        in_summary = False
    return names


def own_docstring(obj):
    """The object's own docstring (not one inherited from a base class), or ''."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return (doc or "").strip()


def missing_symbols(api_dir, packages=PUBLIC_PACKAGES):
    """``[(name, reason)]`` for every public symbol the API pages leave undocumented."""
    listed = listed_symbols(api_dir)
    missing = []
    for package in packages:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            full = f"{package}.{name}"
            obj = getattr(module, name, None)
            if full not in listed:
                missing.append((full, "not listed on any page of docs/api/"))
            elif (
                inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
            ) and not own_docstring(obj):
                missing.append((full, "has no docstring"))
    return missing


def _check(app):
    api_dir = os.path.join(app.srcdir, "api")
    for full, reason in missing_symbols(api_dir):
        logger.warning("undocumented public symbol %s: %s", full, reason, type="coverage_check")


def setup(app):
    app.connect("builder-inited", _check)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
