"""Which addresses and UDP ports a call's ICE uses (``--webrtc-address``, ``--webrtc-ports``,
``--webrtc-public-address``).

aiortc gathers candidates with aioice, which offers every interface's address but loopback, on
any port, and has no setting for either. ``install()`` has aiortc's gatherer make its ICE
connections as ``PolicyConnection``: a call made while ``using(policy)`` is in effect (the edge
sets it around its SDP negotiation) offers host candidates on the policy's addresses only, each on
a free port of its range, announced as the public address when one is set (1:1 NAT); any other
aiortc use in the process (a test's own peer) is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import itertools
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aioice
import aioice.ice
from aioice.candidate import Candidate, candidate_foundation, candidate_priority

#: The receive buffer of a media socket (aioice's own choice for its sockets).
UDP_RCVBUF = 1024 * 1024


class NoMediaPortError(OSError):
    """Every port of the range is taken on an address (as many calls as ports)."""


@dataclass(frozen=True)
class IcePolicy:
    addresses: tuple[str, ...]
    """Local addresses host candidates are gathered on (bound)."""
    ports: tuple[int, int] | None = None
    """Inclusive UDP port range of media sockets (None: any the kernel gives)."""
    public_address: str = ""
    """The address candidates announce instead of the bound one ("" = the bound one)."""

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("ICE needs at least one address")
        for address in (*self.addresses, *([self.public_address] if self.public_address else [])):
            ipaddress.ip_address(address)  # ValueError for anything but an IP address
        if self.ports is not None:
            low, high = self.ports
            if not 1024 <= low <= high <= 65535:
                raise ValueError(f"UDP port range {low}-{high}: use LOW-HIGH within 1024-65535")

    @property
    def port_count(self) -> int:
        return 0 if self.ports is None else self.ports[1] - self.ports[0] + 1


def parse_ports(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` (inclusive); raises ValueError."""
    low, sep, high = text.partition("-")
    if not sep:
        raise ValueError(f"--webrtc-ports {text!r}: use LOW-HIGH, e.g. 40000-40099")
    return int(low), int(high)


def host_addresses() -> tuple[str, ...]:
    """Every interface's IPv4 address but loopback (what aioice offers by default)."""
    return tuple(a for a in aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False))


_POLICY: contextvars.ContextVar[IcePolicy | None] = contextvars.ContextVar("duplex_ice_policy", default=None)
_next_port = itertools.count()


@contextlib.contextmanager
def using(policy: IcePolicy) -> Iterator[None]:
    """ICE connections made in this context (this task's) follow ``policy``."""
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def _bind(address: str, ports: tuple[int, int] | None) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    if ports is None:
        candidates: list[int] = [0]
    else:
        low, high = ports
        count = high - low + 1
        start = next(_next_port) % count  # round robin: a port just freed is the last one tried
        candidates = [low + (start + i) % count for i in range(count)]
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
            sock.bind((address, port))
        except OSError:
            sock.close()
            continue
        sock.setblocking(False)
        return sock
    raise NoMediaPortError(f"no free UDP port on {address} in {ports}")


class PolicyConnection(aioice.Connection):
    """An aioice connection whose host candidates follow the ``IcePolicy`` in effect when it was
    made (none: aioice's own behaviour)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = _POLICY.get()

    async def get_component_candidates(
        self,
        component: int,
        addresses: list[str],
        timeout: int = 5,  # noqa: ASYNC109 - aioice's signature
    ) -> list[Candidate]:
        policy = self.policy
        if policy is None:
            return list(await super().get_component_candidates(component, addresses, timeout))
        loop = asyncio.get_running_loop()
        candidates: list[Candidate] = []
        protocols: list[aioice.ice.StunProtocol] = []
        try:
            for address in policy.addresses:
                sock = _bind(address, policy.ports)
                try:
                    _, protocol = await loop.create_datagram_endpoint(
                        lambda: aioice.ice.StunProtocol(self), sock=sock
                    )
                except BaseException:
                    sock.close()
                    raise
                host = policy.public_address or address
                port = sock.getsockname()[1]
                protocol.local_candidate = Candidate(
                    foundation=candidate_foundation("host", "udp", host),
                    component=component,
                    transport="udp",
                    priority=candidate_priority(component, "host"),
                    host=host,
                    port=port,
                    type="host",
                )
                protocols.append(protocol)
                candidates.append(protocol.local_candidate)
        except BaseException:
            for protocol in protocols:
                protocol.transport.close()
            raise
        # aioice pairs and closes what is in its list of protocols.
        self._protocols += protocols
        return candidates


def install() -> None:
    """Have aiortc's ICE gatherer make ``PolicyConnection``s (idempotent). aioice logs every
    connectivity check at INFO: warnings only."""
    import aiortc.rtcicetransport

    logging.getLogger("aioice").setLevel(logging.WARNING)

    setattr(aiortc.rtcicetransport, "Connection", PolicyConnection)  # noqa: B010 - not exported
