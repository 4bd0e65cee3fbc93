"""Two nodes, simulated on this machine: two torchrun launches of 2 CPU processes each
(``--nnodes 2 --node_rank {0,1}``, one rendezvous on 127.0.0.1, gloo), as a job across two hosts
would start. The ring loss (DDP steps on uneven per-rank batches, float64) and two InfCLTrainer
steps of a tiny CLIP must equal one process on the concatenated batch, and every process must be
numbered as torchrun numbers it (global RANK = node_rank * 2 + LOCAL_RANK) by torch.distributed and
Accelerate alike.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import ring_workers
from tests.helpers.offline import run_nodes
from tests.helpers.trainer_fixtures import one_thread  # noqa: F401  (fixture)
from tests.test_ring import assert_logged_loss_is_the_global_mean, assert_step_matches_one_process
from tests.test_trainer import assert_trainer_runs_match_one_process

NODES, PROCESSES_PER_NODE = 2, 2
WORLD_SIZE = NODES * PROCESSES_PER_NODE
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "multinode_workers.py")
SCENARIOS = sorted(name for name, scenario in ring_workers.SCENARIOS.items() if WORLD_SIZE in scenario.rows)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The folder the two launches wrote (once for the module), and every rank's results."""
    out_dir = tmp_path_factory.mktemp("multinode")
    run_nodes(WORKER, out_dir, nodes=NODES, processes_per_node=PROCESSES_PER_NODE, timeout=300)
    ranks = [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    return out_dir, ranks


def test_every_process_is_numbered_as_the_launch_numbers_it(launched):
    _, ranks = launched
    for rank, result in enumerate(ranks):
        launch = result["launch"]
        node, local = divmod(rank, PROCESSES_PER_NODE)
        assert (launch["RANK"], launch["GROUP_RANK"], launch["LOCAL_RANK"]) == (rank, node, local), launch
        assert (launch["WORLD_SIZE"], launch["LOCAL_WORLD_SIZE"]) == (WORLD_SIZE, PROCESSES_PER_NODE), launch
        assert (launch["dist_rank"], launch["dist_world_size"]) == (rank, WORLD_SIZE), launch
        assert (launch["process_index"], launch["local_process_index"], launch["num_processes"]) == (
            rank, local, WORLD_SIZE), launch


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ring_across_two_nodes_equals_one_process(launched, scenario):
    _, ranks = launched
    assert_step_matches_one_process(ranks, scenario)
    assert_logged_loss_is_the_global_mean(ranks, scenario)


@pytest.mark.usefixtures("one_thread")
def test_trainer_across_two_nodes_equals_one_process(launched):
    out_dir, _ = launched
    assert_trainer_runs_match_one_process(out_dir)
