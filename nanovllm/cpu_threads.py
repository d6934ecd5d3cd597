"""How many CPU threads torch uses by default: one per physical core this process may run on.

Hyper-threads share a core's vector units, so a matmul thread on each of a core's two hardware
threads gains nothing and makes OpenMP wait on the slower one; the CPU affinity (a container's or
taskset's share, not the host's count) says which cores are ours. ``$OMP_NUM_THREADS``, when set,
wins (the test suite sets it to share the cores between pytest-xdist workers).
"""

from __future__ import annotations

import os
from pathlib import Path

_SYSFS = Path("/sys/devices/system/cpu")


def usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sysfs: Path = _SYSFS) -> int:
    """Distinct (package, core) pairs among ``cpus`` (default: the usable ones); the CPU count
    where the topology is not readable."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when it is a positive integer, else the physical cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores()
