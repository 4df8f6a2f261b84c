"""Call slots counted where they cost (``session_service.api.admission.CallLedger``, a state with no
I/O) and the defaults that keep one caller below the replica's bound. The interceptor itself is
played against real processes in tests/test_trust_attacks.py and in-process in
tests/test_session_capacity.py."""

from __future__ import annotations

import pytest

from duplex.errors import CapacityError, ErrorCode
from session_service.api.admission import CallLedger, CallLimits
from session_service.config import ServiceConfig


def _refused(ledger: CallLedger, principal: str | None) -> CapacityError:
    with pytest.raises(CapacityError) as err:
        ledger.enter(principal)
    assert err.value.code == ErrorCode.TOO_MANY_CALLS and err.value.retryable
    return err.value


def test_a_principals_calls_are_bounded_and_others_still_get_slots() -> None:
    ledger = CallLedger(CallLimits(max_calls=5, max_calls_per_principal=3))
    for _ in range(3):
        ledger.enter("mallory")
    assert "per caller" in _refused(ledger, "mallory").message
    ledger.enter("alice")
    ledger.enter("bob")
    assert ledger.calls == 5 and ledger.calls_of("mallory") == 3
    assert "on this replica" in _refused(ledger, "carol").message
    ledger.leave("mallory")
    ledger.enter("carol")
    for who in ("mallory", "mallory", "alice", "bob", "carol"):
        ledger.leave(who)
    assert ledger.calls == 0 and ledger.calls_of("mallory") == 0


def test_without_principals_only_the_replicas_bound_applies() -> None:
    ledger = CallLedger(CallLimits(max_calls=2, max_calls_per_principal=1))
    ledger.enter(None)
    ledger.enter(None)
    _refused(ledger, None)
    ledger.leave(None)
    ledger.enter(None)


def test_refusals_wait_a_few_per_address_and_in_all() -> None:
    ledger = CallLedger(
        CallLimits(max_calls=0, max_calls_per_principal=0, max_refusals_per_peer=2, max_refusals=3)
    )
    assert ledger.refusal_may_wait("ipv4:10.0.0.1") and ledger.refusal_may_wait("ipv4:10.0.0.1")
    assert not ledger.refusal_may_wait("ipv4:10.0.0.1")  # refused at once, not counted
    assert ledger.refusal_may_wait("ipv4:10.0.0.2")
    assert not ledger.refusal_may_wait("ipv4:10.0.0.3")  # the bound in all
    ledger.refusal_done("ipv4:10.0.0.1")
    assert ledger.refusals_from("ipv4:10.0.0.1") == 1 and ledger.refusals == 2
    assert ledger.refusal_may_wait("ipv4:10.0.0.3")


@pytest.mark.parametrize(
    ("settings", "per_principal"),
    [
        ({}, 256 + 16),
        ({"max_sessions_per_principal": 10}, 2 * 10 + 16),
        ({"max_calls_per_principal": 7}, 7),
        ({"max_concurrent_rpcs": 3}, 2),
        ({"max_concurrent_rpcs": 1}, 1),
    ],
)
def test_one_caller_is_bounded_below_the_replica(settings: dict[str, int], per_principal: int) -> None:
    cfg = ServiceConfig(plugin="p", workers=("127.0.0.1:1",), **settings)  # type: ignore[arg-type]
    assert cfg.calls_per_principal == per_principal
    if "max_calls_per_principal" not in settings and cfg.concurrent_rpcs > 1:
        assert cfg.calls_per_principal < cfg.concurrent_rpcs
