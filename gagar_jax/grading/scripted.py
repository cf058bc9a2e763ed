"""``ScriptedGraderPolicy``: a deterministic grading policy speaking the chat-completions protocol.

It is a policy implementation, not a mock of a server: it reads only what the agentic grader's
tools returned in the conversation (never the workspace itself) and decides its next tool calls
and its verdict from that, exactly as a model must. It exists to test the tool loop end to end
(tool-call encoding, anonymisation, evidence validation against the real workspace, rejection
feedback and repair, budgets) without a model that can follow the protocol, and as a reference
baseline: it ranks passing candidates by diff size.

Its procedure: ``read_summaries``; then ``show_diff`` and ``read_test_log`` for every passing
candidate (parallel tool calls in one message); ``read_trajectory`` where a candidate has events;
``read_file`` on the first touched file; optionally ``run_check``; then ``submit_verdict``:
tier 1 for the smallest diff, 2 for up to twice its size, 3 beyond; dense ranks by size;
``minimality = smallest / size``; each tier-2/3 candidate cites its first hunk as evidence.

``first_submission_error`` makes the first verdict cite a line outside the diff (to exercise the
rejection-feedback path); ``answer_as_text`` returns the final verdict as message content instead
of a tool call (for endpoints without tool support).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gagar_jax.grading.schema import DIMENSIONS

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@", re.MULTILINE)


def _enveloped_lines(text: str) -> list[str]:
    """The lines inside one untrusted envelope (the summaries' file list), as a model reads them."""
    lines = text.split("\n") if text else []
    return [ln for ln in lines[1:-1] if ln]


class ScriptedGraderPolicy:
    """A deterministic policy for ``AgenticGrader`` (see the module docstring)."""

    def __init__(
        self,
        *,
        use_check: bool = False,
        first_submission_error: bool = False,
        answer_as_text: bool = False,
        check_command: str = "python -m pytest -q",
    ):
        self.use_check = use_check
        self.first_submission_error = first_submission_error
        self.answer_as_text = answer_as_text
        self.check_command = check_command
        self.calls = 0
        self.tools_called: list[str] = []

    def chat_completions(
        self, messages, *, tools=None, max_tokens=1024, temperature=0.0, response_format=None
    ) -> dict:
        self.calls += 1
        results = {
            m.get("tool_call_id"): m.get("content", "") for m in messages if m.get("role") == "tool"
        }
        rejected = sum(
            1
            for m in messages
            if m.get("role") in ("tool", "user")
            and str(m.get("content", "")).startswith("Verdict rejected")
        )
        if "summaries" not in results:
            return self._calls([("summaries", "read_summaries", {})])
        summ = json.loads(results["summaries"])["candidates"]
        passing = [c for c in summ if c["status"] == "passed"]
        wanted = []
        for c in passing:
            a = c["candidate"]
            wanted += [
                (f"diff:{a}", "show_diff", {"candidate": a}),
                (f"log:{a}", "read_test_log", {"candidate": a}),
            ]
            if c["trajectory_events"]:
                wanted.append(
                    (f"traj:{a}", "read_trajectory", {"candidate": a, "start": 0, "end": 5})
                )
        files = [f for c in passing for f in _enveloped_lines(c["patch"].get("files", ""))]
        if files:
            wanted.append(
                ("file", "read_file", {"path": files[0], "start_line": 1, "end_line": 40})
            )
        if self.use_check and passing:
            a = passing[0]["candidate"]
            wanted.append(
                (f"check:{a}", "run_check", {"candidate": a, "command": self.check_command})
            )
        missing = [w for w in wanted if w[0] not in results]
        if missing:
            return self._calls(missing)
        verdict = self._verdict(
            passing, results, broken=self.first_submission_error and not rejected
        )
        if self.answer_as_text:
            return self._text("Here is my verdict:\n```json\n" + json.dumps(verdict) + "\n```")
        return self._calls([(f"submit{rejected}", "submit_verdict", verdict)])

    def _verdict(self, passing: list[dict], results: dict[str, str], broken: bool) -> dict:
        sizes, first = {}, {}
        for c in passing:
            a = c["candidate"]
            diff = results[f"diff:{a}"]
            sizes[a] = sum(
                1
                for ln in diff.splitlines()
                if ln[:1] in "+-" and not ln.startswith(("+++ ", "--- "))
            )
            path = next((ln[6:] for ln in diff.splitlines() if ln.startswith("+++ b/")), None)
            m = _HUNK.search(diff)
            first[a] = (path, int(m.group(1)) if m else None)
        smallest = min(sizes.values(), default=0)
        ranks = {s: i + 1 for i, s in enumerate(sorted(set(sizes.values())))}
        items = []
        for a, size in sizes.items():
            tier = 1 if size <= smallest else (2 if size <= 2 * smallest else 3)
            minimality = smallest / size if size else 1.0
            evidence = []
            path, line = first[a]
            if (tier >= 2 or minimality < 0.5) and path is not None:
                evidence.append(
                    {
                        "claim": "minimality",
                        "kind": "patch",
                        "candidate": a,
                        "file": path,
                        "line": 10_000 if broken else line,
                        "note": f"{size} changed lines vs {smallest} in the smallest",
                    }
                )
            items.append(
                {
                    "candidate": a,
                    "tier": tier,
                    "rank": ranks[size],
                    "scores": {d: 1.0 for d in DIMENSIONS} | {"minimality": round(minimality, 4)},
                    "cheat": False,
                    "cheat_reason": "",
                    "evidence": evidence,
                }
            )
        return {"verdicts": items}

    def _calls(self, calls: list[tuple[str, str, dict[str, Any]]]) -> dict:
        self.tools_called += [name for _, name, _ in calls]
        return {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": cid,
                                "type": "function",
                                "function": {"name": name, "arguments": json.dumps(args)},
                            }
                            for cid, name, args in calls
                        ],
                    },
                }
            ]
        }

    @staticmethod
    def _text(content: str) -> dict:
        return {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": content},
                }
            ]
        }
