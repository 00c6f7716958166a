"""The run manifest: everything a volunteer's peer needs to join a run, in one JSON object.

A coordinator serves it at `GET /api/manifest`; a run without one can hand out the same JSON as a file. It names the
run, the protocol and package version its peers speak, the authority that signs tickets and how it admits peers,
where the swarm can be reached (bootstrap multiaddrs), the coordinator to report to, and the settings every peer of
the run must share (`settings`, in the peer's TOML sections: the model, the inner and outer optimiser, the round
rules). The peer fills in those settings itself and refuses the run in one line when its own version differs
(`swarmloco.peer.join`).

`task` names what the run trains (the task's name, such as `stdlib-gpt-tiny`) and `fingerprint` the model
fingerprint its peers announce, which peers compare before they average (a hash of the task's config, the seed and
every parameter's name and shape: `swarmloco.protocol.base.records.fingerprint`). A peer that would build another
task or another fingerprint from the same settings (another swarmloco, another plug-in) refuses at start instead of
never finding a group. Both are optional: "" (or absent) when the coordinator cannot tell, and then nothing is
checked; empty ones are left out of the JSON, so readers that predate them still read such a manifest.

The manifest is a stranger's bytes to the peer that reads it, so `Manifest.parse` bounds every size and refuses
anything malformed; it carries no secret (an invite code travels apart from it).
"""
from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 * 1024
MAX_BOOTSTRAP = 32
MAX_SECTIONS, MAX_KEYS, MAX_LIST, MAX_TEXT = 16, 64, 64, 512
MAX_TASK = 128  # characters of a task name
MAX_FINGERPRINT = 64  # hex digits of a model fingerprint (a peer record carries at most as many)
_HEX = frozenset("0123456789abcdef")
_SCALARS = (bool, int, float, str)


class ManifestError(ValueError):
    """A manifest that cannot be used; the message says what is wrong in one line."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    run_id: str
    protocol_version: int
    package_version: str
    authority: str  # the peer id that signs the run's tickets ("": a private run, no admission)
    admission: str  # invite, open, allowlist or none
    work_bits: int = 0  # the proof of work a new identity brings in an open run
    bootstrap: tuple[str, ...] = ()  # multiaddrs of peers (or the coordinator's DHT node) already in the swarm
    coordinator: str = ""  # URL of the coordinator that issues tickets and takes reports ("": none)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> key -> value, fixed by the run
    task: str = ""  # the task the run trains ("": not known to whoever wrote the manifest)
    fingerprint: str = ""  # the model fingerprint of the run's peers, lowercase hex ("": not known)

    def to_value(self) -> dict[str, Any]:
        value = {"manifest": MANIFEST_VERSION, **asdict(self), "bootstrap": list(self.bootstrap)}
        return {k: v for k, v in value.items() if v != "" or k not in ("task", "fingerprint")}

    @classmethod
    def parse(cls, value: Any) -> Manifest:
        """A checked manifest from its JSON value; raises ManifestError."""
        if not isinstance(value, dict):
            raise ManifestError("the manifest is not a JSON object")
        if value.get("manifest") != MANIFEST_VERSION:
            raise ManifestError(f"manifest format {value.get('manifest')!r}; this swarmloco reads format "
                                f"{MANIFEST_VERSION}")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - names - {"manifest"})
        if unknown:
            raise ManifestError(f"the manifest has unknown fields {unknown[:5]}")
        missing = sorted({"run_id", "protocol_version", "package_version", "authority", "admission"} - set(value))
        if missing:
            raise ManifestError(f"the manifest lacks {', '.join(missing)}")
        fields = {k: v for k, v in value.items() if k in names}
        if not all(isinstance(fields.get(k, ""), str) and len(fields.get(k, "")) <= MAX_TEXT for k in
                   ("run_id", "package_version", "authority", "admission", "coordinator")):
            raise ManifestError("run_id, package_version, authority, admission and coordinator must be short strings")
        if not all(type(fields.get(k, 0)) is int and 0 <= fields.get(k, 0) < 2**31
                   for k in ("protocol_version", "work_bits")):
            raise ManifestError("protocol_version and work_bits must be small non-negative integers")
        boot = fields.get("bootstrap", [])
        if not (isinstance(boot, list) and len(boot) <= MAX_BOOTSTRAP
                and all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in boot)):
            raise ManifestError(f"bootstrap must be a list of at most {MAX_BOOTSTRAP} multiaddrs")
        settings = fields.get("settings", {})
        problem = settings_problem(settings)
        if problem:
            raise ManifestError(f"the manifest's settings: {problem}")
        problem = model_problem(fields.get("task", ""), fields.get("fingerprint", ""))
        if problem:
            raise ManifestError(f"the manifest's {problem}")
        if not fields["run_id"]:
            raise ManifestError("the manifest's run_id is empty")
        return cls(**{**fields, "bootstrap": tuple(boot), "settings": settings})

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ManifestError("the manifest is not JSON") from None
        return cls.parse(value)


def settings_problem(settings: Any) -> str:
    """Why `settings` cannot be a manifest's settings ("" when it can): TOML-like sections of scalar values or lists
    of them, bounded. Which sections and keys a peer accepts is the peer's to check."""
    if not isinstance(settings, dict) or len(settings) > MAX_SECTIONS:
        return f"must be at most {MAX_SECTIONS} sections"
    for section, entries in settings.items():
        if not (isinstance(section, str) and 0 < len(section) <= 32 and isinstance(entries, dict)
                and len(entries) <= MAX_KEYS):
            return f"section {str(section)[:40]!r} must name at most {MAX_KEYS} keys"
        for key, value in entries.items():
            if not (isinstance(key, str) and 0 < len(key) <= 64):
                return f"{section}: keys must be short strings"
            items = value if isinstance(value, list) else [value]
            if len(items) > MAX_LIST or not all(_scalar(v) for v in items):
                return f"{section}.{key} must be a number, a boolean, a short string or a short list of them"
    return ""


def model_problem(task: Any, fingerprint: Any) -> str:
    """Why `task` and `fingerprint` cannot be a manifest's ("" when they can): a short printable task name and a
    lowercase hex fingerprint of at most MAX_FINGERPRINT digits, each possibly empty."""
    if not (isinstance(task, str) and len(task) <= MAX_TASK and task.isprintable()):
        return f"task must be a printable name of at most {MAX_TASK} characters"
    if not (isinstance(fingerprint, str) and len(fingerprint) <= MAX_FINGERPRINT and set(fingerprint) <= _HEX):
        return f"fingerprint must be at most {MAX_FINGERPRINT} lowercase hex digits"
    return ""


def _scalar(v: Any) -> bool:
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) < 2**53
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, str):
        return len(v) <= MAX_TEXT
    return isinstance(v, _SCALARS)


def package_version() -> str:
    """The installed swarmloco's version ("unknown" when it runs from a tree that was never installed)."""
    try:
        return importlib.metadata.version("swarmloco")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
