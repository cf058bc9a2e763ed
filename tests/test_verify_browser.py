"""The browser judge with a real headless Chromium: calibration set, containment, deadlines.

One browser is shared by the module (``keep_browser=True``); the tests about process cleanup
start their own judge so they can check that its whole process tree is gone afterwards.
"""

import http.server
import json
import os
import shutil
import threading

import playwright  # noqa: F401
import pytest

from gagar_jax.verify import browser as B
from gagar_jax.verify.browser_rubric import RubricError, checklist_of, validate_rubric

if not os.path.exists(B.DEFAULT_EXECUTABLE):
    pytest.skip("chromium is not installed (make system-deps)", allow_module_level=True)

pytestmark = pytest.mark.browser

CAL = os.path.join(os.path.dirname(__file__), "fixtures", "browser_calibration")
CASES = B.load_calibration(CAL)
TODO = json.load(open(os.path.join(CAL, "labels.json")))["rubrics"]["todo"]
# Short waits keep the module's CI time low (dead pages poll expect_timeout_ms per item).
FAST = dict(
    load_timeout_s=3,
    call_timeout_s=2.5,
    deadline_s=30,
    expect_timeout_ms=300,
    action_timeout_ms=1000,
)


@pytest.fixture(scope="module")
def judge():
    with B.BrowserJudge(keep_browser=True, **FAST) as j:
        yield j
        pids = j.browser_pids
        assert pids, "a kept browser has a live process tree"
    assert B.alive(pids) == (), "close() leaves no browser process"


@pytest.fixture(scope="module")
def calibration(judge):
    verdicts = [judge.judge(c["dir"], c["rubric"]) for c in CASES]
    return verdicts, B.calibration_table(CASES, verdicts)


def test_calibration_agrees_with_planted_labels(calibration):
    verdicts, table = calibration
    print("\n" + table["markdown"])
    print(f"page agreement {table['page_agreement']:.3f}, item {table['item_agreement']:.3f}")
    assert len(CASES) >= 12
    assert all(v.status == "ok" for v in verdicts)
    disagree = [r["page"] for r in table["rows"] if not r["agree"]]
    assert disagree == [], table["markdown"]
    assert table["item_agreement"] == 1.0


def test_verdict_shape_and_evidence(calibration):
    verdicts, _ = calibration
    by = {c["page"]: v for c, v in zip(CASES, verdicts)}
    v = by["todo_dead_button"]
    assert 0.0 <= v.score <= 1.0
    assert set(v.timings) >= {"launch", "snapshot", "checklist", "plan", "execute", "judge"}
    assert v.checklist.ids == tuple(i["id"] for i in TODO["items"])
    failing = [i for i in v.items if not i.passed]
    assert failing and all(i.frame is not None and i.selector for i in failing)
    # the evidence frame is a real screenshot taken at that item's checks
    for i in v.items:
        f = v.frames[i.frame]
        assert f.item_id == i.id and f.step == "check" and f.screenshot[:2] == b"\xff\xd8"
    # a screenshot after every action of the plan, plus load and one check frame per item
    assert len(v.frames) == 1 + len(v.plan.steps) + len(v.items)
    assert "FAIL adds_item" in v.report()
    ok = by["todo_ok"]
    assert ok.score == 1.0 and ok.pass_rate == 1.0 and ok.fault is None
    assert by["todo_popup"].popups >= 1 and by["todo_popup"].score == 1.0
    assert by["todo_dialog_flood"].dialogs > 20
    assert any("127.0.0.1:9" in u for u in by["todo_loopback_fetch"].blocked_requests)


def test_source_padding_does_not_pay(calibration):
    """Same (dead) behaviour, 20x the source: same score. The judge reads the runtime."""
    verdicts, _ = calibration
    by = {c["page"]: v for c, v in zip(CASES, verdicts)}
    size = lambda p: os.path.getsize(os.path.join(CAL, p, "index.html"))  # noqa: E731
    assert size("todo_padded_broken") > 10 * size("todo_dead_button")
    assert by["todo_padded_broken"].score == by["todo_dead_button"].score == 0.25
    assert by["todo_source_only"].score == 0.25


class _Counting(http.server.BaseHTTPRequestHandler):
    hits: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        body = b"milk"
        self.send_response(200)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_other_loopback_ports_hosts_and_files_are_unreachable(judge, tmp_path):
    """A real server on another loopback port receives nothing; file:// and hosts fail too."""
    _Counting.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    secret = tmp_path / "secret.txt"
    secret.write_text("milk")
    art = tmp_path / "art"
    art.mkdir()
    (art / "index.html").write_text(
        f"""<!doctype html><html><body><p>Todo</p><ul id="list"></ul>
<img src="http://127.0.0.1:{port}/img.png"><iframe src="file://{secret}"></iframe>
<link rel="stylesheet" href="http://localhost:{port}/s.css">
<script>
const put = t => {{ const li = document.createElement('li'); li.textContent = t;
                    document.getElementById('list').appendChild(li); }};
fetch('http://127.0.0.1:{port}/answer').then(r => r.text()).then(put).catch(() => {{}});
fetch('file://{secret}').then(r => r.text()).then(put).catch(() => {{}});
fetch('http://example.com/').then(r => r.text()).then(put).catch(() => {{}});
try {{ const ws = new WebSocket('ws://127.0.0.1:{port}/'); ws.onmessage = e => put(e.data); }}
catch (e) {{}}
navigator.sendBeacon('http://127.0.0.1:{port}/beacon', 'x');
</script></body></html>"""
    )
    rubric = {
        "items": [
            {
                "id": "reached",
                "actions": [{"wait_ms": 300}],
                "expect": [{"count": {"css": "#list li"}, "at_least": 1}],
            }
        ]
    }
    try:
        v = judge.judge(art, rubric)
    finally:
        srv.shutdown()
        srv.server_close()
    assert v.status == "ok"
    assert v.items[0].passed is False and v.score == 0.0
    assert _Counting.hits == []
    blocked = " ".join(v.blocked_requests)
    assert f"127.0.0.1:{port}/answer" in blocked and f"ws://127.0.0.1:{port}" in blocked


def test_artifact_server_refuses_escapes(judge, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("milk")
    art = tmp_path / "art"
    art.mkdir()
    os.symlink(outside, art / "link.txt")
    (art / "index.html").write_text(
        """<!doctype html><html><body><p>Todo</p><ul id="list"></ul><script>
const put = t => { const li = document.createElement('li'); li.textContent = t;
                   document.getElementById('list').appendChild(li); };
for (const u of ['link.txt', '../outside.txt', '%2e%2e/outside.txt', '/..%2foutside.txt'])
  fetch(u).then(r => r.ok ? r.text() : '').then(t => t && put(t));
</script></body></html>"""
    )
    rubric = {
        "items": [
            {"id": "escaped", "actions": [{"wait_ms": 300}], "expect": [{"text_visible": "milk"}]}
        ]
    }
    v = judge.judge(art, rubric)
    assert v.status == "ok" and v.items[0].passed is False


def _judge_alone(page_dir, rubric, **kw):
    with B.BrowserJudge(**{**FAST, **kw}) as j:
        v = j.judge(page_dir, rubric)
        assert j.browser_pids == ()
    return v


@pytest.mark.parametrize("page", ["todo_loop_on_click", "todo_dom_growth"])
def test_hostile_pages_end_within_the_deadline_and_leave_no_process(page):
    v = _judge_alone(os.path.join(CAL, page), TODO, deadline_s=8)
    assert v.status == "ok" and v.score == 0.0 and v.fault in B.FAULTS
    # the deadline bounds every stage; teardown (close + SIGKILL + wait) comes on top
    assert v.timings["total"] - v.timings["teardown"] - v.timings["launch"] <= (
        8 + B.PROBE_S + B.DOM_PROBE_S + 1
    )
    assert len(v.browser_pids) >= 2  # browser + renderer(s) were seen
    assert B.alive(v.browser_pids) == ()


def test_spent_deadline_on_a_looping_page_is_a_score_zero(tmp_path):
    """The overall deadline (not the call cap) runs out: still a page fault, within bounds."""
    v = _judge_alone(os.path.join(CAL, "todo_loop_at_load"), TODO, deadline_s=2, load_timeout_s=10)
    assert v.status == "ok" and v.fault == "page_unresponsive" and v.score == 0.0
    assert B.alive(v.browser_pids) == ()


def test_pages_that_reload_or_close_themselves_score_zero_not_infra(judge, tmp_path):
    """A page must never turn its own failure into a masked infra_error."""
    rubric = {
        "items": [
            {
                "id": "a",
                "actions": [{"click": {"role": "button", "name": "Go"}}],
                "expect": [{"count": {"css": "li"}, "equals": 1}],
            }
        ]
    }
    for name, script in (
        ("reload", "setTimeout(() => location.reload(), 30);"),
        (
            "close",
            "document.querySelector('button').onclick = () => "
            "{ window.close(); location.href = 'about:blank'; };",
        ),
        (
            "away",
            "document.querySelector('button').onclick = () => "
            "{ location.href = 'http://127.0.0.1:9/'; };",
        ),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "index.html").write_text(
            f"<html><body><button>Go</button><script>{script}</script></body></html>"
        )
        v = judge.judge(d, rubric)
        assert v.status == "ok" and v.score == 0.0, (name, v.detail)


def test_dead_browser_is_infra_error(tmp_path):
    v = _judge_alone(os.path.join(CAL, "todo_ok"), TODO, executable_path=str(tmp_path / "nope"))
    assert v.status == "infra_error" and "browser did not start" in v.detail
    assert v.score == 0.0 and v.items == ()


def test_video_and_frames_on_disk(tmp_path):
    v = _judge_alone(
        os.path.join(CAL, "counter_ok"),
        json.load(open(os.path.join(CAL, "labels.json")))["rubrics"]["counter"],
        record_video=True,
        output_dir=tmp_path,
    )
    assert v.score == 1.0
    assert v.video and os.path.getsize(v.video) > 0
    assert all(f.path and os.path.exists(f.path) for f in v.frames)


# -- rubric schema ----------------------------------------------------------------------------


def _acts(r, k):
    return r["items"][k]["actions"]


def _exps(r, k):
    return r["items"][k]["expect"]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("items"), "items"),
        (lambda r: r.update(entry="http://evil/x.html"), "entry"),
        (lambda r: r.update(entry="../x.html"), "entry"),
        (lambda r: _acts(r, 1)[1].update(click={"role": "x"}), "items[1].actions[1].click.role"),
        (lambda r: _acts(r, 1)[0].update(fill={"css": "a", "b": 1}), "items[1].actions[0].fill"),
        (lambda r: _acts(r, 1).append({"wait_ms": 10**6}), "items[1].actions[2].wait_ms"),
        (lambda r: _acts(r, 1).append({"goto": "/etc/passwd"}), "items[1].actions[2].goto"),
        (lambda r: _exps(r, 1)[1].update(equals="2"), "items[1].expect[1].equals"),
        (lambda r: r["items"][0].update(weight=-1), "items[0].weight"),
        (lambda r: r["items"][0].update(expect=[]), "items[0].expect"),
        (lambda r: r["items"][2].update(id="renders_form"), "items[2].id"),
        (
            lambda r: _exps(r, 2).append({"no_console_errors": 1}),
            "items[2].expect[3].no_console_errors",
        ),  # noqa: E501
        (lambda r: _acts(r, 2)[1].update(key="Enter; rm"), "items[2].actions[1].key"),
    ],
)
def test_rubric_errors_name_the_field(mutate, field):
    rubric = json.loads(json.dumps(TODO))
    mutate(rubric)
    with pytest.raises(RubricError) as e:
        validate_rubric(rubric)
    assert e.value.field == field, str(e.value)


def test_rubric_round_trip_and_stable_checklist_ids():
    r = validate_rubric(TODO)
    assert validate_rubric(r.to_dict()) == r
    assert validate_rubric(json.dumps(TODO)) == r
    c1, c2 = checklist_of(r), checklist_of(validate_rubric(r.to_dict()))
    assert c1 == c2
    assert c1.entries[1].details[2][0] == "adds_item/expect/2"


def test_bad_rubric_is_the_callers_error_before_any_browser(tmp_path):
    j = B.BrowserJudge(**FAST)
    with pytest.raises(RubricError):
        j.judge(tmp_path, {"items": [{"id": "x"}]})
    assert j._loop is None  # nothing was started


def test_aria_roles_parser():
    aria = '- heading "Todo" [level=1]\n- textbox "New \\"item\\""\n- button "Add"\n- list'
    roles = B.aria_roles(aria)
    assert ("heading", "Todo") in roles and ("textbox", 'New "item"') in roles
    assert ("list", None) in roles and ("button", None) in roles


def test_snapshot_cap_is_logged(tmp_path, caplog):
    (tmp_path / "index.html").write_text(
        "<html><body>" + "".join(f"<p>line {i}</p>" for i in range(300)) + "</body></html>"
    )
    rubric = {"items": [{"id": "x", "expect": [{"text_visible": "line 299"}]}]}
    with caplog.at_level("WARNING", logger="gagar_jax.verify.browser"):
        v = _judge_alone(tmp_path, rubric, max_snapshot_chars=500)
    assert v.snapshot.truncated and len(v.snapshot.aria) == 500 and v.snapshot.aria_chars > 500
    assert v.score == 1.0  # the cap limits what is kept, not what is checked
    assert "truncated" in caplog.text


def test_copied_artifact_is_judged_the_same(judge, tmp_path):
    """The judge depends on the directory's content only (a fresh copy, a fresh origin)."""
    dst = tmp_path / "copy"
    shutil.copytree(os.path.join(CAL, "todo_partial"), dst)
    assert judge.judge(dst, TODO).score == 0.75
