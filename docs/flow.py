"""Draw docs/img/flow.svg, the picture of raycheck's flow in the README and on the site's home page:
a step's record from the train worker to storage, and the two ways a recovery comes back.
Run ``.venv/bin/python docs/flow.py`` after changing it (the SVG is committed)."""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "img" / "flow.svg"

BOXES = {  # name -> (x, y, title, subtitle)
    "worker": (0.0, 2.0, "train worker", "Ray Train, CPU or GPU:\nthe MeZO step"),
    "keeper": (4.2, 2.0, "log keeper", "driver's node:\nsteplog.bin (fsynced)"),
    "shadow": (8.4, 2.0, "shadow replayer", "CPU actor(s): replay\nthe log, bit for bit"),
    "persister": (12.6, 2.0, "snapshot persister", "writes images\nasynchronously"),
    "storage": (12.6, -1.2, "storage", "disk or S3: shards,\nmanifest, index"),
    "controller": (4.2, 4.3, "controller (the driver)", "injects failures, restarts\nactors, writes summary.json"),
}
W, H = 2.8, 1.3


def main(out: pathlib.Path = OUT) -> None:
    """Draw the picture into ``out`` (its suffix gives the format: ``.svg``, ``.png`` to look at it)."""
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "raycheck", "font.family": "DejaVu Sans"})
    fig, ax = plt.subplots(figsize=(13, 5.4))
    ax.set_xlim(-0.3, 15.7)
    ax.set_ylim(-1.6, 6.3)
    ax.axis("off")
    colours = {"controller": "#e8eaf6", "storage": "#fff3e0"}
    for name, (x, y, title, sub) in BOXES.items():
        ax.add_patch(FancyBboxPatch((x, y), W, H, boxstyle="round,pad=0.05,rounding_size=0.15",
                                    fc=colours.get(name, "#e3f2fd"), ec="#37474f", lw=1.2))
        ax.text(x + W / 2, y + H - 0.32, title, ha="center", va="center", fontsize=11.5, weight="bold", color="#263238")
        ax.text(x + W / 2, y + 0.42, sub, ha="center", va="center", fontsize=9, color="#37474f")

    def arrow(a: tuple[float, float], b: tuple[float, float], dashed: bool = False, colour: str = "#1565c0",
              rad: float = 0.0, lw: float = 1.6) -> None:
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=15, lw=lw, color=colour,
                                     linestyle="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))

    def label(x: float, y: float, text: str, colour: str = "#1565c0", **kw) -> None:
        ax.text(x, y, text, ha="center", va="bottom", color=colour, **{"fontsize": 9, **kw})

    mid = 2.0 + H / 2
    for a, b, text in (("worker", "keeper", "1. step record\n(84 bytes)\nbefore the update"),
                       ("keeper", "shadow", "2. records,\nin order"),
                       ("shadow", "persister", "3. recovery\nimages")):
        x0, x1 = BOXES[a][0] + W + 0.08, BOXES[b][0] - 0.08
        arrow((x0, mid), (x1, mid))
        label((x0 + x1) / 2, mid + 0.12, text)
    x = 12.6 + W / 2
    arrow((x, 1.92), (x, -1.2 + H + 0.08))
    ax.text(x + 0.15, 0.75, "4. commit: shards,\nmanifest last,\nthen the index", ha="left", va="center", fontsize=9, color="#1565c0")
    red = "#c62828"
    arrow((8.4 + 0.6, 1.92), (W - 0.4, 1.92), dashed=True, colour=red, rad=-0.22)
    label(7.1, 1.25, "a", red, weight="bold", fontsize=11)
    arrow((12.55, -1.2 + H / 2), (0.6, 1.92), dashed=True, colour=red, rad=-0.08)
    label(9.6, -0.55, "b", red, weight="bold", fontsize=11)
    ax.text(0.0, -1.05, "After a failure the worker restores the freshest complete state:\n"
            "(a) the live shadow's image, through Ray's object store; else\n"
            "(b) the newest verified snapshot from storage, plus the log tail.", ha="left", va="center", fontsize=9.5,
            color=red)
    for target in ("worker", "shadow", "persister"):
        bx, by = BOXES[target][:2]
        ax.add_patch(FancyArrowPatch((4.2 + W / 2, 4.25), (bx + W / 2, by + H + 0.08), arrowstyle="-|>", mutation_scale=10,
                                     lw=0.9, color="#78909c", linestyle=":"))
    ax.text(7.7, 6.0, "Training never waits for a checkpoint; nothing that was logged is lost.", ha="center",
            fontsize=11, style="italic", color="#263238")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", dpi=110, metadata={"Date": None} if out.suffix == ".svg" else {})
    plt.close(fig)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
