"""``raycheck inspect`` and ``raycheck verify``: look into a snapshot store and re-hash it."""

from __future__ import annotations

import datetime
import pathlib
from typing import Annotated

import typer

from storage.backend import Storage
from storage.log_segments import read_segments
from storage.snapshots import SnapshotStore
from storage.steplog import StepLogError

UriArg = Annotated[str, typer.Argument(help="Snapshot store: a run directory, a path, file://PATH or s3://BUCKET/PREFIX.")]
EndpointOpt = Annotated[str, typer.Option(help="S3 endpoint URL (default: $AWS_ENDPOINT_URL).")]


def _store(uri: str, s3_endpoint: str) -> SnapshotStore:
    if "://" not in uri and (pathlib.Path(uri) / "snapshots").is_dir():
        uri = str(pathlib.Path(uri) / "snapshots")  # a run directory
    return SnapshotStore(Storage(uri, **({"endpoint_url": s3_endpoint} if s3_endpoint else {})))


def _units_by_step(manifest: dict) -> str:
    steps: dict[int, int] = {}
    for spec in manifest["units"].values():
        steps[spec["step"]] = steps.get(spec["step"], 0) + 1
    return ", ".join(f"{n} @ step {s}" for s, n in sorted(steps.items()))


def inspect(uri: UriArg, s3_endpoint: EndpointOpt = "") -> None:
    """List committed snapshots: step, size, units and the step each unit belongs to, and the step log."""
    store = _store(uri, s3_endpoint)
    infos = store.list()
    typer.echo(f"{store.storage.url()}: {len(infos)} committed snapshot(s)")
    for info in infos:
        created = datetime.datetime.fromtimestamp(info.manifest["created_unix_s"]).isoformat(timespec="seconds")
        typer.echo(f"  step {info.step:>8}  {info.bytes / 1e6:10.1f} MB  {len(info.manifest['units']):>4} units "
                   f"({_units_by_step(info.manifest)})  {created}  {info.folder}")
    try:
        header, records = read_segments(store.storage)
    except (StepLogError, OSError) as exc:
        typer.echo(f"step log segments: unreadable: {exc}")
        return
    if header is not None:
        typer.echo(f"step log segments: steps 0..{len(records) - 1} (model {header.get('model')})")


def verify(uri: UriArg, s3_endpoint: EndpointOpt = "") -> None:
    """Re-hash every shard of every committed snapshot (and the mirrored step log); exit 1 naming each bad one."""
    store = _store(uri, s3_endpoint)
    bad = []
    infos = store.list()
    for info in infos:
        problems = store.verify(info)
        typer.echo(f"{'BAD' if problems else 'ok '}  step {info.step:>8}  {info.folder}")
        for p in problems:
            typer.echo(f"       {p}")
        bad += problems
    try:
        header, records = read_segments(store.storage)
        if header is not None:
            typer.echo(f"ok   step log segments: steps 0..{len(records) - 1}")
    except (StepLogError, OSError) as exc:
        typer.echo(f"BAD  step log segments: {exc}")
        bad.append(str(exc))
    if not infos:
        typer.echo(f"no committed snapshots in {store.storage.url()}", err=True)
        raise typer.Exit(2)
    if bad:
        typer.echo(f"{len(bad)} problem(s) found", err=True)
        raise typer.Exit(1)
    typer.echo(f"all {len(infos)} snapshot(s) verified")
