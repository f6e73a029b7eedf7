"""Test hook: VGPU_TEST_CRASH_AT=<step> makes the plugin SIGKILL itself at that step of prepare or
unprepare, so that tests can check the checkpoint finishes or rolls back every interrupted claim.

The variable is read from the environment at each step; production never sets it.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

CRASH_ENV = "VGPU_TEST_CRASH_AT"
CRASH_STEPS = (
    "prepare-started",  # after the PrepareStarted checkpoint
    "prepare-dir",  # after the claim directory, limits, shared dir and demand file exist
    "prepare-cdi",  # after the CDI spec is written
    "reclaim-notice",  # a burst reclaim (evict) recorded and its notice sent, before the grace
    "prepare-completed",  # after the PrepareCompleted checkpoint, before answering
    "unprepare-started",  # after the UnprepareStarted checkpoint
    "unprepare-cdi",  # after the CDI spec is removed
    "unprepare-dir",  # after the directory and demand file are removed, before the entry goes
)


def maybe_crash(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        log.warning("test hook %s=%s: killing this process", CRASH_ENV, step)
        os.kill(os.getpid(), signal.SIGKILL)
