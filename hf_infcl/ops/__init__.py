"""Numerics of the loss, with no Hugging Face imports: the reference, the tiled PyTorch block
ops, the fused Triton block ops (the :mod:`hf_infcl.ops.triton` folder, which alone imports
Triton), and the one autograd Function that drives them over a schedule of key blocks (one block
in one process, travelling blocks in a ring), and the label smoothing terms computed beside
them from the mean key and query."""

import sys


def reset_autotuning() -> None:
    """Forget the Triton kernels' autotuned configurations: the next call of each kernel tunes
    afresh (a benchmark sweeping problem sizes tunes each for itself). Nothing to do, and Triton
    is not imported, when the kernels have not been loaded yet."""
    from . import warm_start

    warm_start.wait()  # its thread may be importing the launch module right now, half initialised
    launch = sys.modules.get(__name__ + ".triton.launch")
    if launch is not None:
        launch.reset_autotuning()


__all__ = ["reset_autotuning"]
