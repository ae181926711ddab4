"""Which shapes calibration times: a quick set for a hot instance's start-up, more for the rest.

No torch here: the supervisor builds a worker's spec with these before any worker process exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Probes:
    """Which shapes to time; `quick` for start-up, a longer list for `talaria profile`."""

    prefill_tokens: tuple[int, ...] = (16, 64, 256)
    cached_tokens: tuple[int, ...] = (256,)  # prefix lengths for prefill-with-cached-prefix probes
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_contexts: tuple[int, ...] = (32, 256)
    repeats: int = 3  # timed runs per shape (after one warm-up); the fastest counts
    copy_bytes: int = 32 << 20
    staged_switches: bool = True  # also time the full-D2D and partial switch paths (several models)


QUICK = Probes(prefill_tokens=(16, 128), cached_tokens=(128,), decode_batches=(1, 8), decode_contexts=(64,),
               repeats=2, copy_bytes=8 << 20, staged_switches=False)  # hot instances: the router's cost model, in a second or two
FULL = Probes()  # start-up calibration of an instance that budgets rounds from its profile
