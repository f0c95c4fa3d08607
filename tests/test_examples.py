"""The README's example script, run the ways a user runs it."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train.py")
ARGS = ["--model", "vgg19:tiny", "--steps", "6", "--batch-size", "4"]


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("strategy,servers", [("allreduce", 0), ("ps", 1)])  # the strategies: tests/test_parity.py
def test_under_gradsync_run(strategy, servers):
    proc = run([sys.executable, "-m", "gradsync.launch", "-np", "2", "--servers", str(servers), "--",
                sys.executable, EXAMPLE, "--strategy", strategy, *ARGS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker 0] step   5  loss" in proc.stdout
    assert "[worker 1]" not in proc.stdout  # only rank 0 prints


def test_under_torchrun():
    proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", EXAMPLE, *ARGS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step   5  loss" in proc.stdout


def test_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, EXAMPLE, *ARGS], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "step   5  loss" in proc.stdout
