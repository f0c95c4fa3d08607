import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
