"""``raycheck merge``: a composite snapshot from units of several snapshots; ``raycheck export``: a snapshot as a
Hugging Face folder (logic: ``storage.merge``)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Annotated, Any

import typer

from raycheck.cli.storage import EndpointOpt, open_store
from raycheck.storage.backend import StorageError, local_path
from raycheck.storage.merge import (
    MergeError,
    Source,
    check_output,
    commit_merge,
    export_hf,
    parse_source,
    parse_take,
    prepare_hf_export,
    prepare_merge,
    write_hf_export,
)
from raycheck.storage.snapshots import NoSnapshotError, SnapshotCorruptError
from raycheck.job.config import MODEL_NAMES
from raycheck.training.model import check_outside_cache, default_cache_dir, model_folder


def merge(
    source: Annotated[list[str], typer.Option(
        help="NAME=STORE or NAME=STORE@STEP, STORE a run directory, path, file:// or s3:// store; without "
             "@STEP its newest committed snapshot. The first source's layout is the reference. Repeatable.")],
    take: Annotated[list[str], typer.Option(
        help="UNITS:NAME: layer ranges (0-14), layer numbers (7) or unit names (embed,norm,lm_head) "
             "to take from source NAME. Every unit exactly once. Repeatable.")],
    out: Annotated[str, typer.Option(help="Empty store for the composite snapshot (path, file:// or s3://; an S3 bucket must exist).")],
    export_hf_dir: Annotated[pathlib.Path | None, typer.Option(
        "--export-hf", help="Also write the merged parameters as a Hugging Face folder here: a new or empty folder outside the model cache (needs --model).")] = None,
    model: Annotated[str, typer.Option(help=f"Model for --export-hf (config and layout): {', '.join(MODEL_NAMES)}, a model folder or a cached model id.")] = "",
    s3_endpoint: EndpointOpt = "",
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
) -> None:
    """Assemble units (weights and optimizer state) from several snapshots into one committed snapshot.

    Everything is checked before anything is committed (sources, takes, the output store, and with
    --export-hf the model and its folder); a failed merge leaves no new folder or object behind."""
    if export_hf_dir is not None and not model:
        raise typer.BadParameter("--export-hf needs --model (the model whose config and layout to use)")
    try:
        parsed = [parse_source(s) for s in source]
        takes = [parse_take(t) for t in take]
    except MergeError as exc:
        raise typer.BadParameter(str(exc)) from exc
    sources = [Source(name, open_store(uri, s3_endpoint), step) for name, uri, step in parsed]
    made = None
    committed = False
    try:
        if export_hf_dir is not None:  # before the output store is made: a refused merge writes nothing
            check_outside_cache(export_hf_dir, cache_dir)
        made = _new_local_folder(out)
        out_store = open_store(out, s3_endpoint, create=True)
        check_output(out_store)
        prepared = prepare_merge(sources, takes)
        export = None
        if export_hf_dir is not None:
            export = prepare_hf_export(prepared.state, export_hf_dir, model, model_folder(model, cache_dir))
        result = commit_merge(prepared, out_store)
        committed = True
        for unit, name in result.unit_sources.items():
            typer.echo(f"  {unit:<12} <- {name} @ step {result.unit_steps[unit]}")
        typer.echo(f"committed step {result.info.step}: {out_store.storage.url(result.info.folder)}")
        if export is not None:
            typer.echo(f"Hugging Face folder: {write_hf_export(export)}")
    except (MergeError, NoSnapshotError, SnapshotCorruptError, ValueError, FileExistsError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except OSError as exc:  # StorageError included
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        if not committed and made is not None:
            _remove_empty_folders(made)


def _new_local_folder(uri: str) -> pathlib.Path | None:
    """The outermost folder the merge creates for the local store ``uri`` (it or a missing parent);
    None when ``uri`` exists or is not local."""
    folder = local_path(uri)
    if folder is None or folder.exists():
        return None
    while not folder.parent.exists():
        folder = folder.parent
    return folder


def _remove_empty_folders(root: pathlib.Path) -> None:
    """Remove ``root`` and the folders under it, bottom up, as long as they hold no file."""
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: len(entry[0]), reverse=True):
        with contextlib.suppress(OSError):  # not empty: a file stays, and so does its folder
            os.rmdir(folder)


def export(
    checkpoint: Annotated[str, typer.Argument(metavar="CHECKPOINT", help=(
        "One snapshot: Ray Train's Result.checkpoint path (a pointer raycheck reported), a summary's "
        "ray_train_checkpoint.path or final_snapshot, a snapshot folder (path or s3:// URI); or a store or a run "
        "directory (the --out of raycheck run): its newest."))],
    hf: Annotated[pathlib.Path, typer.Option(help="The Hugging Face folder to write: new or empty, outside the model cache.")],
    model: Annotated[str, typer.Option(help=f"The run's model (config and layout): {', '.join(MODEL_NAMES)}, a model folder or a cached model id.")],
    s3_endpoint: EndpointOpt = "",
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
) -> None:
    """Write a committed snapshot's weights as a folder transformers loads (from_pretrained).

    The weights only (the optimizer state is dropped), checked against --model's layout before anything is
    written. Exit 2: a bad checkpoint, model or target folder, nothing written."""
    options: dict[str, Any] = {"endpoint_url": s3_endpoint} if s3_endpoint else {}
    try:
        check_outside_cache(hf, cache_dir)
        folder = export_hf(checkpoint, hf, model, model_folder(model, cache_dir), **options)
    except (NoSnapshotError, SnapshotCorruptError, StorageError, ValueError, FileExistsError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"Hugging Face folder: {folder}")
