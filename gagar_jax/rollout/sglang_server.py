"""Starting and stopping a real SGLang server on a CPU-only machine (tests, notebooks, small runs).

The server runs in its own virtual environment (`.venv-sglang`, built by
`scripts/setup_sglang.sh`): SGLang pins torch and numpy versions that must not share an environment
with the JAX stack. The flags below are the ones measured to work on CPU: float32 (the default dtype
made the KV cache float16 and 10x slower), torch-native attention and sampling, small token budgets
(the default memory fraction reserved 15 GB), no CUDA graphs, no warm-up, loopback only, no hub.

    with SGLangServer(model_dir, port=free_port()) as server:
        client = SGLangClient(server.url)
        ...

`stop()` kills the whole process group (the server forks scheduler and detokenizer processes); the
context manager and `atexit` make sure no server outlives its owner.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-sglang"
DEFAULT_STUB_DIR = REPO_ROOT / "scripts" / "sglang_cpu"
# On the PYTHONPATH of a server that returns routed experts: its host buffer without CUDA
# page-locking (scripts/sglang_cpu/host_memory/sitecustomize.py says why)
HOST_MEMORY_DIR = DEFAULT_STUB_DIR / "host_memory"
ROUTES_FLAG = "--enable-return-routed-experts"

CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--dtype",
    "float32",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--skip-server-warmup",
)

# For servers that answer constrained (JSON schema) requests, e.g. the agentic grader's verdicts:
# xgrammar lets any run of whitespace between JSON tokens unless told otherwise, which a weak
# model can fill until max_tokens. Two characters in a row at most.
CONSTRAINED_JSON_FLAGS = ("--constrained-json-max-whitespace-cnt", "2")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_python(venv: str | os.PathLike | None = None) -> Path:
    """The interpreter of the SGLang venv ($GAGAR_SGLANG_VENV or .venv-sglang at the repo root)."""
    venv = Path(venv or os.environ.get("GAGAR_SGLANG_VENV", DEFAULT_VENV))
    return venv / "bin" / "python"


def disabled_model_modules(
    venv: str | os.PathLike | None = None, keep: tuple[str, ...] = ("qwen2", "llama")
) -> list[str]:
    """SGLang model modules other than `keep`: the scheduler imports all ~250 of them at start-up
    unless SGLANG_DISABLED_MODEL_ARCHS names them, which costs a minute or more on a busy 2-core
    machine. Empty if the SGLang package is not found (nothing is disabled then)."""
    python = sglang_python(venv)
    found = sorted(python.parent.parent.glob("lib/python3*/site-packages/sglang/srt/models"))
    if not found:
        return []
    return sorted(
        f.stem for f in found[-1].glob("*.py") if f.stem not in keep and not f.stem.startswith("__")
    )


def server_env(
    stub_dir: str | os.PathLike | None = None,
    venv: str | os.PathLike | None = None,
    model_modules: tuple[str, ...] | None = ("qwen2", "llama"),
) -> dict[str, str]:
    """The environment the CPU server needs (see module docstring).

    `model_modules`: the SGLang model modules to import (None: all of them).
    """
    env = dict(os.environ)
    if model_modules is not None:
        disabled = disabled_model_modules(venv, tuple(model_modules))
        if disabled:
            env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(disabled)
    stub = str(stub_dir or DEFAULT_STUB_DIR)
    env["PYTHONPATH"] = stub + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    for key in ("XLA_FLAGS", "VIRTUAL_ENV"):  # the JAX side's settings mean nothing to the server
        env.pop(key, None)
    return env


class SGLangServer:
    """A `python -m sglang.launch_server` subprocess on 127.0.0.1 with the CPU flags.

    Args:
      model_dir: a Hugging Face layout directory (config.json, safetensors, tokenizer files).
      port: the port to serve on (`free_port()` if None).
      max_total_tokens, context_length, max_running_requests: the small token budgets.
      log_path: where the server's stdout/stderr go (a file next to the model if None).
      extra_args: more flags for launch_server.
      model_modules: SGLang model modules to import at start-up (None: all; see
        `disabled_model_modules`). Must include the served architecture's module.
      return_routes: a mixture-of-experts model's server that returns each token's routed
        experts (``--enable-return-routed-experts``; `SGLangClient(record_routes=...)` asks
        for them). On a machine without CUDA its host buffer is allocated without
        page-locking (``HOST_MEMORY_DIR`` on the server's PYTHONPATH).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        port: int | None = None,
        max_total_tokens: int = 8192,
        context_length: int = 2048,
        max_running_requests: int = 16,
        venv: str | os.PathLike | None = None,
        stub_dir: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        extra_args: tuple[str, ...] = (),
        model_modules: tuple[str, ...] | None = ("qwen2", "llama"),
        return_routes: bool = False,
    ):
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"SGLangServer.model_dir has no config.json: {self.model_dir}")
        self.python = sglang_python(venv)
        if not self.python.exists():
            raise FileNotFoundError(
                f"no SGLang venv interpreter at {self.python}: run `make sglang-venv` "
                "(scripts/setup_sglang.sh)"
            )
        self.port = int(port or free_port())
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(log_path or self.model_dir.parent / f"sglang-{self.port}.log")
        self.env = server_env(stub_dir, venv, model_modules)
        if return_routes:
            self.env["PYTHONPATH"] = str(HOST_MEMORY_DIR) + os.pathsep + self.env["PYTHONPATH"]
            extra_args = (ROUTES_FLAG, *extra_args)
        self.argv = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *CPU_FLAGS,
            "--max-total-tokens",
            str(max_total_tokens),
            "--context-length",
            str(context_length),
            "--max-running-requests",
            str(max_running_requests),
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._log = None

    # -------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 240.0) -> SGLangServer:
        """Launches the server; blocks until `/health` answers 200 (or raises with the log tail)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.url} is already running (pid {self.proc.pid})")
        t0 = time.monotonic()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        atexit.register(self.stop)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server for {self.url} exited with code {self.proc.returncode} during "
                    f"start-up; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.start_seconds = time.monotonic() - t0
                return self
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(
            f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s; "
            f"log {self.log_path}:\n"
            f"{tail}"
        )

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return (
                httpx.get(f"{self.url}/health", timeout=timeout_s, trust_env=False).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Stops the server's whole process group (SIGTERM, then SIGKILL after `timeout_s`)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(sig)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self._signal_group(signal.SIGKILL)
                    self.proc.wait(timeout=timeout_s)
            # Children (scheduler, detokenizer) may outlive the parent: sweep the group once more.
            self._signal_group(signal.SIGKILL)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """Hard stop (SIGKILL to the process group): a server crash, as far as a client can tell."""
        self.stop(sig=signal.SIGKILL, timeout_s=10.0)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session=True: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangRouter(SGLangServer):
    """SGLang's router (`python -m sglang_router.launch_router`, the `sglang-router` package) on
    127.0.0.1 in front of running servers; the client talks to `router.url` as to one server.

    Args:
      worker_urls: URLs of running SGLang servers.
      port: the router's port (`free_port()` if None).
      policy: routing policy (round_robin, random, cache_aware, power_of_two).
      log_path: where the router's output goes.
    """

    def __init__(
        self,
        worker_urls: list[str],
        *,
        port: int | None = None,
        policy: str = "round_robin",
        venv: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        if not worker_urls:
            raise ValueError("SGLangRouter.worker_urls must name at least one server")
        self.python = sglang_python(venv)
        if not self.python.exists():
            raise FileNotFoundError(f"no SGLang venv interpreter at {self.python}")
        self.port = int(port or free_port())
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(
            log_path or Path(tempfile.gettempdir()) / f"sglang-router-{self.port}.log"
        )
        self.env = _script_env()
        self.argv = [
            str(self.python),
            "-m",
            "sglang_router.launch_router",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            *extra_args,
        ]
        self.proc = None
        self.start_seconds = None
        self._log = None


def _script_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "VIRTUAL_ENV", "PYTHONPATH")
    }
    env.update(
        {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    )
    return env


def _run_model_script(args: list[str], venv, timeout_s: float, out_dir) -> Path:
    """Runs `scripts/sglang_cpu/make_tiny_model.py ARGS` with the SGLang venv's interpreter."""
    cmd = [str(sglang_python(venv)), str(DEFAULT_STUB_DIR / "make_tiny_model.py"), *args]
    res = subprocess.run(cmd, env=_script_env(), capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return Path(out_dir)


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    arch: str = "qwen2",
    venv: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
) -> Path:
    """Builds a tiny random model + locally trained BPE tokenizer in HF layout (in the SGLang venv).

    Runs `scripts/sglang_cpu/make_tiny_model.py` with the SGLang venv's interpreter (it needs torch,
    transformers and tokenizers, which the JAX venv does not have). Returns `out_dir`.
    """
    args = [
        "--out",
        str(out_dir),
        "--seed",
        str(seed),
        "--vocab-size",
        str(vocab_size),
        "--arch",
        arch,
    ]
    return _run_model_script(args, venv, timeout_s, out_dir)


def randomize_weights(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seed: int,
    venv: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
) -> Path:
    """Writes a copy of `model_dir` with fresh random weights (same config and tokenizer)."""
    args = ["--out", str(out_dir), "--seed", str(seed), "--like", str(model_dir)]
    return _run_model_script(args, venv, timeout_s, out_dir)


if __name__ == "__main__":  # python -m gagar_jax.rollout.sglang_server MODEL_DIR [PORT]
    with SGLangServer(sys.argv[1], port=int(sys.argv[2]) if len(sys.argv) > 2 else None) as srv:
        print(
            f"serving {srv.url} (started in {srv.start_seconds:.1f} s); Ctrl-C to stop", flush=True
        )
        try:
            while srv.running():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
