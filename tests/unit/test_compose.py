"""docker-compose.yml and Dockerfile, checked without a Docker engine.

The compose file is parsed with PyYAML, its ${VAR:-default} references are expanded the way Compose does, and every
service's command goes through the real `swarmloco` argument parser (a typo'd flag fails here). The peer config is
then built from that argv and the service's environment exactly as `swarmloco peer` would, and its startup step
(peer/bootstrap.py: the coordinator's ready file, the replica's shard) runs against a fake ready file and a fake
DNS server.
"""
from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from _fake_dns import FakeDNS

from swarmloco.cli import build_parser
from swarmloco.peer import bootstrap
from swarmloco.peer.config import PeerConfig, build_config
from swarmloco.peer.options import OPTIONS, OTHER_ENV

ROOT = Path(__file__).resolve().parents[2]
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


def peer_config(compose: dict[str, Any], service: str, **env: str) -> PeerConfig:
    """What `swarmloco peer` builds in that container, before its startup step; `env` stands for the host's."""
    svc = services_of(compose)[service]
    return build_config(
        build_parser().parse_args(argv_of(svc)), env={**{k: str(v) for k, v in svc["environment"].items()}, **env}
    )


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
    known = {opt.env for opt in OPTIONS} | OTHER_ENV
    for name in PEER_SERVICES:
        env = raw["services"][name]["environment"]
        assert isinstance(env, dict)
        unknown = {k for k in env if k not in known}
        assert not unknown, f"{name}: {unknown} are not swarmloco peer settings"


def test_compose_only_declares_services(raw: dict[str, Any]) -> None:
    """No program inside the compose file: what a peer does at startup is a documented peer option."""
    assert not [k for k in raw if k.startswith("x-") and "entrypoint" in k]
    for name, svc in raw["services"].items():
        assert "entrypoint" not in svc, name
    text = COMPOSE.read_text()
    assert "python -c" not in text and "- -c" not in text


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
    # invite-only with the code the coordinator generates (kept in /data) and writes into the ready file
    assert args.admission == "invite" and not args.invite_code and args.invite_file is None


@pytest.mark.parametrize(
    "host_env",
    [
        {},
        {
            "SWARMLOCO_RUN_ID": "r7",
            "SWARMLOCO_QUORUM": "3",
            "SWARMLOCO_PRESET": "small",
            "SWARMLOCO_MAX_ROUNDS": "5",
            "SWARMLOCO_INNER_STEPS": "20",
        },
    ],
)
def test_peer_commands_parse_and_build_a_config(raw: dict[str, Any], host_env: dict[str, str]) -> None:
    compose = interpolate(raw, host_env)
    coord_args = build_parser().parse_args(argv_of(services_of(compose)["coordinator"]))
    for name in PEER_SERVICES:
        assert build_parser().parse_args(argv_of(services_of(compose)[name])).command == "peer"
        cfg = peer_config(compose, name)
        assert cfg.network.run_id == coord_args.run_id == host_env.get("SWARMLOCO_RUN_ID", "compose")
        assert cfg.network.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
        assert cfg.network.initial_peers == ()  # found at startup, from the ready file
        assert cfg.round.quorum == int(host_env.get("SWARMLOCO_QUORUM", 2))
        assert cfg.run.preset == host_env.get("SWARMLOCO_PRESET", "tiny")
        assert cfg.run.max_rounds == int(host_env.get("SWARMLOCO_MAX_ROUNDS", 0))
        assert cfg.train.inner_steps == int(host_env.get("SWARMLOCO_INNER_STEPS", 50))
        assert cfg.run.coordinator == "http://coordinator:8000"
        assert (cfg.run.shard_index, cfg.run.num_shards) == (None, 8)  # None: auto
        assert cfg.bootstrap.wait_s == 300
        assert not cfg.run.solo


def test_peers_bootstrap_from_the_file_and_port_the_coordinator_writes(compose: dict[str, Any]) -> None:
    coord = services_of(compose)["coordinator"]
    coord_args = build_parser().parse_args(argv_of(coord))
    volume = next(m.split(":")[0] for m in coord["volumes"] if m.split(":")[1] == "/bootstrap")
    for name in PEER_SERVICES:
        boot = peer_config(compose, name).bootstrap
        assert Path(boot.file or "") == coord_args.ready_file
        assert boot.host == "coordinator" and boot.port == coord_args.dht_port
        (mount,) = services_of(compose)[name]["volumes"]
        assert mount == f"{volume}:{Path(boot.file or '').parent}:ro"


def test_parser_rejects_a_typo() -> None:
    """The guard the tests above rely on: argparse exits on an unknown flag."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--quorom", "2"])


# -------------------------------------------------------------------------------------------------- startup
def write_ready_file(path: Path) -> None:
    # the fields `swarmloco coordinator --ready-file` writes (see coordinator/server.py)
    path.write_text(
        json.dumps(
            {
                "url": "http://127.0.0.1:8000",
                "run_id": "compose",
                "dht_peer_id": FAKE_PEER_ID,
                "dht_maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{FAKE_PEER_ID}"],
                "invite": "generated-code",
            }
        )
    )


def in_tmp(cfg: PeerConfig, tmp_path: Path) -> PeerConfig:
    """The same config with the ready file in tmp_path instead of the container's /bootstrap volume."""
    return replace(cfg, bootstrap=replace(cfg.bootstrap, file=str(tmp_path / Path(cfg.bootstrap.file or "").name)))


@pytest.mark.parametrize("service", PEER_SERVICES)
def test_startup_finds_the_coordinator_and_picks_the_replica_shard(
    compose: dict[str, Any], service: str, tmp_path: Path
) -> None:
    cfg = in_tmp(peer_config(compose, service), tmp_path)
    write_ready_file(tmp_path / "coordinator.json")
    with FakeDNS(f"swarmloco-{service}-3.swarmloco_default") as dns:
        out = bootstrap.resolve(cfg, dns_server=dns.address, ip="172.18.0.4")
    assert len(dns.questions) == 1
    assert out.network.initial_peers == (f"/dns4/coordinator/tcp/31337/p2p/{FAKE_PEER_ID}",)
    assert (out.run.shard_index, out.run.num_shards) == (2, 8)  # replica 3 -> shard 2 of 8
    assert cfg.admission.invite == "" and out.admission.invite == "generated-code"  # the coordinator's own code


def test_startup_keeps_an_invite_code_given_on_the_command_line(compose: dict[str, Any], tmp_path: Path) -> None:
    cfg = in_tmp(peer_config(compose, "peer", SWARMLOCO_SHARD_INDEX="1", SWARMLOCO_INVITE="mine"), tmp_path)
    write_ready_file(tmp_path / "coordinator.json")
    assert bootstrap.resolve(cfg).admission.invite == "mine"


def test_startup_joins_a_given_swarm_without_the_coordinator(compose: dict[str, Any], tmp_path: Path) -> None:
    maddr = f"/ip4/203.0.113.7/tcp/31337/p2p/{FAKE_PEER_ID}"
    host_env = {
        "SWARMLOCO_INITIAL_PEER": maddr,
        "SWARMLOCO_SHARD_INDEX": "5",
        "SWARMLOCO_COORDINATOR": "",
        "SWARMLOCO_BOOTSTRAP_WAIT": "0",
    }
    cfg = in_tmp(peer_config(interpolate(yaml.safe_load(COMPOSE.read_text()), host_env), "peer"), tmp_path)
    assert cfg.run.coordinator is None  # empty = report nowhere
    out = bootstrap.resolve(cfg)  # no ready file exists: it must not be needed
    assert out.network.initial_peers == (maddr,) and out.run.shard_index == 5


def test_startup_gives_up_when_the_coordinator_never_writes_its_ready_file(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    cfg = in_tmp(peer_config(compose, "peer", SWARMLOCO_BOOTSTRAP_WAIT="0.2"), tmp_path)
    with pytest.raises(bootstrap.BootstrapError, match=r"no dht_peer_id in .*coordinator\.json after 0\.2 s"):
        bootstrap.resolve(cfg)


# -------------------------------------------------------------------------------------------------- Dockerfile
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
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
    for folder in set(project["tool"]["setuptools"]["package-dir"].values()):
        assert (ROOT / folder / "__init__.py").exists(), folder
        assert folder in copied, f"Dockerfile does not COPY {folder}/"


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv"} <= ignored
    needed = {"pyproject.toml", "README.md", "protocol", "peer", "coordinator", "swarmloco"}
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
