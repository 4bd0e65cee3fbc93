"""Worker of ``tests/test_grad_cache.py``'s check of :func:`hf_infcl.chunk_graphs.average_gradients`:
``torchrun --nproc_per_node 2 tests/helpers/average_gradients_worker.py`` (gloo).

Every rank makes the same parameters (fp32 and bf16, one without a gradient, one frozen) with
gradients drawn from its own seed, averages them in buckets small enough that there are several,
and compares with the mean of every rank's draws in float64. Then the ranks disagree on which
parameter has a gradient: each must raise the same ValueError, and none may hang.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl import chunk_graphs  # noqa: E402
from tests.helpers.trainer_fixtures import end_worker_process  # noqa: E402

SHAPES = [((7, 5), torch.float32), ((300,), torch.float32), ((4, 4), torch.bfloat16), ((3,), torch.float32),
          ((9, 2), torch.float32)]
NO_GRADIENT, FROZEN = 3, 4


def parameters_of(rank: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(100 + rank)
    params = []
    for index, (shape, dtype) in enumerate(SHAPES):
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=index != FROZEN)
        if index not in (NO_GRADIENT, FROZEN):
            param.grad = torch.randn(shape, generator=generator).to(dtype)
        params.append(param)
    return params


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    chunk_graphs._BUCKET_BYTES = 1200  # several buckets: the 300 floats alone, the others together
    params = parameters_of(rank)
    chunk_graphs.average_gradients(params)
    every_rank = [parameters_of(other) for other in range(world)]
    for index, param in enumerate(params):
        if index in (NO_GRADIENT, FROZEN):
            assert param.grad is None, index
            continue
        expected = sum(ranks[index].grad.double() for ranks in every_rank) / world
        tolerance = 1e-2 if param.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(param.grad.double(), expected, rtol=tolerance, atol=tolerance)
        assert param.grad.dtype == param.dtype

    disagreeing = parameters_of(rank)
    if rank == 1:
        disagreeing[0].grad = None
    try:
        chunk_graphs.average_gradients(disagreeing)
    except ValueError as error:
        assert "the ranks disagree on which parameters have a gradient" in str(error), error
    else:
        raise AssertionError(f"rank {rank}: no error for ranks that disagree")
    dist.barrier()
    print(f"rank {rank}: OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_worker_process()
