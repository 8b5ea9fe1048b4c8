"""Membership of a closed run: a swarm key shared by the members, that signs every DHT record and gates averaging.

hivemind 1.1.12's bundled ``p2pd`` has no private-network (pre-shared key) option (``p2pd -help`` lists none), so
a stranger can still open a libp2p connection to a member. What it can no longer do:

- *store or forge DHT records*: every record a member stores carries an HMAC-SHA256 tag over (key, subkey, value,
  expiration) made with the swarm key (``MemberRecordValidator``, hivemind's record-validator hook); members' DHT
  nodes refuse untagged records on store and ignore them on read. That covers the progress records, the
  averager's matchmaking declarations and the state donors' priorities;
- *average or download state*: the averager asks ``MemberCheck`` about the caller's peer id (authenticated by
  libp2p), and admits only a peer with a member-signed progress record in the DHT.

A refused stranger costs a member one bounded DHT read at most (``timeout_s``), then a refusal reply.
An open run (no key) admits everyone. This module does not stop a *member* from misbehaving (robust.py does).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import struct
import time
from pathlib import Path
from typing import Any

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.timed_storage import ValueWithExpiration

logger = logging.getLogger(__name__)
MIN_SECRET_BYTES = 16
_TAG_BYTES = 32


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


class MemberCheck:
    """Is a peer a member? Yes if the DHT holds a member-signed progress record under its peer id.

    Runs inside the averager process (its RPC handlers). Known members are cached; an unknown caller triggers one
    DHT read, at most every ``refresh_s``, bounded by ``timeout_s``.
    """

    def __init__(self, dht: Any, progress_key: str, refresh_s: float = 2.0, timeout_s: float = 3.0):
        self._dht, self._key, self._refresh_s, self._timeout_s = dht, progress_key, refresh_s, timeout_s
        self._members: set[str] = set()
        self._refreshed = -float("inf")
        self._refused: set[str] = set()  # logged once each
        self._lock: asyncio.Lock | None = None

    async def refusal(self, peer: Any, what: str) -> str | None:
        """None if ``peer`` (a hivemind PeerID) may ``what``; otherwise why not (logged once per peer)."""
        name = peer.to_base58()
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
