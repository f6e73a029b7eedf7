"""Tenant-derived strings (process names, paths, environment values) made safe to log, to post
as an Event and to use as a label: one line, printable, bounded. A process name with a newline
must not become a forged line of the root plugin's log."""

from __future__ import annotations

import logging

MAX_CHARS = 256  # of one tenant-derived string, after escaping

# every C0 control, DEL and the C1 controls as Python writes them in a repr; the Unicode line
# separators some log readers split on; bytes that were not UTF-8 (surrogateescape) as \xNN
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES |= {c: f"\\u{c:04x}" for c in (0x2028, 0x2029)}
_ESCAPES |= {c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)}
# the formatter escapes these; printable() also the backslash, so its output reads unambiguously
_CONTROLS = dict(_ESCAPES)
_ESCAPES[ord("\\")] = "\\\\"


def printable(value: str | bytes, limit: int = MAX_CHARS) -> str:
    """`value` with every control character and backslash escaped (bytes that are not UTF-8
    as \\xNN), cut to `limit` characters with a marker."""
    text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
    out = text.translate(_ESCAPES)
    return out if len(out) <= limit else out[: limit - 3] + "..."


class OneLineFormatter(logging.Formatter):
    """A formatter whose every record is one line: control characters in the message (wherever
    they came from) are escaped; a traceback, which the formatter itself appends, stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)


def configure(level: int | str, stream: object | None = None) -> None:
    """logging.basicConfig with the one-line formatter (the plugin's and `vgpu`'s logs)."""
    handler = logging.StreamHandler(stream)  # type: ignore[arg-type]
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
