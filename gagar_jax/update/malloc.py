"""Keep the host heap between update steps (glibc ``mallopt``), for scripts to call at start-up.

XLA:CPU allocates a compiled program's temporary buffer afresh on every call (311 MB for the
small benchmark config's update). glibc serves a request that large with ``mmap`` and returns
it with ``munmap``, so every step faults in and zero-fills those pages again: about 93,000
minor page faults and 0.14-0.19 s of kernel time per step of ~0.77 CPU-seconds. With
:func:`keep_heap` the allocator serves large blocks from its heap (``M_MMAP_MAX = 0``), keeps
freed memory instead of returning it (``M_TRIM_THRESHOLD``), and uses one arena
(``M_ARENA_MAX = 1``; the heaps of the other arenas are capped at 64 MB, too small for such a
buffer), so the next step reuses the same pages. The same as starting the process with
``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...``.

The cost: memory the process freed stays in its heap (its resident size stays at its peak)
and the heap can fragment. The setting is process-wide, so the library never applies it on
import: ``scripts/train.py`` and the benchmarks call :func:`keep_heap` first thing, and the
environment variable ``GAGAR_MALLOC_KEEP_HEAP=0`` turns it off. On a host where JAX will use an
accelerator (a CUDA, ROCm or TPU plugin is installed and ``JAX_PLATFORMS`` is not ``cpu``) the
default is off: the update's buffers live on the device, so there is nothing to keep, and one
arena would make the compiler's many threads share one allocator lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pkgutil
from importlib import metadata, util

ENV_VAR = "GAGAR_MALLOC_KEEP_HEAP"
# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, ~2 GiB of free heap kept


def accelerator_plugin() -> str | None:
    """The accelerator JAX will use in this process, found without initialising JAX: the
    platforms ``JAX_PLATFORMS`` names (None when it names only ``cpu``), else the installed JAX
    plugins (``jax_plugins`` entry points and namespace modules, ``libtpu``), comma-joined;
    None when there is none."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return None if platforms == "cpu" else platforms
    names = {ep.name for ep in metadata.entry_points(group="jax_plugins")}
    try:
        import jax_plugins  # a namespace package: importing it initialises nothing
    except ImportError:
        pass
    else:
        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    if util.find_spec("libtpu") is not None:
        names.add("libtpu")
    return ",".join(sorted(names)) or None


def keep_heap(enable: bool | None = None) -> bool:
    """Sets glibc's allocator to keep and reuse freed memory (see the module docstring).

    ``enable`` None: on unless the environment variable ``GAGAR_MALLOC_KEEP_HEAP`` is ``0``
    (or ``false`` / ``no`` / ``off``) or JAX will use an accelerator
    (:func:`accelerator_plugin`); True or False decides alone. Call it before the first JAX
    computation (threads that already have an arena keep it). Returns whether the setting was
    applied: False when disabled, or off glibc (no ``mallopt``) where nothing is changed.
    """
    if enable is None:
        enable = os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")
        enable = enable and accelerator_plugin() is None
    if not enable:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = True
    for param, value in (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_MAX, 0),
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
    ):
        ok = bool(mallopt(param, value)) and ok
    return ok
