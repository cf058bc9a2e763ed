"""Serving the gateway: uvicorn in a thread of the trainer (or of a test), or as its own process.

``GatewayServer(gateway).start()`` binds a socket on ``host`` (port 0: a free one), runs
uvicorn on it in a daemon thread with its own event loop and returns once it accepts
connections; ``url`` is then ``http://host:port`` and ``session_url(session)`` a session's
OpenAI/Anthropic base URL. ``stop()`` shuts it down (open sessions stay in the gateway object).

``uds``: also serve on a Unix socket at that path (mode 0666 in a 0755 directory): a sandboxed
harness without any network reaches the gateway, and nothing else, through it
(``gagar_jax.envs.harness`` binds it into the sandbox and forwards a loopback port to it).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import uvicorn

from gagar_jax.rollout.gateway.app import create_app


class GatewayServer:
    def __init__(
        self,
        gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_key=None,
        uds: str | None = None,
    ):
        self.gateway = gateway
        self.app = create_app(gateway, admin_key=admin_key)
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self._sockets = [self._sock]
        self.uds = uds
        if uds:
            os.makedirs(os.path.dirname(uds) or ".", exist_ok=True)
            os.chmod(os.path.dirname(uds) or ".", 0o755)
            if os.path.exists(uds):
                os.unlink(uds)
            unix = socket.socket(socket.AF_UNIX)
            unix.bind(uds)
            os.chmod(uds, 0o666)
            self._sockets.append(unix)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def session_url(self, session) -> str:
        """The session's base URL for both SDKs (OpenAI: ``base_url``; Anthropic: its
        ``base_url`` without the trailing ``/v1``, which the SDK adds)."""
        return f"{self.url}/sessions/{session.token}/v1"

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": self._sockets},
            name="gagar-gateway",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        for sock in self._sockets:
            sock.close()
        if self.uds and os.path.exists(self.uds):
            os.unlink(self.uds)

    def serve_forever(self) -> None:
        """Serves in the calling thread until interrupted (the command-line gateway)."""
        self._server.run(sockets=self._sockets)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
