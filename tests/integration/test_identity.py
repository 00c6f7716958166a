"""Ed25519 peer identity: file format, peer id derivation (checked against p2pd), signatures."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import base58
import pytest

from swarmloco.protocol.trust.identity import (
    IdentityError,
    load_or_create_identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)

pytestmark = pytest.mark.timeout(60)


def test_create_then_reload_gives_same_identity(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    first = load_or_create_identity(path)
    assert first.peer_id.startswith("12D3KooW")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_or_create_identity(str(path))
    assert again.peer_id == first.peer_id and again.path == path
    assert peer_id_from_public_key(public_key_from_peer_id(first.peer_id)) == first.peer_id


def test_sign_and_verify(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a.key")
    b = load_or_create_identity(tmp_path / "b.key")
    sig = a.sign(b"hello")
    assert len(sig) == 64
    assert verify(a.peer_id, b"hello", sig)
    assert not verify(a.peer_id, b"hellO", sig)
    assert not verify(b.peer_id, b"hello", sig)
    assert not verify(a.peer_id, b"hello", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert not verify(a.peer_id, b"hello", sig[:32])
    assert not verify("not-a-peer-id", b"hello", sig)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        load_or_create_identity(tmp_path / "nope" / "peer.key")


def test_garbage_and_rsa_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"\xff\x00garbage" * 10)
    with pytest.raises(IdentityError):
        load_or_create_identity(junk)

    from hivemind.p2p.p2p_daemon import P2P

    rsa = tmp_path / "rsa.key"
    P2P.generate_identity(str(rsa))
    with pytest.raises(IdentityError, match="RSA key, but swarmloco needs Ed25519"):
        load_or_create_identity(rsa)


def test_corrupt_public_half_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    load_or_create_identity(path)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    bad = tmp_path / "bad.key"
    bad.write_bytes(bytes(blob))
    with pytest.raises(IdentityError, match="does not match"):
        load_or_create_identity(bad)


def test_public_key_from_non_ed25519_peer_ids(tmp_path: Path) -> None:
    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon import P2P

    rsa = tmp_path / "rsa.key"
    P2P.generate_identity(str(rsa))
    rsa_peer_id = PeerID.from_identity(rsa.read_bytes()).to_base58()
    assert rsa_peer_id.startswith("Qm")
    valid = load_or_create_identity(tmp_path / "ok.key").peer_id
    raw = base58.b58decode(valid)
    secp = base58.b58encode(raw[:3] + b"\x02" + raw[4:]).decode()  # key_type Secp256k1
    for bad in (rsa_peer_id, "", "0OIl", valid[:-1], valid + "1", secp, "x" * 500):
        with pytest.raises(ValueError):
            public_key_from_peer_id(bad)


@pytest.mark.integration
def test_peer_id_matches_p2pd(tmp_path: Path) -> None:
    import hivemind

    path = tmp_path / "peer.key"
    identity = load_or_create_identity(path)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path),
                       check_if_identity_free=False)
    try:
        assert dht.peer_id.to_base58() == identity.peer_id
    finally:
        dht.shutdown()


def test_file_is_libp2p_protobuf(tmp_path: Path) -> None:
    from hivemind.proto import crypto_pb2

    identity = load_or_create_identity(tmp_path / "peer.key")
    msg = crypto_pb2.PrivateKey()
    msg.ParseFromString((tmp_path / "peer.key").read_bytes())
    assert msg.key_type == crypto_pb2.KeyType.Ed25519 and len(msg.data) == 64
    pub = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=msg.data[32:]).SerializeToString()
    assert base58.b58decode(identity.peer_id) == bytes([0, len(pub)]) + pub
