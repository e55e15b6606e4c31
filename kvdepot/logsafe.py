"""Log lines that clients cannot forge or flood.

A client-given string (a client name, a namespace's model name) logged as it
is can hold a newline and start a line of its own that reads like the
daemon's ("...\\nkvdepotd ready"); `one_line` escapes it. Something any client can
make happen over and over (a garbage frame, a refused connection) is logged
at most once per interval, with the count of those left out.
"""

from __future__ import annotations

import logging
import re
import time

# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: object) -> str:
    """`text` with every character that could break a log line escaped (\\n, \\x1b...)."""
    text = str(text)
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class EscapingFormatter(logging.Formatter):
    """A text formatter whose message is one line whatever its arguments hold;
    a traceback (exc_info) still follows on lines of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class RateLimitedLog:
    """At most one line per `interval` seconds for each kind of event; the next
    line says how many were left out in between."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock=time.monotonic):
        self._log = logger
        self._interval = interval
        self._clock = clock
        # kind -> (when its last line was logged, events left out since)
        self._kinds: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args, exc_info: bool = False) -> None:
        now = self._clock()
        last, suppressed = self._kinds.get(kind, (None, 0))
        if last is not None and now - last < self._interval:
            self._kinds[kind] = (last, suppressed + 1)
            return
        self._kinds[kind] = (now, 0)
        if suppressed:
            message += f" (and {suppressed} more like it in the last {now - last:.0f} s)"
        self._log.warning(message, *args, exc_info=exc_info)
