"""Attack class: the harness surface (a harness, or the model's commands it runs, inside the
sandbox with the gateway as its one endpoint).

Each attack runs as a ``command`` harness episode through ``HarnessRunner`` (real bwrap sandbox,
real gateway on the tiny policy) and writes what it managed into ``report.json`` in its
workspace; the test reads it back from the episode's diff and checks the host. Every attack must
fail, and its episode must end ``finished`` (the harness's doing), never ``infra_error``. Network
probes aim at loopback addresses only: the sandbox's own ``lo`` and the host's gateway port.
The last attack fuzzes the gateway's HTTP surface directly: no request makes it answer 500.
"""

import json
import os
import secrets
import subprocess

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gagar_jax.envs.harness import HarnessConfig, HarnessRunner
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.envs.repo import RepoTask
from gagar_jax.rollout.gateway import BatchingBackend, Gateway, GatewayConfig, GatewayServer
from gagar_jax.rollout.sampler import Sampler
from tests.gateway_fixtures import tiny_policy
from tests.hf_fixtures import make_tiny_tokenizer

MARKER = "HIDDEN_" + secrets.token_hex(8)
TASK = RepoTask(
    task_id="attack",
    issue="fix a.py",
    files={"a.py": "x = 1\n", "tests/test_a.py": "def test():\n    pass\n"},
    fail_to_pass=("tests/test_a.py::test",),
    test_files=("tests/test_a.py",),
    test_patch=(
        "--- a/tests/test_a.py\n+++ b/tests/test_a.py\n@@ -1,2 +1,2 @@\n def test():\n"
        f"-    pass\n+    assert '{MARKER}'\n"
    ),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    sampler = Sampler(
        tiny_policy(tok),
        pad_id=tok.pad_id,
        batch_buckets=(1, 2),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    gw = Gateway(
        BatchingBackend(sampler),
        tok,
        GatewayConfig(context_limit=256, default_max_tokens=8, max_tokens_cap=16),
    )
    uds = str(tmp_path_factory.mktemp("gw") / "gateway.sock")
    with GatewayServer(gw, uds=uds, admin_key="admin-" + secrets.token_hex(8)) as server:
        yield gw, server


def attack(served, body: str, episode_id: str, **config) -> tuple[dict, object]:
    gw, server = served
    script = f"cat > /tmp/attack.py <<'GAGAR_EOF'\n{body}\nGAGAR_EOF\npython /tmp/attack.py"
    runner = HarnessRunner(gw, server, HarnessConfig(command=script, max_wall_s=60, **config))
    ep = runner.run(TASK, episode_id=episode_id)
    assert ep.status == "finished", (ep.finish_reason, ep.stderr[-2000:])
    assert ep.diff.ok, ep.diff.refused
    assert "report.json" in ep.diff.files, ep.stderr[-3000:]
    return json.loads(ep.diff.files["report.json"]), ep


def test_the_harness_reaches_no_host_but_the_gateway(served):
    _, server = served
    report, _ = attack(
        served,
        f"""
import json, os, socket, urllib.request
res = {{}}
for name, family, addr in [("host_gateway_tcp", socket.AF_INET, ("127.0.0.1", {server.port})),
                           ("host_gateway_v6", socket.AF_INET6, ("::1", {server.port}))]:
    try:
        socket.create_connection(addr, timeout=2); res[name] = "connected"
    except OSError as e:
        res[name] = type(e).__name__
res["interfaces"] = sorted(ln.split(":")[0].strip() for ln in open("/proc/net/dev").readlines()[2:])
res["routes"] = open("/proc/net/route").read().splitlines()[1:]
try:
    socket.getaddrinfo("pypi.org", 443); res["dns"] = "resolved"
except OSError:
    res["dns"] = "failed"
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                             headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}})
res["gateway"] = urllib.request.urlopen(req, timeout=10).status
json.dump(res, open("report.json", "w"))
""",
        "net",
    )
    assert report["host_gateway_tcp"] == "ConnectionRefusedError"  # the sandbox's own lo
    assert report["host_gateway_v6"] != "connected"
    assert report["interfaces"] == ["lo"] and report["routes"] == [] and report["dns"] == "failed"
    assert report["gateway"] == 200  # through the forwarded socket, and only that


def test_the_hidden_tests_are_nowhere_the_harness_can_look(served):
    report, ep = attack(
        served,
        f"""
import json, os, subprocess
m = "{MARKER[:9]}" + "{MARKER[9:]}"  # split: this script's own text must not hold the marker
found = subprocess.run(f"grep -rl {{m}} /workdir /tmp /home /root /var /opt /srv 2>/dev/null",
                       shell=True, capture_output=True, text=True).stdout.split()
env = [k for k, v in os.environ.items() if m in v]
tests = open("tests/test_a.py").read()
json.dump({{"found": found, "env": env, "tests": tests}}, open("report.json", "w"))
""",
        "hidden",
    )
    assert report == {"found": [], "env": [], "tests": "def test():\n    pass\n"}
    assert MARKER not in json.dumps(ep.record)


def test_the_harness_writes_nothing_outside_its_workspace(served, tmp_path):
    gw, server = served
    sock_dir = os.path.dirname(server.uds)
    host_tmp = f"/tmp/gagar_attack_{secrets.token_hex(4)}"
    stdlib = os.path.join(os.path.dirname(os.__file__), "gagar_attack.py")
    targets = ["/usr/gagar_attack", "/etc/gagar_attack", f"{sock_dir}/planted", host_tmp,
               "../../gagar_attack", stdlib]  # fmt: skip
    report, _ = attack(
        served,
        f"""
import json, os
res = {{}}
for t in {targets!r} + [os.environ["GAGAR_TASK_FILE"]]:
    try:
        open(t, "w").write("owned"); res[t] = "written"
    except OSError as e:
        res[t] = type(e).__name__
json.dump(res, open("report.json", "w"))
""",
        "writes",
    )
    for t in targets[:2] + targets[2:3] + targets[5:]:
        assert not os.path.exists(t), t
    assert not os.path.exists(host_tmp)  # the sandbox's /tmp is its own
    assert report[targets[0]] != "written" and report[targets[1]] != "written"
    assert report[f"{sock_dir}/planted"] != "written"


def test_no_process_outlives_the_episode(served):
    n = 4000 + secrets.randbelow(900)  # durations no other process on the machine sleeps
    attack(
        served,
        f"""
import json, os, subprocess
subprocess.Popen("setsid nohup sleep {n} >/dev/null 2>&1 &", shell=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "{n + 1}"])
    os._exit(0)
json.dump({{}}, open("report.json", "w"))
""",
        "leftovers",
    )
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout.splitlines()
    assert f"sleep {n}" not in ps and f"sleep {n + 1}" not in ps


def test_a_session_cannot_use_another_sessions_token_or_the_admin_routes(served):
    gw, server = served
    victim = gw.open_session("victim")
    guesses = [victim.token[:-1] + ("A" if victim.token[-1] != "A" else "B"), "gs-", "", "admin"]
    report, ep = attack(
        served,
        f"""
import json, os, urllib.request, urllib.error
base = os.environ["OPENAI_BASE_URL"].split("/sessions/")[0]
own = os.environ["OPENAI_API_KEY"]
body = json.dumps({{"model": "p", "messages": [{{"role": "user", "content": "hi"}}],
                    "max_tokens": 2}}).encode()
def status(url, key, data=body):
    req = urllib.request.Request(url, data=data, headers={{"Authorization": "Bearer " + key,
                                                            "Content-Type": "application/json"}})
    try:
        return urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as e:
        return e.code
res = {{"own": status(base + f"/sessions/{{own}}/v1/chat/completions", "x")}}
for g in {guesses!r}:
    res["path:" + g] = status(base + f"/sessions/{{g}}/v1/chat/completions", own)
    res["key:" + g] = status(base + "/v1/chat/completions", g)
res["admin_open"] = status(base + "/admin/sessions", own, b"{{}}")
res["admin_read"] = status(base + "/admin/episodes/victim", own, None)
json.dump(res, open("report.json", "w"))
""",
        "forger",
    )
    assert report.pop("own") == 200
    assert set(report.values()) == {404}, report
    assert victim.calls == [] and gw.store.get(victim.token) is victim
    assert len(ep.record["calls"]) == 1
    gw.finish_session(victim.token)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=20,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "x"]), "content": JSON},
    optional={"tool_calls": JSON, "tool_call_id": JSON},
)
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={
        "tools": JSON,
        "stream": JSON,
        "temperature": JSON,
        "max_tokens": JSON,
        "stop": JSON,
        "n": JSON,
        "tool_choice": JSON,
        "system": JSON,
        "stop_sequences": JSON,
        "top_k": JSON,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY | JSON, route=st.sampled_from(["chat/completions", "messages"]))
def test_no_request_makes_the_gateway_raise(served, body, route):
    gw, server = served
    s = gw.open_session()
    try:
        r = httpx.post(
            f"{server.session_url(s)}/{route}",
            content=json.dumps(body, allow_nan=True),
            timeout=30,
        )
    finally:
        gw.finish_session(s.token)
    assert r.status_code in (200, 400), (r.status_code, r.text[:500])
    assert isinstance(r.json(), dict) or r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"\xff\xfe", b"{}" * 3],
)
def test_malformed_bodies_are_400(served, raw):
    gw, server = served
    s = gw.open_session()
    r = httpx.post(f"{server.session_url(s)}/chat/completions", content=raw, timeout=30)
    gw.finish_session(s.token)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
