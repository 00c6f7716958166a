"""Peer identity: one Ed25519 key that is both the libp2p identity and the report-signing key.

The key is stored in libp2p's ``PrivateKey`` protobuf format (``key_type=Ed25519``, ``data`` = 32-byte seed
followed by the 32-byte public key), so the very same file can be handed to hivemind as ``identity_path``
(``hivemind.DHT(..., identity_path=path, check_if_identity_free=False)``) and p2pd will run under it.

Binding reports to peer ids: the libp2p peer id of an Ed25519 key is the base58btc encoding of an *identity*
multihash (code ``0x00``) whose digest is the protobuf ``PublicKey{key_type=Ed25519, data=<32 bytes>}``. Such ids
always start with ``12D3KooW``. The public key can therefore be read back from the peer id string alone, and a
signature made with the private key proves the signer owns that peer id — no key registry is needed.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "Identity",
    "IdentityError",
    "load_or_create_identity",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "verify",
]

logger = logging.getLogger(__name__)

# libp2p crypto.pb KeyType.Ed25519 and the protobuf wire tags of PublicKey/PrivateKey (field 1 varint, field 2 bytes).
_KEY_TYPE_ED25519 = 1
_TAG_KEY_TYPE = 0x08
_TAG_DATA = 0x12
_ED25519_KEY_LEN = 32
# Multihash "identity" function code; libp2p inlines keys whose protobuf encoding is at most 42 bytes.
_MULTIHASH_IDENTITY = 0x00
_MAX_PEER_ID_CHARS = 128
_MAX_IDENTITY_FILE_BYTES = 4096


class IdentityError(ValueError):
    """The identity file cannot be used (unreadable, malformed or not an Ed25519 key)."""


def _encode_key_message(data: bytes) -> bytes:
    """Deterministic protobuf encoding of ``PublicKey``/``PrivateKey`` with ``key_type=Ed25519``."""
    if len(data) > 127:
        raise ValueError(f"key data too long for the short protobuf encoding: {len(data)} bytes")
    return bytes([_TAG_KEY_TYPE, _KEY_TYPE_ED25519, _TAG_DATA, len(data)]) + data


def _public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(key: Ed25519PublicKey) -> str:
    """The libp2p peer id (base58btc, ``12D3KooW...``) of an Ed25519 public key."""
    proto = _encode_key_message(_public_bytes(key))
    return base58.b58encode(bytes([_MULTIHASH_IDENTITY, len(proto)]) + proto).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Extract the Ed25519 public key inlined in a libp2p peer id.

    :raises ValueError: if ``peer_id`` is not a base58 identity-multihash of an Ed25519 ``PublicKey``
    """
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise ValueError(f"peer id must be a non-empty string of at most {_MAX_PEER_ID_CHARS} chars")
    return _key_of(peer_id)


@functools.lru_cache(maxsize=4096)
def _key_of(peer_id: str) -> Ed25519PublicKey:
    """The decoding itself, remembered for the peers seen lately: every record, report and signature check of a
    peer decodes its id again (base58 costs about as much as the check). Only successes are remembered."""
    try:
        raw = base58.b58decode(peer_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"peer id {peer_id[:64]!r} is not valid base58: {e}") from None
    expected_len = 2 + 4 + _ED25519_KEY_LEN
    if len(raw) != expected_len or raw[0] != _MULTIHASH_IDENTITY or raw[1] != expected_len - 2:
        raise ValueError(
            f"peer id {peer_id[:64]!r} is not an identity multihash of an Ed25519 key "
            f"(decoded {len(raw)} bytes, expected {expected_len} starting with 0x00 0x24)"
        )
    header = raw[2:6]
    if header != bytes([_TAG_KEY_TYPE, _KEY_TYPE_ED25519, _TAG_DATA, _ED25519_KEY_LEN]):
        raise ValueError(f"peer id {peer_id[:64]!r} does not hold an Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(raw[6:])


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by the key inlined in ``peer_id``."""
    try:
        key = public_key_from_peer_id(peer_id)
    except ValueError:
        return False
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 64:
        return False
    try:
        key.verify(bytes(signature), data)
    except InvalidSignature:
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 peer identity loaded from (or saved to) a libp2p private-key file."""

    path: Path
    private_key: Ed25519PrivateKey = field(repr=False)
    peer_id: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_id", peer_id_from_public_key(self.private_key.public_key()))

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``data``."""
        return self.private_key.sign(data)

    @staticmethod
    def generate() -> Ed25519PrivateKey:
        return Ed25519PrivateKey.generate()


_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}


def _read_varint(blob: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(blob) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = blob[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _decode_key_message(blob: bytes) -> tuple[int, bytes]:
    """Decode libp2p ``crypto.pb.PrivateKey``/``PublicKey`` (two fields) without a protobuf runtime."""
    key_type: int | None = None
    data: bytes | None = None
    pos = 0
    while pos < len(blob):
        tag, pos = _read_varint(blob, pos)
        field_no, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, pos = _read_varint(blob, pos)
            if field_no == 1:
                key_type = value
        elif wire_type == 2:
            length, pos = _read_varint(blob, pos)
            if pos + length > len(blob):
                raise ValueError("length-delimited field runs past the end")
            if field_no == 2:
                data = blob[pos:pos + length]
            pos += length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type}")
    if key_type is None or data is None:
        raise ValueError("key_type or data is missing")
    return key_type, data


def _parse_private_key_file(path: Path, blob: bytes) -> Ed25519PrivateKey:
    """Parse libp2p ``PrivateKey`` protobuf bytes; accept the 64-byte (seed||pub) and legacy 96-byte layouts."""
    try:
        key_type, data = _decode_key_message(blob)
    except ValueError as e:
        raise IdentityError(f"identity file {path} is not a libp2p private key protobuf: {e}") from None
    if key_type != _KEY_TYPE_ED25519:
        name = _KEY_TYPE_NAMES.get(key_type, f"type-{key_type}")
        raise IdentityError(
            f"identity file {path} holds a {name} key, but swarmloco needs Ed25519; "
            f"move it away and a new Ed25519 identity will be created"
        )
    if len(data) not in (64, 96):
        raise IdentityError(f"identity file {path}: Ed25519 key data is {len(data)} bytes, expected 64")
    key = Ed25519PrivateKey.from_private_bytes(data[:32])
    if _public_bytes(key.public_key()) != data[32:64]:
        raise IdentityError(f"identity file {path}: public half does not match the private seed (corrupt file)")
    return key


def load_or_create_identity(path: str | Path) -> Identity:
    """Load the Ed25519 identity at ``path``, creating it (mode 0o600) if the file does not exist.

    :raises IdentityError: if the file exists but is unreadable or not an Ed25519 libp2p private key, or if the
        parent directory does not exist
    """
    path = Path(path)
    if path.exists():
        try:
            with open(path, "rb") as f:
                blob = f.read(_MAX_IDENTITY_FILE_BYTES + 1)
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e}") from None
        if len(blob) > _MAX_IDENTITY_FILE_BYTES:
            raise IdentityError(f"identity file {path} is larger than {_MAX_IDENTITY_FILE_BYTES} bytes")
        return Identity(path=path, private_key=_parse_private_key_file(path, blob))

    if not path.parent.is_dir():
        raise IdentityError(f"directory {path.parent} for the identity file does not exist; create it first")
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    blob = _encode_key_message(seed + _public_bytes(key.public_key()))
    # O_EXCL: never clobber a file another process created meanwhile; 0o600 keeps the key private.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_or_create_identity(path)
    except OSError as e:
        raise IdentityError(f"cannot create identity file {path}: {e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    identity = Identity(path=path, private_key=key)
    logger.info("created new Ed25519 identity %s at %s", identity.peer_id, path)
    return identity
