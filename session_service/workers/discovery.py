"""Where the workers are: a static list, or a DNS name resolved again while the service runs.

``--workers`` takes either form:

- ``HOST:PORT[,HOST:PORT...]``: a fixed list, dialled as written (each name resolved by gRPC).
- ``dns:[//DNS_HOST[:DNS_PORT]/]NAME:PORT`` (the gRPC target syntax): every A and AAAA record of
  ``NAME`` is one worker at ``ADDRESS:PORT`` (a Kubernetes headless Service lists one record per
  ready pod). Without an authority (``dns:///NAME:PORT``) the system's resolver configuration
  (``/etc/resolv.conf``: its servers and search list) is used; with one, that DNS server alone
  is asked, and ``NAME`` is taken as absolute.

``WorkerDiscovery`` resolves the name every ``interval_s`` and whenever ``nudge`` asks (a worker
link was lost: its pod may have moved), at most once per ``min_interval_s``, and hands each
usable answer to the pool (``placement.WorkerPool.update``), which adds and removes links.

What an answer can do is bounded: only A and AAAA records of the name count (dnspython follows
a CNAME chain and checks that records answer the question); an address that cannot be dialled
(unspecified, multicast, IPv6 link-local without a zone) is skipped; at most ``max_workers``
addresses are taken (the lowest, so every replica takes the same ones). A failed resolution
(timeout, SERVFAIL, either of the two queries) or an empty one (NXDOMAIN, no records) changes
nothing: the links stay as they are, so a DNS outage never takes workers away, and it is
retried with backoff. The library doing the DNS is dnspython (its asyncio resolver, no cache:
every resolution asks the server; a truncated UDP answer is retried over TCP).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from session_service.metrics import RESOLUTIONS

log = logging.getLogger(__name__)

#: How often the workers' name is resolved again (``--workers-resolve-interval-s``).
DEFAULT_RESOLVE_INTERVAL_S = 10.0

#: Never resolve more often than this, however many links are lost (a flapping worker must not
#: turn into a DNS flood); also the first retry after a failed or empty resolution.
MIN_RESOLVE_INTERVAL_S = 1.0

#: Most workers one answer may add (``--max-workers``); a static list may not be longer either.
DEFAULT_MAX_WORKERS = 64

#: How long one resolution (both queries, every server, retries included) may take.
RESOLVE_TIMEOUT_S = 5.0

_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class WorkersSpecError(ValueError):
    """``--workers`` is neither a list of ``HOST:PORT`` nor one ``dns:`` target."""


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """``dns:[//SERVER/]NAME:PORT``: the workers are the A and AAAA records of ``name``."""

    name: str
    """The name to resolve, as given (a trailing dot makes it absolute: no search list)."""
    port: int
    """The workers' port (a record carries no port: every worker listens on the same one)."""
    server: tuple[str, int] | None = None
    """The DNS server to ask (an IP address and port); None: the system's resolver."""

    @property
    def host(self) -> str:
        """The name without a trailing dot: the name a worker's TLS certificate must carry."""
        return self.name.rstrip(".")

    def __str__(self) -> str:
        if self.server is None:
            return f"dns:///{self.name}:{self.port}"
        host, port = self.server
        return f"dns://{_join(host, port)}/{self.name}:{self.port}"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise WorkersSpecError(f"{what}: the port must be a number from 1 to 65535, got {text!r}")
    return int(text)


def _check_name(name: str, spec: str) -> None:
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    if len(name.rstrip(".")) > 253 or not all(_LABEL.match(label) for label in labels):
        raise WorkersSpecError(f"{spec}: {name!r} is not a DNS name")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return
    raise WorkersSpecError(f"{spec}: {name!r} is an address, not a name: list addresses as HOST:PORT")


def parse_dns_target(spec: str) -> DnsTarget:
    """``dns:///NAME:PORT``, ``dns://SERVER[:PORT]/NAME:PORT`` or ``dns:NAME:PORT``."""
    rest = spec[len("dns:") :]
    server: tuple[str, int] | None = None
    if rest.startswith("//"):
        authority, sep, rest = rest[2:].partition("/")
        if not sep:
            raise WorkersSpecError(f"{spec}: expected dns://[SERVER[:PORT]]/NAME:PORT")
        if authority:
            host, port = authority, 53
            if authority.startswith("["):
                host, _, tail = authority[1:].partition("]")
                if tail:
                    if not tail.startswith(":"):
                        raise WorkersSpecError(f"{spec}: bad DNS server {authority!r}")
                    port = _port(tail[1:], spec)
            elif authority.count(":") == 1:
                host, _, port_text = authority.partition(":")
                port = _port(port_text, spec)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise WorkersSpecError(
                    f"{spec}: the DNS server must be an IP address (optionally :PORT), got {authority!r}"
                ) from None
            server = (host, port)
    name, sep, port_text = rest.rpartition(":")
    if not sep or not name:
        raise WorkersSpecError(f"{spec}: expected NAME:PORT after the dns: prefix (a record has no port)")
    _check_name(name, spec)
    return DnsTarget(name=name, port=_port(port_text, spec), server=server)


def parse_workers(
    workers: Sequence[str], *, max_workers: int = DEFAULT_MAX_WORKERS
) -> tuple[str, ...] | DnsTarget:
    """``--workers``, split at commas: a static list of ``HOST:PORT`` or one ``dns:`` target.

    Raises ``WorkersSpecError`` naming what is wrong."""
    items = [w.strip() for w in workers if w.strip()]
    if not items:
        raise WorkersSpecError("--workers needs at least one HOST:PORT or a dns:///NAME:PORT target")
    if any(w.lower().startswith("dns:") for w in items):
        if len(items) != 1:
            raise WorkersSpecError("--workers takes one dns: target, or a list of HOST:PORT, not both")
        return parse_dns_target(items[0])
    for w in items:
        host, sep, port = w.rpartition(":")
        if not sep or not host.strip("[]"):
            raise WorkersSpecError(f"expected HOST:PORT, got {w!r}")
        _port(port, w)
    unique = tuple(dict.fromkeys(items))
    if len(unique) > max_workers:
        raise WorkersSpecError(
            f"--workers lists {len(unique)} workers, more than --max-workers {max_workers}"
        )
    return unique


class DiscoveryError(Exception):
    """A resolution that gave no usable answer (the message says why; it names no record)."""


class Resolve(Protocol):
    """One resolution: the addresses the name has now (empty: it has none)."""

    async def __call__(self) -> list[IPAddress]: ...


def usable(address: IPAddress) -> bool:
    """Whether a worker could listen at ``address`` (loopback counts: tests and one-host setups)."""
    if address.is_unspecified or address.is_multicast:
        return False
    return not (isinstance(address, ipaddress.IPv6Address) and address.is_link_local)


def worker_address(address: IPAddress, port: int) -> str:
    """The ``HOST:PORT`` a link dials (``[v6]:PORT`` for IPv6)."""
    return _join(str(address), port)


class DnsResolver:
    """A ``Resolve`` over dnspython's asyncio resolver: the A and AAAA records of the target."""

    def __init__(self, target: DnsTarget, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
        self.target = target
        self._timeout_s = timeout_s
        self._search = target.server is None
        self._resolver: dns.asyncresolver.Resolver | None = None

    def _make(self) -> dns.asyncresolver.Resolver:
        """The resolver, made at the first resolution (a missing /etc/resolv.conf is then a
        failed resolution, logged and retried, not a crash)."""
        if self._resolver is not None:
            return self._resolver
        target = self.target
        if target.server is None:
            # /etc/resolv.conf: its servers, search list and ndots (the name as getaddrinfo
            # would look it up, /etc/hosts aside).
            try:
                resolver = dns.asyncresolver.Resolver()
            except dns.resolver.NoResolverConfiguration as exc:
                raise DiscoveryError(
                    "no system resolver configuration (/etc/resolv.conf); name a DNS server: "
                    "dns://IP[:PORT]/NAME:PORT"
                ) from exc
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [target.server[0]]
            resolver.port = target.server[1]
        resolver.cache = None  # every resolution asks: the point is to see changes
        resolver.lifetime = self._timeout_s
        resolver.timeout = min(2.0, self._timeout_s)
        self._resolver = resolver
        return resolver

    async def _query(self, resolver: dns.asyncresolver.Resolver, rdtype: str) -> list[IPAddress]:
        try:
            answer = await resolver.resolve(
                self.target.name, rdtype, search=self._search, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            return []
        except dns.exception.Timeout as exc:
            raise DiscoveryError(f"{rdtype} query timed out") from exc
        except dns.resolver.NoNameservers as exc:
            raise DiscoveryError(f"{rdtype} query: no server answered it ({exc})") from exc
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"{rdtype} query failed: {type(exc).__name__}: {exc}") from exc
        if answer.rrset is None:
            return []
        found: list[IPAddress] = []
        for rdata in answer.rrset:
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_address(rdata.to_text()))
        return found

    async def __call__(self) -> list[IPAddress]:
        # Both or nothing: a partial answer (A answered, AAAA timed out) could drop half the
        # workers of a dual-stack cluster.
        resolver = self._make()
        answers = await asyncio.gather(
            self._query(resolver, "A"), self._query(resolver, "AAAA"), return_exceptions=True
        )
        found: list[IPAddress] = []
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
            found.extend(answer)
        return found


Apply = Callable[[Sequence[str]], Awaitable[None]]


class WorkerDiscovery:
    """Resolves a ``DnsTarget`` periodically and on request, and applies each usable answer."""

    def __init__(
        self,
        target: DnsTarget,
        apply: Apply,
        *,
        interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        min_interval_s: float = MIN_RESOLVE_INTERVAL_S,
        max_workers: int = DEFAULT_MAX_WORKERS,
        resolve: Resolve | None = None,
    ) -> None:
        """``apply``: hands the worker addresses (``IP:PORT``, sorted) to the pool; ``resolve``:
        one resolution (default: ``DnsResolver(target)``)."""
        self.target = target
        self._apply = apply
        self._interval_s = interval_s
        self._min_interval_s = min(min_interval_s, interval_s)
        self._max_workers = max_workers
        self._resolve: Resolve = resolve if resolve is not None else DnsResolver(target)
        self._nudged = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.addresses: tuple[str, ...] = ()
        """The addresses of the last answer applied."""
        self.resolutions = 0
        """Resolutions done (whatever their outcome)."""
        self._last_problem = ""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-discovery-{self.target}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def nudge(self) -> None:
        """Resolve again soon (a worker link was lost), not sooner than ``min_interval_s`` after
        the last resolution."""
        self._nudged.set()

    async def refresh(self) -> bool:
        """One resolution; applies it when it is usable. Returns whether it was."""
        self.resolutions += 1
        try:
            found = await self._resolve()
        except DiscoveryError as err:
            RESOLUTIONS.labels(result="failed").inc()
            self._problem(
                f"resolving {self.target} failed: {err}; keeping the {len(self.addresses)} workers known"
            )
            return False
        addresses = self._select(found)
        if not addresses:
            RESOLUTIONS.labels(result="empty").inc()
            self._problem(
                f"{self.target} has no usable A/AAAA record; keeping the {len(self.addresses)} workers known"
            )
            return False
        RESOLUTIONS.labels(result="ok").inc()
        if self._last_problem:
            log.info("resolving %s works again", self.target)
            self._last_problem = ""
        if addresses != self.addresses:
            await self._apply(addresses)
            self.addresses = addresses
        return True

    def _problem(self, message: str) -> None:
        # Logged when it starts or changes, not every interval while it lasts (the counter counts).
        if message != self._last_problem:
            log.warning("%s", message)
            self._last_problem = message

    def _select(self, found: Sequence[IPAddress]) -> tuple[str, ...]:
        unique = sorted(set(found), key=lambda a: (a.version, int(a)))
        skipped = [a for a in unique if not usable(a)]
        if skipped:
            log.warning(
                "%s: skipping %d addresses no worker can listen at: %s",
                self.target,
                len(skipped),
                ", ".join(map(str, skipped[:4])),
            )
        good = [a for a in unique if usable(a)]
        if len(good) > self._max_workers:
            log.warning(
                "%s lists %d workers; taking the first %d (--max-workers)",
                self.target,
                len(good),
                self._max_workers,
            )
            good = good[: self._max_workers]
        return tuple(worker_address(a, self.target.port) for a in good)

    async def _run(self) -> None:
        backoff = self._min_interval_s
        while True:
            started = time.monotonic()
            try:
                ok = await self.refresh()
            except Exception:
                log.exception("worker discovery: applying an answer of %s failed", self.target)
                ok = False
            # A failed or empty resolution is retried sooner (backoff up to the interval): at
            # start, the workers may not be in DNS yet.
            wait = self._interval_s if ok else backoff
            backoff = self._min_interval_s if ok else min(self._interval_s, backoff * 2)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._nudged.wait()
            self._nudged.clear()
            rest = self._min_interval_s - (time.monotonic() - started)
            if rest > 0:
                await asyncio.sleep(rest)
