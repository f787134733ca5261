"""The files of a run directory. Only the driver writes them (``orchestrator.journal.RunRecord``
appends the event and metric streams it receives from the run's journal)."""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from raycheck.storage.files import atomic_write


@dataclass(frozen=True)
class RunDir:
    """Paths of one run."""

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
    def controller_state(self) -> pathlib.Path:
        """The driver's ``Controller.state_dict`` (the planner's measured costs, the restart counts), for ``--resume``."""
        return self.root / "controller.json"

    @staticmethod
    def write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
        """Replace ``path`` with ``value`` as JSON, atomically and durably (``storage.files.atomic_write``):
        readers see the old or the new value."""
        atomic_write(path, json.dumps(value, indent=2, default=str).encode())

    @staticmethod
    def read_json(path: pathlib.Path) -> dict[str, Any] | None:
        try:
            loaded: dict[str, Any] = json.loads(path.read_text())
            return loaded
        except FileNotFoundError:
            return None

    def append(self, stream: pathlib.Path, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` to ``stream``, one JSON line each, in one write; fsynced for events."""
        if not rows:
            return
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        fd = os.open(stream, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if stream == self.events:
                os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def read(stream: pathlib.Path) -> list[dict[str, Any]]:
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
