"""Monitor flags shared by the behaviour monitor, the toy family and the grading package."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MonitorFlag:
    """One shortcut behaviour found in a candidate.

    Attributes:
      rule: the rule's name (e.g. ``"edit_tests"``, ``"hard_coded_outputs"``).
      evidence: where it was seen, quoting the patch location or trajectory event.
      confirmed: True when the evidence is unambiguous; confirmed flags set ``cheat`` (reward 0).
    """

    rule: str
    evidence: str
    confirmed: bool
