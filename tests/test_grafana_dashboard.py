"""``docs/grafana/raycheck.json``: every PromQL expression parses and names only series the controller
emits (``orchestrator.metrics.SERIES``), and the panels the issue asks for are there. Pure, no Ray."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from raycheck.orchestrator.metrics import SERIES, prometheus_names

DASHBOARD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "grafana" / "raycheck.json"

FUNCTIONS = {"rate", "irate", "increase", "delta", "sum", "max", "min", "avg", "count", "topk", "last_over_time",
             "max_over_time", "clamp_min"}
"""The PromQL functions and aggregations the dashboard may use."""
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
TOKEN = re.compile(r'\s+|"(?:[^"\\]|\\.)*"|\$\{?\w+\}?|\{\{|\}\}|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?[smhdwy]?'
                   r"|=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>]")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small parser: tokens, balanced brackets, label
    matchers, ranges and grouping labels skipped, functions and keywords told from names).

    Raises:
        ValueError: a character no token matches, unbalanced brackets, or an unknown function.
    """
    tokens, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot parse {expr!r} at {expr[pos:]!r}")
        tokens += [] if m.group().isspace() else [m.group()]
        pos = m.end()
    names, stack = set(), []  # open brackets; "g" for the parenthesis of a grouping (by, on, ...)
    for i, tok in enumerate(tokens):
        before, after = tokens[i - 1] if i else "", tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in "({[":
            stack.append("g" if tok == "(" and before in KEYWORDS else tok)
        elif tok in ")}]":
            if not stack or {"g": ")", "(": ")", "{": "}", "[": "]"}[stack.pop()] != tok:
                raise ValueError(f"unbalanced {tok!r} in {expr!r}")
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok) and stack[-1:] not in (["{"], ["g"]) and tok not in KEYWORDS:
            if tok in FUNCTIONS and after in ("(", "by", "without"):  # a call, or an aggregation's grouping first
                continue
            if after == "(":
                raise ValueError(f"unknown function {tok!r} in {expr!r}")
            names.add(tok)
    if stack:
        raise ValueError(f"unclosed bracket in {expr!r}")
    return names


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL query of the dashboard: each panel target's ``expr`` and the series of each query
    variable (Grafana's ``label_values(SERIES, LABEL)``)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
            assert m, f"variable {v['name']}: {v['query']!r} is not label_values(SERIES, LABEL)"
            exprs.append(m.group(1))
    return exprs


def test_the_parser_finds_names_and_refuses_what_it_cannot_read():
    assert metric_names('sum by (target) (increase(ray_a_total{run=~"$run", x!="}"}[5m])) / ray_b') == {"ray_a_total", "ray_b"}
    assert metric_names("sum without (a, b) (ray_c) > on (a) group_left ray_d") == {"ray_c", "ray_d"}
    for bad in ("rate(ray_a[1m]", "ray_a}", "nosuchfn(ray_a)", "ray_a # comment", "rate(ray_a[1m)]"):
        with pytest.raises(ValueError):
            metric_names(bad)


def test_every_query_names_only_series_the_controller_emits():
    dashboard = json.loads(DASHBOARD.read_text())
    used = set()
    for expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, f"{expr!r} selects no series"
        assert names <= prometheus_names(), f"{expr!r} names {sorted(names - prometheus_names())}, not emitted"
        used |= names
    # the panels the dashboard is for: checkpoint stall, shadow lag, snapshot age, recovery breakdown
    assert {"ray_raycheck_checkpoint_stall_seconds_total", "ray_raycheck_shadow_lag_steps", "ray_raycheck_snapshot_age_steps",
            "ray_raycheck_recovery_component_seconds"} <= used
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_prometheus_names_follow_rays_export():
    """Ray exports ``raycheck_x`` as ``ray_raycheck_x``, a counter with ``_total`` (what the end-to-end
    test scrapes)."""
    kinds = {s.name: s.kind for s in SERIES}
    assert kinds["raycheck_steps"] == "counter" and "ray_raycheck_steps_total" in prometheus_names()
    assert kinds["raycheck_shadow_lag_steps"] == "gauge" and "ray_raycheck_shadow_lag_steps" in prometheus_names()
