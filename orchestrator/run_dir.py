"""The files of a run directory, and the append-only event and metric streams in it."""

from __future__ import annotations

import json
import os
import pathlib
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RunDir:
    """Paths of one run. ``events.jsonl`` and ``metrics.jsonl`` are appended by several processes
    (single ``O_APPEND`` writes of one line each, atomic on local filesystems)."""

    root: pathlib.Path

    @property
    def step_log(self) -> pathlib.Path:
        return self.root / "steplog.bin"

    @property
    def events(self) -> pathlib.Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> pathlib.Path:
        return self.root / "metrics.jsonl"

    @property
    def markers(self) -> pathlib.Path:
        return self.root / "failures"

    @property
    def shadow_pointer(self) -> pathlib.Path:
        """``{"name", "incarnation"}`` of the current shadow actor."""
        return self.root / "shadow.json"

    @staticmethod
    def write_json(path: pathlib.Path, value: dict) -> None:
        """Replace ``path`` atomically (temp file, fsync, rename): readers see the old or the new value."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(value, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    @staticmethod
    def read_json(path: pathlib.Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def append(self, stream: pathlib.Path, **row) -> None:
        """Append one JSON line (with ``unix_s`` added) to ``stream``; fsynced for events."""
        row.setdefault("unix_s", time.time())
        data = (json.dumps(row) + "\n").encode()
        fd = os.open(stream, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if stream == self.events:
                os.fsync(fd)
        finally:
            os.close(fd)

    def event(self, kind: str, **fields) -> None:
        self.append(self.events, kind=kind, **fields)

    @staticmethod
    def read(stream: pathlib.Path) -> list[dict]:
        """All complete lines of ``stream`` (a partial last line is ignored)."""
        if not stream.exists():
            return []
        rows = []
        for line in stream.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows
