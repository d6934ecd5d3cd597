"""How many CPU threads torch uses by default: one per physical core this process may run on.

Hyper-threads share a core's vector units, so a matmul thread on each of a core's two hardware
threads gains nothing and makes OpenMP wait on the slower one; the CPU affinity (a container's or
taskset's share, not the host's count) says which cores are ours. ``$OMP_NUM_THREADS``, when set,
wins (the test suite sets it to share the cores between pytest-xdist workers).

Cores that other processes keep busy are left out when that was measured (``watch_other_load``,
started by the ``generate`` command before torch is imported): OpenMP's threads spin while they
wait for each other, so a thread sharing its core with another process stalls every one of the
~2,000 parallel regions of a decode step (BENCHMARKS.md, start-up: 16 decode steps of
SmolLM2-135M took 2.5-7.5 s on 2 threads next to one other busy process, 1.1-1.2 s on one).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

logger = logging.getLogger(__name__)
_SYSFS = Path("/sys/devices/system/cpu")
_PROC_STAT = Path("/proc/stat")
_watch: tuple[float, float, float] | None = None  # (monotonic time, own CPU s, busy CPU s) at the start


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


def busy_cpu_seconds(cpus: set[int], stat: Path = _PROC_STAT) -> float | None:
    """CPU seconds the kernel counts as busy (not idle, not waiting for I/O) on ``cpus`` since
    boot, all processes together; None where /proc/stat is not readable."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            ticks += sum(values) - values[3] - values[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU time so far (user + system, every thread), to the microsecond
    (``os.times`` counts 10 ms clock ticks: a short client run read 0.0)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def watch_other_load() -> None:
    """Start measuring how much of the usable CPUs other processes use (see default_threads)."""
    global _watch
    busy = busy_cpu_seconds(usable_cpus())
    _watch = None if busy is None else (time.monotonic(), own_cpu_seconds(), busy)


def cpus_busy_elsewhere(min_window: float = 0.2) -> float | None:
    """How many CPUs other processes kept busy since ``watch_other_load``: the usable CPUs' busy
    time less this process's own, per second. None when not watched, or watched for less than
    ``min_window`` seconds (too few clock ticks to tell)."""
    if _watch is None:
        return None
    started, own, busy = _watch
    elapsed = time.monotonic() - started
    now = busy_cpu_seconds(usable_cpus())
    if now is None or elapsed < min_window:
        return None
    return max(0.0, ((now - busy) - (own_cpu_seconds() - own)) / elapsed)


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when it is a positive integer, else the physical cores, less the CPUs
    other processes kept busy while this one started (when ``watch_other_load`` ran), at least 1."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    global _watch
    cores = physical_cores()
    elsewhere = cpus_busy_elsewhere()
    _watch = None  # one measurement for the one engine the command starts: never a stale window later
    if elsewhere is None:
        return cores
    threads = max(1, min(cores, round(len(usable_cpus()) - elsewhere)))
    if threads < cores:
        logger.info("%d of %d cores for torch: other processes kept %.1f CPUs busy", threads, cores, elsewhere)
    return threads
