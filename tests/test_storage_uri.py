"""The one reading of a storage URI (``storage.backend.split_uri``) and what is built on it: the local
folder (``local_path``), whether only one node holds the storage (``node_local``) and ``Storage``'s
scheme (no Ray, no network)."""

from __future__ import annotations

import os
import pathlib

import pytest

from raycheck.storage.backend import Storage, local_path, node_local, split_uri


@pytest.mark.parametrize("uri, parts, local, one_node", [
    ("s3://bucket/run/a", ("s3", "bucket/run/a"), None, False),
    ("memory://scratch", ("memory", "scratch"), None, True),
    ("file:///data/run", ("file", "/data/run"), "/data/run", True),
    ("/data/run", ("file", "/data/run"), "/data/run", True),
    ("gs://bucket/run", ("gs", "bucket/run"), None, False),
])
def test_a_uri_is_taken_apart_once(uri, parts, local, one_node):
    assert split_uri(uri) == parts
    assert local_path(uri) == (None if local is None else pathlib.Path(local).resolve())
    assert node_local(uri) is one_node


def test_a_relative_path_is_a_local_folder_resolved_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert split_uri("runs/a") == ("file", "runs/a")
    assert local_path("runs/a") == local_path("file://runs/a") == tmp_path.resolve() / "runs" / "a"
    assert Storage("runs/a").root == Storage("file://runs/a").root == os.path.join(str(tmp_path.resolve()), "runs", "a")


def test_storage_refuses_a_scheme_it_has_no_backend_for():
    with pytest.raises(ValueError, match=r"^'gs://bucket/run': unsupported storage scheme 'gs'; use one of file, s3, memory$"):
        Storage("gs://bucket/run")
