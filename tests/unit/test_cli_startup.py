"""What the console script decides before anything heavy starts: the join command it prints, the flag table it
builds without importing torch or hivemind, the command it blames for an unknown flag, and whether a port can be
owned."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from swarmloco.cli import build_parser, parse
from swarmloco.coordinator.cli import public_join
from swarmloco.peer.options import OPTIONS
from swarmloco.protocol.network.ports import port_taken, tcp_listen_addresses

ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
INFO = {"url": "http://127.0.0.1:8000", "port": 8000, "run_id": "r",
        "dht_maddrs": [f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}", f"/ip4/192.0.2.9/tcp/31337/p2p/{ID}"]}


def test_join_command_names_a_public_address_when_listening_everywhere() -> None:
    command, note = public_join(INFO, host="0.0.0.0", dht_host="0.0.0.0", invite="code")
    assert command == "swarmloco peer --join http://192.0.2.9:8000 --invite code" and note is None
    command, note = public_join(INFO, host="127.0.0.1", dht_host="0.0.0.0")  # the API stays local: its URL too
    assert command == "swarmloco peer --join http://127.0.0.1:8000"
    assert note is not None and "works on this machine only" in note and "(--host)" in note


def test_join_command_says_when_only_loopback_is_known() -> None:
    info = {**INFO, "dht_maddrs": INFO["dht_maddrs"][:1]}
    command, note = public_join(info, host="127.0.0.1", dht_host="127.0.0.1")
    assert command == "swarmloco peer --join http://127.0.0.1:8000"
    assert note is not None and "works on this machine only" in note and "--host and --dht-host" in note


def test_the_peer_parser_is_built_without_torch_or_hivemind() -> None:
    # a fresh interpreter: this test process has long imported both
    code = ("import sys; from swarmloco.cli import build_parser; "
            "build_parser(['peer', '--help']).parse_args(['peer', '--max-steps', '3']); "
            "heavy = sorted(m for m in ('torch', 'hivemind') if m in sys.modules); "
            "assert not heavy, f'building the peer parser imported {heavy}'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("argv", [["--inner-lr", "3"], ["--resume"]], ids=["bad-value", "nothing-to-resume"])
def test_a_bad_setting_is_answered_before_torch_is_imported(argv: list[str], tmp_path: Path) -> None:
    """A mistake in the settings costs the user a fraction of a second, not torch's import and the model's build."""
    code = ("import sys; from swarmloco.peer.cli import run_peer; from swarmloco.cli import parse; "
            f"args = parse(['peer', '--solo', '--workdir', {str(tmp_path)!r}, *{argv!r}]); "
            "code = run_peer(args); "
            "assert code == 2, code; assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_flag_kinds_and_defaults_come_from_the_dataclasses() -> None:
    sub = next(a for a in build_parser(["peer"])._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.option_strings[0]: a for a in sub.choices["peer"]._actions if a.option_strings}
    assert {o.flag for o in OPTIONS} | {"-h", "--config"} == set(actions)
    assert isinstance(actions["--solo"], argparse.BooleanOptionalAction)  # a bool field: --solo / --no-solo
    assert isinstance(actions["--initial-peer"], argparse._AppendAction)  # a tuple field: the flag repeats
    assert actions["--shard-index"].metavar == "N|auto"
    assert "(default: 0.0004)" in (actions["--inner-lr"].help or "")
    assert "(default: /ip4/0.0.0.0/tcp/0)" in (actions["--host-maddr"].help or "")
    assert all(a.default is None for flag, a in actions.items() if flag != "-h")  # given flags only count


def test_help_shows_defaults_and_unknown_flags_blame_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["peer", "--help"], ["swarm", "--help"]):
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert "inner AdamW learning rate (default: 0.0004) [env SWARMLOCO_INNER_LR]" in out
    assert "number of peer processes (default: 3)" in out
    with pytest.raises(SystemExit) as exc:
        parse(["peer", "--rounds", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: swarmloco peer")
    assert "unrecognized arguments: --rounds 3 (did you mean --max-rounds?)" in err


def test_only_the_chosen_command_gets_its_flags() -> None:
    parser = build_parser(["status", "--coordinator", "http://x"])
    assert parser.parse_args(["status", "--coordinator", "http://x"]).rounds == 10
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices["peer"]._actions) == 1  # only -h: the peer's table was not built


def test_a_listening_port_is_taken_and_a_free_one_is_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        assert port_taken("127.0.0.1", port) and port_taken("0.0.0.0", port)
    assert port_taken("127.0.0.1", 0) is None
    assert tcp_listen_addresses(["/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/0", "/ip4/1.2.3.4/udp/9/quic"]) == [
        ("/ip4/0.0.0.0/tcp/31337", "0.0.0.0", 31337), ("/ip6/::/tcp/0", "::", 0)]


def test_a_generated_invite_code_never_starts_like_a_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--invite -x...` reads as a flag, not a value: the printed join command would fail for one code in 64."""
    import secrets

    from swarmloco.coordinator.cli import generated_invite

    drawn = iter(["-starts-like-a-flag", "fine-code"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    assert generated_invite(tmp_path / "db.invite") == "fine-code"
