"""Commits that outlive the job: written to a folder atomically, read back by ``gradsync run --resume``.

A :class:`gradsync.adapt.Controller` commits (parameters, buffers, optimizer state, step, epoch,
data position, batch size) in memory between steps; an elastic job restores the last one when a
worker dies. With a checkpoint folder (``gradsync run --checkpoint-dir DIR``, or
``Controller(checkpoint_dir=DIR)``), worker 0 also writes every ``every_steps``-th commit, or the
first one ``every_s`` seconds after the last write, to ``DIR/commit-<step>.pt``:

- on its own thread, so the step that made the commit does not wait for the disk (the commit is
  a copy already; a write still running when the next one is due makes that one wait its turn,
  and only the newest waiting commit is kept);
- atomically: a temporary file in the same folder, ``fsync``, ``rename`` over the final name,
  ``fsync`` of the folder. A reader sees a whole commit or none, whatever kills the process when;
- with ``torch.save`` of tensors, numbers and lists only, read back with ``weights_only=True``;
- keeping the newest :data:`KEEP`.

``gradsync run --resume DIR`` starts the job with that folder and ``GRADSYNC_RESUME=1``: every
worker's Controller loads the newest whole commit before the first step, and training continues
from its step with its data position, so no committed step is lost and the model ends as an
uninterrupted run's would (the steps after the commit run again on the same global batches).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import time

from gradsync.errors import ConfigError

KEEP = 2
FORMAT = 1
DIR_ENV, EVERY_ENV, SECONDS_ENV, RESUME_ENV = ("GRADSYNC_CHECKPOINT_DIR", "GRADSYNC_CHECKPOINT_EVERY",
                                               "GRADSYNC_CHECKPOINT_SECONDS", "GRADSYNC_RESUME")
_NAME = re.compile(r"^commit-(\d+)\.pt$")


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(folder: str, commit: dict) -> str:
    """Write ``commit`` as ``folder/commit-<step>.pt`` atomically; its path."""
    import torch  # here: the launcher reads commits() and imports no torch

    step = commit["counters"]["step"]
    final = os.path.join(folder, f"commit-{step:09d}.pt")
    tmp = os.path.join(folder, f".commit-{step:09d}.pt.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "time": time.time(), **commit}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_folder(folder)
    return final


def commits(folder: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the whole commits in ``folder``, newest first (temporary files are not)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            match = _NAME.match(name)
            if match:
                found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found, reverse=True)


def latest(folder: str) -> dict | None:
    """The newest commit in ``folder`` that reads back whole; None when there is none. A file that
    does not load (written by something else, or damaged on disk) is skipped with a warning."""
    import torch

    for _, path in commits(folder):
        try:
            commit = torch.load(path, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: fall back to the one before
            print(f"gradsync: skipping checkpoint {path}: it does not load ({exc})", flush=True)
            continue
        if commit.get("format") == FORMAT:
            commit["path"] = path
            return commit
    return None


def prune(folder: str, keep: int = KEEP) -> None:
    for _, path in commits(folder)[keep:]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Schedule:
    """When a commit is written: at every ``every_steps``-th step, or the first step ``every_s``
    seconds after the last write."""

    def __init__(self, every_steps: int = 10, every_s: float | None = None):
        if every_steps < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 step, got {every_steps}")
        if every_s is not None and not 0 < every_s < float("inf"):
            raise ConfigError(f"checkpoint_seconds must be a positive number of seconds, got {every_s}")
        self.every_steps, self.every_s = every_steps, every_s
        self.last_write = time.monotonic()

    def due(self, step: int) -> bool:
        if step % self.every_steps == 0:
            return True
        return self.every_s is not None and time.monotonic() - self.last_write >= self.every_s


class DurableCommits:
    """Writes due commits to ``folder`` from a thread of its own (see the module docstring)."""

    def __init__(self, folder: str, schedule: Schedule):
        self.folder, self.schedule = folder, schedule
        os.makedirs(folder, exist_ok=True)
        self.written: list[str] = []
        self.error: BaseException | None = None
        self._pending: dict | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gradsync-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, commit: dict) -> None:
        """Queue ``commit`` (already a copy) for writing; a commit still waiting is replaced."""
        if self.error is not None:
            raise self.error
        self.schedule.last_write = time.monotonic()
        with self._cv:
            self._pending = commit
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                commit, self._pending, self._busy = self._pending, None, True
            try:
                self.written.append(write(self.folder, commit))
                prune(self.folder)
            except BaseException as exc:  # noqa: BLE001 - raised by the next submit() or close()
                self.error = exc
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every submitted commit is on disk."""
        with self._cv:
            while self._pending is not None or self._busy:
                self._cv.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
