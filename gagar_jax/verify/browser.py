"""Interactive browser judge for front-end artifacts (rubric verifier of the verification paper).

``BrowserJudge(...).judge(artifact_dir, rubric) -> BrowserVerdict`` runs the artifact in a real
headless Chromium (Debian's ``chromium`` driven by the ``playwright`` package, launched with
``executable_path``) and scores it against a rubric (``browser_rubric``) by what the page *does*,
never by what its source says. The pipeline of the paper, each stage typed and timed
(``BrowserVerdict.timings``):

=========  ====================================================================================
stage      what happens
=========  ====================================================================================
launch     browser + isolated context (own loopback origin, request routing, dialog/popup
           handlers); reused across calls with ``keep_browser=True``
snapshot   load the entry page; ``PageSnapshot``: ARIA snapshot (capped at
           ``max_snapshot_chars``, truncation recorded), title, URL, DOM size, visible
           elements, console and page errors. Gate: a page that does not load, renders blank,
           throws at load or floods the DOM scores 0 before any item (no render, no reward)
checklist  rubric -> ``Checklist`` (key items with stable ids, one detail per expectation)
plan       one-pass ``ActionPlan``: the rubric's own actions (rule-based default) or an LLM
           planner's for items that only have a description; validated against the snapshot
           (an LLM plan naming a target that is neither on the page nor in the rubric is
           rejected, re-asked, then falls back)
execute    the plan on one page, items in order (state carries over), a screenshot ``Frame``
           after every action and at every item's checks; a video when ``record_video``
judge      rule-based: each item passes iff all its expectations hold (polled for
           ``expect_timeout_ms``); the evidence is the frame and selector of the check. An
           optional LLM judge (``BrowserLLMJudge``) can veto a pass or decide description-only
           items, only with a quote grounded in a frame's runtime ARIA text
=========  ====================================================================================

``score`` = weighted fraction of items passed (items an LLM could not judge are left out of both
sides; if none can be judged the verdict is ``infra_error``: masked, never scored 0).

Containment (each point has a test in ``tests/test_verify_browser.py``):

* The artifact directory is served by the judge's own HTTP server on ``127.0.0.1:<random port>``
  (GET/HEAD only, no listings, nothing outside the directory, symlinks out refused). Every
  request of the context goes through ``BrowserContext.route``: only that origin continues,
  everything else (other loopback ports, other hosts, ``file://``) is aborted and recorded in
  ``blocked_requests``; WebSockets are routed and closed; service workers are blocked; host
  names do not resolve (``--host-resolver-rules``).
* Every browser call (``evaluate``, ``aria_snapshot``, screenshots, actions, CDP) runs under
  ``asyncio.wait_for`` with ``min(call_timeout_s, time left of deadline_s)``. A call that runs
  past it makes the judge probe the browser with a fresh page: a live browser means the page is
  at fault (``fault="page_unresponsive"``, score 0); a dead one is ``infra_error``.
* Dialogs are dismissed (more than ``max_dialogs`` is a fault), popups are closed and counted, a
  renderer crash is ``fault="page_crashed"``, a DOM past ``max_dom_nodes`` is ``"dom_growth"``.
* After every call (``keep_browser=False``, the default) or at ``close()``, the browser is
  closed, and every process of its tree still alive is SIGKILLed (found by a unique launch
  token and the ``/proc`` parent links); ``verdict.browser_pids`` lists the tree, for tests.

Chromium runs as root here only with ``--no-sandbox``: its own sandbox is off, so the page is
contained by the routing above and, for untrusted artifacts in training, by running the judge in
the project's sandbox user/namespace like any other verifier.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import http.server
import json
import logging
import mimetypes
import os
import re
import secrets
import signal
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.verify.browser_rubric import (
    Action,
    Checklist,
    Expectation,
    Rubric,
    RubricError,
    RubricItem,
    Target,
    checklist_of,
    validate_rubric,
)

_log = logging.getLogger(__name__)
STATUSES = ("ok", "infra_error")
FAULTS = (
    "no_render",  # the entry page did not load (missing, HTTP error, navigation failed)
    "blank",  # loaded but nothing visible
    "load_error",  # an uncaught exception while loading
    "page_unresponsive",  # a browser call on the page ran past its deadline; the browser lived
    "page_crashed",  # the renderer crashed
    "dom_growth",  # the DOM grew past max_dom_nodes
    "dialog_flood",  # more than max_dialogs dialogs
    "page_closed",  # the page closed itself (window.close())
    "page_error",  # a browser call failed because of the page (e.g. it navigated mid-call)
)
DEFAULT_EXECUTABLE = "/usr/bin/chromium"
PROBE_S = 5.0  # the liveness probe after a call ran past its deadline
DOM_PROBE_S = 1.5  # then: is the page's DOM flooded (a DOM count that still answers)?
_CHROMIUM_ARGS = (
    "--no-sandbox",  # Chromium refuses to start as root otherwise (see the module docstring)
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--js-flags=--max-old-space-size=512",
)
# Page measurements go through Playwright locators, which run in Playwright's isolated utility
# world: a page that monkeypatches DOM methods in its own world cannot fake them.


class BrowserUnavailable(RuntimeError):
    """Chromium or the playwright package is missing (an infrastructure problem)."""


class _Deadline(Exception):
    """A browser call ran past its wall-clock deadline."""


class _PageFault(Exception):
    def __init__(self, fault: str, detail: str):
        super().__init__(f"{fault}: {detail}")
        self.fault = fault
        self.detail = detail


# ------------------------------------------------------------------------------------------------
# Typed stage outputs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PageSnapshot:
    """Page information after load (the paper's accessibility tree and browser state)."""

    url: str
    title: str
    aria: str  # ARIA snapshot YAML, capped
    aria_chars: int  # its length before the cap
    truncated: bool
    dom_nodes: int
    text_chars: int
    visible_elements: int  # 0 or 1: whether any element of the body is visible
    console_errors: tuple[str, ...]
    page_errors: tuple[str, ...]

    @property
    def roles(self) -> frozenset[tuple[str, str | None]]:
        return aria_roles(self.aria)


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """One action of the plan; ``in_snapshot`` says whether its target is on the loaded page."""

    item_id: str
    index: int
    action: Action
    in_snapshot: bool | None  # None for actions without a target


@dataclasses.dataclass(frozen=True)
class ActionPlan:
    """The one-pass plan: for each item, its actions and checks (``source``: rubric | llm)."""

    items: tuple[RubricItem, ...]
    steps: tuple[PlannedStep, ...]
    source: Mapping[str, str]  # item id -> "rubric" | "llm" | "unplanned"
    rejections: tuple[str, ...] = ()  # why LLM plans were rejected (before the fallback)


@dataclasses.dataclass(frozen=True)
class Frame:
    """A screenshot after an action (``step``) or at an item's checks (``"check"``)."""

    index: int
    item_id: str | None
    step: str
    url: str
    screenshot: bytes | None
    path: str | None = None
    aria: str = ""  # runtime ARIA text at this frame (kept when an LLM judge reads frames)


@dataclasses.dataclass(frozen=True)
class CheckOutcome:
    detail_id: str
    passed: bool
    detail: str
    selector: str | None


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """One checklist item's outcome; ``frame`` and ``selector`` are its evidence."""

    id: str
    passed: bool | None  # None: could not be judged (left out of the score)
    weight: float
    frame: int | None
    selector: str | None
    evidence: str
    checks: tuple[CheckOutcome, ...] = ()
    judged_by: str = "rules"


@dataclasses.dataclass(frozen=True)
class BrowserVerdict:
    """The judge's verdict on one artifact.

    Attributes:
      status: ``"ok"`` or ``"infra_error"`` (browser failed to start or died: mask, don't score).
      score: weighted fraction of judged items that passed, in [0, 1] (0 under a ``fault``).
      items: per checklist item, pass/fail with the evidence frame and selector.
      timings: seconds per stage (launch, snapshot, checklist, plan, execute, judge, teardown,
        total).
      fault: why the page earned 0 regardless of items (one of ``FAULTS``), or None.
      detail: a readable reason for faults and infra errors.
      snapshot, checklist, plan, frames: the stages' typed outputs.
      blocked_requests: URLs the routing aborted; dialogs, popups: how many were handled.
      video: path of the recorded video (``record_video``), else None.
      browser_pids: the browser's process tree as seen at teardown (all gone when returned,
        unless ``keep_browser``).
    """

    status: str
    score: float
    items: tuple[ItemResult, ...]
    timings: Mapping[str, float]
    fault: str | None = None
    detail: str = ""
    snapshot: PageSnapshot | None = None
    checklist: Checklist | None = None
    plan: ActionPlan | None = None
    frames: tuple[Frame, ...] = ()
    blocked_requests: tuple[str, ...] = ()
    dialogs: int = 0
    popups: int = 0
    video: str | None = None
    browser_pids: tuple[int, ...] = ()

    @property
    def pass_rate(self) -> float:
        """Unweighted fraction of judged items that passed (0 under a fault)."""
        judged = [i for i in self.items if i.passed is not None]
        if self.fault or not judged:
            return 0.0
        return sum(1 for i in judged if i.passed) / len(judged)

    def report(self) -> str:
        """A short deterministic text (a verifier's test log): one PASS/FAIL line per item."""
        lines = [f"browser judge: status {self.status}, score {self.score:.3f}"]
        if self.fault:
            lines.append(f"FAULT {self.fault}: {self.detail}")
        elif self.detail:
            lines.append(self.detail)
        for it in self.items:
            mark = "SKIP" if it.passed is None else "PASS" if it.passed else "FAIL"
            lines.append(f"{mark} {it.id}: {it.evidence}")
        if self.blocked_requests:
            lines.append(f"blocked requests: {len(self.blocked_requests)}")
        return "\n".join(lines)


def aria_roles(aria: str) -> frozenset[tuple[str, str | None]]:
    """``(role, name)`` pairs of an ARIA snapshot (``- button "Add"`` -> ("button", "Add")).

    Each role also appears with name None, so a name-less target matches any element of it.
    """
    out: set[tuple[str, str | None]] = set()
    for m in re.finditer(r'^\s*- ([a-z]+)(?: "((?:[^"\\]|\\.)*)")?', aria, re.MULTILINE):
        role, name = m.group(1), m.group(2)
        out.add((role, None))
        if name is not None:
            out.add((role, name.replace('\\"', '"').replace("\\\\", "\\")))
    return frozenset(out)


# ------------------------------------------------------------------------------------------------
# Artifact server and process handling
# ------------------------------------------------------------------------------------------------


class _ArtifactServer:
    """Serves one directory on 127.0.0.1:<ephemeral port> (GET/HEAD, files only, no escapes)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        root_dir = self.root

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _file(self) -> str | None:
                path = urllib.parse.urlsplit(self.path).path
                rel = urllib.parse.unquote(path).lstrip("/") or "index.html"
                full = os.path.realpath(os.path.join(root_dir, rel))
                if not full.startswith(root_dir + os.sep) or not os.path.isfile(full):
                    return None
                return full

            def _serve(self, body: bool) -> None:
                full = self._file()
                if full is None:
                    self.send_error(404)
                    return
                with open(full, "rb") as f:
                    data = f.read()
                ctype = mimetypes.guess_type(full)[0] or "application/octet-stream"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's naming
                self._serve(True)

            def do_HEAD(self):  # noqa: N802
                self._serve(False)

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # quiet: the page hung up
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline) from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        out[int(name)] = (int(rest[1]), rest[0], cmd)
    return out


def process_tree(token: str) -> tuple[int, ...]:
    """Live (non-zombie) processes whose cmdline has ``token``, and all their descendants."""
    table = _proc_table()
    roots = {p for p, (_, _, cmd) in table.items() if token in cmd}
    tree = set(roots)
    grew = True
    while grew:
        grew = False
        for p, (pp, _, _) in table.items():
            if pp in tree and p not in tree:
                tree.add(p)
                grew = True
    return tuple(sorted(p for p in tree if table[p][1] != "Z"))


def alive(pids: Sequence[int]) -> tuple[int, ...]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    table = _proc_table()
    return tuple(p for p in pids if p in table and table[p][1] != "Z")


def _kill(pids: Sequence[int], wait_s: float = 3.0) -> tuple[int, ...]:
    """SIGKILLs ``pids`` and waits until they are gone; returns the survivors."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + wait_s
    left = alive(pids)
    while left and time.monotonic() < end:
        time.sleep(0.02)
        left = alive(left)
    return left


# ------------------------------------------------------------------------------------------------
# The judge
# ------------------------------------------------------------------------------------------------


class _Run:
    """Mutable state of one judge call (events recorded by page handlers)."""

    def __init__(self, root: str, deadline: float):
        self.root = root
        self.deadline = deadline
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.blocked: list[str] = []
        self.dialogs = 0
        self.popups = 0
        self.crashed = False
        self.frames: list[Frame] = []
        self.video: str | None = None
        self.video_file = None
        self.video_times: list[Any] = []
        self.abort = asyncio.Event()  # set by handlers (dialog flood, crash): calls stop at once

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def errors(self) -> int:
        return len(self.console_errors) + len(self.page_errors)


class BrowserJudge:
    """Judges front-end artifacts in a real headless Chromium (see the module docstring).

    Args:
      executable_path: the Chromium binary (Debian's ``/usr/bin/chromium`` by default).
      deadline_s: wall-clock budget of one ``judge`` call, every browser call included.
      call_timeout_s: cap on any single browser call (also bounded by the time left).
      load_timeout_s: cap on loading a page (``goto``).
      action_timeout_ms: Playwright's auto-wait for actions (a missing/hidden target fails).
      expect_timeout_ms: how long an expectation is polled before it fails.
      settle_ms: wait after load and after each action before measuring.
      viewport: page size in CSS pixels.
      max_snapshot_chars: cap of the ARIA snapshot kept in ``PageSnapshot`` (truncation logged).
      max_dom_nodes: a DOM larger than this is the ``dom_growth`` fault.
      max_dialogs: more dialogs than this is the ``dialog_flood`` fault.
      screenshots: take a JPEG after every action (the frames); False only for benchmarks.
      record_video: record a video of the page (CDP screencast -> ``output_dir/video/
        video.mjpeg``; needs ``output_dir``).
      output_dir: where frames (``frame-NNN.jpg``) and the video are written (else in memory).
      keep_browser: keep one browser between calls (tests, benchmarks, graders); ``close()``
        ends it. Default: a fresh browser per call, gone when ``judge`` returns.
      planner: an optional ``BrowserLLMPlanner`` (plans items that have only a description).
      llm_judge: an optional ``BrowserLLMJudge``.
    """

    def __init__(
        self,
        *,
        executable_path: str | None = None,
        deadline_s: float = 60.0,
        call_timeout_s: float = 8.0,
        load_timeout_s: float = 10.0,
        action_timeout_ms: int = 2000,
        expect_timeout_ms: int = 750,
        settle_ms: int = 50,
        viewport: tuple[int, int] = (800, 600),
        max_snapshot_chars: int = 20_000,
        max_dom_nodes: int = 20_000,
        max_dialogs: int = 20,
        screenshots: bool = True,
        record_video: bool = False,
        output_dir: str | os.PathLike | None = None,
        keep_browser: bool = False,
        planner: Any = None,
        llm_judge: Any = None,
    ):
        for name, val in (
            ("deadline_s", deadline_s),
            ("call_timeout_s", call_timeout_s),
            ("load_timeout_s", load_timeout_s),
        ):
            if not val > 0:
                raise ValueError(f"BrowserJudge.{name} must be > 0 seconds, got {val!r}")
        if record_video and output_dir is None:
            raise ValueError("BrowserJudge.record_video needs output_dir (where the video goes)")
        self.executable_path = executable_path or DEFAULT_EXECUTABLE
        self.deadline_s = float(deadline_s)
        self.call_timeout_s = float(call_timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self.action_timeout_ms = int(action_timeout_ms)
        self.expect_timeout_ms = int(expect_timeout_ms)
        self.settle_ms = int(settle_ms)
        self.viewport = {"width": int(viewport[0]), "height": int(viewport[1])}
        self.max_snapshot_chars = int(max_snapshot_chars)
        self.max_dom_nodes = int(max_dom_nodes)
        self.max_dialogs = int(max_dialogs)
        self.screenshots = screenshots
        self.record_video = record_video
        self.output_dir = os.fspath(output_dir) if output_dir is not None else None
        self.keep_browser = keep_browser
        self.planner = planner
        self.llm_judge = llm_judge
        self.metrics: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pw = None
        self._browser = None
        self._token = ""
        self._pids: tuple[int, ...] = ()

    # -- public ------------------------------------------------------------------------------

    def judge(self, artifact_dir: str | os.PathLike, rubric: Any) -> BrowserVerdict:
        """Judges the artifact in ``artifact_dir`` against ``rubric`` (dict, JSON or ``Rubric``).

        Raises ``RubricError`` for a malformed rubric (the caller's bug, named field). Never
        raises for anything the page does; browser failures come back as ``infra_error``.
        """
        rub = validate_rubric(rubric, require_expect=self.planner is None)
        artifact_dir = os.fspath(artifact_dir)
        if not os.path.isdir(artifact_dir):
            raise ValueError(
                f"BrowserJudge.judge: artifact_dir {artifact_dir!r} is not a directory"
            )
        with self._lock:
            self.metrics["judged"] += 1
            loop = self._ensure_loop()
            t0 = time.monotonic()
            fut = asyncio.run_coroutine_threadsafe(self._judge(artifact_dir, rub, t0), loop)
            try:
                verdict = fut.result(timeout=self.deadline_s + 120.0)  # + launch, probe, teardown
            except BaseException as e:  # noqa: BLE001 - the loop itself is stuck or died
                fut.cancel()
                self._hard_kill()
                verdict = self._infra(f"judge did not finish: {type(e).__name__}: {e}", t0)
            self.metrics[f"status/{verdict.status}"] += 1
            if verdict.fault:
                self.metrics[f"fault/{verdict.fault}"] += 1
            return verdict

    def close(self) -> None:
        """Closes the browser (killing its process tree) and the judge's event-loop thread."""
        with self._lock:
            if self._loop is None:
                return
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(timeout=15)
            except BaseException:  # noqa: BLE001
                self._hard_kill()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> BrowserJudge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if self._pids:
                _kill(alive(self._pids), wait_s=0.5)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def browser_pids(self) -> tuple[int, ...]:
        """The live browser process tree (empty when no browser runs)."""
        return process_tree(self._token) if self._token else ()

    # -- loop and browser ---------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="browser-judge", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    async def _launch(self) -> None:
        if self._browser is not None and self._browser.is_connected():
            return
        if not os.path.exists(self.executable_path):
            raise BrowserUnavailable(
                f"no Chromium at {self.executable_path} (apt-get install chromium)"
            )
        try:
            from playwright.async_api import async_playwright
        except ImportError as e:
            raise BrowserUnavailable(
                "the playwright package is not installed (pip install -e '.[browser]')"
            ) from e
        if self._pw is None:
            self._pw = await asyncio.wait_for(async_playwright().start(), 30)
        self._token = f"--gagar-judge={secrets.token_hex(8)}"
        self._browser = await asyncio.wait_for(
            self._pw.chromium.launch(
                executable_path=self.executable_path,
                headless=True,
                args=[*_CHROMIUM_ARGS, self._token],
                timeout=30_000,
            ),
            35,
        )
        self._pids = process_tree(self._token)

    async def _close_browser(self) -> tuple[int, ...]:
        """Closes the browser; SIGKILLs whatever of its tree survives. Returns the tree seen."""
        pids = process_tree(self._token) if self._token else ()
        pids = tuple(sorted(set(pids) | set(self._pids)))
        if self._browser is not None:
            try:
                await asyncio.wait_for(self._browser.close(), 5)
            except BaseException:  # noqa: BLE001 - a hung browser is killed below
                pass
        self._browser = None
        survivors = await asyncio.to_thread(_kill, alive(pids), 3.0)
        if survivors:
            self.metrics["unkillable_processes"] += len(survivors)
        self._pids = ()
        return pids

    async def _shutdown(self) -> None:
        await self._close_browser()
        if self._pw is not None:
            try:
                await asyncio.wait_for(self._pw.stop(), 10)
            except BaseException:  # noqa: BLE001
                pass
            self._pw = None

    def _hard_kill(self) -> None:
        pids = set(self._pids) | set(process_tree(self._token) if self._token else ())
        _kill(alive(sorted(pids)))
        self._browser = None
        self._pids = ()

    def _infra(self, detail: str, t0: float, **kw: Any) -> BrowserVerdict:
        self.metrics["infra_error"] += 1
        return BrowserVerdict(
            "infra_error", 0.0, (), {"total": time.monotonic() - t0}, detail=detail, **kw
        )

    # -- one judge call ------------------------------------------------------------------------

    async def _call(self, run: _Run, aw: Any, cap: float | None = None) -> Any:
        """Awaits ``aw`` under min(cap or call_timeout_s, time left); raises ``_Deadline``."""
        left = run.left()
        timeout = min(cap if cap is not None else self.call_timeout_s, left)
        if timeout <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise _Deadline("the judge's deadline is spent")
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(run.abort.wait())
        try:
            done, _ = await asyncio.wait(
                {task, stop}, timeout=timeout, return_when="FIRST_COMPLETED"
            )
        finally:
            stop.cancel()
        if task in done:
            return task.result()
        task.cancel()
        task.add_done_callback(_drop)
        if stop in done:
            raise _Deadline("stopped: the page crashed or flooded dialogs")
        raise _Deadline(f"browser call exceeded {timeout:.1f} s")

    async def _browser_alive(self) -> bool:
        """A fresh page in a fresh context answers within PROBE_S (the probe after a deadline)."""

        async def probe() -> bool:
            ctx = await self._browser.new_context()
            try:
                page = await ctx.new_page()
                return await page.evaluate("1 + 1") == 2
            finally:
                await ctx.close()

        try:
            return await asyncio.wait_for(probe(), PROBE_S)
        except BaseException:  # noqa: BLE001
            return False

    async def _judge(self, artifact_dir: str, rubric: Rubric, t0: float) -> BrowserVerdict:
        timings: dict[str, float] = {}
        run = _Run(artifact_dir, t0 + self.deadline_s)
        server = _ArtifactServer(artifact_dir)
        ctx = None
        pids: tuple[int, ...] = ()
        try:
            t = time.monotonic()
            try:
                await self._launch()
            except BaseException as e:  # noqa: BLE001
                return self._infra(f"browser did not start: {type(e).__name__}: {e}", t0)
            # The deadline covers the page's work, not the browser's start (an infra cost).
            run.deadline = time.monotonic() + self.deadline_s
            ctx, page = await self._new_context(run, server.origin)
            timings["launch"] = time.monotonic() - t
            verdict = await self._pipeline(run, page, server.origin, rubric, timings)
        except BaseException as e:  # noqa: BLE001 - anything unexpected is the judge's fault
            verdict = None
            detail = f"judge error: {type(e).__name__}: {e}"[:500]
        finally:
            t = time.monotonic()
            if ctx is not None:
                try:
                    await asyncio.wait_for(ctx.close(), 5)
                except BaseException:  # noqa: BLE001 - closed with the browser below
                    pass
            video = None
            if run.video_file is not None:
                run.video_file.close()
                with open(run.video[: -len(".mjpeg")] + ".json", "w") as f:
                    json.dump({"frames": len(run.video_times), "timestamps": run.video_times}, f)
                video = run.video if run.video_times else None
            if not self.keep_browser or (verdict is not None and verdict.status != "ok"):
                pids = await self._close_browser()
            server.close()
            timings["teardown"] = time.monotonic() - t
            timings["total"] = time.monotonic() - t0
        if verdict is None:
            return self._infra(detail, t0, browser_pids=pids)
        return dataclasses.replace(
            verdict,
            timings=dict(timings),
            video=os.fspath(video) if video else None,
            browser_pids=pids,
        )

    async def _new_context(self, run: _Run, origin: str):
        opts: dict[str, Any] = {
            "viewport": self.viewport,
            "service_workers": "block",
            "accept_downloads": False,
            "base_url": origin,
        }
        ctx = await self._call(run, self._browser.new_context(**opts), 10)
        ctx.set_default_timeout(self.action_timeout_ms)

        async def route(r):
            url = r.request.url
            if url == origin or url.startswith(origin + "/"):
                await r.continue_()
            else:
                run.blocked.append(url[:300])
                await r.abort("blockedbyclient")

        async def ws_route(ws):
            run.blocked.append(ws.url[:300])
            await ws.close()

        await self._call(run, ctx.route("**/*", route))
        await self._call(run, ctx.route_web_socket(re.compile(r".*"), ws_route))
        main: list[Any] = []

        def on_page(p):  # popups: closed at once, counted
            if main and p is not main[0]:
                run.popups += 1
                asyncio.ensure_future(_quiet(p.close()))

        ctx.on("page", on_page)
        page = await self._call(run, ctx.new_page(), 10)
        main.append(page)
        if self.record_video:
            await self._start_screencast(run, ctx, page)

        def on_dialog(d):
            run.dialogs += 1
            if run.dialogs > self.max_dialogs:
                run.abort.set()
            asyncio.ensure_future(_quiet(d.dismiss()))

        def on_console(m):
            if m.type == "error":
                run.console_errors.append(m.text[:300])

        def on_crash(_):
            run.crashed = True
            run.abort.set()

        page.on("dialog", on_dialog)
        page.on("console", on_console)
        page.on("pageerror", lambda e: run.page_errors.append(str(e)[:300]))
        page.on("crash", on_crash)
        return ctx, page

    async def _start_screencast(self, run: _Run, ctx, page) -> None:
        """Records the page through raw CDP (``Page.startScreencast``) into an MJPEG file.

        Playwright's own video needs its ffmpeg download, which is impossible here; a
        concatenation of JPEG frames is a valid MJPEG stream (ffmpeg/VLC play it), and
        ``video.json`` holds each frame's timestamp.
        """
        vdir = os.path.join(self.output_dir, "video")
        os.makedirs(vdir, exist_ok=True)
        run.video = os.path.join(vdir, "video.mjpeg")
        run.video_times = []
        out = open(run.video, "wb")  # noqa: SIM115 - closed in _judge's teardown
        run.video_file = out
        cdp = await self._call(run, ctx.new_cdp_session(page))

        def on_frame(ev):
            out.write(base64.b64decode(ev["data"]))
            run.video_times.append(ev.get("metadata", {}).get("timestamp"))
            ack = cdp.send("Page.screencastFrameAck", {"sessionId": ev["sessionId"]})
            asyncio.ensure_future(_quiet(ack))

        cdp.on("Page.screencastFrame", on_frame)
        params = {"format": "jpeg", "quality": 40, "maxWidth": self.viewport["width"]}
        await self._call(run, cdp.send("Page.startScreencast", params))

    async def _fault_check(self, run: _Run, page) -> None:
        """Raises ``_PageFault`` when the page crashed, flooded dialogs or grew its DOM."""
        if run.crashed:
            raise _PageFault("page_crashed", "the renderer crashed")
        if run.dialogs > self.max_dialogs:
            raise _PageFault("dialog_flood", f"{run.dialogs} dialogs (> {self.max_dialogs})")
        nodes = await self._call(run, page.locator("*").count())
        if isinstance(nodes, int) and nodes > self.max_dom_nodes:
            raise _PageFault("dom_growth", f"{nodes} DOM nodes (> {self.max_dom_nodes})")

    async def _frame(self, run: _Run, page, item_id: str | None, step: str) -> int:
        shot = None
        path = None
        aria = ""
        if self.screenshots:
            shot = await self._call(run, page.screenshot(type="jpeg", quality=50, timeout=5000))
            if self.output_dir is not None:
                os.makedirs(self.output_dir, exist_ok=True)
                path = os.path.join(self.output_dir, f"frame-{len(run.frames):03d}.jpg")
                with open(path, "wb") as f:
                    f.write(shot)
        if self.llm_judge is not None:
            aria = await self._call(run, page.locator("body").aria_snapshot(timeout=5000))
            aria = aria[: self.llm_judge.max_frame_chars]
        run.frames.append(Frame(len(run.frames), item_id, step, page.url, shot, path, aria))
        return len(run.frames) - 1

    async def _pipeline(self, run, page, origin, rubric: Rubric, timings) -> BrowserVerdict:
        # -- snapshot (and the render gate) ----------------------------------------------------
        t = time.monotonic()
        checklist = checklist_of(rubric)
        try:
            snap = await self._snapshot(run, page, origin, rubric.entry)
        except _PageFault as f:
            timings["snapshot"] = time.monotonic() - t
            return await self._faulted(run, page, checklist, f, None)
        except _Deadline as d:
            timings["snapshot"] = time.monotonic() - t
            return await self._deadline(run, page, checklist, d, None)
        except Exception as e:  # noqa: BLE001 - a call the page broke (closed itself, navigated)
            timings["snapshot"] = time.monotonic() - t
            return await self._page_error(run, page, checklist, e, None)
        timings["snapshot"] = time.monotonic() - t
        if snap.truncated:
            self.metrics["snapshot_truncated"] += 1
            _log.warning(
                "ARIA snapshot of %s truncated: %d -> %d chars",
                snap.url,
                snap.aria_chars,
                self.max_snapshot_chars,
            )
        # -- checklist -------------------------------------------------------------------------
        t = time.monotonic()
        checklist = checklist_of(rubric)
        timings["checklist"] = time.monotonic() - t
        # -- plan ------------------------------------------------------------------------------
        t = time.monotonic()
        try:
            plan = await self._plan(run, page, rubric, checklist, snap)
        except _Deadline as d:
            timings["plan"] = time.monotonic() - t
            return await self._deadline(run, page, checklist, d, snap)
        except Exception as e:  # noqa: BLE001
            timings["plan"] = time.monotonic() - t
            return await self._page_error(run, page, checklist, e, snap)
        timings["plan"] = time.monotonic() - t
        # -- execute + rule judge ---------------------------------------------------------------
        t = time.monotonic()
        results: list[ItemResult] = []
        try:
            for item in plan.items:
                results.append(await self._run_item(run, page, item, plan.source[item.id]))
        except _PageFault as f:
            timings["execute"] = time.monotonic() - t
            return await self._faulted(run, page, checklist, f, snap, plan)
        except _Deadline as d:
            timings["execute"] = time.monotonic() - t
            return await self._deadline(run, page, checklist, d, snap, plan)
        except Exception as e:  # noqa: BLE001
            timings["execute"] = time.monotonic() - t
            return await self._page_error(run, page, checklist, e, snap, plan)
        timings["execute"] = time.monotonic() - t
        # -- judge -----------------------------------------------------------------------------
        t = time.monotonic()
        detail = ""
        if self.llm_judge is not None:
            results, detail = await self._llm_judge(run, rubric, checklist, results, page)
        timings["judge"] = time.monotonic() - t
        judged = [r for r in results if r.passed is not None]
        if not judged:
            return BrowserVerdict(
                "infra_error",
                0.0,
                tuple(results),
                {},
                None,
                detail or "no item could be judged (planner/judge fallback)",
                snap,
                checklist,
                plan,
                tuple(run.frames),
                tuple(run.blocked),
                run.dialogs,
                run.popups,
            )
        total = sum(r.weight for r in judged)
        score = sum(r.weight for r in judged if r.passed) / total
        return BrowserVerdict(
            "ok",
            float(min(1.0, max(0.0, score))),
            tuple(results),
            {},
            None,
            detail,
            snap,
            checklist,
            plan,
            tuple(run.frames),
            tuple(run.blocked),
            run.dialogs,
            run.popups,
        )

    async def _snapshot(self, run: _Run, page, origin: str, entry: str) -> PageSnapshot:
        try:
            resp = await self._call(
                run,
                page.goto(
                    f"{origin}/{entry}", wait_until="load", timeout=self.load_timeout_s * 1e3
                ),
                self.load_timeout_s + 1,
            )
        except _Deadline:
            raise
        except Exception as e:  # noqa: BLE001 - navigation failed: Playwright's own timeout too
            if "Timeout" in type(e).__name__:
                raise _Deadline(f"page did not load within {self.load_timeout_s} s") from e
            raise _PageFault("no_render", f"navigation failed: {str(e)[:200]}") from e
        if resp is None or resp.status != 200:
            raise _PageFault("no_render", f"{entry}: HTTP {resp.status if resp else 'no response'}")
        await self._call(run, page.wait_for_timeout(max(self.settle_ms, 100)))
        await self._fault_check(run, page)
        nodes = await self._call(run, page.locator("*").count())
        text = await self._call(run, page.locator("body").inner_text(timeout=5000))
        visible = await self._call(run, page.locator("body *").filter(visible=True).first.count())
        title = await self._call(run, page.title())
        state = {
            "url": page.url,
            "title": title,
            "dom_nodes": nodes,
            "text_chars": len(text.strip()),
            "visible_elements": visible,
        }
        aria = await self._call(run, page.locator("body").aria_snapshot(timeout=5000))
        await self._frame(run, page, None, "load")
        snap = PageSnapshot(
            url=str(state["url"]),
            title=str(state["title"])[:200],
            aria=aria[: self.max_snapshot_chars],
            aria_chars=len(aria),
            truncated=len(aria) > self.max_snapshot_chars,
            dom_nodes=int(state["dom_nodes"]),
            text_chars=int(state["text_chars"]),
            visible_elements=int(state["visible_elements"]),
            console_errors=tuple(run.console_errors),
            page_errors=tuple(run.page_errors),
        )
        if run.page_errors:
            raise _PageFault("load_error", f"uncaught at load: {run.page_errors[0]}")
        if snap.visible_elements == 0 and snap.text_chars == 0:
            raise _PageFault("blank", "nothing visible after load")
        return snap

    async def _target_on_page(self, run: _Run, page, target: Target, snap: PageSnapshot) -> bool:
        if target.role:
            return (target.role, target.name) in snap.roles
        if target.text:
            return target.text in snap.aria
        try:
            return await self._call(run, page.locator(target.css).count()) > 0
        except _Deadline:
            raise
        except Exception:  # noqa: BLE001 - an invalid selector is not on the page
            return False

    async def _plan(self, run, page, rubric: Rubric, checklist: Checklist, snap) -> ActionPlan:
        items = list(rubric.items)
        source = {it.id: "rubric" for it in items}
        rejections: list[str] = []
        if self.planner is not None and any(e.needs_plan for e in checklist.entries):
            need = [e for e in checklist.entries if e.needs_plan]
            known = rubric.targets()

            async def on_page(target: Target) -> bool:
                return target in known or await self._target_on_page(run, page, target, snap)

            planned, rejections = await self.planner.aplan(need, snap, on_page)
            self.metrics["planner/rejections"] += len(rejections)
            for k, it in enumerate(items):
                if it.id in planned:
                    acts, exps = planned[it.id]
                    items[k] = dataclasses.replace(it, actions=acts, expect=exps)
                    source[it.id] = "llm"
                elif not it.expect:
                    source[it.id] = "unplanned"
            if any(s == "unplanned" for s in source.values()):
                self.metrics["planner/fallback"] += 1
        steps = []
        for it in items:
            for k, a in enumerate(it.actions):
                seen = None
                if a.target is not None:
                    seen = await self._target_on_page(run, page, a.target, snap)
                steps.append(PlannedStep(it.id, k, a, seen))
        return ActionPlan(tuple(items), tuple(steps), source, tuple(rejections))

    def _locate(self, page, t: Target):
        if t.role:
            loc = (
                page.get_by_role(t.role, name=t.name, exact=True)
                if t.name is not None
                else page.get_by_role(t.role)
            )
        elif t.css:
            loc = page.locator(t.css)
        else:
            loc = page.get_by_text(t.text)
        return loc.nth(t.nth) if t.nth is not None else loc

    async def _act(self, run: _Run, page, a: Action) -> str | None:
        """Runs one action; returns why it failed (the item fails) or None."""
        cap = self.action_timeout_ms / 1e3 + 2.0
        if a.kind == "wait_ms":
            await self._call(run, page.wait_for_timeout(a.ms), a.ms / 1e3 + 2.0)
            return None
        if a.kind == "goto":
            try:
                resp = await self._call(
                    run,
                    page.goto(a.path, wait_until="load", timeout=self.load_timeout_s * 1e3),
                    self.load_timeout_s + 1,
                )
            except _Deadline:
                raise
            except Exception as e:  # noqa: BLE001
                return f"goto {a.path} failed: {str(e)[:150]}"
            return None if resp is not None and resp.status == 200 else f"goto {a.path}: no page"
        loc = self._locate(page, a.target)
        if a.target.nth is None:
            n = await self._call(run, loc.count())
            if n != 1:
                return f"{a.target.selector()} matches {n} elements (an action needs exactly 1)"
        try:
            if a.kind == "fill":
                await self._call(run, loc.fill(a.text, timeout=self.action_timeout_ms), cap)
            elif a.kind == "click":
                await self._call(run, loc.click(timeout=self.action_timeout_ms), cap)
            else:
                await self._call(run, loc.press(a.key, timeout=self.action_timeout_ms), cap)
        except _Deadline:
            raise
        except Exception as e:  # noqa: BLE001 - Playwright's own timeout / not actionable
            return f"{a.describe()} failed: {str(e).splitlines()[0][:150]}"
        return None

    async def _check_once(self, run, page, e: Expectation, errors_before: int):
        if e.kind == "text_visible":
            n = await self._call(run, page.get_by_text(e.text).filter(visible=True).count())
            return n > 0, f"{n} visible element(s) with text {e.text!r}", f'text="{e.text}"'
        if e.kind == "no_console_errors":
            new = (run.console_errors + run.page_errors)[errors_before:]
            errs = run.errors - errors_before
            return errs == 0, (f"{errs} error(s): {new[0][:120]}" if errs else "no errors"), None
        loc = self._locate(page, e.target)
        sel = e.target.selector()
        if e.kind == "count":
            n = await self._call(run, loc.count())
            ok = n == e.equals if e.at_least is None else n >= e.at_least
            return ok, f"{n} match(es)", sel
        n = await self._call(run, loc.count())
        if n != 1:
            return False, f"{n} match(es); a value check needs exactly 1", sel
        try:
            v = await self._call(run, loc.input_value(timeout=self.action_timeout_ms))
        except _Deadline:
            raise
        except Exception as ex:  # noqa: BLE001 - not an input element
            return False, f"no value: {str(ex).splitlines()[0][:120]}", sel
        return v == e.equals, f"value {v[:80]!r}", sel

    async def _run_item(self, run: _Run, page, item: RubricItem, source: str) -> ItemResult:
        if not item.expect:  # unplanned (the LLM planner failed): left to the LLM judge
            frame = await self._frame(run, page, item.id, "check")
            return ItemResult(item.id, None, item.weight, frame, None, "no checks", (), "none")
        errors_before = run.errors
        failure = None
        for a in item.actions:
            failure = await self._act(run, page, a)
            await self._call(run, page.wait_for_timeout(self.settle_ms))
            await self._fault_check(run, page)
            await self._frame(run, page, item.id, a.describe())
            if failure:
                break
        checks: list[CheckOutcome] = []
        if failure:
            checks = [
                CheckOutcome(f"{item.id}/expect/{k}", False, f"not checked: {failure}", None)
                for k in range(len(item.expect))
            ]
        else:
            # Poll all checks together (an update may land a little after the action), at most
            # expect_timeout_ms per item; the last round is the outcome.
            end = time.monotonic() + self.expect_timeout_ms / 1e3
            while True:
                checks = []
                for k, e in enumerate(item.expect):
                    ok, detail, sel = await self._check_once(run, page, e, errors_before)
                    checks.append(
                        CheckOutcome(f"{item.id}/expect/{k}", ok, f"{e.describe()}: {detail}", sel)
                    )
                if all(c.passed for c in checks) or time.monotonic() >= end:
                    break
                await self._call(run, page.wait_for_timeout(50))
        await self._fault_check(run, page)
        frame = await self._frame(run, page, item.id, "check")
        passed = failure is None and all(c.passed for c in checks)
        bad = next((c for c in checks if not c.passed), None)
        evidence = failure or (bad.detail if bad else "all checks hold")
        selector = (bad or (checks[-1] if checks else None)) and (bad or checks[-1]).selector
        return ItemResult(item.id, passed, item.weight, frame, selector, evidence, tuple(checks))

    async def _faulted(self, run, page, checklist, f: _PageFault, snap, plan=None):
        frame = len(run.frames) - 1 if run.frames else None
        items = tuple(
            ItemResult(e.id, False, e.weight, frame, None, f"{f.fault}: {f.detail}")
            for e in checklist.entries
        )
        return BrowserVerdict(
            "ok",
            0.0,
            items,
            {},
            f.fault,
            f.detail,
            snap,
            checklist,
            plan,
            tuple(run.frames),
            tuple(run.blocked),
            run.dialogs,
            run.popups,
        )

    async def _deadline(self, run, page, checklist, d: _Deadline, snap, plan=None):
        """A call ran past its deadline: the page's fault if the browser still answers."""
        if await self._browser_alive():
            fault, detail = "page_unresponsive", str(d)
            if run.crashed:
                fault = "page_crashed"
            elif run.dialogs > self.max_dialogs:
                fault = "dialog_flood"
            else:  # a flooded DOM also makes calls slow: name it when the page still answers
                try:
                    nodes = await asyncio.wait_for(page.locator("*").count(), DOM_PROBE_S)
                except BaseException:  # noqa: BLE001 - hung: page_unresponsive
                    nodes = None
                if nodes is not None and nodes > self.max_dom_nodes:
                    fault, detail = "dom_growth", f"{nodes} DOM nodes (> {self.max_dom_nodes})"
            return await self._faulted(run, page, checklist, _PageFault(fault, detail), snap, plan)
        self.metrics["infra_error"] += 1
        return BrowserVerdict(
            "infra_error",
            0.0,
            (),
            {},
            None,
            f"browser unresponsive after: {d}",
            snap,
            checklist,
            plan,
            tuple(run.frames),
            tuple(run.blocked),
            run.dialogs,
            run.popups,
        )

    async def _page_error(self, run, page, checklist, e: Exception, snap, plan=None):
        """A browser call on the page failed (not a deadline). With a live browser that is the
        page's doing (it closed itself, navigated or reloaded mid-call): a fault, score 0, so a
        page can never turn its failure into a masked ``infra_error``."""
        if await self._browser_alive():
            fault = "page_closed" if page.is_closed() else "page_error"
            if run.crashed:
                fault = "page_crashed"
            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return await self._faulted(run, page, checklist, _PageFault(fault, detail), snap, plan)
        self.metrics["infra_error"] += 1
        return BrowserVerdict(
            "infra_error",
            0.0,
            (),
            {},
            None,
            f"browser died: {type(e).__name__}: {e}"[:300],
            snap,
            checklist,
            plan,
            tuple(run.frames),
            tuple(run.blocked),
            run.dialogs,
            run.popups,
        )

    async def _llm_judge(self, run, rubric, checklist, results, page):
        source = _read_source(run.root, rubric.entry)
        return await self.llm_judge.ajudge(checklist, results, tuple(run.frames), source)


def _drop(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it


async def _quiet(aw) -> None:
    try:
        await asyncio.wait_for(aw, 5)
    except BaseException:  # noqa: BLE001 - a closed page or dialog
        pass


def _read_source(root: str, entry: str, cap: int = 8000) -> str:
    if not root:
        return ""
    try:
        with open(os.path.join(root, entry), encoding="utf-8", errors="replace") as f:
            return f.read(cap)
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------


def load_calibration(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The calibration set under ``root``: ``labels.json`` lists ``{"page", "rubric", "label"}``.

    ``label`` is the planted truth: ``{"score": s, "fault": f | [f, ...] | null, "items": {id:
    bool}}`` (a list of faults: any of them is right, e.g. a DOM flood that also stalls the page).
    """
    root = os.fspath(root)
    with open(os.path.join(root, "labels.json")) as f:
        spec = json.load(f)
    rubrics = spec["rubrics"]
    out = []
    for case in spec["pages"]:
        out.append(
            {
                "page": case["page"],
                "dir": os.path.join(root, case["page"]),
                "rubric": rubrics[case["rubric"]],
                "label": case["label"],
                "defect": case.get("defect", ""),
            }
        )
    return out


def calibration_table(
    cases: Sequence[Mapping[str, Any]], verdicts: Sequence[BrowserVerdict]
) -> dict[str, Any]:
    """Agreement of verdicts with planted labels: per page and per item, with a markdown table."""
    rows = []
    item_agree = item_total = page_agree = 0
    for case, v in zip(cases, verdicts, strict=True):
        lab = case["label"]
        got = {i.id: i.passed for i in v.items}
        agree_items = sum(1 for k, want in lab["items"].items() if got.get(k) == want)
        item_agree += agree_items
        item_total += len(lab["items"])
        want = lab.get("fault")
        faults = want if isinstance(want, list) else [want]  # a list: any of these names
        ok = v.status == "ok" and abs(v.score - float(lab["score"])) < 1e-6 and v.fault in faults
        page_agree += ok
        rows.append(
            {
                "page": case["page"],
                "defect": case["defect"],
                "label_score": float(lab["score"]),
                "score": v.score,
                "label_fault": "/".join(faults) if isinstance(want, list) else want,
                "fault": v.fault,
                "status": v.status,
                "items_agree": f"{agree_items}/{len(lab['items'])}",
                "agree": ok,
                "seconds": round(v.timings.get("total", 0.0), 2),
            }
        )
    lines = [
        "| page | planted defect | label score | judge score | label fault | judge fault | items "
        "agree | agree | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['page']} | {r['defect']} | {r['label_score']:.2f} | {r['score']:.2f} | "
            f"{r['label_fault'] or '-'} | {r['fault'] or '-'} | {r['items_agree']} | "
            f"{'yes' if r['agree'] else 'NO'} | {r['seconds']} |"
        )
    return {
        "rows": rows,
        "page_agreement": page_agree / max(1, len(rows)),
        "item_agreement": item_agree / max(1, item_total),
        "markdown": "\n".join(lines),
    }


__all__ = [
    "FAULTS",
    "STATUSES",
    "Action",
    "ActionPlan",
    "BrowserJudge",
    "BrowserUnavailable",
    "BrowserVerdict",
    "CheckOutcome",
    "Checklist",
    "Frame",
    "ItemResult",
    "PageSnapshot",
    "PlannedStep",
    "Rubric",
    "RubricError",
    "alive",
    "aria_roles",
    "calibration_table",
    "load_calibration",
    "process_tree",
]
