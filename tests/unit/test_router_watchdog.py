"""The router's watchdog: a deadline armed after a later one still fires on time, and a
disarmed one never does."""

from __future__ import annotations

import threading
import time

from pdserve.router.watchdog import Watchdog


def test_a_sooner_deadline_armed_after_a_later_one_fires_first() -> None:
    dog = Watchdog()
    late, soon = threading.Event(), threading.Event()
    try:
        with dog.armed(60.0, late.set):
            started = time.monotonic()
            with dog.armed(0.05, soon.set):
                assert soon.wait(5.0), "the 50 ms deadline did not fire within 5 s"
            assert time.monotonic() - started < 5.0
            assert not late.is_set()
    finally:
        dog.close()
    assert not late.is_set()


def test_disarmed_deadlines_never_fire_and_later_ones_still_do() -> None:
    dog = Watchdog()
    fired: list[int] = []
    last = threading.Event()
    try:
        for i in range(200):  # each disarmed at once, as a decode stream that started
            with dog.armed(0.01, lambda i=i: fired.append(i)):
                pass
        with dog.armed(0.05, last.set):
            assert last.wait(5.0)
    finally:
        dog.close()
    assert fired == []
