"""The container back-end's test image: built once from Debian packages (``mmdebstrap``, no
registry) into a cache directory and imported, then reused by every later session."""

from __future__ import annotations

import functools
import os

import pytest

from gagar_jax.verify import container as ctr

CACHE_DIR = os.environ.get(
    "GAGAR_CONTAINER_CACHE", os.path.expanduser("~/.cache/gagar_jax/containers")
)


@functools.cache
def _engine_problem() -> str | None:
    try:
        ctr.container_engine()
    except ctr.ContainerUnavailable as e:
        return str(e)
    return None


@functools.cache
def base_image() -> str:
    """The default image of the back-end (python3 and pytest from Debian), built once; skips
    the calling test where no container engine is installed (``make system-deps`` installs
    podman, mmdebstrap and runc)."""
    problem = _engine_problem()
    if problem:
        pytest.skip(f"container back-end unavailable: {problem}")
    return ctr.build_base_image(ctr.DEFAULT_IMAGE, CACHE_DIR)
