"""Loss curves with matplotlib (optional: without it the plots are skipped with a note)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: pip install matplotlib to get them")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> Path | None:
    """Training loss (left) and validation loss (right) against tokens, one line per run.

    `runs` maps a run name to its metrics records (`read_metrics`).
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        train = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None]
        val = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        line = ax_train.plot(*zip(*train), label=name, linewidth=1.2)[0] if train else None
        if val:
            ax_val.plot(*zip(*val), marker="o", markersize=3, label=name,
                        color=line.get_color() if line else None)
    for ax, ylabel in ((ax_train, "training loss"), (ax_val, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_train.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
