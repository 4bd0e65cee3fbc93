"""hf_infcl.rng.RngState: the snapshot gradient caching replays dropout from (CPU here; the CUDA
part is torch.utils.checkpoint's own get_device_states / set_device_states)."""

from __future__ import annotations

import torch

from hf_infcl.rng import RngState


def test_restored_block_draws_the_captured_numbers_and_leaves_the_stream_alone():
    torch.manual_seed(0)
    state = RngState.capture(torch.ones(3), "not a tensor")
    first = torch.rand(5)
    dropped = torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)
    after_first = torch.rand(5)  # where the stream stands once the forward has run
    torch.manual_seed(0)
    torch.rand(5)
    torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)
    with state.restored():
        assert torch.equal(torch.rand(5), first)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True), dropped)
    # The replay put the generator back: the next draw is the one an unreplayed run would make.
    assert torch.equal(torch.rand(5), after_first)


def test_restored_twice_repeats_the_same_numbers():
    state = RngState.capture()
    with state.restored():
        once = torch.randn(7)
    with state.restored():
        twice = torch.randn(7)
    assert torch.equal(once, twice)


def test_cpu_tensors_capture_no_device_state():
    state = RngState.capture(torch.zeros(2), torch.zeros(2, dtype=torch.long))
    if not torch.cuda.is_initialized():
        assert state.devices == [] and state.device_states == []


def test_active_dropout_layers_are_those_that_draw_now():
    from hf_infcl.rng import active_dropout_layers

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0),
                                torch.nn.Sequential(torch.nn.AlphaDropout(0.2)))
    assert active_dropout_layers(model) == ["1", "3.0"]  # p = 0 draws nothing
    model[3].eval()
    assert active_dropout_layers(model) == ["1"]
    model.eval()
    assert active_dropout_layers(model) == []
    assert active_dropout_layers(torch.nn.Dropout(0.5)) == [""]
