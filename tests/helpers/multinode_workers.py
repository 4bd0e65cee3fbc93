"""Worker of the two-node test (``tests/test_multinode.py``): one process of two torchrun launches
of 2 processes each, ``--nnodes 2 --node_rank {0,1}``, over gloo on this machine.

Each process records how the launch numbered it (RANK, LOCAL_RANK, GROUP_RANK, and the ranks that
torch.distributed and Accelerate give it), runs the DDP ring steps of
``tests/helpers/ring_workers.py`` that have a four-process split and the Trainer runs of
``tests/helpers/trainer_workers.py`` in the same process group, and writes its numbering and ring
results to ``OUT/rank{RANK}.pt``. Nothing is asserted here beyond what those helpers assert: the test judges.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers import ring_workers, trainer_workers  # noqa: E402
from tests.helpers.trainer_fixtures import end_worker_process  # noqa: E402

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    scenarios = {name: ring_workers.run_scenario(name, scenario, rank, world_size)
                 for name, scenario in ring_workers.SCENARIOS.items() if world_size in scenario.rows}
    trainer_workers.main(out_dir)
    from accelerate import PartialState

    state = PartialState()  # after the Trainer: the state its Accelerator set up and shares
    launch = {name: int(os.environ[name]) for name in LAUNCH_VARIABLES}
    launch.update(dist_rank=rank, dist_world_size=world_size, process_index=state.process_index,
                  local_process_index=state.local_process_index, num_processes=state.num_processes)
    torch.save({"launch": launch, "scenarios": scenarios}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank's file is written before any process of the job ends


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
