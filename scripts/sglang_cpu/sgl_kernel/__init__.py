"""Import-only stand-in for `sgl_kernel` so a real SGLang server starts on a CPU without AMX.

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports a few names from `sgl_kernel` at load time,
and no CPU build of `sgl_kernel` is published (the `sglang-kernel` wheel needs libcuda). On a CPU
without AMX these kernels are never called: the server uses its torch-native paths. Every name here
raises if it ever is called, so a path that needs a real kernel fails loudly, never silently.

Any name not defined resolves to such a raising function too (module `__getattr__`), and
`scripts/sglang_cpu/check_sgl_kernel_names.py` lists the names SGLang actually imports, so an
upgrade that adds one is visible. Put this directory on PYTHONPATH only in the server's environment.
"""

import os

__version__ = "0.0.0+gagar-jax-cpu-stand-in"
_LOG = os.environ.get("GAGAR_SGL_KERNEL_LOG")  # check_sgl_kernel_names.py: record every name


def _record(event):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {event}\n")


class StandInKernelCalled(RuntimeError):
    pass


def _stand_in(name):
    def fn(*args, **kwargs):
        _record(f"call {name}")
        raise StandInKernelCalled(
            f"sgl_kernel.{name} was called, but this is gagar_jax's import-only stand-in for CPU "
            "servers (scripts/sglang_cpu). This SGLang code path needs the real kernel library."
        )

    fn.__name__ = name
    fn.__qualname__ = name
    return fn


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    _record(f"import {name}")
    fn = _stand_in(name)
    globals()[name] = fn
    return fn
