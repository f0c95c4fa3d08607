"""The results store: every experiment run, cell by cell, in one sqlite file.

Default place: ``$GRADSYNC_STORE``, else ``$XDG_DATA_HOME/gradsync/experiments.sqlite``
(``~/.local/share/gradsync/experiments.sqlite``); ``--store FILE`` picks another. gradsync also ships
the runs its docs/results pages were generated from (:data:`SHIPPED`, read only): without
``--store``, ``gradsync experiment list/report/validate`` fall back to them for an experiment the
user's store has not run (:func:`open_stores`). A run records the
spec, target, scale and overrides, the environment it ran in, and per cell: the exact command, its
records, its duration and outcome. Each cell is committed in its own transaction as it finishes, so
an interrupted run leaves the store consistent and ``gradsync experiment run`` resumes it at the
first cell without a result.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time

from gradsync.errors import ConfigError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    spec TEXT NOT NULL, target TEXT NOT NULL, scale TEXT NOT NULL, overrides TEXT NOT NULL,
    started REAL NOT NULL, finished REAL, status TEXT NOT NULL, environment TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cells (
    run_id INTEGER NOT NULL REFERENCES runs(id), key TEXT NOT NULL, cell TEXT NOT NULL,
    command TEXT NOT NULL, records TEXT NOT NULL, seconds REAL NOT NULL, status TEXT NOT NULL,
    message TEXT NOT NULL, finished REAL NOT NULL, PRIMARY KEY (run_id, key));
"""


def default_path() -> str:
    if os.environ.get("GRADSYNC_STORE"):
        return os.environ["GRADSYNC_STORE"]
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "gradsync", "experiments.sqlite")


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped.sqlite")
"""The stored runs behind docs/results, installed with the package."""


def open_stores(path: str | None) -> list["Store"]:
    """``--store PATH``: that store alone. Without it: the user's store, then the shipped runs."""
    if path is not None:
        return [Store(path)]
    stores = [Store()]
    if os.path.exists(SHIPPED) and os.path.abspath(stores[0].path) != SHIPPED:
        stores.append(Store(SHIPPED, readonly=True))
    return stores


def cell_key(cell: dict) -> str:
    """A cell's identity in its run: its values, as sorted JSON."""
    return json.dumps(cell, sort_keys=True)


class Store:
    def __init__(self, path: str | None = None, *, readonly: bool = False):
        self.path = path or default_path()
        self.readonly = readonly
        """Opened for reading only (the shipped runs): nothing is written, not even the schema."""
        if not readonly:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        try:
            self.db = (sqlite3.connect(f"file:{os.path.abspath(self.path)}?mode=ro", uri=True) if readonly
                       else sqlite3.connect(self.path))
            version = self._version()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path} is not a gradsync results store ({exc})") from None
        if version is not None and version > SCHEMA_VERSION:
            raise ConfigError(f"{self.path} was written by a newer gradsync (store version {version}, this one "
                              f"reads up to {SCHEMA_VERSION}): upgrade gradsync, or pass --store with another file")
        if readonly:
            return
        with self.db:
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def _version(self) -> int | None:
        has_meta = self.db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
        if not has_meta:
            return None
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else None

    def close(self) -> None:
        self.db.close()

    # -- runs ----------------------------------------------------------------------------------
    def start_run(self, spec: str, target: str, scale: str, overrides: dict, environment: dict) -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (spec, target, scale, overrides, started, status, environment) VALUES (?,?,?,?,?,?,?)",
                (spec, target, scale, json.dumps(overrides, sort_keys=True), time.time(), "running",
                 json.dumps(environment, sort_keys=True)))
        return int(cur.lastrowid)

    def unfinished_run(self, spec: str, target: str, scale: str, overrides: dict) -> int | None:
        """The latest run of this spec, target, scale and overrides that did not finish."""
        row = self.db.execute(
            "SELECT id FROM runs WHERE spec=? AND target=? AND scale=? AND overrides=? AND status!='done' "
            "ORDER BY id DESC LIMIT 1", (spec, target, scale, json.dumps(overrides, sort_keys=True))).fetchone()
        return None if row is None else int(row[0])

    def finish_run(self, run_id: int, status: str) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status=?, finished=? WHERE id=?", (status, time.time(), run_id))

    def runs(self, spec: str | None = None) -> list[dict]:
        query, args = "SELECT id, spec, target, scale, overrides, started, finished, status, environment FROM runs", ()
        if spec is not None:
            query, args = query + " WHERE spec=?", (spec,)
        rows = self.db.execute(query + " ORDER BY id", args).fetchall()
        return [{"id": r[0], "spec": r[1], "target": r[2], "scale": r[3], "overrides": json.loads(r[4]),
                 "started": r[5], "finished": r[6], "status": r[7], "environment": json.loads(r[8])} for r in rows]

    def latest(self, spec: str, *, done: bool = True) -> dict | None:
        """The newest run of ``spec`` (finished ones only, unless ``done=False``)."""
        runs = [r for r in self.runs(spec) if r["status"] == "done" or not done]
        return runs[-1] if runs else None

    # -- cells ---------------------------------------------------------------------------------
    def save_cell(self, run_id: int, cell: dict, command: list[str], records: list[dict], seconds: float,
                  status: str, message: str = "") -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO cells VALUES (?,?,?,?,?,?,?,?,?)",
                            (run_id, cell_key(cell), json.dumps(cell, sort_keys=True), json.dumps(command),
                             json.dumps(records), seconds, status, message, time.time()))

    def cells(self, run_id: int) -> list[dict]:
        rows = self.db.execute("SELECT cell, command, records, seconds, status, message FROM cells WHERE run_id=? "
                               "ORDER BY finished", (run_id,)).fetchall()
        return [{"cell": json.loads(r[0]), "command": json.loads(r[1]), "records": json.loads(r[2]),
                 "seconds": r[3], "status": r[4], "message": r[5]} for r in rows]

    def done_keys(self, run_id: int) -> set[str]:
        rows = self.db.execute("SELECT key FROM cells WHERE run_id=? AND status='done'", (run_id,)).fetchall()
        return {r[0] for r in rows}

    def records(self, run_id: int) -> list[dict]:
        """Every record of a run, each with its cell (``record["cell"]``)."""
        out = []
        for cell in self.cells(run_id):
            for record in cell["records"]:
                out.append({**record, "cell": cell["cell"]})
        return out
