"""Shared test configuration: GPU tests skip cleanly on machines without CUDA, and each test process
tunes into a tuning store of its own."""

import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    # The tuning store lets one process of a machine tune a key while the others wait on its file
    # lock. pytest-xdist workers on one GPU each need many different keys, so with one shared store
    # they would tune one after the other; a store per process (and none of the user's) keeps them
    # concurrent, as they were before the store existed. Tests of the store set their own.
    os.environ["HF_INFCL_CACHE"] = tempfile.mkdtemp(prefix="hf_infcl_test_store_")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
