"""CPU-only SGLang servers: host buffers are allocated without CUDA page-locking.

SGLang 0.5.23 allocates the routed-experts capturer's host buffer (``--enable-return-routed-
experts``) with ``pin_memory=True``, and for the ``cpu`` device that calls
``cudaHostRegister`` through ``torch.cuda.cudart()``, which fails on a machine without an
NVIDIA driver (``sglang.srt.state_capturer.base.BaseHostCache`` ->
``sglang.srt.mem_cache.pool_host.common.alloc_with_host_register`` -> ``_cuda_host_register``).
Page-locking host memory only speeds up copies to a GPU; on a machine without one the buffer
is ordinary memory either way. This module (on the server's ``PYTHONPATH`` only, see
``gagar_jax.rollout.sglang_server.SGLangServer(return_routes=True)``) turns that one
registration into a no-op when torch sees no CUDA device, as soon as SGLang's module is
imported; nothing else changes. Re-check the function's name on an SGLang upgrade: if it is
gone, the server fails at start-up as it would without this module.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _patch(module) -> None:
    import torch

    if torch.cuda.is_available() or not hasattr(module, "_cuda_host_register"):
        return

    def _cuda_host_register(buffer, registration_granularity_bytes=None):
        return None  # no CUDA: nothing to page-lock the buffer for

    module._cuda_host_register = _cuda_host_register


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
