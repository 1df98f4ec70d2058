"""Running iptables/nft/conntrack binaries from the event loop, with errors a user can act on.

Everything the kernel backends execute goes through ``run``: an asyncio subprocess (the loop
never blocks on a fork or on the xtables lock), a bounded wait, and one translation of the
two failures users cause — a missing binary and missing privileges — into a one-line
``RulesError`` that says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from uproxy.rules.base import RulesError

log = logging.getLogger("uproxy.rules.command")

DEFAULT_TIMEOUT_S = 60.0
PRIVILEGE_FIX = "run as root or with CAP_NET_ADMIN (and CAP_NET_RAW for legacy iptables)"
_FIX = f"{PRIVILEGE_FIX}, or use --rules none"
_PERMISSION_MARKERS = ("Permission denied", "must be root", "Operation not permitted")
_PACKAGES = {"nft": "nftables", "conntrack": "conntrack"}  # else: iptables

WriteGuard = Callable[[], AbstractContextManager[None]]
# What every program that writes rules runs inside (``write``): set by the proxy while its
# workers are bound to CPUs (``WorkerPool.released``).
_write_guard: WriteGuard | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def message(self) -> str:
        """The first line of the program's complaint, for a one-line error."""
        text = (self.stderr or self.stdout).strip()
        held = _lock_held(text)
        if held is not None:
            return held
        if text:
            return text.splitlines()[0]
        if self.returncode < 0:  # asyncio's way of saying a signal ended it
            try:
                return f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        return f"exit code {self.returncode}"


# iptables that gave up waiting (``-w``) for the xtables lock says so on its second line; its
# first, "Can't lock /run/xtables.lock: Resource temporarily unavailable", reads as a kernel
# resource running out rather than another writer (a CNI plugin, the kubelet) in the way.
_LOCK_HELD = re.compile(r"holding the xtables lock\.(?: Stopped waiting after (\d+)s)?")
_LOCK_PATH = re.compile(r"Can't lock (\S+):")


def _lock_held(text: str) -> str | None:
    """The complaint of an iptables program that another one held the xtables lock, in the
    words python-iptables' backend uses for the same wait; None for any other complaint."""
    held = _LOCK_HELD.search(text)
    if held is None:
        return None
    path = _LOCK_PATH.search(text)
    where = f"{path.group(1)} (the xtables lock)" if path else "the xtables lock"
    waited = f" for more than {held.group(1)}s" if held.group(1) else ""
    return f"another program holds {where}{waited}"


CAP_NET_ADMIN = 12  # linux/capability.h


def has_net_admin(status: str = "/proc/self/status") -> bool | None:
    """Whether this process holds CAP_NET_ADMIN (its effective set); None if unknown."""
    try:
        with open(status, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def missing_permission(backend: str) -> str | None:
    """Why ``--rules backend`` cannot program anything here, checked before the start (every
    rules program needs CAP_NET_ADMIN); None when it can, or when that cannot be told."""
    if has_net_admin() is False:
        return f"--rules {backend} needs CAP_NET_ADMIN, which this process lacks; {_FIX}"
    return None


class PermissionDenied(RulesError):
    """A rules program was refused for lack of privilege (``program`` names it)."""

    def __init__(self, program: str) -> None:
        super().__init__(f"{program}: permission denied; {_FIX}")
        self.program = program


def permission_error(program: str) -> RulesError:
    return PermissionDenied(program)


def guard_writes(guard: WriteGuard | None) -> None:
    """Run every rules write inside ``guard()`` from now on (None: inside nothing)."""
    global _write_guard
    _write_guard = guard


def unguard_writes(guard: WriteGuard) -> None:
    """Stop guarding writes with ``guard``; a guard set since then stays."""
    global _write_guard
    if _write_guard == guard:
        _write_guard = None


def writing() -> AbstractContextManager[None]:
    """What a rules write runs inside: the guard ``guard_writes`` set, else nothing. A
    write's commits hold a CPU in the kernel, and the proxy's guard lets bound workers
    leave that CPU meanwhile."""
    return _write_guard() if _write_guard is not None else contextlib.nullcontext()


async def write(argv: Sequence[str], *, stdin: str) -> Completed:
    """``run`` for a program that writes rules from ``stdin`` (``iptables-restore``, ``nft
    -f -``), inside ``writing()``."""
    with writing():
        return await run(argv, stdin=stdin)


async def run(
    argv: Sequence[str],
    *,
    stdin: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
) -> Completed:
    """Run ``argv`` and return its output; raise RulesError when it cannot run or fails.

    With ``check=False`` a non-zero exit is returned to the caller instead (permission
    problems and a missing binary still raise).
    """
    program = argv[0]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        package = _PACKAGES.get(program, "iptables")
        raise RulesError(
            f"{program} not found: install the {package} package, or use --rules none"
        ) from None
    except PermissionError:
        raise permission_error(program) from None
    try:
        # Not asyncio.wait_for, which on Python 3.11 can lose the caller's cancellation (a
        # stop) when the command ends in the same turn (see ``runner``).
        async with asyncio.timeout(timeout_s):
            out, err = await _communicate(proc, stdin.encode() if stdin is not None else None)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RulesError(f"{program} did not finish within {timeout_s:g}s") from None
    except BaseException:
        # Cancelled (a stop cancels the sync that runs it): left running, a write committed
        # after the stop's own cleanup (--cleanup-on-exit) and put back a whole table of
        # rules that lead to ports nobody listens on any more. A commit is atomic: killed,
        # it is in or not, and the caller counts it as not written.
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    done = Completed(
        tuple(argv),
        proc.returncode or 0,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
    )
    if done.returncode != 0:
        if any(marker in done.stderr for marker in _PERMISSION_MARKERS):
            raise permission_error(program)
        if check:
            log.debug(
                "Command failed",
                extra={"kv": {"argv": " ".join(argv), "rc": done.returncode, "err": done.stderr}},
            )
            raise RulesError(f"{program} failed: {done.message}")
    return done


async def _communicate(proc: asyncio.subprocess.Process, data: bytes | None) -> tuple[bytes, bytes]:
    """``proc.communicate``, but a program that exits before reading all of ``data`` is
    not an error of its own: its exit status and stderr say why. (uvloop raises a
    RuntimeError, "the handler is closed", for the write, which was the only line a sync
    failure gave, the program's own message lost.)"""

    async def feed() -> None:
        if proc.stdin is None:
            return
        try:
            if data:
                proc.stdin.write(data)
                await proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            pass  # it stopped reading: it has exited, or is about to
        finally:
            with contextlib.suppress(ConnectionError, RuntimeError):
                proc.stdin.close()

    async def read(stream: asyncio.StreamReader | None) -> bytes:
        return await stream.read() if stream is not None else b""

    _, out, err = await asyncio.gather(feed(), read(proc.stdout), read(proc.stderr))
    await proc.wait()
    return out, err
