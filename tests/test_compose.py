"""docker-compose.yml and Dockerfile, checked without a Docker engine.

The compose file is parsed with PyYAML, its ${VAR:-default} references are expanded the way Compose does, and every
service's command goes through the real `swarmloco` argument parser (a typo'd flag fails here). The peer entrypoint
(an inline Python script in the compose file) runs for real against a fake ready file and a fake DNS server, with a
stand-in `swarmloco` executable that records what it was started with; the peer configuration is then built from
that argv and environment exactly as `swarmloco peer` would.
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from peer import config as peer_config
from peer import swarm_config  # noqa: F401  (registers the [network] and [round] options)
from scripts.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PEER_SERVICES = ("peer", "peer-gpu")
FAKE_PEER_ID = "12D3KooWGjEaPBd3sRZdsyrNpvWDRFHdR3QX4cRAdWyTspxw87Yb"

pytestmark = pytest.mark.timeout(60)

# -------------------------------------------------------------------------------------------------- interpolation
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["plain"]
        op, arg = m["op"], m["arg"] or ""
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op in ("-", ":-"):
            return arg if unset or current is None else current
        if op in ("?", ":?"):
            if unset:
                raise KeyError(f"{name}: {arg}")
            return current or ""
        return current or ""

    assert "${" not in _VAR.sub("", value), f"unsupported (nested?) substitution in {value!r}"
    return _VAR.sub(sub, value)


def test_interpolate_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET:-d} $SET $$SET", env) == "x d  d d x $SET"
    with pytest.raises(KeyError):
        interpolate("${UNSET:?needed}", env)


# -------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """The file as Compose sees it with an empty environment (every default applies)."""
    return interpolate(raw, {})


def services_of(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def argv_of(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd), "use the exec (list-of-strings) form"
    assert cmd[0] == "swarmloco", cmd
    return cmd[1:]


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} must appear once in {argv}"
    return argv[argv.index(flag) + 1]


def known_peer_env() -> set[str]:
    return {opt.env for opt in peer_config.OPTIONS} | {peer_config.ENV_PREFIX + "CONFIG"}


# -------------------------------------------------------------------------------------------------- structure
def test_services_and_volumes(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    assert {"coordinator", "peer"} <= set(services)
    coord = services["coordinator"]
    published = {p.split(":")[-1]: p for p in coord["ports"]}
    assert set(published) == {"8000", "31337"}, coord["ports"]
    assert published["8000"] == "8000:8000"
    mounts = {m.split(":")[1]: m.split(":")[0] for m in coord["volumes"]}
    assert mounts == {"/data": "coordinator-data", "/bootstrap": "bootstrap"}
    assert set(compose["volumes"]) >= {"coordinator-data", "bootstrap"}
    for name in PEER_SERVICES:
        peer = services[name]
        # what would break `--scale peer=N`: a fixed name, hostname or published port
        assert not {"container_name", "hostname", "ports"} & set(peer), name
        assert peer["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert peer["volumes"] == ["bootstrap:/bootstrap:ro"]
        assert peer["init"] is True and peer["restart"] == "on-failure"
    assert "profiles" not in services["peer"]
    for name, svc in services.items():
        assert "build" in svc and svc["build"]["context"] == "." and svc["build"]["dockerfile"] == "Dockerfile", name


def test_coordinator_healthcheck_hits_healthz_on_its_port(compose: dict[str, Any]) -> None:
    coord = services_of(compose)["coordinator"]
    check = coord["healthcheck"]
    assert check["test"][0] == "CMD"
    port = flag_value(argv_of(coord), "--port")
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(check["test"])
    assert check["test"][1] == "python"  # python:3.11-slim has no curl or wget
    code = check["test"][-1]
    compile(code, "<healthcheck>", "exec")
    for key in ("interval", "timeout", "start_period"):
        assert re.fullmatch(r"\d+s", check[key]), (key, check[key])
    assert int(check["retries"]) >= 1


def test_gpu_service_reserves_an_nvidia_gpu_and_builds_cuda_torch(compose: dict[str, Any]) -> None:
    gpu = services_of(compose)["peer-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", gpu["build"]["args"]["TORCH_INDEX_URL"])
    assert gpu["image"] != services_of(compose)["peer"]["image"]
    assert gpu["environment"]["SWARMLOCO_DEVICE"] == "cuda"
    assert services_of(compose)["peer"]["environment"]["SWARMLOCO_DEVICE"] == "cpu"


def test_peer_environment_names_only_real_settings(raw: dict[str, Any]) -> None:
    known = known_peer_env()
    for name in PEER_SERVICES:
        env = raw["services"][name]["environment"]
        assert isinstance(env, dict)
        unknown = {k for k in env if k.startswith(peer_config.ENV_PREFIX) and k not in known}
        assert not unknown, f"{name}: {unknown} are not swarmloco peer settings"
        others = {k for k in env if not k.startswith(peer_config.ENV_PREFIX)}
        assert others <= {"BOOTSTRAP_READY_FILE", "BOOTSTRAP_HOST", "BOOTSTRAP_DHT_PORT", "BOOTSTRAP_WAIT_S"}, others


def test_no_stray_dollar_in_entrypoint(raw: dict[str, Any]) -> None:
    """Compose interpolates the entrypoint too; the script must come through unchanged."""
    script = raw["services"]["peer"]["entrypoint"][2]
    assert "$" not in script
    compile(script, "<peer entrypoint>", "exec")


# -------------------------------------------------------------------------------------------------- CLI parsing
def test_coordinator_command_parses(compose: dict[str, Any]) -> None:
    coord = services_of(compose)["coordinator"]
    args = build_parser().parse_args(argv_of(coord))
    assert args.command == "coordinator"
    assert args.host == "0.0.0.0" and args.port == 8000
    assert args.dht_host == "0.0.0.0" and args.dht_port == 31337 and not args.no_dht
    # state that must survive restarts (database, DHT identity => stable peer id) lives in the data volume
    assert args.db.parent == Path("/data") and args.identity.parent == Path("/data")
    assert args.ready_file == Path("/bootstrap/coordinator.json")
    assert args.run_id == "compose"


@pytest.mark.parametrize("host_env", [{}, {"SWARMLOCO_RUN_ID": "r7", "SWARMLOCO_QUORUM": "3", "SWARMLOCO_PRESET": "small",
                                           "SWARMLOCO_MAX_ROUNDS": "5", "SWARMLOCO_INNER_STEPS": "20"}])
def test_peer_commands_parse_and_build_a_config(raw: dict[str, Any], host_env: dict[str, str]) -> None:
    compose = interpolate(raw, host_env)
    coord_args = build_parser().parse_args(argv_of(services_of(compose)["coordinator"]))
    for name in PEER_SERVICES:
        svc = services_of(compose)[name]
        args = build_parser().parse_args(argv_of(svc))
        assert args.command == "peer"
        env = {k: v for k, v in svc["environment"].items() if v != ""}
        env["SWARMLOCO_INITIAL_PEER"] = f"/dns4/coordinator/tcp/31337/p2p/{FAKE_PEER_ID}"
        env["SWARMLOCO_SHARD_INDEX"] = "0"
        cfg = peer_config.build_config(args, env=env)
        net = cfg["network"]
        assert net.run_id == coord_args.run_id == host_env.get("SWARMLOCO_RUN_ID", "compose")
        assert net.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
        assert cfg["round"].quorum == int(host_env.get("SWARMLOCO_QUORUM", 2))
        assert cfg["run"].preset == host_env.get("SWARMLOCO_PRESET", "tiny")
        assert cfg["run"].coordinator == "http://coordinator:8000"
        assert not cfg["run"].solo


def test_parser_rejects_a_typo() -> None:
    """The guard the tests above rely on: argparse exits on an unknown flag."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--quorom", "2"])


# -------------------------------------------------------------------------------------------------- entrypoint
class FakeDNS:
    """Answers every PTR query on 127.0.0.1 with one name (Docker's DNS answers with <project>-<service>-<n>.<net>)."""

    def __init__(self, name: str | None) -> None:
        self.name = name  # None: answer with no records (NXDOMAIN-like)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, addr = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            question = query[12:]
            if self.name is None:
                self.sock.sendto(query[:2] + struct.pack(">5H", 0x8183, 1, 0, 0, 0) + question, addr)
                continue
            rdata = b"".join(bytes([len(p)]) + p.encode() for p in self.name.split(".")) + b"\0"
            header = query[:2] + struct.pack(">5H", 0x8180, 1, 1, 0, 0)
            answer = struct.pack(">HHHIH", 0xC00C, 12, 1, 600, len(rdata)) + rdata  # name = pointer to question
            self.sock.sendto(header + question + answer, addr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture()
def fake_swarmloco(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A `swarmloco` stand-in on PATH that writes its argv and SWARMLOCO_* environment to a JSON file."""
    bindir, record = tmp_path / "bin", tmp_path / "record.json"
    bindir.mkdir()
    exe = bindir / "swarmloco"
    exe.write_text(f"#!{sys.executable}\n"
                   "import json, os, sys\n"
                   f"json.dump({{'argv': sys.argv[1:], 'env': {{k: v for k, v in os.environ.items() "
                   f"if k.startswith('SWARMLOCO_')}}}}, open({str(record)!r}, 'w'))\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    yield bindir, record


def run_entrypoint(compose: dict[str, Any], service: str, env: dict[str, str], bindir: Path,
                   timeout: float = 20) -> subprocess.CompletedProcess[str]:
    svc = services_of(compose)[service]
    entry = svc["entrypoint"]
    assert entry[:2] == ["python", "-c"] and len(entry) == 3
    full_env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", **env}
    return subprocess.run([sys.executable, "-c", entry[2], *svc["command"]], env=full_env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def container_env(compose: dict[str, Any], service: str, tmp_path: Path, **overrides: str) -> dict[str, str]:
    env = {k: str(v) for k, v in services_of(compose)[service]["environment"].items()}
    env["BOOTSTRAP_READY_FILE"] = str(tmp_path / "coordinator.json")
    env.update(overrides)
    return env


def write_ready_file(path: Path) -> None:
    # the fields `swarmloco coordinator --ready-file` writes (see coordinator/server.py)
    path.write_text(json.dumps({"url": "http://127.0.0.1:8000", "run_id": "compose", "dht_peer_id": FAKE_PEER_ID,
                                "dht_maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{FAKE_PEER_ID}"]}))


@pytest.mark.parametrize("service", PEER_SERVICES)
def test_entrypoint_finds_the_coordinator_and_picks_the_replica_shard(
        compose: dict[str, Any], service: str, tmp_path: Path, fake_swarmloco: tuple[Path, Path]) -> None:
    bindir, record = fake_swarmloco
    write_ready_file(tmp_path / "coordinator.json")
    dns = FakeDNS(f"swarmloco-{service}-3.swarmloco_default")
    try:
        proc = run_entrypoint(compose, service, container_env(compose, service, tmp_path,
                                                              ENTRYPOINT_DNS_SERVER=dns.address), bindir)
    finally:
        dns.close()
    assert proc.returncode == 0, proc.stderr
    assert dns.queries == 1
    got = json.loads(record.read_text())
    assert got["argv"] == services_of(compose)[service]["command"][1:]
    env = got["env"]
    assert env["SWARMLOCO_INITIAL_PEER"] == f"/dns4/coordinator/tcp/31337/p2p/{FAKE_PEER_ID}"
    assert env["SWARMLOCO_SHARD_INDEX"] == "2"  # replica 3 -> shard 2 of 8
    assert all(v != "" for v in env.values()), "empty SWARMLOCO_* variables must be dropped"
    # and the real loader accepts the result
    cfg = peer_config.build_config(build_parser().parse_args(got["argv"]), env=env)
    assert cfg["network"].initial_peers == (env["SWARMLOCO_INITIAL_PEER"],)
    assert (cfg["run"].shard_index, cfg["run"].num_shards) == (2, 8)


def test_entrypoint_joins_a_given_swarm_without_the_coordinator(
        compose: dict[str, Any], tmp_path: Path, fake_swarmloco: tuple[Path, Path]) -> None:
    bindir, record = fake_swarmloco
    maddr = f"/ip4/203.0.113.7/tcp/31337/p2p/{FAKE_PEER_ID}"
    env = container_env(compose, "peer", tmp_path, SWARMLOCO_INITIAL_PEER=maddr, SWARMLOCO_SHARD_INDEX="5",
                        SWARMLOCO_COORDINATOR="", BOOTSTRAP_WAIT_S="0")
    proc = run_entrypoint(compose, "peer", env, bindir)  # no ready file exists: it must not be needed
    assert proc.returncode == 0, proc.stderr
    got = json.loads(record.read_text())["env"]
    assert got["SWARMLOCO_INITIAL_PEER"] == maddr and got["SWARMLOCO_SHARD_INDEX"] == "5"
    assert "SWARMLOCO_COORDINATOR" not in got  # empty = report nowhere
    cfg = peer_config.build_config(build_parser().parse_args(json.loads(record.read_text())["argv"]), env=got)
    assert cfg["run"].coordinator is None


def test_entrypoint_without_dns_answer_picks_a_valid_random_shard(
        compose: dict[str, Any], tmp_path: Path, fake_swarmloco: tuple[Path, Path]) -> None:
    bindir, record = fake_swarmloco
    write_ready_file(tmp_path / "coordinator.json")
    dns = FakeDNS(None)
    try:
        env = container_env(compose, "peer", tmp_path, ENTRYPOINT_DNS_SERVER=dns.address, SWARMLOCO_NUM_SHARDS="4")
        proc = run_entrypoint(compose, "peer", env, bindir)
    finally:
        dns.close()
    assert proc.returncode == 0, proc.stderr
    assert "random shard" in proc.stderr
    assert 0 <= int(json.loads(record.read_text())["env"]["SWARMLOCO_SHARD_INDEX"]) < 4


def test_entrypoint_gives_up_when_the_coordinator_never_writes_its_ready_file(
        compose: dict[str, Any], tmp_path: Path, fake_swarmloco: tuple[Path, Path]) -> None:
    bindir, record = fake_swarmloco
    proc = run_entrypoint(compose, "peer", container_env(compose, "peer", tmp_path, BOOTSTRAP_WAIT_S="0"), bindir)
    assert proc.returncode == 1
    assert "dht_peer_id" in proc.stderr
    assert not record.exists()


# -------------------------------------------------------------------------------------------------- Dockerfile
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_installs_cpu_torch_then_the_project() -> None:
    instr = dockerfile_instructions()
    assert instr[0] == ("FROM", "python:3.11-slim")
    args = dict(a.split("=", 1) for kind, a in instr if kind == "ARG")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [a for kind, a in instr if kind == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    assert re.search(r'pip install "?torch==2\.13\.0"? --index-url "?\$\{?TORCH_INDEX_URL\}?"?', runs[torch_step])
    project_step = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_step < project_step, "torch must come from the PyTorch index before `pip install .` pulls it"
    pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in pin, "Dockerfile and pyproject.toml must pin the same torch"


def test_dockerfile_copies_every_package_the_project_ships() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied: set[str] = set()
    for kind, arg in dockerfile_instructions():
        if kind == "COPY":
            copied.update(p.rstrip("/") for p in arg.split()[:-1] if not p.startswith("--"))
    if "." in copied:
        return
    assert {"pyproject.toml", project["project"]["readme"]} <= copied
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert (ROOT / package / "__init__.py").exists(), package
        assert package in copied, f"Dockerfile does not COPY {package}/"


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {line.strip().rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    needed = {"pyproject.toml", "README.md", "protocol", "peer", "coordinator", "scripts"}
    assert not needed & ignored


def test_compose_uses_only_flags_that_exist() -> None:
    """Every --flag written anywhere in the compose commands is one the parser of that subcommand knows."""
    compose = interpolate(yaml.safe_load(COMPOSE.read_text()), {})
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, svc in services_of(compose).items():
        argv = argv_of(svc)
        assert isinstance(sub.choices, dict)
        known = set(sub.choices[argv[0]]._option_string_actions)
        flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        assert flags <= known, f"{name}: unknown flags {flags - known}"


def test_docs_describe_scaling_gpu_and_joining() -> None:
    doc = (ROOT / "docs" / "docker.md").read_text()
    for needle in ("--scale peer=4", "--profile gpu", "SWARMLOCO_INITIAL_PEER", "/healthz"):
        assert needle in doc, needle
