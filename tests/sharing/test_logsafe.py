"""sharing/logsafe.py: tenant-derived strings are one printable line, and so is every record of
the plugin's and `vgpu`'s logs."""

from __future__ import annotations

import io
import logging

from sharing.logsafe import OneLineFormatter, printable


def test_controls_backslashes_and_bad_utf8_are_escaped() -> None:
    assert printable("a\nb\rc\td\x1b[31m\x7f\x85") == "a\\nb\\rc\\td\\x1b[31m\\x7f\\x85"
    assert printable("x\u2028y\u2029z") == "x\\u2028y\\u2029z"
    assert printable("C:\\path") == "C:\\\\path"  # a literal backslash-n never reads as a newline
    assert printable(b"ok\xff\xfe\n") == "ok\\xff\\xfe\\n"
    assert printable("plain name-1.2") == "plain name-1.2"


def test_long_strings_are_cut_with_a_marker() -> None:
    assert printable("a" * 1000) == "a" * 253 + "..."
    assert printable("\n" * 200, limit=10) == "\\n\\n\\n\\..."


def test_a_record_is_one_line_and_a_traceback_is_kept() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("test_logsafe")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("pid %d (%s) over quota", 7, "x\nWARNING forged line")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed:\n%s", "detail")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "WARNING pid 7 (x\\nWARNING forged line) over quota"
    assert lines[1] == "ERROR failed:\\ndetail"
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"
