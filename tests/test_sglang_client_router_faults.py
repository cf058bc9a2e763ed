"""The client's weight sync behind a router whose ``/workers`` listing fails for a moment.

A real SGLang router does this only when it is busy (a slow answer, or a worker briefly out of
its list), which a test cannot bring about on demand. So a stand-in router (a plain HTTP server,
named as such) answers 404 to ``/update_weights_from_disk`` as the real one does, and lists no
workers for its first ``empty`` answers; the worker behind it is a stand-in too.
"""

import http.server
import json
import threading

import pytest

from gagar_jax.rollout import SGLangClient, SGLangRequestError


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Router or worker, by ``server.role``; records the paths it was asked."""

    def log_message(self, *args):
        pass

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        srv = self.server
        srv.asked.append(self.path)
        if srv.role == "router" and self.path == "/workers":
            if srv.broken:
                return self._send(503, {"detail": "busy"})
            if srv.empty > 0:
                srv.empty -= 1
                return self._send(200, {"workers": []})
            return self._send(200, {"workers": [{"url": srv.worker_url}]})
        if srv.role == "worker" and self.path in ("/model_info", "/get_model_info"):
            return self._send(200, {"weight_version": srv.version})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        srv = self.server
        srv.asked.append(self.path)
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        if srv.role == "worker" and self.path == "/update_weights_from_disk":
            srv.version = body["weight_version"]
            return self._send(200, {"success": True, "message": "ok"})
        self._send(404, {"detail": "Not Found"})


def _serve(role, **attrs):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    srv.role, srv.asked = role, []
    for k, v in attrs.items():
        setattr(srv, k, v)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def router_and_worker():
    worker, worker_url = _serve("worker", version="0")
    router, router_url = _serve("router", worker_url=worker_url, empty=0, broken=False)
    yield router, router_url, worker
    router.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("empty", [0, 1, 2])
def test_a_momentarily_empty_worker_list_is_asked_again(router_and_worker, tmp_path, empty):
    router, url, worker = router_and_worker
    router.empty = empty
    client = SGLangClient(url, max_retries=0)
    assert client.update_weights_from_disk(str(tmp_path), version=7) == 7
    assert worker.version == "7" and client.policy_version == 7
    assert router.asked.count("/workers") == empty + 1
    assert client.metrics["router_workers_retries"] == empty
    assert client.metrics["router_weight_fanouts"] == 1


def test_a_router_that_keeps_listing_no_workers_fails_the_sync_by_name(router_and_worker, tmp_path):
    router, url, worker = router_and_worker
    router.empty = 10
    client = SGLangClient(url, max_retries=0, policy_version=3)
    with pytest.raises(SGLangRequestError, match=r"lists no workers at /workers \(asked 3 times\)"):
        client.update_weights_from_disk(str(tmp_path), version=4)
    assert router.asked.count("/workers") == 3 and client.metrics["router_workers_retries"] == 2
    assert worker.version == "0" and client.policy_version == 3


def test_a_router_that_never_answers_workers_is_named_as_such(router_and_worker, tmp_path):
    router, url, worker = router_and_worker
    router.broken = True
    client = SGLangClient(url, max_retries=0)
    with pytest.raises(SGLangRequestError, match=r"does not answer /workers \(asked 3 times\)"):
        client.update_weights_from_disk(str(tmp_path), version=4)
    assert router.asked.count("/workers") == 3 and worker.version == "0"
