"""The selftest's checks, their verdicts and the report (human text or JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# Where a report goes: the project asks its first users with real GPUs for one.
SEND_TO = (
    "the vgpu-sharing issue tracker: open an issue titled 'selftest: <GPU model>, driver "
    "<version>' and attach the output of `vgpu selftest --json` (pass or fail: nobody working on "
    "the project has run it on a real GPU)"
)

PASS, FAIL, SKIP, INFO = "pass", "fail", "skip", "info"


@dataclass
class Check:
    """One check: `name` is "<section>.<what>" (e.g. "memory.pitch"), `status` one of pass, fail,
    skip (could not run here; `detail` says why) or info (measured, no target to hold)."""

    name: str
    status: str
    detail: str
    threshold: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    sim: bool
    device: int
    quick: bool
    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> str:
        doc = {
            "ok": self.ok,
            "failed": [c.name for c in self.failed],
            "simulated_gpu": self.sim,
            "device": self.device,
            "quick": self.quick,
            "environment": self.environment,
            "checks": [asdict(c) for c in self.checks],
            "send_to": SEND_TO,
        }
        return json.dumps(doc, indent=2, sort_keys=False)

    def to_text(self) -> str:
        lines = [f"vgpu selftest on {'the simulated GPU' if self.sim else 'this node'}, "
                 f"device {self.device}{' (quick)' if self.quick else ''}", ""]  # fmt: skip
        lines.append("node:")
        for k, v in self.environment.items():
            lines.append(f"  {k:<22} {v}")
        section = ""
        for c in self.checks:
            head = c.name.split(".", 1)[0]
            if head != section:
                section = head
                lines += ["", f"{section}:"]
            lines.append(f"  {c.status.upper():<5} {c.name:<24} {c.detail}")
            if c.threshold:
                lines.append(f"        {'':<24} threshold: {c.threshold}")
        lines.append("")
        skipped = [c.name for c in self.checks if c.status == SKIP]
        if self.ok and skipped:
            lines.append("VERDICT: PASS, but not checked here: " + ", ".join(skipped))
        elif self.ok:
            lines.append("VERDICT: PASS (every check held)")
        else:
            lines.append("VERDICT: FAIL: " + ", ".join(c.name for c in self.failed))
        lines.append(f"Please send this report to {SEND_TO}.")
        return "\n".join(lines)
