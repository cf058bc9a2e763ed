"""Opt-in per-test profile: CPU seconds, wall seconds and XLA compilations of every test.

Enabled by ``GAGAR_TEST_PROFILE=<prefix>``: each pytest process (each xdist worker) appends one
JSON line per test to ``<prefix>.<worker>.jsonl`` with the test's node id, its file, the process's
CPU seconds (user + system, every thread: XLA compiles on its own threads) and wall seconds over
the test's setup, call and teardown, the CPU seconds of the child processes it waited for
(sandboxes, scripts), and JAX's backend compilations during it (count and seconds,
plus the seconds spent tracing to jaxprs and lowering to MLIR; of those compilations, the ones the
persistent compilation cache answered and the compile seconds that saved).
``benchmarks/test_profile.py`` sums the lines per file and per test.
"""

import json
import os
import resource
import time

import pytest

_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    # The persistent compilation cache (tests/conftest.py): programs it returned, and the compile
    # seconds they took when first compiled, less the time to read them back.
    "/jax/compilation_cache/compile_time_saved_sec": "cache_hit",
}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CompileProfile:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.counts = {name: 0 for name in _EVENTS.values()}
        self.secs = {name: 0.0 for name in _EVENTS.values()}
        self.out = None
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event, duration, **kwargs):
        name = _EVENTS.get(event)
        if name is not None:
            self.counts[name] += 1
            self.secs[name] += duration

    def _open(self, config):
        if self.out is None:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            self.out = open(f"{self.prefix}.{worker}.jsonl", "a")
        return self.out

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        counts, secs = dict(self.counts), dict(self.secs)
        usage = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        yield
        wall = time.perf_counter() - wall
        cpu = _cpu(resource.RUSAGE_SELF) - usage[0]
        child_cpu = _cpu(resource.RUSAGE_CHILDREN) - usage[1]
        row = {
            "test": item.nodeid,
            "file": item.nodeid.split("::")[0],
            "cpu_s": round(cpu, 3),
            "child_cpu_s": round(child_cpu, 3),
            "wall_s": round(wall, 3),
            "compiles": self.counts["compile"] - counts["compile"],
            "cache_hits": self.counts["cache_hit"] - counts["cache_hit"],
        }
        for name in _EVENTS.values():
            row[f"{name}_s"] = round(self.secs[name] - secs[name], 3)
        out = self._open(item.config)
        out.write(json.dumps(row) + "\n")
        out.flush()


def register(config) -> None:
    prefix = os.environ.get("GAGAR_TEST_PROFILE")
    if prefix:
        config.pluginmanager.register(CompileProfile(prefix), "gagar-compile-profile")
