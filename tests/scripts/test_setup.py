"""scripts/setup does only what is missing: with the build current it runs no pip at all."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_setup_skips_a_current_build() -> None:
    # The test run itself follows a set-up (scripts/test, .ci/run), so the build is current: a
    # second set-up must say so and install nothing (a pip run costs ~20 s even with nothing to do).
    r = subprocess.run(
        [str(REPO / "scripts" / "setup")], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    assert "[setup] ready (the build is current)" in r.stderr, r.stderr
    assert "installing" not in r.stderr, r.stderr
