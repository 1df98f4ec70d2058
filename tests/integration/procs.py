"""Finding uproxy's worker processes from outside, as ``ps`` would."""

from __future__ import annotations

import os
from pathlib import Path

WORKER = b"uproxy.dataplane.worker"


def children(pid: int, marker: bytes = WORKER) -> list[int]:
    """The live child processes of ``pid`` whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rpartition(")")[2].split()[1]) == pid and marker in cmdline:
            found.append(int(name))
    return sorted(found)
