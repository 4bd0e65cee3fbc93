"""The Triton route: fused kernels beside their launchers, and the block ops built on them.

Importing this package imports Triton (an ImportError where it is not installed); nothing
outside it does, so ``import hf_infcl`` and the torch backends work without Triton.

- :mod:`.blocks`: :class:`TritonBlocks`, the block ops of :mod:`hf_infcl.ops.spec`;
- :mod:`.super_tiles`: the backward's walk over super-tiles, and the routes that write each
  one's G;
- the kernels with their launchers: :mod:`.stats` (the forward's statistics and their merge),
  :mod:`.grad_tile` (the backward's G), :mod:`.sigmoid_from_dots` and :mod:`.gluon_sigmoid`
  (the sigmoid loss's one pass), :mod:`.combine_rows` (the epilogues), :mod:`.distillation`
  (in-batch distillation's statistics and G), :mod:`.left_out` (the guided score filter's
  left-out entries), :mod:`.matryoshka` (Matryoshka's prefixes in one pass, opt-in);
- :mod:`.jit_math`: the @triton.jit helpers they share; :mod:`.device`: device queries;
- :mod:`.launch`: autotuned launches, with :mod:`.tuning_store` keeping the choices on disk.
"""

from .blocks import TritonBlocks

__all__ = ["TritonBlocks"]
