"""Launched as users launch multi-machine jobs: two torchrun launchers (standing in
for two machines) of two processes each, c10d rendezvous on the loopback address,
gloo: SupCon, InfoNCE, CLIP, SigLIP and the triplet losses (every mining) on both
strategies, and a DDP step, equal to one process (scripts/torchrun_check.py)."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_torchrun_launchers_of_two_processes_equal_one_process() -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    launchers = [
        subprocess.Popen(
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
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    outputs = []
    for launcher in launchers:
        out, _ = launcher.communicate(timeout=300)
        outputs.append(out)
        assert launcher.returncode == 0, out
    # the ranks of a launcher share its output: their lines may interleave
    found = re.findall(r"rank (\d)/4 (.+?) +(all_gather|ring) +max error \S+ (ok|DIFFERS)", "\n".join(outputs))
    # 4 ranks x (7 losses x 2 strategies + the DDP step)
    assert len(found) == 4 * (7 * 2 + 1), "\n".join(outputs)
    assert all(verdict == "ok" for *_, verdict in found), found
    assert sum(name.startswith("triplet") and strategy == "ring" for _, name, strategy, _ in found) == 4 * 3
