"""Resident-memory readings from /proc (Linux), shared by the benchmark and the doctor."""

from __future__ import annotations

from typing import Optional


def status_mb(key: str) -> Optional[float]:
    """A ``/proc/self/status`` field in MB (``VmRSS``, ``VmHWM``, ``VmSize``), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reset_peak() -> Optional[float]:
    """Resets the peak resident size (VmHWM) to the current one; returns the current (MB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return status_mb("VmRSS")
