"""A fake DNS server on 127.0.0.1 that answers PTR queries the way Docker's embedded DNS does."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Self


class FakeDNS:
    """Answers every query with one PTR name (Docker answers with <project>-<service>-<n>.<network>)."""

    def __init__(self, name: str | None) -> None:
        self.name = name  # None: answer NXDOMAIN with no records
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address: tuple[str, int] = ("127.0.0.1", self.sock.getsockname()[1])
        self.questions: list[bytes] = []
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
            question = query[12:]
            self.questions.append(question)
            if self.name is None:
                self.sock.sendto(query[:2] + struct.pack(">5H", 0x8183, 1, 0, 0, 0) + question, addr)
                continue
            rdata = b"".join(bytes([len(p)]) + p.encode() for p in self.name.split(".")) + b"\0"
            header = query[:2] + struct.pack(">5H", 0x8180, 1, 1, 0, 0)
            answer = struct.pack(">HHHIH", 0xC00C, 12, 1, 600, len(rdata)) + rdata  # its name points at the question
            self.sock.sendto(header + question + answer, addr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
