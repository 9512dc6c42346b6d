"""The dashboard's lock-out of client addresses that keep sending wrong logins
(ortq.dashboard.throttle), on a clock the test moves; the real dashboard's use of it is
tests/test_dashboard_security.py's test_wrong_logins_lock_the_address_out."""

from __future__ import annotations

from ortq.dashboard.throttle import FORGET_AFTER, FREE_FAILURES, LONGEST_LOCKOUT, LoginThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_free_failures_then_lockouts_that_double_up_to_the_cap() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for _ in range(FREE_FAILURES):
        throttle.failed("10.0.0.1")
        assert throttle.retry_after("10.0.0.1") == 0
    waits = []
    for _ in range(14):
        throttle.failed("10.0.0.1")
        waits.append(throttle.retry_after("10.0.0.1"))
        clock.now += waits[-1]  # waited it out: may try again
        assert throttle.retry_after("10.0.0.1") == 0
    assert waits == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, int(LONGEST_LOCKOUT), 900, 900, 900]
    assert throttle.retry_after("10.0.0.2") == 0  # another address is not locked out


def test_a_right_login_or_an_hour_without_failures_starts_the_count_again() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for _ in range(FREE_FAILURES):
        throttle.failed("10.0.0.1")
    throttle.succeeded("10.0.0.1")
    throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 0
    for _ in range(FREE_FAILURES):
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 1
    clock.now += FORGET_AFTER + 1
    throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 0


def test_an_ipv6_host_counts_by_its_network_and_memory_is_bounded() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock, max_clients=3)
    for n in range(FREE_FAILURES + 1):  # a new address of one /64 each time
        throttle.failed(f"2001:db8:1:2::{n + 1:x}")
    assert throttle.retry_after("2001:db8:1:2:ffff::1") == 1
    assert throttle.retry_after("2001:db8:1:3::1") == 0
    for _ in range(FREE_FAILURES + 1):
        throttle.failed("::ffff:192.0.2.7")  # an IPv4 client on a dual-stack socket
    assert throttle.retry_after("192.0.2.7") == 1
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):  # three more addresses: the oldest go
        throttle.failed(address)
    assert throttle.retry_after("2001:db8:1:2::1") == 0
    assert throttle.retry_after("192.0.2.7") == 0
