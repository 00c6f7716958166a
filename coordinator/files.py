"""Files the coordinator writes for other processes on its host (the ready file, the generated invite code):
replaced in one step, so a reader sees the old file or the new one and never half of it, and readable by the owner
only when they hold a secret."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str, *, private: bool) -> None:
    """Replace `path` with `text`; `private`: mode 0600, else the umask's default."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a fresh file gets the mode below; an old one would keep its own
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
