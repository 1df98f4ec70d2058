"""Replies cut short or garbled anywhere, fed to the parsers of what the kernel sends."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Sequence


def feed_garbled(
    parse: Callable[[bytes], object],
    replies: Sequence[bytes],
    *,
    count: int = 20_000,
    seed: int,
    seconds: int = 20,
) -> None:
    """``count`` seeded mutations of ``replies`` (cut short, a few bytes changed, or a few
    random bytes inserted) to ``parse``, under an alarm: it raises (the test fails) or never
    returns (the alarm fails it, naming the input) if a parser lacks a bound."""
    rng = random.Random(seed)
    data = b""

    def stuck(*_: object) -> None:
        raise TimeoutError(f"a parser loops on {data.hex()}")

    before = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)  # the whole loop takes well under a second
    try:
        for _ in range(count):
            mutated = bytearray(rng.choice(replies))
            roll = rng.random()
            if roll < 0.3:
                del mutated[rng.randrange(len(mutated) + 1) :]
            elif roll < 0.7:
                for _ in range(rng.randrange(1, 4)):
                    mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            else:
                at = rng.randrange(len(mutated) + 1)
                mutated[at:at] = rng.randbytes(rng.randrange(1, 8))
            data = bytes(mutated)
            parse(data)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
