"""A run closed by an allow-list of public keys (membership.py): who can sign records, and what a peer is told."""

from __future__ import annotations

import base64
import pickle
import re

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID

from p2p_diloco.cli.peer import peer_main
from p2p_diloco.swarm.membership import (
    AllowList,
    AllowListValidator,
    MemberRecordValidator,
    RunMembership,
    load_identity,
)

RECORD = DHTRecord(b"run.progress", b"subkey", b"value", 1234.5)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Three identities (RSA keys take a moment to make); the first two are on the allow-list."""
    folder = tmp_path_factory.mktemp("keys")
    identities = [load_identity(folder / f"{name}.key") for name in ("alice", "bob", "mallory")]
    (folder / "allow").write_text(f"# the run's members\n{identities[0].public_key}  alice\n\n{identities[1].public_key}\n")
    return folder, identities, AllowList(folder / "allow")


def _signed(validator, record: DHTRecord = RECORD) -> DHTRecord:
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def test_identity_peer_id_is_the_one_p2pd_runs_as(keys):
    folder, identities, allow_list = keys
    assert identities[0].peer_id == PeerID.from_identity((folder / "alice.key").read_bytes()).to_base58()
    assert allow_list.peer_ids == {identities[0].peer_id, identities[1].peer_id}
    assert load_identity(folder / "alice.key").public_key == identities[0].public_key  # read, not replaced


def test_only_records_signed_by_a_listed_key_are_accepted(keys):
    _, (alice, bob, mallory), allow_list = keys
    ours, theirs = AllowListValidator(alice, allow_list), AllowListValidator(mallory, allow_list)
    signed = _signed(AllowListValidator(bob, allow_list))
    assert ours.validate(signed) and ours.strip_value(signed) == b"value"
    assert not ours.validate(_signed(theirs))  # a stranger signing with its own key
    assert not ours.validate(RECORD)  # unsigned
    for field, value in [("value", b"other" + signed.value[5:]), ("key", b"other.progress"),
                         ("subkey", b"other"), ("expiration_time", 1e9)]:
        assert not ours.validate(DHTRecord(**{**signed.__dict__, field: value})), field
    fingerprint_at = len(b"value")
    swapped = signed.value[:fingerprint_at] + ours._fingerprint + signed.value[fingerprint_at + 8 :]
    assert not ours.validate(DHTRecord(**{**signed.__dict__, "value": swapped}))  # bob's signature as alice's
    for junk in (b"", b"\x00", b"\xff" * 9, b"x" * 300 + b"\xff\xff"):
        assert not ours.validate(DHTRecord(**{**signed.__dict__, "value": junk}))
    copy = pickle.loads(pickle.dumps(ours))  # the DHT may run its validators in another process
    assert copy.validate(signed) and copy.validate(_signed(copy)) and not copy.validate(_signed(theirs))


def test_with_a_swarm_key_too_a_record_needs_both(keys, tmp_path):
    _, (alice, _, mallory), allow_list = keys
    (tmp_path / "swarm.key").write_text("a secret of more than sixteen bytes")
    membership = RunMembership.from_files(str(tmp_path / "swarm.key"), str(keys[0] / "allow"), str(keys[0] / "alice.key"))
    both = CompositeValidator(membership.validators)
    signed = _signed(both)
    assert both.validate(signed) and both.strip_value(signed) == b"value"
    key_only = CompositeValidator([v for v in membership.validators if isinstance(v, MemberRecordValidator)])
    key_and_stranger = CompositeValidator([*key_only._validators, AllowListValidator(mallory, allow_list)])
    assert not both.validate(_signed(key_only)) and not both.validate(_signed(key_and_stranger))
    assert "allow-list" in membership.describe() and "swarm key" in membership.describe()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lists no public key"),
        ("# only a comment\n", "lists no public key"),
        ("not-base64!\n", "line 1: 'not-base64!' is not a base64 libp2p public key"),
        (base64.b64encode(b"\x08\x00\x12\x03abc").decode() + "\n", "line 1: .* is not a base64 libp2p public key"),
    ],
)
def test_a_bad_allow_list_is_named_with_its_line(tmp_path, text, message):
    (tmp_path / "allow").write_text(text)
    with pytest.raises(ValueError, match=message):
        AllowList(tmp_path / "allow")


def test_a_key_listed_twice_or_an_unreadable_list_is_refused(keys, tmp_path):
    _, (alice, _, _), _ = keys
    (tmp_path / "allow").write_text(f"{alice.public_key}\n{alice.public_key} again\n")
    with pytest.raises(ValueError, match="line 2: this key is listed twice"):
        AllowList(tmp_path / "allow")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        AllowList(tmp_path / "binary")
    with pytest.raises(ValueError, match="cannot read allow-list"):
        AllowList(tmp_path / "missing")


def test_peer_shows_its_identity_and_refuses_to_start_off_the_list(keys, tmp_path, capsys):
    folder, (alice, _, mallory), _ = keys
    assert peer_main(["--identity", str(folder / "alice.key"), "--show-identity"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"{alice.public_key}  # peer {alice.peer_id}"
    assert peer_main(["--identity", str(tmp_path / "new.key"), "--show-identity"]) == 0  # made on the spot
    assert (tmp_path / "new.key").stat().st_mode & 0o077 == 0
    assert capsys.readouterr().out.split()[0] == load_identity(tmp_path / "new.key").public_key
    allow = str(folder / "allow")
    cases = [
        (["--identity", str(folder / "mallory.key")], f"this peer \\({mallory.peer_id}, .*is not on the allow-list"),
        ([], "--allow-list needs --identity"),
        (["--identity", str(tmp_path / "absent.key")], "does not exist yet"),
    ]
    for extra, message in cases:
        assert peer_main([*extra, "--allow-list", allow, "--max-outer-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert peer_main(["--show-identity"]) == 2
    assert "needs --identity" in capsys.readouterr().err


def test_an_open_run_ignores_signed_records_and_says_why_once(keys, caplog):
    from hivemind.utils.serializer import MSGPackSerializer

    _, (alice, _, _), allow_list = keys
    plain = DHTRecord(RECORD.key, RECORD.subkey, MSGPackSerializer.dumps({"outer_step": 3}), RECORD.expiration_time)
    membership = RunMembership.from_files(None, None, None)
    assert not membership.closed and membership.check(None, "run.progress") is None
    (validator,) = membership.validators
    assert validator.validate(plain) and validator.strip_value(plain) == plain.value
    signed = _signed(AllowListValidator(alice, allow_list), plain)
    with caplog.at_level("WARNING"):
        assert not validator.validate(signed) and not validator.validate(signed)
    assert [r.getMessage() for r in caplog.records if "closed" in r.getMessage()] == [
        "ignoring signed DHT records: this run is closed to members; pass its --swarm-key-file or --allow-list "
        "(with an --identity on the list) to take part"
    ]
