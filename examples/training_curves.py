"""The training curves a CLIP run leaves beside its checkpoint: ``training_curves.png``, three
panels over optimizer steps (training loss, logit scale, held-out recall@1 and zero-shot
accuracy), which the model card shows.

matplotlib is optional (``pip install matplotlib``); without it the run says so once at its
start and writes no PNG. It is imported only here, with the file-only Agg backend, so that a
run on a machine without a display never opens a window.
"""

from __future__ import annotations

import os

FILE_NAME = "training_curves.png"
INSTALL_HINT = "no training-curves PNG: matplotlib is not installed (pip install matplotlib)"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plotting(log) -> bool:
    """Whether the PNG can be drawn; if not, say so (``log``) before any work."""
    if _pyplot() is None:
        log(f"note: {INSTALL_HINT}")
        return False
    return True


def _held_out_series(history: list[dict]) -> dict[str, tuple[list, list]]:
    """{metric: (steps, values)} of the metrics worth a curve: top-1 and recall@1."""
    series: dict[str, tuple[list, list]] = {}
    for point in history:
        for name, value in point.items():
            if name.endswith(("top1", "recall@1")) and value is not None:
                steps, values = series.setdefault(name, ([], []))
                steps.append(point["step"])
                values.append(value)
    return series


def save_training_curves(curves: list[dict], history: list[dict], output_dir: str, log=print) -> str | None:
    """Draw ``curves`` (``{"step", "loss", "logit_scale", ...}`` at logging steps) and ``history``
    (held-out metrics at evaluation steps) to ``output_dir/training_curves.png``; the file's name,
    or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    figure, (loss_axes, scale_axes, eval_axes) = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    steps = [point["step"] for point in curves]
    marker = "." if len(steps) < 30 else None  # a short run's few points stay visible
    loss_axes.plot(steps, [point["loss"] for point in curves], marker=marker)
    loss_axes.set(title="training loss (global batch)", xlabel="step")
    scale_axes.plot(steps, [point["logit_scale"] for point in curves], color="tab:orange", marker=marker)
    scale_axes.set(title="logit scale", xlabel="step")
    for name, (at, values) in _held_out_series(history).items():
        eval_axes.plot(at, values, marker="o", label=name)
    eval_axes.set(title="held out", xlabel="step", ylim=(0, 1.02))
    if eval_axes.lines:
        eval_axes.legend(fontsize="small", loc="lower right")
    for axes in (loss_axes, scale_axes, eval_axes):
        axes.grid(alpha=0.3)
    path = os.path.join(output_dir, FILE_NAME)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    log(f"training curves: {path}")
    return FILE_NAME
