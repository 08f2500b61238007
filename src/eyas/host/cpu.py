"""CPU threads, chosen deliberately.

torch's default (one thread per core) is the worst choice on a busy machine for a small
model: every matmul ends in a barrier that waits for the slowest thread, and a thread that
another job has preempted makes the whole step wait (greedy decoding of the demo target ran
~50x slower at the default than with one thread while other jobs ran). So:

- `OMP_NUM_THREADS` (or `EYAS_THREADS`), when set, is obeyed;
- else a small model (hidden size <= 256: the demo and test targets) gets one thread for
  extraction and decoding, whose matmuls are a few rows wide;
- else (and for training, whose batches are thousands of tokens wide) every CPU this
  process may run on (its affinity mask, not the machine's count).

The runtimes may not change the count behind our back under load (OMP_DYNAMIC and
MKL_DYNAMIC are off, set by the CLI before torch loads): a fixed count keeps float sums in
a fixed order, so CPU training is reproducible bit for bit: with two threads, 8 fresh
processes of the same training of the demo ended with the same weights
(bench/reproducible.py). `--feature-noise` once broke that: torch made the noisy states
differently now and then with two threads (2 or 3 of 8 processes parted, 5e-5 apart); they
are made in numpy on a CPU now (`trainer.noisy`).
"""

from __future__ import annotations

import os

SMALL_HIDDEN = 256


def pin_runtime_env() -> None:
    """Call before torch is imported."""
    os.environ.setdefault("OMP_DYNAMIC", "FALSE")
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")


def choose_threads(hidden_size: int | None = None) -> int:
    for var in ("EYAS_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    if hidden_size is not None and hidden_size <= SMALL_HIDDEN:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def configure_threads(hidden_size: int | None = None) -> int:
    """Set torch's intra-op threads for this process; returns the count."""
    import torch

    n = choose_threads(hidden_size)
    torch.set_num_threads(n)
    return n
