"""A fork server for local peers: one process imports torch, hivemind and the peer once, and forks every peer.

A tiny-preset peer is mostly its imports: torch's operator tables, hivemind, and the torch._dynamo/sympy stack that
the first optimizer step pulls in are ~270 MB of private memory in every freshly exec'd process. Forked from one
parent that imported them (and froze them out of the garbage collector, so collections do not dirty their pages),
the peers share those pages copy-on-write. Each forked peer is still its own session with its own logs, argv and
exit status, like a `subprocess.Popen` started with `start_new_session=True`.

Protocol on the server's stdin/stdout, one JSON object per line: `{"argv": [...], "stdout": PATH, "stderr": PATH}`
(argv as for Popen, `python -m MODULE ARGS` with MODULE one of ENTRY_POINTS; optionally `"env": {...}`, the peer's
whole environment, for what it reads at run time) is answered `{"pid": PID}`, and every exit of a forked peer is
reported as `{"exited": PID, "rc": RC}`.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import IO, Any

# What a peer imports anyway, plus what its first optimizer step imports lazily (torch._dynamo and sympy).
PRELOAD = ("torch", "torch._dynamo", "hivemind", "uvloop", "swarmloco.cli", "swarmloco.peer.cli",
           "swarmloco.peer.swarm_sync", "swarmloco.peer.solo", "swarmloco.protocol.network.node")
ENTRY_POINTS = ("swarmloco.cli", "swarmloco.chaos_hostile")  # what a request may run: `python -m` one of these


class ForkedPeer:
    """The `subprocess.Popen` subset the launcher uses, for a peer the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.returncode) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"peer pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class Zygote:
    """The launcher's side: starts the server (its own session), forks peers through it, tracks their exits."""

    def __init__(self, env: dict[str, str], *, timeout: float = 180.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmloco.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._ready = False
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self.proc.poll() is not None, timeout):
                raise RuntimeError(f"the fork server did not import its modules within {timeout:.0f}s")
        if not self._ready:
            raise RuntimeError(f"the fork server exited with {self.proc.returncode} while importing")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(int(msg["pid"]))
                elif "exited" in msg:
                    self._exits[int(msg["exited"])] = int(msg["rc"])
                self._cond.notify_all()
        with self._cond:
            self._ready = False
            self._cond.notify_all()

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
        if self.proc.poll() is not None:  # the server is gone, so nobody reaps it: look at the pid itself
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGKILL
        return None

    def spawn(self, argv: Sequence[str], stdout: str, stderr: str, *, env: dict[str, str] | None = None,
              timeout: float = 60.0) -> ForkedPeer:
        """Fork a peer running `python -m MODULE ARGS` (argv as for Popen; MODULE one of ENTRY_POINTS) with its
        output in these files.
        `env` replaces the forked peer's environment (what it reads at run time, such as SWARMLOCO_FAULTS; what
        was read at import, such as OMP_NUM_THREADS, is the server's)."""
        assert self.proc.stdin is not None
        request: dict[str, Any] = {"argv": list(argv), "stdout": stdout, "stderr": stderr}
        if env is not None:
            request["env"] = dict(env)
        with self._cond:
            seen = len(self._pids)
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            if not self._cond.wait_for(lambda: len(self._pids) > seen or self.proc.poll() is not None, timeout):
                raise RuntimeError("the fork server did not fork the peer")
            if len(self._pids) <= seen:
                raise RuntimeError(f"the fork server exited with {self.proc.returncode}")
            return ForkedPeer(self, self._pids[seen])

    def close(self) -> None:
        """Stop the server (the peers it forked are in their own sessions: the launcher stops those)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


# --- the server -------------------------------------------------------------------------------------------------
def _child(request: dict[str, Any]) -> None:
    """In the forked peer: become its own session, take its log files, run the CLI, never return."""
    rc = 1
    try:
        os.setsid()
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if target != fd:  # fd 1 was closed before the fork's reply pipe could leak: open may hand it back
                os.dup2(target, fd)
                os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout = sys.__stdout__  # fd 1 again, now the peer's log (the server pointed it at stderr)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if "numpy" in sys.modules:  # numpy's global RNG is not reseeded by fork (Python's `random` is)
            sys.modules["numpy"].random.seed()
        if isinstance(request.get("env"), dict):
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        module, args = _entry(list(request["argv"]))
        sys.argv = [module, *args]
        rc = importlib.import_module(module).main(args)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # whatever kills the peer is written to its stderr log
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _entry(argv: list[str]) -> tuple[str, list[str]]:
    """(module, its arguments) of `python -m MODULE ARGS`; a bare `python ARGS` runs the swarmloco CLI. The module
    must be one of ours with a `main(argv) -> int` (the CLI, or a chaos run's hostile peer)."""
    module, args = ("swarmloco.cli", argv[1:])
    if "-m" in argv:
        at = argv.index("-m")
        module, args = argv[at + 1], argv[at + 2:]
    if module not in ENTRY_POINTS:
        raise ValueError(f"the fork server runs only {', '.join(ENTRY_POINTS)}, not {module!r}")
    return module, args


def _send(out: IO[bytes], msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg).encode() + b"\n")
    out.flush()


def serve(preload: Sequence[str] = PRELOAD) -> None:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing an import prints may corrupt the protocol
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the imported objects move to a generation no collection walks: their pages stay shared
    _send(out, {"ready": True})
    stdin = sys.stdin.buffer
    buffered = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.2)
        while True:  # reap every forked peer that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(out, {"exited": pid, "rc": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            return  # the launcher is gone
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(out.fileno())
                _child(request)
            _send(out, {"pid": pid})


if __name__ == "__main__":
    serve()
