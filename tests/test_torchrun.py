"""Launched as users launch multi-machine jobs: two torchrun launchers (standing in
for two machines) of two processes each, c10d rendezvous on the loopback address,
gloo: SupCon, InfoNCE, CLIP, SigLIP, the triplet losses (every mining), Multi-Similarity,
Circle and a flex loss mined by its row statistics on both strategies, and a DDP step,
equal to one process (scripts/torchrun_check.py)."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(node: int, port: int, log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "2",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            str(ROOT / "scripts" / "torchrun_check.py"),
        ],
        # to files, not pipes: a launcher blocked on a full pipe that nobody reads yet
        # would stall its ranks' collectives, and the other launcher's with them
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


@pytest.mark.slow
def test_two_torchrun_launchers_of_two_processes_equal_one_process(tmp_path: pathlib.Path) -> None:
    port = _free_port()
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = [_launch(node, port, log) for node, log in zip((0, 1), logs)]
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in launchers) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        hung = [p for p in launchers if p.poll() is None]
        for p in hung:
            p.kill()
            p.wait()
    outputs = [log.read_text() for log in logs]
    assert not hung, "launchers still running after 300 s:\n" + "\n".join(outputs)
    for p, out in zip(launchers, outputs):
        assert p.returncode == 0, out
    # the ranks of a launcher share its output: their lines may interleave
    found = re.findall(r"rank (\d)/4 (.+?) +(all_gather|ring) +max error \S+ (ok|DIFFERS)", "\n".join(outputs))
    # 4 ranks x (7 losses x 2 strategies + the DDP step)
    assert len(found) == 4 * (10 * 2 + 1), "\n".join(outputs)  # 10 losses, 2 strategies, the DDP step
    assert all(verdict == "ok" for *_, verdict in found), found
    assert sum(name.startswith("triplet") and strategy == "ring" for _, name, strategy, _ in found) == 4 * 3
