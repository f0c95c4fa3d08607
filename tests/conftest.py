import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
