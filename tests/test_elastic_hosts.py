"""Elastic jobs over several hosts (gradsync run --elastic --nnodes MIN:MAX): one agent per emulated
host, hosts that join, a host that is lost for good, a resize from another host, and the replay."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gradsync.cluster import EmulatedCluster, leftovers
from test_elastic import EXAMPLE, GRADSYNC, ROOT, assert_matches_reference

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating network namespaces and qdiscs needs root")
PORT = 29411
SECRET = "0123456789abcdef0123456789abcdef"


class Log:
    """A process's output, read as it comes."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"no {pattern!r} within {timeout} s:\n{self.text()[-4000:]}"
            time.sleep(0.05)


@needs_root
def test_hosts_join_one_is_lost_and_another_resizes_the_job(tmp_path):
    # Three emulated hosts, one agent each: 1 -> 2 -> 3 workers as hosts 1 and 2 register, host 1
    # lost for good -> 2, a resize from host 2 -> 1, then StopFile; the replay of the global batches.
    out, stop = tmp_path / "result.json", tmp_path / "stop"
    with EmulatedCluster(3, 10e9) as cluster:
        endpoint = f"{cluster.address(0)}:{PORT}"
        env = {**os.environ, **cluster.env(), "GRADSYNC_JOB_SECRET": SECRET, "GRADSYNC_TIMEOUT": "20"}

        def agent(host: int) -> Log:
            return Log(subprocess.Popen(
                [*cluster.exec_prefix(host), *GRADSYNC, "run", "--elastic", "--nnodes", "1:3", "--nproc-per-node", "1",
                 "--rdzv-endpoint", endpoint, "--", sys.executable, EXAMPLE, "--out", str(out), "--sleep", "0.05",
                 "--steps", "100000", "--stop-file", str(stop)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                env={**env, "GRADSYNC_HOST": f"emulated host {host}"}))

        lead, first = agent(0), agent(1)
        try:
            lead.wait_for(r"generation 1: 2 workers \[0, 1\] \(workers \[1\] joined\)")
            # An agent with another secret stops at once, saying so, and registers nothing.
            wrong = subprocess.run([*cluster.exec_prefix(2), *GRADSYNC, "run", "--elastic", "--nnodes", "1:3",
                                    "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--", "true"],
                                   capture_output=True, text=True, env={**env, "GRADSYNC_JOB_SECRET": "f" * 32}, timeout=60)
            assert wrong.returncode == 2, wrong.stderr
            assert "has another secret than this agent's GRADSYNC_JOB_SECRET" in wrong.stderr, wrong.stderr
            second = agent(2)
            lead.wait_for(r"generation 2: 3 workers \[0, 1, 2\]")
            second.wait_for(r"elastic worker 2 joined generation 2 \(3 workers\)")
            # Host 1 dies whole: its link goes down and its agent (and with it its worker) is killed.
            cluster.link_down(1)
            os.killpg(first.proc.pid, signal.SIGKILL)
            lead.wait_for(r"host 1 \(emulated host 1\) is lost")
            lead.wait_for(r"generation 3: 2 workers \[0, 2\] \(worker 1 failed: its host was lost")
            lead.wait_for(r"generation 3 regrouped, 3 -> 2 workers")
            # A resize from host 2, through the endpoint, with the job's secret.
            asked = subprocess.run([*cluster.exec_prefix(2), *GRADSYNC, "resize", "1", "--addr", cluster.address(0),
                                    "--port", str(PORT)], capture_output=True, text=True, env=env, timeout=60)
            assert asked.returncode == 0, asked.stderr
            lead.wait_for(r"generation 4: 1 workers \[0\]")
            stop.touch()
            assert lead.proc.wait(timeout=60) == 0, lead.text()[-4000:]
            assert second.proc.wait(timeout=30) == 0, second.text()[-4000:]
            assert "worker 2: left the job" in second.text()
        finally:
            for log in (lead, first, locals().get("second")):
                if log is not None and log.proc.poll() is None:
                    os.killpg(log.proc.pid, signal.SIGKILL)
                    log.proc.wait()
    result = json.loads(out.read_text())
    assert [(r["from"], r["to"]) for r in result["resizes"]] == [(1, 2), (2, 3), (3, 2), (2, 1)]
    assert_matches_reference(result)
    assert leftovers() == []


def test_an_agent_without_the_jobs_secret_stops_at_once():
    none = subprocess.run([*GRADSYNC, "run", "--elastic", "--nnodes", "1:2", "--nproc-per-node", "1",
                           "--rdzv-endpoint", "127.0.0.1:1", "--", "true"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "GRADSYNC_JOB_SECRET"}, timeout=60)
    assert none.returncode == 2 and "needs the job's secret on every host" in none.stderr, none.stderr
