"""The container back-end's shadowing check: a candidate's new module that would be imported
instead of a package the image has installed is refused before the run, as under bwrap for the
sandbox's own environment, though the host has no such package."""

from __future__ import annotations

import os

import pytest
from container_fixtures import base_image
from test_verify_repo import FAST, _new_file_diff, _patch, _task

from gagar_jax.verify import container as ctr
from gagar_jax.verify.repo import verify_repo_patch

IMAGEPKGS = os.path.join(os.path.dirname(__file__), "fixtures", "containers", "imagepkgs")


@pytest.mark.container
def test_a_module_shadowing_an_image_installed_package_is_refused():
    base_image()
    spec = ctr.ContainerSpec(dockerfile=IMAGEPKGS)
    mods = ctr.image_modules(spec)
    assert mods["imgonly_pkg"][0] == "module" and mods["acmens"][0] == "namespace"
    assert mods["acmens.core"][0] == "module" and "pytest" in mods
    task = _task("statkit")
    fix = _patch("statkit", "minimal")

    def run(extra, **kw):
        kw.setdefault("container", spec)
        return verify_repo_patch(task, fix + extra, limits=FAST, environment="container", **kw)

    # a top-level module of the image's regular package
    v = run(_new_file_diff("imgonly_pkg.py", "VALUE = 2\n"))
    assert v.status == "failed" and "shadowing: imgonly_pkg.py" in (v.patch_error or ""), v
    assert "image's installed module 'imgonly_pkg'" in v.patch_error
    # a namespace portion ahead of the image's, holding its regular subpackage
    v = run(_new_file_diff("acmens/core/__init__.py", "X = 2\n"))
    assert v.status == "failed" and "shadowing: acmens/core/__init__.py" in (v.patch_error or "")
    # the same patches on the base image, which has neither package: nothing to shadow
    v = run(_new_file_diff("imgonly_pkg.py", "VALUE = 2\n"), container=ctr.DEFAULT_SPEC)
    assert v.status == "passed", v.test_log
    # a new module of a name the image does not have is the candidate's own
    v = run(_new_file_diff("statkit_helpers.py", "HELP = 1\n"))
    assert v.status == "passed", v.test_log


@pytest.mark.container
def test_a_task_environment_for_another_python_is_an_infra_error(tmp_path):
    """The task's uv environment is bound into the back-end's own image only when the image's
    interpreter is the Python it was built for; otherwise every run is an infra_error naming
    both versions, never a candidate's failure."""
    import dataclasses

    base_image()
    site = tmp_path / "env" / "lib" / "python3.99" / "site-packages"
    site.mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    task = dataclasses.replace(_task("statkit"), env_path=str(tmp_path / "env"))
    spec = ctr.container_spec(task, "container")
    assert spec.site_dirs == (str(site),)
    assert "built for python3.99" in ctr.container_problem(spec)
    v = verify_repo_patch(task, _patch("statkit", "minimal"), limits=FAST, environment="container")
    assert v.infra_error and "python3.99" in v.test_log, v.test_log
