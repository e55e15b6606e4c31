"""The remote tier's circuit breaker, on a clock the test moves."""

from __future__ import annotations

from kvdepot.server.tiers.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_opens_after_failures_in_a_row_and_one_trial_closes_it(caplog):
    clock = Clock()
    breaker = Breaker("the store", failures=3, cooldown_s=1.0, clock=clock)
    breaker.failed(TimeoutError())
    breaker.succeeded()  # a success in between: the count starts again
    for _ in range(2):
        breaker.failed(TimeoutError())
    assert breaker.state == CLOSED and breaker.allows()
    breaker.failed(TimeoutError("timed out"))
    assert breaker.state == OPEN and breaker.skipping() and not breaker.allows()
    assert sum("is failing (TimeoutError: timed out)" in r.message for r in caplog.records) == 1
    clock.now += 1.0
    assert breaker.allows() and breaker.state == HALF_OPEN
    assert not breaker.allows()  # one trial at a time
    breaker.succeeded()
    assert breaker.state == CLOSED and breaker.allows()
    assert sum("answers again" in r.message for r in caplog.records) == 1


def test_a_failed_trial_doubles_the_cool_down_up_to_its_most():
    clock = Clock()
    breaker = Breaker("the store", failures=1, cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    breaker.failed("refused")
    waits = []
    for _ in range(4):
        waited = 0.0
        while not breaker.allows():
            clock.now += 0.25
            waited += 0.25
        waits.append(waited)
        breaker.failed("refused")
    assert waits == [1.0, 2.0, 3.0, 3.0]
    assert breaker.opened == 5


def test_a_trial_that_never_reports_back_is_replaced():
    clock = Clock()
    breaker = Breaker("the store", failures=1, cooldown_s=1.0, trial_s=5.0, clock=clock)
    breaker.failed("refused")
    clock.now += 1.0
    assert breaker.allows()  # a trial whose caller then made no call
    clock.now += 4.9
    assert not breaker.allows()
    clock.now += 0.1
    assert breaker.allows()
    breaker.succeeded()
    assert breaker.state == CLOSED
