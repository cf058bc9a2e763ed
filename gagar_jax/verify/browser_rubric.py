"""The front-end rubric: schema, validation with named-field errors, and the checklist.

A rubric is a JSON object (the rule-based judge runs it as written; the LLM planner produces the
same ``actions``/``expect`` lists for items that only have a description)::

  {"entry": "index.html",
   "items": [{"id": "adds_item", "description": "free text", "weight": 1.0,
              "actions": [{"fill": TARGET, "text": "milk"}, {"click": TARGET},
                          {"press": TARGET, "key": "Enter"}, {"wait_ms": 200},
                          {"goto": "other.html"}],
              "expect":  [{"text_visible": "milk"}, {"count": TARGET, "equals": 2},
                          {"value": TARGET, "equals": ""}, {"no_console_errors": true}]}]}

  TARGET = {"role": "button", "name": "Add item"} | {"css": "#list li"} | {"text": "Save"}
           (optionally with "nth": k to pick the k-th match; otherwise an action needs exactly one)

``count`` also takes ``"at_least": n`` instead of ``equals``. Items run in order on one page.
``validate_rubric`` turns anything else into a ``RubricError`` whose ``field`` is the JSON path of
the bad value (``items[1].actions[0].click.role``) and whose message says what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import re
from collections.abc import Mapping
from typing import Any

ACTION_KINDS = ("fill", "click", "press", "wait_ms", "goto")
EXPECT_KINDS = ("text_visible", "count", "value", "no_console_errors")
TARGET_KINDS = ("role", "css", "text")
# ARIA roles Playwright's get_by_role accepts that front-end rubrics use; others are refused so a
# typo ("buton") is a named error instead of a silently failing item.
ROLES = (
    "alert",
    "article",
    "banner",
    "button",
    "cell",
    "checkbox",
    "columnheader",
    "combobox",
    "dialog",
    "form",
    "grid",
    "gridcell",
    "heading",
    "img",
    "link",
    "list",
    "listbox",
    "listitem",
    "main",
    "menu",
    "menuitem",
    "navigation",
    "option",
    "paragraph",
    "progressbar",
    "radio",
    "region",
    "row",
    "rowheader",
    "searchbox",
    "slider",
    "spinbutton",
    "status",
    "switch",
    "tab",
    "table",
    "tablist",
    "tabpanel",
    "textbox",
    "toolbar",
)
MAX_ITEMS = 64
MAX_STEPS_PER_ITEM = 32
MAX_WAIT_MS = 5000
MAX_TEXT_CHARS = 1000
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9+]{1,32}$")  # Enter, Tab, Control+a, ArrowDown


class RubricError(ValueError):
    """A rubric (or a planner's output) is malformed; ``field`` is the JSON path of the value."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class Target:
    """An element on the page: exactly one of ``role`` (+ optional ``name``), ``css``, ``text``."""

    role: str | None = None
    name: str | None = None
    css: str | None = None
    text: str | None = None
    nth: int | None = None

    @property
    def kind(self) -> str:
        return "role" if self.role else "css" if self.css else "text"

    def selector(self) -> str:
        """A readable, Playwright-like selector string (the evidence's ``selector``)."""
        if self.role:
            s = f"role={self.role}" + (f'[name="{self.name}"]' if self.name is not None else "")
        elif self.css:
            s = f"css={self.css}"
        else:
            s = f'text="{self.text}"'
        return s + (f" >> nth={self.nth}" if self.nth is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Action:
    """One user action: ``kind`` in ``ACTION_KINDS`` and its arguments."""

    kind: str
    target: Target | None = None
    text: str | None = None  # fill
    key: str | None = None  # press
    ms: int | None = None  # wait_ms
    path: str | None = None  # goto

    def describe(self) -> str:
        if self.kind == "fill":
            return f"fill {self.target.selector()} with {self.text!r}"
        if self.kind == "click":
            return f"click {self.target.selector()}"
        if self.kind == "press":
            return f"press {self.key} on {self.target.selector()}"
        if self.kind == "wait_ms":
            return f"wait {self.ms} ms"
        return f"goto {self.path}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.kind in ("fill", "click", "press"):
            out[self.kind] = self.target.to_dict()
        if self.kind == "fill":
            out["text"] = self.text
        if self.kind == "press":
            out["key"] = self.key
        if self.kind == "wait_ms":
            out["wait_ms"] = self.ms
        if self.kind == "goto":
            out["goto"] = self.path
        return out


@dataclasses.dataclass(frozen=True)
class Expectation:
    """One check on the page after an item's actions: ``kind`` in ``EXPECT_KINDS``."""

    kind: str
    target: Target | None = None
    text: str | None = None  # text_visible
    equals: Any = None  # count (int) / value (str)
    at_least: int | None = None  # count

    def describe(self) -> str:
        if self.kind == "text_visible":
            return f"text {self.text!r} is visible"
        if self.kind == "count":
            rel = f"== {self.equals}" if self.at_least is None else f">= {self.at_least}"
            return f"count of {self.target.selector()} {rel}"
        if self.kind == "value":
            return f"value of {self.target.selector()} == {self.equals!r}"
        return "no console errors"

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "text_visible":
            return {"text_visible": self.text}
        if self.kind == "no_console_errors":
            return {"no_console_errors": True}
        out: dict[str, Any] = {self.kind: self.target.to_dict()}
        if self.at_least is not None:
            out["at_least"] = self.at_least
        else:
            out["equals"] = self.equals
        return out


@dataclasses.dataclass(frozen=True)
class RubricItem:
    id: str
    description: str
    weight: float
    actions: tuple[Action, ...]
    expect: tuple[Expectation, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "description": self.description,
            "weight": self.weight,
            "actions": [a.to_dict() for a in self.actions],
            "expect": [e.to_dict() for e in self.expect],
        }


@dataclasses.dataclass(frozen=True)
class Rubric:
    entry: str
    items: tuple[RubricItem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"entry": self.entry, "items": [i.to_dict() for i in self.items]}

    def targets(self) -> set[Target]:
        """Every target the rubric's author named (the LLM planner may reuse these)."""
        out = {a.target for i in self.items for a in i.actions if a.target is not None}
        return out | {e.target for i in self.items for e in i.expect if e.target is not None}


def _str(obj: Mapping, key: str, where: str, *, max_chars: int = MAX_TEXT_CHARS) -> str:
    val = obj.get(key)
    if not isinstance(val, str):
        raise RubricError(f"{where}.{key}", f"expected a string, got {type(val).__name__}")
    if len(val) > max_chars:
        raise RubricError(f"{where}.{key}", f"at most {max_chars} characters, got {len(val)}")
    return val


def _int(val: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
        raise RubricError(where, f"expected an integer in [{lo}, {hi}], got {val!r}")
    return val


def relative_page(path: Any, where: str) -> str:
    """A page path inside the artifact (no scheme, no absolute path, no ``..``)."""
    if not isinstance(path, str) or not path or len(path) > 256:
        raise RubricError(where, f"expected a relative page path like 'index.html', got {path!r}")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path) or path.startswith(("/", "\\")):
        raise RubricError(where, f"must be relative to the artifact directory, got {path!r}")
    norm = posixpath.normpath(path.split("#")[0].split("?")[0])
    if norm.startswith("..") or "\\" in path or "\x00" in path:
        raise RubricError(where, f"must stay inside the artifact directory, got {path!r}")
    return path


def parse_target(obj: Any, where: str) -> Target:
    if not isinstance(obj, Mapping):
        raise RubricError(where, 'TARGET must be an object: {"role", "name"} | {"css"} | {"text"}')
    kinds = [k for k in TARGET_KINDS if k in obj]
    if len(kinds) != 1:
        raise RubricError(
            where, f"TARGET needs exactly one of {list(TARGET_KINDS)}, got keys {sorted(obj)}"
        )
    extra = set(obj) - {"role", "name", "css", "text", "nth"}
    if extra or ("name" in obj and kinds[0] != "role"):
        raise RubricError(where, f"unexpected TARGET keys {sorted(extra or {'name'})}")
    nth = _int(obj["nth"], f"{where}.nth", 0, 999) if "nth" in obj else None
    kind = kinds[0]
    if kind == "role":
        role = _str(obj, "role", where, max_chars=32)
        if role not in ROLES:
            raise RubricError(f"{where}.role", f"unknown ARIA role {role!r}; known: {ROLES}")
        name = _str(obj, "name", where) if "name" in obj else None
        return Target(role=role, name=name, nth=nth)
    val = _str(obj, kind, where)
    if not val.strip():
        raise RubricError(f"{where}.{kind}", "must not be empty")
    return Target(**{kind: val}, nth=nth)


def parse_action(obj: Any, where: str) -> Action:
    if not isinstance(obj, Mapping):
        raise RubricError(where, f"an action must be an object with one of {ACTION_KINDS}")
    kinds = [k for k in ACTION_KINDS if k in obj]
    if len(kinds) != 1:
        raise RubricError(
            where, f"an action needs exactly one of {list(ACTION_KINDS)}, got keys {sorted(obj)}"
        )
    kind = kinds[0]
    allowed = {kind} | {"fill": {"text"}, "press": {"key"}}.get(kind, set())
    if set(obj) - allowed:
        raise RubricError(where, f"unexpected keys {sorted(set(obj) - allowed)} for {kind!r}")
    if kind == "wait_ms":
        return Action("wait_ms", ms=_int(obj["wait_ms"], f"{where}.wait_ms", 0, MAX_WAIT_MS))
    if kind == "goto":
        return Action("goto", path=relative_page(obj["goto"], f"{where}.goto"))
    target = parse_target(obj[kind], f"{where}.{kind}")
    if kind == "fill":
        return Action("fill", target, text=_str(obj, "text", where))
    if kind == "press":
        key = _str(obj, "key", where, max_chars=32)
        if not _KEY_RE.match(key):
            raise RubricError(f"{where}.key", f"expected a key name like 'Enter', got {key!r}")
        return Action("press", target, key=key)
    return Action("click", target)


def parse_expectation(obj: Any, where: str) -> Expectation:
    if not isinstance(obj, Mapping):
        raise RubricError(where, f"an expectation must be an object with one of {EXPECT_KINDS}")
    kinds = [k for k in EXPECT_KINDS if k in obj]
    if len(kinds) != 1:
        raise RubricError(
            where,
            f"an expectation needs exactly one of {list(EXPECT_KINDS)}, got keys {sorted(obj)}",
        )
    kind = kinds[0]
    if kind == "text_visible":
        if set(obj) != {kind}:
            raise RubricError(where, f"unexpected keys {sorted(set(obj) - {kind})}")
        text = _str(obj, kind, where)
        if not text.strip():
            raise RubricError(f"{where}.text_visible", "must not be empty")
        return Expectation(kind, text=text)
    if kind == "no_console_errors":
        if obj[kind] is not True or set(obj) != {kind}:
            raise RubricError(f"{where}.no_console_errors", "expected exactly true")
        return Expectation(kind)
    target = parse_target(obj[kind], f"{where}.{kind}")
    if kind == "value":
        if set(obj) != {kind, "equals"}:
            raise RubricError(where, "'value' takes a TARGET and 'equals' (a string)")
        return Expectation(kind, target, equals=_str(obj, "equals", where))
    keys = set(obj) - {kind}
    if keys == {"equals"}:
        return Expectation(kind, target, equals=_int(obj["equals"], f"{where}.equals", 0, 100_000))
    if keys == {"at_least"}:
        return Expectation(
            kind, target, at_least=_int(obj["at_least"], f"{where}.at_least", 0, 100_000)
        )
    raise RubricError(where, "'count' takes a TARGET and one of 'equals' / 'at_least' (integers)")


def parse_item(
    obj: Any, where: str, *, require_expect: bool = True, require_description: bool = False
) -> RubricItem:
    if not isinstance(obj, Mapping):
        raise RubricError(where, "an item must be an object with 'id', 'actions', 'expect'")
    extra = set(obj) - {"id", "description", "weight", "actions", "expect"}
    if extra:
        raise RubricError(where, f"unexpected keys {sorted(extra)}")
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not _ID_RE.match(item_id):
        raise RubricError(
            f"{where}.id", f"expected an id matching {_ID_RE.pattern}, got {item_id!r}"
        )
    description = _str(obj, "description", where) if "description" in obj else ""
    if require_description and not description.strip():
        raise RubricError(f"{where}.description", "an item without checks needs a description")
    weight = obj.get("weight", 1.0)
    if (
        not isinstance(weight, int | float)
        or isinstance(weight, bool)
        or not math.isfinite(weight)
        or not 0 < weight <= 1000
    ):
        raise RubricError(f"{where}.weight", f"expected a number in (0, 1000], got {weight!r}")
    acts, exps = obj.get("actions", []), obj.get("expect", [])
    for key, val in (("actions", acts), ("expect", exps)):
        if not isinstance(val, list):
            raise RubricError(f"{where}.{key}", f"expected a list, got {type(val).__name__}")
        if len(val) > MAX_STEPS_PER_ITEM:
            raise RubricError(f"{where}.{key}", f"at most {MAX_STEPS_PER_ITEM} entries")
    if require_expect and not exps:
        raise RubricError(f"{where}.expect", "needs at least one expectation")
    return RubricItem(
        item_id,
        description,
        float(weight),
        tuple(parse_action(a, f"{where}.actions[{k}]") for k, a in enumerate(acts)),
        tuple(parse_expectation(e, f"{where}.expect[{k}]") for k, e in enumerate(exps)),
    )


def validate_rubric(obj: Any, *, require_expect: bool = True) -> Rubric:
    """A validated ``Rubric`` from a dict, JSON text or a ``Rubric``; raises ``RubricError``.

    ``require_expect=False`` admits description-only items (an LLM planner writes their checks).
    """
    if isinstance(obj, Rubric):
        return obj
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise RubricError("rubric", f"not JSON: {e}") from e
    if not isinstance(obj, Mapping):
        raise RubricError("rubric", f"expected an object, got {type(obj).__name__}")
    extra = set(obj) - {"entry", "items"}
    if extra:
        raise RubricError("rubric", f"unexpected keys {sorted(extra)}")
    entry = relative_page(obj.get("entry", "index.html"), "entry")
    items = obj.get("items")
    if not isinstance(items, list) or not items:
        raise RubricError("items", "expected a non-empty list of items")
    if len(items) > MAX_ITEMS:
        raise RubricError("items", f"at most {MAX_ITEMS} items, got {len(items)}")
    parsed = tuple(
        parse_item(it, f"items[{k}]", require_expect=require_expect, require_description=True)
        if not require_expect and isinstance(it, Mapping) and not it.get("expect")
        else parse_item(it, f"items[{k}]", require_expect=require_expect)
        for k, it in enumerate(items)
    )
    seen: set[str] = set()
    for k, it in enumerate(parsed):
        if it.id in seen:
            raise RubricError(f"items[{k}].id", f"duplicate item id {it.id!r}")
        seen.add(it.id)
    return Rubric(entry, parsed)


# ------------------------------------------------------------------------------------------------
# Checklist
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChecklistEntry:
    """A key item of the rubric and its details (one per expectation), with stable ids.

    ``id`` is the rubric item's id; detail ids are ``<id>/expect/<k>`` (stable across runs and
    planners: they come from the rubric's order, not from the page).
    """

    id: str
    description: str
    weight: float
    details: tuple[tuple[str, str], ...]  # (detail id, what it checks)
    needs_plan: bool  # no checks in the rubric: an LLM planner must write them


@dataclasses.dataclass(frozen=True)
class Checklist:
    entries: tuple[ChecklistEntry, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(e.id for e in self.entries)


def checklist_of(rubric: Rubric) -> Checklist:
    """Rubric -> checklist (the rule-based checklist stage)."""
    return Checklist(
        tuple(
            ChecklistEntry(
                it.id,
                it.description,
                it.weight,
                tuple((f"{it.id}/expect/{k}", e.describe()) for k, e in enumerate(it.expect)),
                needs_plan=not it.expect,
            )
            for it in rubric.items
        )
    )
