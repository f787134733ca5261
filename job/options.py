"""``raycheck run``'s options, described where the fields they fill are declared: each field of ``JobConfig`` (and
of its components) that has an option carries an ``Opt`` in its metadata, ``field(default=..., metadata=opt(...))``:
the option's name, help, ``--help`` section, unit, range and the function that turns its value into the field's.
``cli.main`` builds the options of ``raycheck run`` from them, with the fields' own defaults: no default is written
twice. A component declared below ``job`` (``policies.layerwise.LayerwiseConfig``) gives the same description as a
plain dict under the key ``OPTION`` (``Opt``'s fields by name).

Also the parse functions those options use (``parse_duration``, ``parse_env``, ...), which the command line
shares."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from raycheck.storage.backend import local_path, split_uri

SECTIONS = ("Run", "Data and task", "Zeroth-order (MeZO)", "First-order", "Failures and restarts",
            "Snapshots, step log and storage", "Shadow and placement")
"""``raycheck run --help``'s sections, in order: what most runs set first."""

OPTION = "raycheck.option"
"""The field metadata key of a field's ``Opt``."""


@dataclass(frozen=True, kw_only=True)
class Opt:
    """How a configuration field is set on ``raycheck run``'s command line.

    Attributes:
        name: the option, ``--layer-threshold`` (its parameter name: ``layer_threshold``).
        help: the ``--help`` text.
        section: its ``--help`` section, one of ``SECTIONS``.
        unit: the unit of the field's value (``s``, ``steps``, ``bytes``), where it has one.
        min, max: the option's range (click checks it), where it has one.
        type: the option's type where it is not the field's (``str`` for ``--mtbf 1h``, ``list[str]`` for a
            repeatable option).
        parse: turns the option's value into the field's (None: the value as it is).
        show: turns the field's default into the option's (the inverse of ``parse``; None: as it is).
        metavar: what ``--help`` shows for the value (``STEP[:TARGET[:HOW]]``, ``zo|fo``); empty: from the unit
            or the type (``metavar_of``).
    """

    name: str
    help: str
    section: str
    unit: str = ""
    min: float | None = None
    max: float | None = None
    type: Any = None
    parse: Callable[[Any], Any] | None = None
    show: Callable[[Any], Any] | None = None
    metavar: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", self.name):
            raise ValueError(f"option {self.name!r}: expected --lowercase-words")
        if self.section not in SECTIONS:
            raise ValueError(f"option {self.name}: section {self.section!r} is not one of {', '.join(SECTIONS)}")

    @property
    def parameter(self) -> str:
        """The option's parameter name (``--layer-threshold``: ``layer_threshold``)."""
        return self.name[2:].replace("-", "_")


UNIT_METAVARS = {"s": "SECONDS", "steps": "STEPS", "bytes": "BYTES", "examples": "N", "tokens": "TOKENS"}
"""The value's name in ``--help`` for an option with a unit and no ``metavar`` of its own."""


def metavar_of(option: Opt, kind: Any) -> str:
    """What ``--help`` shows for ``option``'s value: its ``metavar``, else its unit's name (``UNIT_METAVARS``),
    else its type's (``kind``: ``int`` N, ``float`` NUMBER, anything else TEXT)."""
    if option.metavar:
        return option.metavar
    if option.unit in UNIT_METAVARS:
        return UNIT_METAVARS[option.unit]
    return {int: "N", float: "NUMBER"}.get(kind, "TEXT")


def opt(name: str, section: str, *, help: str, **more: Any) -> dict[str, Opt]:
    """The metadata of a field set by the option ``name``, listed under ``section`` (``Opt``'s fields)."""
    return {OPTION: Opt(name=name, help=help, section=section, **more)}


def option_of(spec: dataclasses.Field[Any]) -> Opt | None:
    """The ``Opt`` of the dataclass field ``spec``; None for a field that no option sets."""
    meta = spec.metadata.get(OPTION)
    if meta is None or isinstance(meta, Opt):
        return meta
    if isinstance(meta, Mapping):
        return Opt(**meta)
    raise TypeError(f"field {spec.name}: metadata {OPTION} must be an Opt or a dict of its fields, got {type(meta).__name__}")


UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_ZERO = re.compile(r"^\s*(0+(\.0*)?|\.0+)\s*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]+)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in a duration with a unit: ``1.2s``, ``250ms``, ``5min``, ``3h``, ``2d``, ``80us``; or a
    bare ``0`` (zero in any unit).

    Raises:
        ValueError: no number, no unit (on a number other than 0), or an unknown unit; the message lists the units.
    """
    if _ZERO.match(text):
        return 0.0
    match = _DURATION.match(text.lower())
    if not match or match.group(3) not in UNITS_S:
        raise ValueError(f"{text!r} is not a duration: write a number and a unit, e.g. 1.2s, 250ms, 5min, 3h, 2d "
                         f"(units: {', '.join(UNITS_S)})")
    number, exponent, unit = match.groups()
    try:
        seconds = float(number) * 10.0 ** int(exponent or 0) * UNITS_S[unit]
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is too large a duration")
    return seconds


def duration_text(seconds: float) -> str:
    """``seconds`` as ``parse_duration`` reads it back: whole hours in ``h`` (``1h``), else seconds (``60s``)."""
    return f"{seconds / 3600:g}h" if seconds and seconds % 3600 == 0 else f"{seconds:g}s"


def parse_env(pairs: list[str], option: str = "--shadow-env") -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict. Raises ``ValueError`` naming ``option`` for one without ``=``."""
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"{option} {bad[0]!r}: expected KEY=VALUE, e.g. ATEN_CPU_CAPABILITY=default")
    return dict(p.split("=", 1) for p in pairs)


def env_pairs(env: dict[str, str]) -> list[str]:
    """``parse_env``'s inverse: ``["KEY=VALUE", ...]``."""
    return [f"{key}={value}" for key, value in env.items()]


def absolute(path: str | pathlib.Path) -> str:
    """A path made absolute; empty stays empty (no file)."""
    return str(pathlib.Path(path).resolve()) if str(path) else ""


def storage_uri(uri: str) -> str:
    """A local path made absolute; URIs as given; empty stays empty (the default storage).

    Raises:
        ValueError: a URI with nothing after its scheme (``s3://``, ``file://``), or a path that reads as a URI
            with a slash missing (``s3:/bucket``: it would be a local folder named ``s3:``).
    """
    scheme, rest = split_uri(uri)
    if uri and "://" in uri and not rest.strip("/"):
        raise ValueError(f"{uri!r} names no {'bucket' if scheme == 's3' else 'folder'}: e.g. s3://BUCKET/PREFIX or file:///ABSOLUTE/PATH")
    typo = re.match(r"^([a-z][a-z0-9+.-]*):/(?!/)", uri)
    if typo:
        raise ValueError(f"{uri!r} reads as a local folder named {typo.group(1)}:; did you mean {typo.group(1)}://{uri[typo.end():]}?")
    folder = local_path(uri) if uri else None
    return uri if folder is None else str(folder)


def endpoint_options(endpoint: str) -> dict[str, str]:
    """``--s3-endpoint URL`` as ``StorageConfig.options``: ``{"endpoint_url": URL}``; empty: none."""
    return {"endpoint_url": endpoint} if endpoint else {}


def endpoint_of(options: dict[str, Any]) -> str:
    """``endpoint_options``' inverse: the endpoint URL in ``options``, or empty."""
    return str(options.get("endpoint_url", ""))


def typed_newlines(text: str) -> str:
    """``\\n`` typed on the command line (backslash, n) as a newline."""
    return text.replace("\\n", "\n")


def shown_newlines(text: str) -> str:
    """``typed_newlines``' inverse: a newline as ``\\n``, as it is typed (click's help would show a space)."""
    return text.replace("\n", "\\n")
