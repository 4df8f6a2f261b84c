"""Units of WebRTC on the edge, no I/O but sockets: the playout (what plays, what was heard, the
output buffer events), the offer check, client secrets, and the ICE policy's ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from realtime_service.client_secrets import ClientSecrets, SecretKeys, SecretRefused
from realtime_service.protocol import PCM24K
from realtime_service.webrtc.ice import IcePolicy, NoMediaPortError, _bind, parse_ports
from realtime_service.webrtc.offer import OfferError, check_sdp, parse_offer
from realtime_service.webrtc.playout import Cleared, Playout, Started, Stopped

MS20 = PCM24K.bytes_for_ms(20)


def audio(ms: int, value: int = 1) -> bytes:
    return bytes([value, 0]) * (PCM24K.bytes_for_ms(ms) // 2)


# ---- playout -------------------------------------------------------------------------------------


def test_a_reply_plays_in_order_with_silence_around_it_and_its_events() -> None:
    p = Playout(PCM24K)
    assert p.take(MS20) == (bytes(MS20), []) and not p.playing
    p.push("r1", "i1", audio(30))
    frame, notices = p.take(MS20)
    assert frame == audio(20) and notices == [Started("r1")] and p.playing
    # 10 ms left, the reply still coming: the rest of the frame is silence (an underrun).
    frame, notices = p.take(MS20)
    assert frame == audio(10) + bytes(MS20 // 2) and notices == [] and p.underruns == 1
    p.push("r1", "i1", audio(20, 2))
    assert p.finish("r1") == []  # audio left to play: stopped comes when it has played
    frame, notices = p.take(MS20)
    assert frame == audio(20, 2) and notices == [Stopped("r1")] and not p.playing
    assert p.played_bytes == PCM24K.bytes_for_ms(50)


def test_a_reply_finished_after_it_played_stops_at_once_and_the_next_follows() -> None:
    p = Playout(PCM24K)
    p.push("r1", "i1", audio(20))
    p.push("r2", "i2", audio(20, 3))
    assert p.take(MS20) == (audio(20), [Started("r1")])
    assert p.finish("r1") == [Stopped("r1")]
    assert p.take(MS20) == (audio(20, 3), [Started("r2")])
    assert p.finish("unknown") == []


def test_clearing_says_how_much_of_each_reply_was_played_and_drops_its_late_audio() -> None:
    p = Playout(PCM24K)
    p.push("r1", "i1", audio(100))
    for _ in range(3):
        p.take(MS20)
    assert p.clear("r1") == [Cleared("r1", "i1", 60)]
    assert not p.playing and p.take(MS20) == (bytes(MS20), [])
    # Audio of the cleared reply still on its way is not played; nor a reply cleared before any came.
    p.push("r1", "i1", audio(40))
    assert p.clear("r2") == []
    p.push("r2", "i2", audio(40))
    assert not p.playing and p.pending_bytes == 0
    # clear() drops every reply; one finished but still playing counts as playing.
    p.push("r3", "i3", audio(40))
    p.take(MS20)
    p.finish("r3")
    assert p.playing and p.clear() == [Cleared("r3", "i3", 20)]


# ---- offers --------------------------------------------------------------------------------------

OFFER = "\r\n".join(
    [
        "v=0",
        "o=- 1 2 IN IP4 127.0.0.1",
        "s=-",
        "t=0 0",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111 0",
        "c=IN IP4 0.0.0.0",
        "a=sendrecv",
        "a=rtpmap:111 opus/48000/2",
        "a=rtpmap:0 PCMU/8000",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "",
    ]
)


@pytest.mark.parametrize(
    ("sdp", "code"),
    [
        ("", "invalid_sdp"),
        ("hello", "invalid_sdp"),
        ("v=0\r\ns=-\r\n", "invalid_sdp"),
        (OFFER.replace("m=audio 9", "m=audio x"), "invalid_sdp"),
        (OFFER.replace("m=audio 9", "m=audio 0"), "offer_without_audio"),
        (OFFER.replace("a=sendrecv", "a=inactive"), "offer_without_audio"),
        (OFFER.replace("m=audio", "m=video"), "offer_without_audio"),
        (OFFER.replace("a=rtpmap:111 opus/48000/2", "a=rtpmap:111 G722/8000"), "unsupported_codec"),
        (OFFER + "a=x:" + "y" * 70_000, "invalid_sdp"),
    ],
)
def test_an_offer_the_edge_cannot_answer_is_refused_with_a_stable_code(sdp: str, code: str) -> None:
    with pytest.raises(OfferError) as err:
        check_sdp(sdp)
    assert err.value.code == code


def test_offers_as_a_body_and_as_a_form() -> None:
    assert check_sdp(OFFER) == OFFER
    assert parse_offer("application/sdp", OFFER.encode(), None).has_data_channel
    offer = parse_offer("multipart/form-data", None, {"sdp": OFFER, "session": '{"instructions": "x"}'})
    assert offer.session == {"instructions": "x"}
    cases = [
        ("application/sdp", b"\xff\xfe", None, "invalid_sdp"),
        ("multipart/form-data", None, {"session": "{}"}, "missing_required_parameter"),
        ("multipart/form-data", None, {"sdp": OFFER, "session": "{"}, "invalid_json"),
        ("multipart/form-data", None, {"sdp": OFFER, "session": "[]"}, "invalid_type"),
        ("text/plain", OFFER.encode(), None, "invalid_content_type"),
    ]
    for content_type, body, form, code in cases:
        with pytest.raises(OfferError) as err:
            parse_offer(content_type, body, form)
        assert err.value.code == code


# ---- client secrets ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_secret_grants_what_it_was_minted_with_once_until_it_expires() -> None:
    clock = Clock()
    secrets = ClientSecrets(SecretKeys.ephemeral(), clock)
    value, expires_at = secrets.mint("alice", "real-token", "parrot", {"instructions": "x"}, 60)
    assert value.startswith("ek_") and expires_at == 1_000_060
    assert "real-token" not in value and "alice" not in value  # sealed, not readable
    grant = secrets.check(value)
    assert (grant.principal, grant.token, grant.model, grant.session) == (
        "alice",
        "real-token",
        "parrot",
        {"instructions": "x"},
    )
    secrets.use(grant)
    with pytest.raises(SecretRefused) as err:
        secrets.check(value)
    assert err.value.code == "used_client_secret"
    secrets.give_back(grant)  # its call did not start: usable again
    assert secrets.check(value) == grant
    clock.now = expires_at
    with pytest.raises(SecretRefused) as err:
        secrets.check(value)
    assert err.value.code == "expired_client_secret"
    with pytest.raises(ValueError):
        secrets.mint("alice", "t", "", None, 7201)


def test_client_secrets_open_only_with_the_keys_that_sealed_them(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated: new first\nk2:" + "b" * 32 + "\nk1:" + "a" * 32 + "\n")
    old = ClientSecrets(SecretKeys({"k1": b"a" * 32}))
    both = ClientSecrets(SecretKeys.from_file(keys))
    value, _ = old.mint("alice", "t", "", None, 60)
    assert both.check(value).principal == "alice"  # another replica, the same keys
    new, _ = both.mint("bob", "t", "", None, 60)
    assert new.startswith("ek_k2_")
    with pytest.raises(SecretRefused):
        old.check(new)
    for forged in ("ek_k1_", "ek_nope_AAAA", value[:-2] + "AA", "ek_k1_" + "A" * 80, "sk-real"):
        with pytest.raises(SecretRefused) as err:
            both.check(forged)
        assert err.value.code == "invalid_api_key"
    for bad in (
        "k1:short\n",
        "no-colon\n",
        "k1:" + "a" * 32 + "\nk1:" + "b" * 32 + "\n",
        "bad id:" + "a" * 32,
    ):
        keys.write_text(bad)
        with pytest.raises(ValueError):
            SecretKeys.from_file(keys)


# ---- ICE ports -----------------------------------------------------------------------------------


def free_range(n: int) -> tuple[int, int]:
    """``n`` consecutive UDP ports free on loopback now."""
    for low in range(41_000, 60_000, 97):
        socks = []
        try:
            for port in range(low, low + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return low, low + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free range")


def test_media_sockets_take_ports_of_the_range_until_none_is_left() -> None:
    ports = free_range(3)
    taken = [_bind("127.0.0.1", ports) for _ in range(3)]
    try:
        assert sorted(s.getsockname()[1] for s in taken) == list(range(ports[0], ports[1] + 1))
        with pytest.raises(NoMediaPortError):
            _bind("127.0.0.1", ports)
        taken.pop().close()
        taken.append(_bind("127.0.0.1", ports))  # a port freed is taken again
    finally:
        for s in taken:
            s.close()


def test_the_ice_policy_checks_its_addresses_and_ports() -> None:
    assert parse_ports("40000-40099") == (40000, 40099)
    assert IcePolicy(("127.0.0.1",), (40000, 40099)).port_count == 100
    for bad in ("40000", "a-b"):
        with pytest.raises(ValueError):
            parse_ports(bad)
    for addresses, ports, public in (
        ((), None, ""),
        (("not-an-ip",), None, ""),
        (("127.0.0.1",), (80, 90), ""),
        (("127.0.0.1",), (40010, 40000), ""),
        (("127.0.0.1",), None, "example.com"),
    ):
        with pytest.raises(ValueError):
            IcePolicy(addresses, ports, public)
