"""The figures (matplotlib, the optional extra `plot`): validation accuracy against Cumulative Time, images/sec
per epoch, the time profile and a topology diagram per configuration, as PNGs next to report.md."""

from dataclasses import dataclass, field
from pathlib import Path

from .logs import Run
from .scaling import profiled, run_stop
from .topology import draw_topology, topology_name

INSTALL_HINT = "pip install matplotlib, or pip install -e '.[plot]'"


def load_matplotlib():
    """(Figure, FigureCanvasAgg), or None when matplotlib is not installed. The Agg canvas is attached to
    each figure directly: no pyplot, no global backend, nothing shown on a screen."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def _save(mpl, fig, path: Path) -> Path:
    mpl[1](fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _legend_name(run: Run) -> str:
    return f"{run.label} ({run.num_nodes}x{run.num_gpus})"


def plot_accuracy(mpl, runs: list[Run], path: Path) -> Path:
    fig = mpl[0](figsize=(7, 4.5))
    ax = fig.add_subplot()
    for run in runs:
        xs = [e["cumulative_time"] for e in run.epochs]
        (line,) = ax.plot(xs, run.accuracies, marker="o", ms=3, label=_legend_name(run))
        stop = run_stop(run)
        if stop is not None:
            star = dict(marker="*", ms=14, color=line.get_color(), linestyle="none")
            ax.plot([xs[stop]], [run.epochs[stop]["val_accuracy"]], **star)
    for target in sorted({r.target for r in runs}):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    times = [e["cumulative_time"] for r in runs for e in r.epochs if e["cumulative_time"] > 0]
    if times and max(times) > 100 * min(times):  # e.g. a GPU run and a CPU run: on a linear axis one is a dot
        ax.set_xscale("log")
        ax.set_xlabel("Cumulative Time (s, training only; log scale)")
    else:
        ax.set_xlim(left=0)
        ax.set_xlabel("Cumulative Time (s, training only)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Validation accuracy against training time (* = stopping criterion met)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(mpl, fig, path)


def plot_throughput(mpl, runs: list[Run], path: Path) -> Path:
    fig = mpl[0](figsize=(7, 4.5))
    ax = fig.add_subplot()
    for run in runs:
        epochs, ips = [e["epoch"] for e in run.epochs], [e["images_per_sec"] for e in run.epochs]
        ax.plot(epochs, ips, marker="o", ms=3, label=_legend_name(run))
    ax.set_xlabel("epoch")
    ax.set_ylabel("images/sec (sum over processes)")
    ax.set_title("Training throughput per epoch")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(mpl, fig, path)


def plot_profile(mpl, runs: list[Run], path: Path) -> Path | None:
    parts, keys = profiled(runs)
    if not parts:
        return None
    fig = mpl[0](figsize=(max(5, 1.3 * len(parts) + 3), 4.5))
    ax = fig.add_subplot()
    x = list(range(len(parts)))
    bottom = [0.0] * len(parts)
    for key in keys:
        heights = [p.get(key, 0.0) for _, p in parts]
        ax.bar(x, heights, bottom=bottom, label=key, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(x, [_legend_name(r) for r, _ in parts], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per epoch (mean)")
    ax.set_title("Where an epoch's time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(mpl, fig, path)


def plot_topology(mpl, num_nodes: int, num_gpus: int, backend: str, device: str, path: Path) -> Path:
    return _save(mpl, draw_topology(mpl[0], num_nodes, num_gpus, backend, device), path)


@dataclass
class Figures:
    """The PNGs written, in order; the topology diagram of each configuration; why none were, if so."""

    written: list[Path] = field(default_factory=list)
    topology: dict[tuple, Path] = field(default_factory=dict)
    skipped: str | None = None

    def has(self, path: Path) -> bool:
        return path in self.written


def draw_figures(runs: list[Run], shown: list[Run], out_dir: Path, wanted: bool) -> Figures:
    """Every figure of the report into out_dir, or none (and why) without matplotlib or when not `wanted`: the
    accuracy, images/sec and profile of the runs `shown` side by side, the topology of each of `runs`."""
    mpl = load_matplotlib() if wanted else None
    if not mpl:
        return Figures(skipped=f"matplotlib is missing ({INSTALL_HINT})" if wanted else "--no-figures was given")
    figures = Figures()
    with_epochs = [r for r in shown if r.epochs]
    if with_epochs:
        figures.written.append(plot_accuracy(mpl, with_epochs, out_dir / "accuracy_vs_time.png"))
        figures.written.append(plot_throughput(mpl, with_epochs, out_dir / "images_per_sec.png"))
    profile_png = plot_profile(mpl, shown, out_dir / "profile.png")
    if profile_png:
        figures.written.append(profile_png)
    for run in runs:
        if run.config not in figures.topology:
            nodes, gpus, backend, device = run.config
            png = plot_topology(mpl, nodes, gpus, str(backend), str(device), out_dir / topology_name(run.config))
            figures.topology[run.config] = png
            figures.written.append(png)
    return figures
