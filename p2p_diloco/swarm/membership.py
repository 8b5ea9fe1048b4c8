"""Membership of a closed run: a swarm key shared by the members, or an allow-list of the members' public keys,
that signs every DHT record and gates averaging.

hivemind 1.1.12's bundled ``p2pd`` has no private-network (pre-shared key) option (``p2pd -help`` lists none), so
a stranger can still open a libp2p connection to a member. What it can no longer do:

- *store or forge DHT records*: every record a member stores carries an HMAC-SHA256 tag over (key, subkey, value,
  expiration) made with the swarm key (``MemberRecordValidator``, hivemind's record-validator hook); members' DHT
  nodes refuse untagged records on store and ignore them on read. That covers the progress records, the
  averager's matchmaking declarations and the state donors' priorities;
- *average or download state*: the averager asks ``MemberCheck`` about the caller's peer id (authenticated by
  libp2p), and admits only a peer with a member-signed progress record in the DHT.

A refused stranger costs a member one bounded DHT read at most (``timeout_s``), then a refusal reply.

With an allow-list (``--allow-list``) no secret is shared: each member signs its records with the private key of
its libp2p identity (``--identity``, RSA-2048, PKCS#1 v1.5 over SHA-256), and ``AllowListValidator`` accepts only
records signed by a listed key. The averager admits a caller whose libp2p peer id (authenticated by the libp2p
handshake) is one of the listed keys' ids, with no DHT read. A key file and an allow-list can be used together.

An open run (neither) admits everyone; its peers ignore signed records they meet, saying once that the run they
joined is closed (``OpenRunValidator``). This module does not stop a *member* from misbehaving (robust.py does).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import logging
import struct
import time
from pathlib import Path
from typing import Any

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

logger = logging.getLogger(__name__)
MIN_SECRET_BYTES = 16
_TAG_BYTES = 32
_FINGERPRINT_BYTES = 8  # names the signer's key in a record signed for an allow-list
_MAX_ALLOW_LIST_BYTES = 1 << 24


def load_swarm_key(path: str | Path) -> bytes:
    """The HMAC key derived from the secret in ``path`` (its bytes, surrounding whitespace ignored); raises
    ValueError with a one-line reason if the file is unreadable or the secret shorter than 16 bytes."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read swarm key file {path}: {e.strerror or e}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"swarm key file {path} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
            "(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > swarm.key)"
        )
    return hashlib.sha256(b"p2p-diloco swarm key v1\0" + secret).digest()


class MemberRecordValidator(RecordValidatorBase):
    """Tags every record this DHT node stores with the swarm key; accepts only records so tagged."""

    def __init__(self, key: bytes):
        self._key = key

    def _tag(self, record: DHTRecord, value: bytes) -> bytes:
        message = b"".join(struct.pack(">I", len(part)) + part for part in (record.key, record.subkey, value))
        return hmac.new(self._key, message + struct.pack(">d", record.expiration_time), hashlib.sha256).digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + self._tag(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) < _TAG_BYTES:
            return False
        value, tag = record.value[:-_TAG_BYTES], record.value[-_TAG_BYTES:]
        return hmac.compare_digest(tag, self._tag(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-_TAG_BYTES]

    @property
    def priority(self) -> int:
        return 100  # the outermost signature: applied last when signing, checked first when reading


def _public_key_bytes(key: rsa.RSAPublicKey) -> bytes:
    """The libp2p form of an RSA public key (a protobuf PublicKey holding its DER SubjectPublicKeyInfo)."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def _peer_id(public_key_bytes: bytes) -> str:
    """The libp2p peer id of a public key in its libp2p form (sha2-256 multihash, base58), as p2pd derives it."""
    digest = multihash.encode(hashlib.sha256(public_key_bytes).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def _fingerprint(public_key_bytes: bytes) -> bytes:
    return hashlib.sha256(public_key_bytes).digest()[:_FINGERPRINT_BYTES]


@dataclasses.dataclass(frozen=True)
class Identity:
    """A peer's libp2p identity: the private key p2pd runs with, and what others put on their allow-lists."""

    private_key: rsa.RSAPrivateKey
    public_key: str  # base64 of the libp2p public key: one line of an allow-list
    peer_id: str


def load_identity(path: str | Path, create: bool = True) -> Identity:
    """The identity in ``path`` (a libp2p private key file, as hivemind writes it), made first if missing and
    ``create``; raises ValueError with a one-line reason."""
    path = Path(path)
    if not path.exists() and create:
        from hivemind.p2p import P2P

        try:
            P2P.generate_identity(str(path))  # RSA-2048, mode 0400: the file p2pd will read
        except OSError as e:
            raise ValueError(f"cannot create identity file {path}: {e.strerror or e}") from None
    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        key = serialization.load_der_private_key(message.data, password=None)
    except OSError as e:
        raise ValueError(f"cannot read identity file {path}: {e.strerror or e}") from None
    except Exception:
        raise ValueError(f"identity file {path} does not hold a libp2p private key") from None
    if message.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"identity file {path} holds a key that is not RSA; p2p-diloco signs with RSA identities")
    return _identity_of(key)


def _identity_of(key: rsa.RSAPrivateKey) -> Identity:
    public = _public_key_bytes(key.public_key())
    return Identity(key, base64.b64encode(public).decode(), _peer_id(public))


class AllowList:
    """The public keys of a closed run's members, read from a file: one base64 libp2p public key per line (what
    ``peer.py --identity FILE --show-identity`` prints); anything after the key and lines starting with # are
    comments."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            if path.stat().st_size > _MAX_ALLOW_LIST_BYTES:
                raise ValueError(f"allow-list {path} is larger than {_MAX_ALLOW_LIST_BYTES >> 20} MiB")
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read allow-list {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"allow-list {path} is not UTF-8 text") from None
        self.path, self._raw, seen = path, [], set()
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            where = f"allow-list {path} line {number}"
            try:
                message = crypto_pb2.PublicKey.FromString(base64.b64decode(fields[0], validate=True))
                key = serialization.load_der_public_key(message.data)
            except Exception:  # binascii.Error, protobuf's DecodeError, cryptography's ValueError
                raise ValueError(f"{where}: {fields[0][:40]!r} is not a base64 libp2p public key "
                                 "(print one with: peers/peer.py --identity FILE --show-identity)") from None
            if message.key_type != crypto_pb2.RSA or not isinstance(key, rsa.RSAPublicKey):
                raise ValueError(f"{where}: not an RSA key; p2p-diloco identities are RSA")
            public = _public_key_bytes(key)
            if public in seen:
                raise ValueError(f"{where}: this key is listed twice")
            seen.add(public)
            self._raw.append(public)
        if not self._raw:
            raise ValueError(f"allow-list {path} lists no public key")
        self._index()

    def _index(self) -> None:
        self.keys: dict[bytes, rsa.RSAPublicKey] = {
            _fingerprint(raw): serialization.load_der_public_key(crypto_pb2.PublicKey.FromString(raw).data)
            for raw in self._raw
        }
        self.peer_ids = {_peer_id(raw) for raw in self._raw}

    def __getstate__(self) -> dict:  # the DHT may pickle its validators into its own process
        return {"path": self.path, "raw": self._raw}

    def __setstate__(self, state: dict) -> None:
        self.path, self._raw = state["path"], state["raw"]
        self._index()

    def check_member(self, identity: Identity, identity_path: str | Path) -> None:
        """Raises ValueError if ``identity`` is not on this list: the peer could not take part."""
        if identity.peer_id not in self.peer_ids:
            raise ValueError(f"this peer ({identity.peer_id}, identity {identity_path}) is not on the allow-list "
                             f"{self.path}; its public key to add: {identity.public_key}")


class AllowListValidator(RecordValidatorBase):
    """Signs every record this DHT node stores with the peer's identity key; accepts only records signed by a key
    on the allow-list. A signed value is: value, signer's key fingerprint (8 bytes), signature, signature length
    (2 bytes). Without an identity (a read-only monitor) it only checks: what it would store goes unsigned, and
    members refuse it."""

    def __init__(self, identity: Identity | None, allow_list: AllowList):
        self._identity, self._allow_list = identity, allow_list
        self._fingerprint = _fingerprint(base64.b64decode(identity.public_key)) if identity else b""

    @staticmethod
    def _message(record: DHTRecord, value: bytes, fingerprint: bytes) -> bytes:
        parts = (record.key, record.subkey, value, fingerprint)
        return b"".join(struct.pack(">I", len(part)) + part for part in parts) + struct.pack(">d", record.expiration_time)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._identity is None:
            return record.value
        message = self._message(record, record.value, self._fingerprint)
        signature = self._identity.private_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
        return record.value + self._fingerprint + signature + struct.pack(">H", len(signature))

    def _split(self, value: bytes) -> tuple[bytes, bytes, bytes] | None:
        if len(value) < 2 + _FINGERPRINT_BYTES:
            return None
        (length,) = struct.unpack(">H", value[-2:])
        end = len(value) - 2 - length
        if end - _FINGERPRINT_BYTES < 0:
            return None
        return value[: end - _FINGERPRINT_BYTES], value[end - _FINGERPRINT_BYTES : end], value[end:-2]

    def validate(self, record: DHTRecord) -> bool:
        parts = self._split(record.value)
        if parts is None:
            return False
        value, fingerprint, signature = parts
        key = self._allow_list.keys.get(fingerprint)
        if key is None:
            return False
        try:
            key.verify(signature, self._message(record, value, fingerprint), padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = self._split(record.value)
        return parts[0] if parts is not None else record.value

    @property
    def priority(self) -> int:
        return 90  # inside the swarm key's tag when both are used

    def __getstate__(self) -> dict:  # the DHT may pickle its validators into its own process
        private = self._identity and self._identity.private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return {"private": private, "allow_list": self._allow_list}

    def __setstate__(self, state: dict) -> None:
        private = state["private"] and serialization.load_der_private_key(state["private"], password=None)
        self.__init__(private and _identity_of(private), state["allow_list"])


class OpenRunValidator(RecordValidatorBase):
    """An open run's records are plain msgpack. A record that is not (it carries a member's tag or signature: the
    run is closed) is ignored, and said once in the log, instead of breaking hivemind's decoder with a traceback
    at every read."""

    def __init__(self) -> None:
        self._warned = False

    def validate(self, record: DHTRecord) -> bool:
        try:
            MSGPackSerializer.loads(record.value)
            return True
        except Exception:
            if not self._warned:
                self._warned = True
                logger.warning("ignoring signed DHT records: this run is closed to members; pass its --swarm-key-file "
                               "or --allow-list (with an --identity on the list) to take part")
            return False

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value


class MemberCheck:
    """Is a peer a member? With an allow-list: yes if its peer id is on it. With a swarm key: yes if the DHT holds
    a member-signed progress record under its peer id.

    Runs inside the averager process (its RPC handlers). Known members are cached; an unknown caller triggers one
    DHT read, at most every ``refresh_s``, bounded by ``timeout_s``.
    """

    def __init__(self, dht: Any, progress_key: str, refresh_s: float = 2.0, timeout_s: float = 3.0,
                 allowed: set[str] | None = None):
        self._dht, self._key, self._refresh_s, self._timeout_s = dht, progress_key, refresh_s, timeout_s
        self._allowed = allowed
        self._members: set[str] = set()
        self._refreshed = -float("inf")
        self._refused: set[str] = set()  # logged once each
        self._lock: asyncio.Lock | None = None

    async def refusal(self, peer: Any, what: str) -> str | None:
        """None if ``peer`` (a hivemind PeerID) may ``what``; otherwise why not (logged once per peer)."""
        name = peer.to_base58()
        if self._allowed is not None:
            if name in self._allowed:
                return None
            reason = f"{name} may not {what}: not on this closed run's allow-list"
        else:
            if name not in self._members:
                await self._refresh()
            if name in self._members:
                return None
            reason = f"{name} may not {what}: not a member of this closed run (no member-signed progress record)"
        if name not in self._refused:
            self._refused.add(name)
            logger.warning("refused: %s", reason)
        return reason

    async def _refresh(self) -> None:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._refreshed < self._refresh_s:
                return
            self._refreshed = time.monotonic()
            try:
                found = await asyncio.wait_for(self._dht.get(self._key, latest=True, return_future=True), self._timeout_s)
            except Exception as e:  # a slow or broken DHT: keep the members we know
                logger.debug("reading the members' progress records failed: %r", e)
                return
            if found is not None and isinstance(found.value, dict):
                self._members |= {str(k) for k, v in found.value.items() if isinstance(v, ValueWithExpiration)}


@dataclasses.dataclass(frozen=True)
class RunMembership:
    """Who may take part in a run, as this peer's config says: the record validators its DHT needs, and the
    check its averager runs on callers (None in an open run)."""

    validators: tuple[RecordValidatorBase, ...]
    allow_list: AllowList | None
    swarm_key_file: str | None

    @classmethod
    def from_files(cls, swarm_key_file: str | None, allow_list_file: str | None, identity_path: str | None) -> RunMembership:
        """Raises ValueError with a one-line reason (unreadable files, this peer not on its own allow-list)."""
        validators: list[RecordValidatorBase] = []
        if swarm_key_file:
            validators.append(MemberRecordValidator(load_swarm_key(swarm_key_file)))
        allow_list = AllowList(allow_list_file) if allow_list_file else None
        if allow_list is not None:
            identity = None  # a monitor reads and checks records, and stores none
            if identity_path:
                identity = load_identity(identity_path, create=False)
                allow_list.check_member(identity, identity_path)
            validators.append(AllowListValidator(identity, allow_list))
        return cls(tuple(validators) or (OpenRunValidator(),), allow_list, swarm_key_file)

    @property
    def closed(self) -> bool:
        return bool(self.swarm_key_file or self.allow_list)

    def check(self, dht: Any, progress_key: str) -> MemberCheck | None:
        if not self.closed:
            return None
        return MemberCheck(dht, progress_key, allowed=self.allow_list.peer_ids if self.allow_list else None)

    def describe(self) -> str:
        """One line for the log at start."""
        if not self.closed:
            return "open run: anyone who can reach this swarm can join its averaging (no --swarm-key-file or --allow-list)"
        who = []
        if self.allow_list is not None:
            who.append(f"the {len(self.allow_list.peer_ids)} peers on the allow-list {self.allow_list.path}")
        if self.swarm_key_file:
            who.append(f"holders of the swarm key in {self.swarm_key_file}")
        return f"closed run: only {' who are also '.join(who)} can store records, average or download state"
