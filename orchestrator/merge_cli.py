"""``raycheck merge``: a composite snapshot from units of several snapshots (logic: ``storage.merge``)."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

from orchestrator.storage_cli import EndpointOpt, open_store
from storage.backend import StorageError
from storage.merge import MergeError, Source, export_hf, merge_snapshots, parse_source, parse_take
from storage.snapshots import NoSnapshotError, SnapshotCorruptError
from training.model import MODEL_NAMES, default_cache_dir


def merge(
    source: Annotated[list[str], typer.Option(
        help="NAME=STORE or NAME=STORE@STEP, STORE a run directory, path, file:// or s3:// store; without "
             "@STEP its newest committed snapshot. The first source's layout is the reference. Repeatable.")],
    take: Annotated[list[str], typer.Option(
        help="UNITS:NAME: layer ranges (0-14), layer numbers (7) or unit names (embed,norm,lm_head) "
             "to take from source NAME. Every unit exactly once. Repeatable.")],
    out: Annotated[str, typer.Option(help="Empty store for the composite snapshot (path, file:// or s3://).")],
    export_hf_dir: Annotated[pathlib.Path | None, typer.Option(
        "--export-hf", help="Also write the merged parameters as a Hugging Face folder here (needs --model).")] = None,
    model: Annotated[str, typer.Option(help=f"Model for --export-hf (config and layout): {', '.join(MODEL_NAMES)}.")] = "",
    s3_endpoint: EndpointOpt = "",
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
) -> None:
    """Assemble units (weights and optimizer state) from several snapshots into one committed snapshot."""
    if export_hf_dir is not None and not model:
        raise typer.BadParameter("--export-hf needs --model (the model whose config and layout to use)")
    try:
        parsed = [parse_source(s) for s in source]
        takes = [parse_take(t) for t in take]
    except MergeError as exc:
        raise typer.BadParameter(str(exc)) from exc
    sources = [Source(name, open_store(uri, s3_endpoint), step) for name, uri, step in parsed]
    out_store = open_store(out, s3_endpoint, create=True)
    try:
        result = merge_snapshots(sources, takes, out_store)
        for unit, name in result.unit_sources.items():
            typer.echo(f"  {unit:<12} <- {name} @ step {result.unit_steps[unit]}")
        typer.echo(f"committed step {result.info.step}: {out_store.storage.url(result.info.folder)}")
        if export_hf_dir is not None:
            folder = export_hf(out_store, export_hf_dir, model, step=result.info.step, cache_dir=cache_dir)
            typer.echo(f"Hugging Face folder: {folder}")
    except (MergeError, NoSnapshotError, SnapshotCorruptError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except StorageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
