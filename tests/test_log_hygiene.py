"""The daemon's log stays the operator's: a client cannot write lines of its
own into it (a newline in its name), nor flood it (garbage over and over)."""

from __future__ import annotations

import logging
import re

from test_limits_connections import Attacker

from kvdepot.logsafe import RateLimitedLog

FORGED = "FAKE kvdepotd 0.1.0 ready on unix:/tmp/elsewhere"


def test_a_client_given_newline_cannot_forge_a_log_line(daemon):
    forge = Attacker("forge", daemon.socket, "engine\n" + FORGED + "\r\x1b[2K")
    forge.report()
    forge.proc.wait(10)
    log = daemon.log()
    assert not [line for line in log.splitlines() if line.startswith("FAKE")], log
    # The name is still there to read, escaped, in the lines that name the session.
    assert re.search(r"session \d+ attached: " + re.escape(f"'engine\\n{FAKE_ESCAPED}'"), log), log
    # A model name with control characters is refused, and said so in the client's error only.
    assert "namespace.model has control characters" not in log


FAKE_ESCAPED = FORGED + "\\r\\x1b[2K"


def test_sessions_that_never_say_hello_do_not_write_a_line_each(daemon):
    # Any local process can attach and hang up at will; an INFO line for each
    # attach and end was 2 lines (about 80 bytes) an attach, at thousands a second.
    lines_before = len(daemon.log().splitlines())
    churn = Attacker("unproven", daemon.socket, 300)
    assert churn.report(timeout=120)["attached"] == 300
    churn.proc.wait(10)
    new_lines = daemon.log().splitlines()[lines_before:]
    assert len(new_lines) <= 6, "\n".join(new_lines[:20])


def test_garbage_frames_from_many_connections_log_a_few_lines_not_one_each(daemon):
    lines_before = len(daemon.log().splitlines())
    garbage = Attacker("garbage", daemon.socket, 1000)
    assert garbage.report(timeout=120)["sent"] == 1000
    garbage.proc.wait(10)
    log = daemon.log()
    new_lines = log.splitlines()[lines_before:]
    assert len(new_lines) <= 6, "\n".join(new_lines[:20])
    assert "closing a job socket connection that sent a frame that is not a JobFrame" in log
    assert "closing a job socket connection that sent a frame of 1073741824 bytes" in log
    assert "Traceback" not in log


def test_a_rate_limited_line_says_how_many_were_left_out(caplog):
    now = [100.0]
    events = RateLimitedLog(logging.getLogger("test.events"), interval=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.events"):
        for _ in range(500):
            events.warning("garbage", "a garbage frame from %s", "pid 1")
        events.warning("other", "another kind is not held back")
        now[0] += 11
        events.warning("garbage", "a garbage frame from %s", "pid 2")
    assert [r.getMessage() for r in caplog.records] == [
        "a garbage frame from pid 1",
        "another kind is not held back",
        "a garbage frame from pid 2 (and 499 more like it in the last 11 s)",
    ]
