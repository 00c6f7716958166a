"""A peer's own admission: where its ticket comes from (authority key, ticket file), checked before use."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarmloco.peer.ticket_cli import add_ticket_arguments, run_ticket
from swarmloco.peer.tickets import Admission, AdmissionConfig, AdmissionSetupError
from swarmloco.protocol.trust.admission import Ticket
from swarmloco.protocol.trust.identity import load_or_create_identity


def _ticket_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_ticket_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_ticket_file_issued_offline_admits_exactly_its_peer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    authority_key, out = tmp_path / "authority.key", tmp_path / "peer.ticket"
    me = load_or_create_identity(tmp_path / "me.key")
    assert run_ticket(_ticket_args("--authority-key", str(authority_key), "--show-authority")) == 0
    authority = capsys.readouterr().out.strip()
    assert run_ticket(_ticket_args("--authority-key", str(authority_key), "--run-id", "lab", "--peer-id", me.peer_id,
                                   "--out", str(out))) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    admission = Admission(AdmissionConfig(authority=authority, ticket=str(out)), me, "lab", None)
    assert Ticket.from_bytes(admission.credentials.ticket).peer_id == me.peer_id
    assert admission.gate.check(admission.credentials.ticket, me.peer_id) == ""
    other = load_or_create_identity(tmp_path / "other.key")
    with pytest.raises(AdmissionSetupError, match="belongs to"):
        Admission(AdmissionConfig(authority=authority, ticket=str(out)), other, "lab", None)
    with pytest.raises(AdmissionSetupError, match="for run"):
        Admission(AdmissionConfig(authority=authority, ticket=str(out)), me, "another-run", None)
    with pytest.raises(AdmissionSetupError, match="no way to get a ticket"):
        Admission(AdmissionConfig(authority=authority), me, "lab", None)
    assert run_ticket(_ticket_args("--authority-key", str(authority_key), "--run-id", "lab", "--peer-id", "bogus")) == 2


def test_an_authority_key_signs_our_own_ticket_and_private_swarms_check_nothing(tmp_path: Path) -> None:
    me = load_or_create_identity(tmp_path / "me.key")
    admission = Admission(AdmissionConfig(authority_key=str(tmp_path / "authority.key"), ticket_s=600), me, "lab",
                          None)
    ticket = Ticket.from_bytes(admission.credentials.ticket)
    assert ticket.authority == admission.gate.authority and 590 < ticket.expires_at - ticket.issued_at <= 600
    with pytest.raises(AdmissionSetupError, match="is not the peer id"):
        Admission(AdmissionConfig(authority_key=str(tmp_path / "authority.key"), authority=me.peer_id), me, "lab",
                  None)
    private = Admission(AdmissionConfig(private=True), me, "lab", None)
    assert private.gate.open and private.credentials.ticket == b""
    with pytest.raises(ValueError, match="private"):
        AdmissionConfig(private=True, authority=me.peer_id)
