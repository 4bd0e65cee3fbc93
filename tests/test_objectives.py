"""Several positives per row and false negatives by score (docs/contract.md) through the public loss:
every backend against the float64 oracle of tests/helpers/oracle_objectives.py on fresh random inputs, the
value and every gradient (queries, keys, scale, bias); bf16 gradients against float64; the Trainer;
and the errors.

The Triton kernels run the same cases under the interpreter in tests/helpers/triton_interpreted.py, and the
ring over gloo in tests/test_ring.py.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import hf_infcl
from hf_infcl import TorchTiles, contrastive_loss
from tests.helpers.oracle_objectives import objective_gradients

# Small tiles, so that every mask and every group crosses tile borders in both directions.
SMALL_TILES = TorchTiles(tile_rows=3, tile_keys=4)
BACKENDS = {"reference": "reference", "torch": SMALL_TILES, "torch-op": "torch"}
LOSSES = {"softmax-sym": dict(loss="softmax", symmetric=True),
          "softmax-asym": dict(loss="softmax", symmetric=False),
          "sigmoid": dict(loss="sigmoid", symmetric=False)}
MODES = [None, "any", "each"]
# name: (margin, strategy, guide width or None). Margins are of the dot products' size (a few units
# for the features below), so each leaves some keys out; negative ones only those above the positive.
FILTERS = {
    "nofilter": (None, "absolute", None),
    "absolute": (0.4, "absolute", None),
    "relative": (0.3, "relative", None),
    "negative": (-0.5, "absolute", None),
    "guide-absolute": (0.2, "absolute", 6),
    "guide-relative": (-0.2, "relative", 3),
}


def make_case(m, k, c, *, seed, groups=True, n_groups=None, distinct_positives=True, guide_width=None):
    """Fresh random float64 features, a positive scale and bias, positives a permutation of keys
    (distinct unless asked), groups with several rows and keys each (ids also beyond the rows', so
    some keys are nobody's group), and guide embeddings of their own width (unrelated to the
    features, so that the guide leaves out other keys than the model's own scores would)."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(m, c, generator=gen, dtype=torch.float64)
    keys = torch.randn(k, c, generator=gen, dtype=torch.float64)
    if distinct_positives:
        positives = torch.randperm(k, generator=gen)[:m]
    else:
        positives = torch.randint(0, k, (m,), generator=gen)
    keys[positives] += 0.3 * queries  # positives more similar than chance, as in a trained model
    # logits of a few units: the sigmoid's and softmax's gradients far from saturation, where their
    # float64 cancellations (sigmoid(z) - 1) stay below the tolerance
    case = dict(queries=queries, keys=keys, scale=float(torch.empty(()).uniform_(0.3, 1.0, generator=gen)),
                bias=float(torch.empty(()).uniform_(-3.0, 0.5, generator=gen)), positives=positives)
    if groups:
        n_groups = n_groups or max(2, m // 3)
        case["query_groups"] = torch.randint(0, n_groups, (m,), generator=gen)
        case["key_groups"] = torch.randint(0, n_groups + 2, (k,), generator=gen)
    if guide_width is not None:
        case["guide_queries"] = torch.randn(m, guide_width, generator=gen, dtype=torch.float64)
        case["guide_keys"] = torch.randn(k, guide_width, generator=gen, dtype=torch.float64)
    return case


def options_of(case, loss, symmetric, mode, margin, strategy, reduction):
    options = dict(loss=loss, symmetric=symmetric, positives=case["positives"],
                   query_groups=case.get("query_groups"), key_groups=case.get("key_groups"),
                   group_positives=mode, false_negative_margin=margin, false_negative_strategy=strategy,
                   guide_queries=case.get("guide_queries"), guide_keys=case.get("guide_keys"),
                   reduction=reduction)
    return options


def run_backend(case, backend, dtype=torch.float64, **options):
    """Value and gradients (of the sum for "none") of queries, keys, scale and bias, as float64 NumPy."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q = case["queries"].to(dtype, copy=True).requires_grad_(True)
    k = case["keys"].to(dtype, copy=True).requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=acc, requires_grad=True)
    bias = torch.tensor(case["bias"], dtype=acc, requires_grad=True)
    guides = {name: options[name].to(dtype) for name in ("guide_queries", "guide_keys")
              if options.get(name) is not None}
    value = contrastive_loss(q, k, scale, bias if options["loss"] == "sigmoid" else None,
                             backend=backend, **{**options, **guides})
    total = value.sum()
    grads = torch.autograd.grad(total, [q, k, scale] + ([bias] if options["loss"] == "sigmoid" else []))
    named = dict(zip(["queries", "keys", "scale", "bias"], (g.double().numpy() for g in grads)))
    named.setdefault("bias", np.float64(0.0))
    detached = value.detach().double().numpy()
    return (detached if detached.ndim else float(detached)), named


def run_oracle(case, **options):
    bias = case["bias"] if options["loss"] == "sigmoid" else None
    return objective_gradients(case["queries"], case["keys"], case["scale"], bias, **options)


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def errors_against_oracle(case, backend, dtype=torch.float64, oracle_case=None, **options):
    value, grads = run_backend(case, backend, dtype, **options)
    expected_value, expected_grads = run_oracle(oracle_case or case, **options)
    errors = {"loss": relative_error(value, expected_value)}
    for name in ("queries", "keys", "scale", "bias"):
        if options["loss"] == "softmax" and name == "bias":
            continue  # no bias given to the softmax loss: both are 0
        errors[name] = relative_error(grads[name], expected_grads[name])
    return errors


def filtered_entries(case, margin, strategy):
    """How many entries the score filter leaves out of the rows' statistics (the oracle's rule),
    so that a test can show it is not vacuous."""
    from tests.helpers.oracle_objectives import objective_masks

    if margin is None:
        return 0
    if "guide_queries" in case:
        scores = case["guide_queries"] @ case["guide_keys"].T
    else:
        scores = case["queries"] @ case["keys"].T
    masks = objective_masks(scores, case["positives"], margin=margin, strategy=strategy)
    return int((~masks.allowed).sum())


CASES = list(itertools.product(BACKENDS, LOSSES, MODES, FILTERS))


@pytest.mark.parametrize("backend,loss_name,mode,filter_name", CASES,
                         ids=[f"{b}-{lo}-{mo}-{f}" for b, lo, mo, f in CASES])
def test_matches_the_float64_oracle(backend, loss_name, mode, filter_name):
    """Every mode x filter x loss on each backend: value and every gradient to 1e-10, on a case with
    extra keys, permuted positives and groups that hold several rows and keys (None: groups leave
    keys out, as today); reductions cycle through mean, sum and none."""
    margin, strategy, guide_width = FILTERS[filter_name]
    seed = random.randrange(2**31)
    shape = [(7, 11, 5), (10, 10, 3), (5, 13, 4)][seed % 3]
    case = make_case(*shape, seed=seed, guide_width=guide_width)
    for _ in range(20):  # a case where the filter leaves something out (nearly every draw)
        if margin is None or filtered_entries(case, margin, strategy) > 0:
            break
        seed += 1
        case = make_case(*shape, seed=seed, guide_width=guide_width)
    if margin is not None:
        assert filtered_entries(case, margin, strategy) > 0, "the filter left nothing out: a vacuous case"
    reduction = ["mean", "sum", "none"][CASES.index((backend, loss_name, mode, filter_name)) % 3]
    options = options_of(case, **LOSSES[loss_name], mode=mode, margin=margin, strategy=strategy,
                         reduction=reduction)
    errors = errors_against_oracle(case, BACKENDS[backend], **options)
    assert max(errors.values()) < 1e-10, (seed, errors)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("loss_name", ["softmax-asym", "sigmoid"])
@pytest.mark.parametrize("mode", MODES)
def test_rows_sharing_a_positive_key(backend, loss_name, mode):
    """Two rows with the same positive key (allowed wherever one column threshold per key is not
    needed): each other's positives in "any"/"each", and the filter with a guide on top."""
    seed = random.randrange(2**31)
    case = make_case(9, 12, 4, seed=seed, distinct_positives=False, guide_width=5)
    case["positives"][1] = case["positives"][0]
    options = options_of(case, **LOSSES[loss_name], mode=mode, margin=0.1, strategy="absolute",
                         reduction="none")
    errors = errors_against_oracle(case, BACKENDS[backend], **options)
    assert max(errors.values()) < 1e-10, (seed, errors)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("hardness_mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
@pytest.mark.parametrize("mode", MODES)
def test_with_the_hardness_offset(mode, hardness_mode, symmetric):
    """The offset never touches a positive (with group_positives, none of the row's group) and
    applies to the keys the filter keeps."""
    seed = random.randrange(2**31)
    case = make_case(8, 14, 4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    owners = torch.randint(-1, 8, (14,), generator=gen)
    owners[case["positives"]] = torch.arange(8)
    options = options_of(case, "softmax", symmetric, mode, 0.3, "absolute", "mean")
    options.update(hardness_mode=hardness_mode, hardness_strength=1.5, query_ids=torch.arange(8),
                   key_owners=owners)
    for backend in ("reference", SMALL_TILES):
        errors = errors_against_oracle(case, backend, **options)
        assert max(errors.values()) < 1e-10, (seed, backend, errors)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("mode", ["any", "each"])
def test_singleton_groups_give_todays_loss(loss_name, mode):
    """When each row's group holds its positive alone, "any" and "each" are today's loss: in fp32
    the same numbers to rounding (the one-pair log-sum-exp is the logit itself), values and
    gradients."""
    seed = random.randrange(2**31)
    case = make_case(9, 13, 6, seed=seed, groups=False)
    query_groups = torch.arange(9) * 5
    key_groups = 1000 + torch.arange(13)
    key_groups[case["positives"]] = query_groups
    today = options_of(case, **LOSSES[loss_name], mode=None, margin=None, strategy="absolute",
                       reduction="none")
    grouped = dict(today, query_groups=query_groups, key_groups=key_groups, group_positives=mode)
    today.update(query_groups=None, key_groups=None)
    for backend in ("torch", SMALL_TILES):
        expected = run_backend(case, backend, torch.float32, **today)
        got = run_backend(case, backend, torch.float32, **grouped)
        np.testing.assert_allclose(got[0], expected[0], rtol=2e-6, atol=1e-6)
        for name in ("queries", "keys", "scale", "bias"):
            np.testing.assert_allclose(got[1][name], expected[1][name], rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("filter_name", ["nofilter", "absolute", "guide-absolute"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("mode", ["any", "each"])
def test_bf16_gradients_match_float64(mode, loss_name, filter_name):
    """bf16 features, a CLIP-sized scale (a peaked softmax, where the positive pairs' gradients
    nearly cancel the statistics'), groups of several positives: every gradient within the
    contract's bf16 tolerance of the float64 oracle on the same rounded inputs."""
    margin, strategy, guide_width = FILTERS[filter_name]
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    m, k, c = 48, 96, 32
    queries = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=torch.float64), dim=1)
    positives = torch.randperm(k, generator=gen)[:m]
    query_groups = torch.randint(0, 16, (m,), generator=gen)
    key_groups = torch.randint(0, 20, (k,), generator=gen)
    same = (query_groups[:, None] == key_groups[None, :]).double()
    same[torch.arange(m), positives] = 1.0
    keys = keys + 2.0 * (same.T @ queries)
    keys = torch.nn.functional.normalize(keys, dim=1)  # a trained model: the positives score high
    case = dict(queries=queries.bfloat16().double(), keys=keys.bfloat16().double(), scale=50.0, bias=-8.0,
                positives=positives, query_groups=query_groups, key_groups=key_groups)
    if guide_width is not None:
        for name, rows in (("guide_queries", m), ("guide_keys", k)):
            guide = torch.randn(rows, guide_width, generator=gen, dtype=torch.float64)
            case[name] = guide.bfloat16().double()
    options = options_of(case, **LOSSES[loss_name], mode=mode, margin=0.1 if margin else None,
                         strategy=strategy, reduction="mean")
    errors = errors_against_oracle(case, "torch", torch.bfloat16, **options)
    assert max(errors.values()) < 1e-2, (seed, errors)


def test_the_module_takes_the_options_and_the_guide():
    seed = random.randrange(2**31)
    case = make_case(7, 11, 5, seed=seed, guide_width=4)
    module = hf_infcl.InfCLLoss(case["scale"], group_positives="each", false_negative_margin=0.2,
                                false_negative_strategy="relative", backend=SMALL_TILES)
    assert "group_positives='each'" in repr(module) and "false_negative_margin=0.2" in repr(module)
    value = module(case["queries"], case["keys"], positives=case["positives"],
                   query_groups=case["query_groups"], key_groups=case["key_groups"],
                   guide_queries=case["guide_queries"], guide_keys=case["guide_keys"])
    expected = contrastive_loss(case["queries"], case["keys"], case["scale"], backend="reference",
                                **options_of(case, "softmax", True, "each", 0.2, "relative", "mean"))
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel runs.


def _bad_input_cases():
    q, k = torch.randn(4, 3), torch.randn(6, 3)
    groups = dict(query_groups=torch.arange(4), key_groups=torch.arange(6))
    guide = dict(guide_queries=torch.randn(4, 2), guide_keys=torch.randn(6, 2))
    filtered = dict(false_negative_margin=0.1)
    return {
        "unknown group_positives": (dict(group_positives="all", **groups), ValueError,
                                    "group_positives must be one of"),
        "group_positives without groups": (dict(group_positives="any"), ValueError,
                                           "group_positives='any' needs query_groups and key_groups"),
        "unknown strategy": (dict(false_negative_strategy="share", **filtered), ValueError,
                             "false_negative_strategy must be one of 'absolute', 'relative'"),
        "margin not a number": (dict(false_negative_margin="0.1"), TypeError,
                                "false_negative_margin must be"),
        "margin a bool": (dict(false_negative_margin=True), TypeError, "false_negative_margin must be"),
        "margin nan": (dict(false_negative_margin=float("nan")), ValueError,
                       "false_negative_margin must be finite"),
        "margin inf": (dict(false_negative_margin=float("-inf")), ValueError,
                       "false_negative_margin must be finite"),
        "guide queries alone": (dict(guide_queries=guide["guide_queries"], **filtered), ValueError,
                                "guide_queries was given without guide_keys"),
        "guide keys alone": (dict(guide_keys=guide["guide_keys"], **filtered), ValueError,
                             "guide_keys was given without guide_queries"),
        "guide without margin": (guide, ValueError, "without false_negative_margin"),
        "guide rows": (dict(guide_queries=torch.randn(5, 2), guide_keys=guide["guide_keys"], **filtered),
                       ValueError, "guide_queries has 5 rows but queries has 4"),
        "guide key rows": (dict(guide_queries=guide["guide_queries"], guide_keys=torch.randn(4, 2),
                                **filtered), ValueError, "guide_keys has 4 rows but keys has 6"),
        "guide dtype": (dict(guide_queries=guide["guide_queries"].double(), guide_keys=guide["guide_keys"],
                             **filtered), TypeError, "guide_queries has dtype torch.float64"),
        "guide device": (dict(guide_queries=torch.randn(4, 2, device="meta"), guide_keys=guide["guide_keys"],
                              **filtered), ValueError, "guide_queries is on meta but queries are on cpu"),
        "guide widths": (dict(guide_queries=guide["guide_queries"], guide_keys=torch.randn(6, 3), **filtered),
                         ValueError, "guide_queries have width 2 but guide_keys have width 3"),
        "guide 1-D": (dict(guide_queries=torch.randn(4), guide_keys=guide["guide_keys"], **filtered),
                      ValueError, "guide_queries must be 2-D"),
        "guide integers": (dict(guide_queries=torch.ones(4, 2, dtype=torch.long),
                                guide_keys=guide["guide_keys"], **filtered), TypeError,
                           "guide_queries must be a floating-point tensor"),
        "shared positive key with the symmetric filter": (
            dict(positives=torch.tensor([0, 1, 1, 2]), **filtered), ValueError,
            "two rows share a positive key"),
        "label smoothing with the filter": (dict(label_smoothing=0.1, **filtered), ValueError,
                                            "label_smoothing=0.1 is not defined with false_negative_margin"),
    }, q, k


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(_bad_input_cases()[0]))
def test_bad_input_names_the_argument(case, backend, monkeypatch):
    cases, q, k = _bad_input_cases()
    arguments, error, message = cases[case]

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the argument check")

    monkeypatch.setattr(TorchTiles, "forward_block", no_kernel)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        contrastive_loss(q, k, 2.0, backend=backend, **arguments)


def test_negative_margins_are_valid_and_the_module_checks_its_options():
    q, k = torch.randn(4, 3), torch.randn(6, 3)
    assert torch.isfinite(contrastive_loss(q, k, 2.0, false_negative_margin=-0.1))
    with pytest.raises(ValueError, match="group_positives must be one of 'any', 'each' or None; got 'some'"):
        hf_infcl.InfCLLoss(group_positives="some")
    with pytest.raises(ValueError, match="false_negative_margin must be finite"):
        hf_infcl.InfCLLoss(false_negative_margin=float("inf"))
    with pytest.raises(ValueError, match="label_smoothing=0.1 is not defined with false_negative_margin"):
        hf_infcl.InfCLLoss(false_negative_margin=0.0, label_smoothing=0.1)


# ------------------------------------------------------------------------------------------------
# The Trainer: group_positives with group_column, the filter on the model's own similarities.


def captions_per_image_batch():
    """A CLIP batch of 5 images with 1 to 3 captions each, one row per (image, caption) pair: the
    group id is the image's, so each row's group holds its image's other captions."""
    from tests.helpers.trainer_fixtures import clip_batch

    images = clip_batch(5, seed=4)
    captions = clip_batch(12, seed=5)
    image_of_row = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 4, 4, 1])
    return {"pixel_values": images["pixel_values"][image_of_row], "input_ids": captions["input_ids"],
            "attention_mask": captions["attention_mask"], "group": image_of_row}


@pytest.mark.parametrize("mode", ["any", "each"])
def test_trainer_loss_with_group_positives_and_the_filter(tmp_path, mode):
    """compute_loss with group_column, group_positives and a margin is the float64 reference of the
    model's own embeddings (symmetric: each caption's column has its image's rows as positives)."""
    from hf_infcl import InfCLTrainer
    from tests.helpers.trainer_fixtures import tiny_clip, trainer_arguments

    batch = captions_per_image_batch()
    model = tiny_clip(dropout=0.0).eval()
    args = trainer_arguments(tmp_path, group_column="group", group_positives=mode,
                             false_negative_margin=-0.05)
    trainer = InfCLTrainer(model=model, args=args)
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        out = model(**{name: value for name, value in batch.items() if name != "group"})
        queries, keys = out.image_embeds.double(), out.text_embeds.double()
        scale = model.logit_scale.exp().double()
        groups = batch["group"]

        def reference(**options):
            return contrastive_loss(queries, keys, scale, query_groups=groups, key_groups=groups,
                                    backend="reference", **options)

        expected = reference(group_positives=mode, false_negative_margin=-0.05)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert abs(float(expected) - float(reference())) > 1e-3  # the positives changed the loss


@pytest.mark.parametrize("mode", ["any", "each"])
def test_one_process_counts_the_pairs_before_its_first_kernel_and_lists_them_after(monkeypatch, mode):
    """Listing the pairs needs their number on the host (one synchronisation): counted before the
    statistics are queued and listed after, that synchronisation waits on the count, not on the
    statistics kernel (hf_infcl.ops.key_blocks.SingleBlock). The backward reuses the pairs."""
    from hf_infcl.ops import key_blocks
    from tests.helpers.recording_tiles import RecordingTiles, recorded

    events = []
    monkeypatch.setattr(key_blocks, "count_pairs", recorded(events, "counted", key_blocks.count_pairs))
    monkeypatch.setattr(key_blocks, "listed", recorded(events, "listed", key_blocks.listed))

    case = make_case(9, 14, 5, seed=3)
    queries, keys = (case[name].requires_grad_() for name in ("queries", "keys"))
    loss = contrastive_loss(queries, keys, logit_scale=case["scale"], positives=case["positives"],
                            query_groups=case["query_groups"], key_groups=case["key_groups"],
                            group_positives=mode, backend=RecordingTiles(4, 4, events))
    loss.backward()
    assert events == ["counted", "forward_block", "listed", "backward_block"]


@pytest.mark.parametrize("guided", [False, True], ids=["own-scores", "guide"])
def test_the_backward_reuses_the_forward_s_thresholds(monkeypatch, guided):
    """The score filter's thresholds (one GEMV of the positives and a few small launches, made
    while the GPU waits) are made once per step: the backward takes the forward's, and its
    gradients are the float64 oracle's."""
    from hf_infcl.ops import key_blocks

    calls = []
    thresholds = key_blocks.score_filter.thresholds
    monkeypatch.setattr(key_blocks.score_filter, "thresholds",
                        lambda *args: calls.append(1) or thresholds(*args))
    case = make_case(9, 14, 5, seed=random.randrange(2**31), guide_width=3 if guided else None)
    options = dict(logit_scale=case["scale"], positives=case["positives"], false_negative_margin=0.2,
                   guide_queries=case.get("guide_queries"), guide_keys=case.get("guide_keys"))
    results = []
    for backend in (TorchTiles(4, 4), "reference"):
        queries, keys = (case[name].clone().requires_grad_() for name in ("queries", "keys"))
        loss = contrastive_loss(queries, keys, backend=backend, **options)
        results.append((loss, *torch.autograd.grad(loss, (queries, keys))))
        if backend != "reference":
            assert calls == [1]
    for value, expected in zip(*results):
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_group_ranges_hold_the_same_pairs_as_the_list(seed):
    """The ranges that the Triton block ops walk (no host synchronisation) enumerate, from the rows'
    side and from the keys', exactly the pairs that the list of pairs holds: each row's group's
    keys, and its own positive where that lies outside the group (positives shared by several
    rows, groups no row has, a group of one)."""
    from hf_infcl.ops.positive_pairs import count_pairs, group_ranges, listed

    gen = torch.Generator().manual_seed(seed)
    m, k = 11 + seed, 17 + 2 * seed
    query_groups = torch.randint(0, 5, (m,), generator=gen)
    key_groups = torch.randint(0, 7, (k,), generator=gen)
    positives = torch.randint(0, k, (m,), generator=gen)
    pairs = listed(count_pairs(query_groups, positives, key_groups, 0, positives_in_block=True))
    expected = sorted(zip(pairs.rows.tolist(), pairs.keys.tolist()))

    def walked(ranges, outer_is_row):
        found = []
        for outer in range(ranges.first.shape[0]):
            start, count = int(ranges.first[outer]), int(ranges.count[outer])
            inner = ranges.order[start:start + count].tolist()
            extra_start = outer if ranges.extra_first is None else int(ranges.extra_first[outer])
            inner += ranges.extra_order[extra_start:extra_start + int(ranges.extra_count[outer])].tolist()
            found += [(outer, j) if outer_is_row else (j, outer) for j in inner]
        return sorted(found)

    ranges = group_ranges(query_groups, positives, key_groups)
    assert len(expected) > m  # several positives per row, beyond each row's own
    assert walked(ranges.rows, True) == expected
    assert walked(ranges.keys, False) == expected


@pytest.mark.parametrize("mode", ["any", "each"])
def test_cached_training_with_group_positives_matches_the_whole_batch(tmp_path, mode):
    """Two steps of the cached step (chunks of 4) equal two whole-batch steps, with several positives
    per row and the filter."""
    from hf_infcl import InfCLTrainer
    from tests.helpers.trainer_fixtures import PairDataset, tiny_clip, trained_parameters, trainer_arguments

    dataset = PairDataset(captions_per_image_batch())
    settings = dict(per_device_train_batch_size=12, max_steps=2, optim="sgd", learning_rate=0.05,
                    group_column="group", group_positives=mode, false_negative_margin=0.1)

    def trained(path, **more):
        trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=trainer_arguments(path, **settings, **more),
                               train_dataset=dataset)
        trainer.train()
        return trained_parameters(trainer)

    full, chunked = trained(tmp_path / "full"), trained(tmp_path / "chunked", chunk_size=4)
    for name, expected in full.items():
        torch.testing.assert_close(chunked[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(full["logit_scale"], tiny_clip().logit_scale.detach())  # it trained


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["any", "each"])
def test_gpu_trainer_steps_with_group_positives_match_cpu(tmp_path, mode):
    """The Trainer's first steps on CUDA with several positives per row (the Triton kernels, their
    pairs walked as ranges; autotuning on), whole-batch and cached, equal the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() > 1:
        pytest.skip("one process sees several GPUs, so the Trainer would use DataParallel, which "
                    "InfCLTrainer refuses; run with CUDA_VISIBLE_DEVICES=0")
    from hf_infcl import InfCLTrainer
    from tests.helpers.trainer_fixtures import PairDataset, tiny_clip, trained_parameters, trainer_arguments

    dataset = PairDataset(captions_per_image_batch())
    settings = dict(per_device_train_batch_size=12, max_steps=2, optim="sgd", learning_rate=0.05,
                    group_column="group", group_positives=mode)

    def trained(path, **more):
        trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=trainer_arguments(path, **settings, **more),
                               train_dataset=dataset)
        trainer.train()
        return {name: value.cpu() for name, value in trained_parameters(trainer).items()}

    on_cpu = trained(tmp_path / "cpu")
    for name, more in (("cuda", {}), ("cuda-chunked", dict(chunk_size=4))):
        on_gpu = trained(tmp_path / name, use_cpu=False, **more)
        for parameter, expected in on_cpu.items():
            # TF32 products on the GPU (the default precision of fp32 inputs)
            torch.testing.assert_close(on_gpu[parameter], expected, rtol=2e-3, atol=2e-4,
                                       msg=f"{name} {parameter}")


def test_trainer_arguments_check_the_objectives(tmp_path):
    from hf_infcl import InfCLTrainer, InfCLTrainingArguments
    from tests.helpers.trainer_fixtures import tiny_clip, trainer_arguments

    with pytest.raises(ValueError, match="^group_positives must be one of 'any', 'each' or None; got 'all'"):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, group_positives="all")
    with pytest.raises(ValueError, match="^false_negative_margin must be finite"):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, false_negative_margin=float("nan"))
    with pytest.raises(ValueError, match="^false_negative_strategy must be one of"):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, false_negative_strategy="share")
    with pytest.raises(ValueError, match="group_positives='any' needs group_column"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, group_positives="any"))
    with pytest.raises(ValueError, match="label_smoothing=0.1 is not defined with false_negative_margin"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, label_smoothing=0.1,
                                                               false_negative_margin=0.0))
