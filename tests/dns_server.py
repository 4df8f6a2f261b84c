"""A small authoritative DNS server on loopback whose answers a test changes while it runs.

Built on dnslib's ``DNSServer`` (UDP, its own thread): every A and AAAA query of a name the zone
holds is answered from the zone as it is at that moment; a name it does not hold is NXDOMAIN.
``fail`` answers SERVFAIL, ``drop`` answers nothing (the client times out). Every query is
counted by (name, type), so a test sees when the session service asked again.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
from collections import Counter
from collections.abc import Iterable, Iterator

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.dns import DNSError
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer


class Zone(BaseResolver):
    """Name -> addresses (IPv4 answer A queries, IPv6 AAAA queries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, list[str]] = {}
        self.queries: Counter[tuple[str, str]] = Counter()
        self.fail = False
        self.drop = False

    def set(self, name: str, addresses: Iterable[str]) -> None:
        """``name`` now has exactly ``addresses`` (an empty list: the name exists, no records)."""
        with self._lock:
            self._names[_key(name)] = list(addresses)

    def remove(self, name: str) -> None:
        """``name`` no longer exists (NXDOMAIN)."""
        with self._lock:
            self._names.pop(_key(name), None)

    def asked(self, name: str) -> int:
        """A and AAAA queries of ``name`` answered or refused so far."""
        with self._lock:
            return sum(n for (q, _), n in self.queries.items() if q == _key(name))

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        qname = str(request.q.qname)
        qtype = QTYPE[request.q.qtype]
        with self._lock:
            self.queries[(_key(qname), qtype)] += 1
            if self.drop:
                raise DNSError("dropped by the test")
            reply = request.reply()
            if self.fail:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            addresses = self._names.get(_key(qname))
            if addresses is None:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            for text in addresses:
                ip = ipaddress.ip_address(text)
                if qtype == "A" and ip.version == 4:
                    reply.add_answer(RR(qname, QTYPE.A, rdata=A(text), ttl=5))
                elif qtype == "AAAA" and ip.version == 6:
                    reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(text), ttl=5))
            return reply


def _key(name: str) -> str:
    return name.lower().rstrip(".") + "."


class _Quiet(DNSLogger):
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)


@contextlib.contextmanager
def dns_server(host: str = "127.0.0.1") -> Iterator[tuple[Zone, int]]:
    """A ``Zone`` served on ``host``, a free UDP port; yields the zone and the port."""
    zone = Zone()
    server = DNSServer(zone, address=host, port=0, logger=_Quiet())
    port: int = server.server.server_address[1]
    server.start_thread()
    try:
        yield zone, port
    finally:
        server.stop()
        server.server.server_close()
