import fcntl
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: under pytest -n N, run while no other test runs (it asserts a time)")


_ALONE = None
"""The machine lock this worker holds exclusively while it runs ``alone`` tests in a row."""


def _is_alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``pytest -n N`` (pytest-xdist, as ``make test`` runs it) tests share the machine's
    cores; one marked ``alone`` asserts a time (a fault named within its timeout) that a neighbour's
    ranks on the same cores would stretch, so it waits until the other workers' current tests end
    and runs by itself (its fixtures' setup included). Every test passes a turnstile first, so that
    one waiting to be alone is not overtaken forever by the others' next tests. ``alone`` tests in a
    row keep the machine: the others wait once for the whole row, not once for each."""
    global _ALONE
    basetemp = item.config.option.basetemp  # set by pytest-xdist: this worker's folder in the run's
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        yield
        return
    shared = os.path.dirname(os.path.abspath(basetemp))
    alone = _is_alone(item)
    if not (alone and _ALONE is not None):
        with open(os.path.join(shared, "turnstile.lock"), "a") as turnstile:
            machine = open(os.path.join(shared, "machine.lock"), "a")
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        if alone:
            _ALONE = machine
    else:
        machine = _ALONE
    try:
        yield
    finally:
        if not (alone and _is_alone(nextitem)):
            _ALONE = None
            fcntl.flock(machine, fcntl.LOCK_UN)
            machine.close()


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytests_folder(tmp_path_factory):
    """What the jobs the suite starts keep in temporary folders (a failed job's flight summary is
    kept for its user, by design) goes under pytest's own folder, which pytest prunes, not /tmp."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = folder, None
    yield
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    tempfile.tempdir = None


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args)``: run ``gradsync ARGS`` in this process; ``(exit status, stdout, stderr)``.

    For argument errors, which need no worker: a subprocess would spend most of its time importing
    torch. ``cwd`` also goes on ``sys.path`` (a user's model module next to the script)."""
    from gradsync.cli import main

    def run(*args, cwd=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
            monkeypatch.syspath_prepend(cwd)
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return code, out.out, out.err
    return run
