"""Mutation score per mutated file, from ``mutmut results --all true`` on standard input (``make mutate``).

A mutant counts as killed when a test failed on it or it timed out (the mutant looped); the score is
killed over the mutants checked, so a mutant that no selected test reaches ("no tests") counts against
it, and one left "not checked" (``make mutate MUTANTS=...`` ran others) is shown but not counted.
Prints one line per file and the total, then the surviving mutants (``mutmut show NAME`` shows each).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "caught by type check"}
UNCHECKED = "not checked"


def main() -> None:
    by_module: dict[str, Counter] = defaultdict(Counter)
    survivors = []
    for line in sys.stdin:
        name, sep, status = line.strip().rpartition(": ")
        if not sep or "__mutmut_" not in name:
            continue
        module = name.rsplit(".", 1)[0]  # "raycheck.training.zo.x_derive_seed__mutmut_3" -> "raycheck.training.zo"
        by_module[module][status] += 1
        if status not in KILLED and status != UNCHECKED:
            survivors.append(f"{name}: {status}")
    total: Counter = sum(by_module.values(), Counter())
    for module, counts in [*sorted(by_module.items()), ("total", total)]:
        killed = sum(counts[s] for s in KILLED)
        n = sum(counts.values()) - counts[UNCHECKED]
        others = ", ".join(f"{s} {c}" for s, c in sorted(counts.items()) if s not in KILLED)
        print(f"{module:<28} {killed:>4} / {n:<4} killed = {100 * killed / max(n, 1):5.1f}%   {others}")
    print("\nnot killed:", *survivors, sep="\n  ")


if __name__ == "__main__":
    main()
