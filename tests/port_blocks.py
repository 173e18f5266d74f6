"""Which ports a test session's stacks use: a block of port offsets claimed for the session's lifetime.

Two `make test` runs in two clones on one machine must not start their emulators, Redis and API on the same ports.
A session claims the first free block among `CANDIDATE_OFFSETS` with an exclusive lock file it holds until it
exits (the kernel releases the lock when the process dies, however it dies), and skips a block whose API, Pub/Sub
or Redis port something else already listens on (a redis-server a killed run left behind). Each block spans two xdist workers' offsets (500 apart).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

# Clear of the bench's stack (12000), chaos (23000) and each other: a stack's ports run from offset + 4443 to
# offset + 9060 for each of the block's two workers, so these blocks share no port, and all stay below 32768,
# where the kernel's ephemeral ports begin.
CANDIDATE_OFFSETS = (10000, 16000, 20000)
_PROBED_PORTS = (8080, 8085, 6390)  # the API, the Pub/Sub emulator and Redis (a killed run can leave one), per offset
_held: list[int] = []  # the lock's file descriptor, kept open for the session


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def claim_port_block(lock_dir: Path | None = None, candidates: tuple[int, ...] = CANDIDATE_OFFSETS) -> int:
    """The first candidate offset no other session holds and nothing listens on; the first candidate when all are
    taken (the stack then fails to start with its own clear message about the port in use)."""
    folder = lock_dir or Path(tempfile.gettempdir())
    for offset in candidates:
        descriptor = os.open(folder / f"maas-test-ports-{offset}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        if any(_listening(offset + step + port) for step in (0, 500) for port in _PROBED_PORTS):
            os.close(descriptor)
            continue
        _held.append(descriptor)
        return offset
    return candidates[0]
