"""The compute-cap control law against a plant model (tests/c/compute_controller_test.c).

No GPU, no simulator, no real time: a discrete-event model of one time-sliced device, launchers
that launch asynchronously or launch-then-synchronize, late wake-ups and measurements inflated by
queueing. Built with ASan/UBSan, so the controller's arithmetic is also checked for UB.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_controller_holds_caps_in_plant_model(tmp_path: Path) -> None:
    exe = tmp_path / "compute_controller_test"
    subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined",
            f"-I{REPO / 'shim' / 'include'}",
            f"-I{REPO / 'shim' / 'src'}",
            "-o",
            str(exe),
            str(REPO / "tests" / "c" / "compute_controller_test.c"),
            str(REPO / "shim" / "src" / "compute_controller.c"),
            "-lm",
        ],
        check=True,
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all ok" in out.stdout
    errs = [abs(float(x)) for x in re.findall(r"err=([-+0-9.]+)", out.stdout)]
    assert errs and max(errs) <= 2.0, out.stdout
