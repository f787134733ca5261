"""Measurement: the residue of MeZO's perturbation round trip (+eps z, -2 eps z, +eps z) per dtype.

For each model and parameter dtype (``training.zo.DTYPES``): load the real weights in that dtype
(``training.model.load_model``; the float32 weights rounded once to nearest-even), apply one step's
round trip with ``training.zo.perturb_`` and no update, and compare every element with its starting
bits: the fraction of elements not back to them, and the max and mean absolute change (over all
elements, in float64, units of the weights). For the half dtypes also the same round trip in torch's
own half-precision arithmetic (``p.add_(z * scale)`` on half tensors: float32 opmath, the product
rounded to the half dtype before the add), as other MeZO code does it, for comparison. Also the
parameters' bytes: all a worker's step holds of them (its z is regenerated in each fused pass, never
held: ``experiments.hotpath_bench`` measures the step's extra memory).

    python -m raycheck.experiments.dtype_residue [--models smollm2-135m tiny] [--eps 1e-3] [--step 0]

Prints a Markdown table (the one in docs/dtypes.md) and returns the rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

import torch

from raycheck.training.model import load_model, trainable_parameters
from raycheck.training.zo import DTYPES, noise, perturb_, step_seed

_BITS = {4: torch.int32, 2: torch.int16}
"""An integer dtype of each element size, to compare tensors bit for bit (-0.0 is not 0.0 here)."""


def native_perturb_(p: torch.Tensor, z: torch.Tensor, scale: float) -> None:
    """p <- p + z * scale in torch's arithmetic of ``p``'s dtype (for comparison; not raycheck's)."""
    p.add_(z * scale)


def round_trip_residue(params: Mapping[str, torch.Tensor], seed: int, eps: float,
                       perturb: Callable[[torch.Tensor, torch.Tensor, float], None] = perturb_) -> dict:
    """Apply +eps z, -2 eps z, +eps z with ``perturb`` to a copy of each tensor of ``params`` (z of step
    seed ``seed``, ``training.zo.noise``) and compare it with the original.

    Returns ``{"elements", "changed" (elements whose bits differ), "changed_fraction", "max_abs_change",
    "mean_abs_change"}``; the changes are absolute, float64, in the weights' units.
    """
    elements = changed = 0
    total_abs, max_abs = 0.0, 0.0
    for i, p in enumerate(params.values()):
        q, z = p.clone(), noise(seed, i, p)
        for scale in (eps, -2 * eps, eps):
            perturb(q, z, scale)
        bits = _BITS[p.element_size()]
        changed += int((q.view(bits) != p.view(bits)).sum())
        delta = (q.double() - p.double()).abs()
        total_abs += float(delta.sum())
        max_abs = max(max_abs, float(delta.max()))
        elements += p.numel()
    return {"elements": elements, "changed": changed, "changed_fraction": changed / elements,
            "max_abs_change": max_abs, "mean_abs_change": total_abs / elements}


def step_memory_bytes(params: Mapping[str, torch.Tensor]) -> dict:
    """What a worker holds per step: ``parameter_bytes``, the parameters (``workers.zo_session.mezo_step_``
    holds no z: each pass regenerates it, ``training.zo.apply_``)."""
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in params.values())}


def measure(model: str, dtype: str, eps: float, step: int) -> list[dict]:
    """The residue and memory rows of ``model`` in ``dtype``: raycheck's arithmetic, and for a half
    dtype torch's own too."""
    params = trainable_parameters(load_model(model, dtype=dtype))
    kinds = {"raycheck": perturb_, **({"torch half ops": native_perturb_} if dtype != "float32" else {})}
    return [{"model": model, "dtype": dtype, "arithmetic": kind, "eps": eps,
             **round_trip_residue(params, step_seed(0, step), eps, perturb), **step_memory_bytes(params)}
            for kind, perturb in kinds.items()]


def table(rows: list[dict]) -> str:
    """``rows`` as a Markdown table."""
    lines = ["| model | dtype | arithmetic | elements | not back to their bits | max abs change | mean abs change | parameters |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['arithmetic']} | {r['elements']:,} | {r['changed_fraction']:.2%} ({r['changed']:,}) | "
                     f"{r['max_abs_change']:.3g} | {r['mean_abs_change']:.3g} | {r['parameter_bytes'] / 2**20:,.1f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny"])
    ap.add_argument("--eps", type=float, default=1e-3, help="perturbation scale (MeZO's and raycheck's default 1e-3)")
    ap.add_argument("--step", type=int, default=0, help="the step whose z is used (run seed 0)")
    args = ap.parse_args(argv)
    rows = [row for model in args.models for dtype in DTYPES for row in measure(model, dtype, args.eps, args.step)]
    print(f"round trip +eps z, -2 eps z, +eps z (eps = {args.eps:g}, z of step {args.step}, run seed 0), no update:")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
