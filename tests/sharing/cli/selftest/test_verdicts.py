"""The selftest's verdicts from given numbers: where each threshold lies, and what a failure
says (the runs themselves: test_selftest_sim.py)."""

from __future__ import annotations

from sharing.cli.selftest.compute import ALONE_POINTS, Share, _judge
from sharing.cli.selftest.memory import judge
from sharing.cli.selftest.report import Check, Report
from sharing.observe.cpuwait import STARVED_PERCENT

GIB = 1 << 30
PAGE = 2 << 20
WINDOW_S = 4.0


def fill(**over: object) -> dict[str, str]:
    kv = {"total": GIB, "free": 0, "nvml_total": GIB, "unit": PAGE, "last": "CUDA_ERROR_OUT_OF_MEMORY",
          "granted": GIB, "allocs": 4}  # fmt: skip
    kv.update(over)
    return {k: str(v) for k, v in kv.items()}


def test_a_full_quota_refused_at_the_last_page_passes() -> None:
    assert judge("plain", GIB, fill(), GIB).status == "pass"
    assert judge("plain", GIB, fill(free=PAGE - 1), GIB - PAGE + 1).status == "pass"


def test_each_memory_failure_is_named() -> None:
    cases = [
        (fill(total=2 * GIB), GIB, "cuMemGetInfo total"),
        (fill(nvml_total=2 * GIB), GIB, "NVML in the process"),
        (fill(), GIB + PAGE, "the driver charges"),
        (fill(last="CUDA_SUCCESS"), GIB, "not a refusal"),
        (fill(free=PAGE), GIB - PAGE, "left (program view)"),
        (fill(), GIB - PAGE, "left (driver view)"),
    ]
    for kv, driver_used, words in cases:
        c = judge("pitch", GIB, kv, driver_used)
        assert c.status == "fail" and c.name == "memory.pitch" and words in c.detail, (kv, c)


def test_no_driver_view_is_said_not_failed() -> None:
    c = judge("plain", GIB, fill(), None)
    assert c.status == "pass" and "host's PID namespace" in c.detail


def verdict(cap: int, share: float | None, cpu_wait_s: float = 0.0) -> Check:
    return _judge(f"compute.cap_{cap}", cap, Share(share, cpu_wait_s, WINDOW_S), ALONE_POINTS, "")


def test_compute_error_bounds() -> None:
    assert verdict(50, 50 + ALONE_POINTS).status == "pass"
    assert verdict(50, 50 + ALONE_POINTS + 0.1).status == "fail"
    assert verdict(50, 50 - ALONE_POINTS - 0.1).status == "fail"
    assert verdict(50, None).status == "fail"


def test_a_short_share_on_a_busy_node_is_inconclusive_but_an_excess_never_is() -> None:
    busy = (STARVED_PERCENT + 10) / 100 * WINDOW_S
    short = _judge("compute.cap_80", 80, Share(70.0, busy, WINDOW_S), ALONE_POINTS, "alone")
    assert short.status == "skip" and short.detail.startswith("inconclusive"), short
    over = _judge("compute.cap_20", 20, Share(90.0, busy, WINDOW_S), ALONE_POINTS, "alone")
    assert over.status == "fail", over


def test_the_verdict_names_failed_and_unchecked_checks() -> None:
    r = Report(sim=True, device=0, quick=True)
    r.add(Check("memory.plain", "pass", ""))
    r.add(Check("compute.cap_80", "skip", "inconclusive"))
    assert r.ok and "VERDICT: PASS, but not checked here: compute.cap_80" in r.to_text()
    r.add(Check("memory.pitch", "fail", ""))
    assert not r.ok and "VERDICT: FAIL: memory.pitch" in r.to_text()
    assert '"failed": [\n    "memory.pitch"\n  ]' in r.to_json()
