"""The docs build's undocumented-symbol check (docs/_ext/coverage_check.py), on the real API
pages."""

import os
import shutil
import sys

import pytest

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
sys.path.insert(0, os.path.join(DOCS, "_ext"))

import coverage_check  # noqa: E402


def test_every_public_symbol_is_on_an_api_page_with_a_docstring():
    assert coverage_check.missing_symbols(os.path.join(DOCS, "api")) == []


def test_a_symbol_left_off_the_api_pages_is_named(tmp_path):
    api = tmp_path / "api"
    shutil.copytree(os.path.join(DOCS, "api"), api, ignore=shutil.ignore_patterns("generated"))
    page = api / "advantages.md"
    text = page.read_text()
    assert "   gagar_advantages\n" in text
    page.write_text(text.replace("   gagar_advantages\n", ""))
    assert coverage_check.missing_symbols(str(api)) == [
        ("gagar_jax.advantages.gagar_advantages", "not listed on any page of docs/api/")
    ]


def test_a_public_function_without_a_docstring_is_named(tmp_path, monkeypatch):
    from gagar_jax import advantages

    def undocumented():
        pass

    monkeypatch.setattr(advantages, "group_stats", undocumented)
    missing = coverage_check.missing_symbols(os.path.join(DOCS, "api"))
    assert missing == [("gagar_jax.advantages.group_stats", "has no docstring")]


@pytest.mark.parametrize("doc", ["a.md", "b.rst"])
def test_listed_symbols_reads_autosummary_blocks(tmp_path, doc):
    (tmp_path / doc).write_text(
        "```{eval-rst}\n.. currentmodule:: pkg\n\n.. autosummary::\n   :toctree: generated\n\n"
        "   one\n   two\n```\n\nprose   not_a_symbol\n"
    )
    assert coverage_check.listed_symbols(str(tmp_path)) == {"pkg.one", "pkg.two"}
