"""The SMon worker heatmap: one cell per worker, x = DP rank, y = PP rank, colour = worker slowdown.

The colour range is fixed (1.0 to 1.5, like SMon's) so that two runs' heatmaps compare; patterns read as:
one hot cell = a worker issue, a hot last row = stage imbalance, scattered heat = sequence-length variance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VMIN, VMAX = 1.0, 1.5
ANNOTATE_MAX_CELLS = 256


def hottest(matrix: np.ndarray) -> tuple[int, int]:
    """(dp_rank, pp_rank) of the slowest worker in a [PP, DP] matrix."""
    p, d = np.unravel_index(int(np.argmax(matrix)), matrix.shape)
    return int(d), int(p)


def write_png(matrix: np.ndarray, path: str | Path, title: str = "") -> None:
    """Render a [PP, DP] matrix of worker slowdowns as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    pp, dp = matrix.shape
    width = min(2.0 + 0.45 * dp, 24.0)
    height = min(1.6 + 0.4 * pp, 16.0)
    fig = Figure(figsize=(width, height), dpi=100)
    ax = fig.add_subplot()
    im = ax.imshow(matrix, cmap="Reds", vmin=VMIN, vmax=VMAX, aspect="auto", interpolation="nearest")
    ax.set_xlabel("DP rank")
    ax.set_ylabel("PP rank")
    if dp <= 32:
        ax.set_xticks(range(dp))
    if pp <= 32:
        ax.set_yticks(range(pp))
    if dp * pp <= ANNOTATE_MAX_CELLS:
        for p in range(pp):
            for d in range(dp):
                v = float(matrix[p, d])
                ax.text(d, p, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if v > VMIN + 0.6 * (VMAX - VMIN) else "black")
    fig.colorbar(im, ax=ax, label="worker slowdown")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
