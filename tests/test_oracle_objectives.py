"""The float64 oracle of docs/contract.md's several positives per row, false negatives by score and
GIST mapping (tests/helpers/oracle_objectives.py), and through it the contract's definitions:

- with singleton groups and no margin it is today's loss (tests/helpers/oracle.py) in every mode;
- small cases whose values are written out by hand;
- a literal, set-by-set transcription of the definitions on random inputs, and the contract's
  closed-form dL/dz against autograd;
- the filter against GIST's own way of masking, and sentence-transformers' GISTEmbedLoss and
  CachedGISTEmbedLoss (their code, fed float64 embeddings) against the contract's mapping, with
  their all-gather simulated over several processes;
- plain InfoNCE, CLIP and SigLIP without groups or margin.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.oracle import contract_loss
from tests.helpers.oracle_objectives import (
    gist_blocks,
    gist_loss,
    objective_gradients,
    objective_loss,
    thresholds,
)

MODES = [None, "any", "each"]
LOSSES = ["softmax", "sigmoid"]


def lse(*values) -> float:
    return float(np.logaddexp.reduce(np.array(values, dtype=np.float64)))


def softplus(value: float) -> float:
    return float(np.logaddexp(0.0, value))


def random_inputs(seed, m=5, k=9, c=4):
    """Queries, keys, a positive scale and a bias, and distinct positives among the k keys (the
    others are extra keys)."""
    rng = np.random.default_rng(seed)
    return dict(queries=rng.standard_normal((m, c)), keys=rng.standard_normal((k, c)),
                scale=float(rng.uniform(0.5, 2.0)), bias=float(rng.uniform(-2.0, 1.0)),
                positives=rng.permutation(k)[:m])


def assert_same(actual, expected, tolerance=1e-12):
    (value, grads), (expected_value, expected_grads) = actual, expected
    np.testing.assert_allclose(value, expected_value, rtol=tolerance, atol=tolerance)
    for name in ("queries", "keys", "scale", "bias"):
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=tolerance, atol=tolerance,
                                   err_msg=name)


# ------------------------------------------------------------------------------------------------
# Singleton groups: today's loss


def singleton_groups(positives, k, labelling):
    """Groups in which no row shares its group with any key but (with "rows") its positive."""
    m = len(positives)
    query_groups = np.arange(m) * 3 + 1
    key_groups = 1000 + np.arange(k)  # no row has these
    if labelling == "rows":
        key_groups[positives] = query_groups
    return query_groups, key_groups


@pytest.mark.parametrize("labelling", ["rows", "other"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_singleton_groups_are_todays_loss(mode, loss, symmetric, reduction, labelling):
    case = random_inputs(seed=zlib.crc32(repr((mode, loss, symmetric, reduction, labelling)).encode()))
    query_groups, key_groups = singleton_groups(case["positives"], len(case["keys"]), labelling)
    options = dict(loss=loss, symmetric=symmetric, positives=case["positives"], reduction=reduction)
    inputs = (case["queries"], case["keys"], case["scale"], case["bias"])
    today = contract_loss(*inputs, **options)
    groups = dict(query_groups=query_groups, key_groups=key_groups, group_positives=mode)
    ours = objective_gradients(*inputs, **groups, **options)
    assert_same(ours, today)


@pytest.mark.parametrize("hardness_mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
@pytest.mark.parametrize("mode", MODES)
def test_singleton_groups_with_the_hardness_offset(mode, hardness_mode):
    case = random_inputs(seed=7)
    m, k = len(case["queries"]), len(case["keys"])
    query_groups, key_groups = singleton_groups(case["positives"], k, "rows")
    owners = np.random.default_rng(8).integers(-1, m + 1, k)
    owners[case["positives"]] = np.arange(m)
    options = dict(positives=case["positives"], hardness_mode=hardness_mode, hardness_strength=0.7,
                   query_ids=np.arange(m), key_owners=owners)
    today = contract_loss(case["queries"], case["keys"], case["scale"], **options)
    ours = objective_gradients(case["queries"], case["keys"], case["scale"], query_groups=query_groups,
                               key_groups=key_groups, group_positives=mode, **options)
    assert_same(ours, today)


@pytest.mark.parametrize("hardness", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("loss", LOSSES)
def test_none_keeps_todays_group_rule(loss, symmetric, hardness):
    """group_positives=None with groups that hold several rows and keys, and positives that two rows
    share: the contract's "Which keys count"."""
    case = random_inputs(seed=11, m=6, k=10)
    rng = np.random.default_rng(12)
    positives = np.array([0, 1, 1, 3, 4, 7])
    query_groups, key_groups = rng.integers(0, 3, 6), rng.integers(0, 4, 10)
    options = dict(loss=loss, symmetric=symmetric, positives=positives, query_groups=query_groups,
                   key_groups=key_groups)
    if hardness and loss == "softmax":
        options.update(hardness_mode="all_negatives", hardness_strength=0.5, query_ids=np.arange(6),
                       key_owners=rng.integers(-1, 6, 10))
    today = contract_loss(case["queries"], case["keys"], case["scale"], case["bias"], **options)
    ours = objective_gradients(case["queries"], case["keys"], case["scale"], case["bias"], **options)
    assert_same(ours, today)


# ------------------------------------------------------------------------------------------------
# By hand: 3 rows, 5 keys, z = Z (queries the identity, keys Zᵀ, scale 1: x = z = Z)

Z = np.array([[0.5, -1.0, 0.25, 1.5, -0.5],
              [1.0, 0.75, -0.25, 0.5, 2.0],
              [-0.5, 0.25, 1.25, -1.5, 0.5]])
# positives: key i for row i. Groups: P(0) = P(1) = {0, 1, 3}, P(2) = {2, 4}; for the column terms
# R(0) = R(1) = {0, 1}, R(2) = {2}. Left out by today's rule: row 0 keys 1, 3; row 1 keys 0, 3;
# row 2 key 4; column 0 row 1; column 1 row 0.
GROUPS = dict(query_groups=[0, 0, 1], key_groups=[0, 0, 2, 0, 1])
ROW_LSE = [lse(*Z[0]), lse(*Z[1]), lse(*Z[2])]

BY_HAND = {
    "any rows": (dict(group_positives="any", symmetric=False, **GROUPS), [
        ROW_LSE[0] - lse(0.5, -1.0, 1.5),
        ROW_LSE[1] - lse(1.0, 0.75, 0.5),
        ROW_LSE[2] - lse(1.25, 0.5)]),
    "each rows": (dict(group_positives="each", symmetric=False, **GROUPS), [
        ROW_LSE[0] - (0.5 - 1.0 + 1.5) / 3,
        ROW_LSE[1] - (1.0 + 0.75 + 0.5) / 3,
        ROW_LSE[2] - (1.25 + 0.5) / 2]),
    "None rows": (dict(group_positives=None, symmetric=False, **GROUPS), [
        lse(0.5, 0.25, -0.5) - 0.5,
        lse(0.75, -0.25, 2.0) - 0.75,
        lse(-0.5, 0.25, 1.25, -1.5) - 1.25]),
    "any columns": (dict(group_positives="any", symmetric=True, **GROUPS), [
        (ROW_LSE[0] - lse(0.5, -1.0, 1.5) + lse(0.5, 1.0, -0.5) - lse(0.5, 1.0)) / 2,
        (ROW_LSE[1] - lse(1.0, 0.75, 0.5) + lse(-1.0, 0.75, 0.25) - lse(-1.0, 0.75)) / 2,
        (ROW_LSE[2] - lse(1.25, 0.5) + lse(0.25, -0.25, 1.25) - 1.25) / 2]),
    "each columns": (dict(group_positives="each", symmetric=True, **GROUPS), [
        (ROW_LSE[0] - (0.5 - 1.0 + 1.5) / 3 + lse(0.5, 1.0, -0.5) - (0.5 + 1.0) / 2) / 2,
        (ROW_LSE[1] - (1.0 + 0.75 + 0.5) / 3 + lse(-1.0, 0.75, 0.25) - (-1.0 + 0.75) / 2) / 2,
        (ROW_LSE[2] - (1.25 + 0.5) / 2 + lse(0.25, -0.25, 1.25) - 1.25) / 2]),
    "None columns": (dict(group_positives=None, symmetric=True, **GROUPS), [
        (lse(0.5, 0.25, -0.5) - 0.5 + lse(0.5, -0.5) - 0.5) / 2,
        (lse(0.75, -0.25, 2.0) - 0.75 + lse(0.75, 0.25) - 0.75) / 2,
        (lse(-0.5, 0.25, 1.25, -1.5) - 1.25 + lse(0.25, -0.25, 1.25) - 1.25) / 2]),
    "sigmoid any": (dict(group_positives="any", loss="sigmoid", **GROUPS), [
        softplus(-0.5) + softplus(1.0) + softplus(-1.5) + softplus(0.25) + softplus(-0.5),
        softplus(-1.0) + softplus(-0.75) + softplus(-0.5) + softplus(-0.25) + softplus(2.0),
        softplus(-1.25) + softplus(-0.5) + softplus(-0.5) + softplus(0.25) + softplus(-1.5)]),
    "sigmoid None": (dict(group_positives=None, loss="sigmoid", **GROUPS), [
        softplus(-0.5) + softplus(0.25) + softplus(-0.5),
        softplus(-0.75) + softplus(-0.25) + softplus(2.0),
        softplus(-1.25) + softplus(-0.5) + softplus(0.25) + softplus(-1.5)]),
    # The filter without a guide (g = x = Z). Absolute, margin 0.5: τ = (0.0, 0.25, 0.75); row 0
    # drops keys 2 and 3, row 1 keys 0, 3 and 4 (key 2 scores -0.25), row 2 nothing.
    "absolute rows": (dict(false_negative_margin=0.5, symmetric=False), [
        lse(0.5, -1.0, -0.5) - 0.5,
        lse(0.75, -0.25) - 0.75,
        ROW_LSE[2] - 1.25]),
    # Relative, margin 0.5: τ = (0.25, 0.375, 0.625): key 2 of row 0 scores exactly τ_0 and stays.
    "relative rows": (dict(false_negative_margin=0.5, false_negative_strategy="relative", symmetric=False), [
        lse(0.5, -1.0, 0.25, -0.5) - 0.5,
        lse(0.75, -0.25) - 0.75,
        ROW_LSE[2] - 1.25]),
    # Columns at τ_i of the column's row: column 0 drops row 1 (1.0 > 0.0), column 1 keeps row 2
    # (0.25 is not above 0.25), column 2 keeps both.
    "absolute columns": (dict(false_negative_margin=0.5, symmetric=True), [
        (lse(0.5, -1.0, -0.5) - 0.5 + lse(0.5, -0.5) - 0.5) / 2,
        (lse(0.75, -0.25) - 0.75 + lse(-1.0, 0.75, 0.25) - 0.75) / 2,
        (ROW_LSE[2] - 1.25 + lse(0.25, -0.25, 1.25) - 1.25) / 2]),
    # Groups as positives are never filtered: row 0 keeps keys 1 and 3 (its positives), drops 2.
    "any absolute": (dict(group_positives="any", false_negative_margin=0.5, symmetric=False, **GROUPS), [
        lse(0.5, -1.0, 1.5, -0.5) - lse(0.5, -1.0, 1.5),
        lse(1.0, 0.75, -0.25, 0.5) - lse(1.0, 0.75, 0.5),
        ROW_LSE[2] - lse(1.25, 0.5)]),
    # None: left out when either rule says so.
    "None absolute": (dict(group_positives=None, false_negative_margin=0.5, symmetric=False, **GROUPS), [
        lse(0.5, -0.5) - 0.5,
        lse(0.75, -0.25) - 0.75,
        lse(-0.5, 0.25, 1.25, -1.5) - 1.25]),
    "sigmoid each absolute": (dict(group_positives="each", loss="sigmoid", false_negative_margin=0.5,
                                   **GROUPS), [
        softplus(-0.5) + softplus(1.0) + softplus(-1.5) + softplus(-0.5),
        softplus(-1.0) + softplus(-0.75) + softplus(-0.5) + softplus(-0.25),
        softplus(-1.25) + softplus(-0.5) + softplus(-0.5) + softplus(0.25) + softplus(-1.5)]),
}


@pytest.mark.parametrize("name", list(BY_HAND))
def test_by_hand(name):
    options, expected = BY_HAND[name]
    per_row = objective_loss(np.eye(3), Z.T, 1.0, reduction="none", **options)
    np.testing.assert_allclose(per_row.numpy(), expected, rtol=0, atol=1e-14)


def test_sigmoid_any_and_each_are_the_same_loss():
    case = random_inputs(seed=3)
    rng = np.random.default_rng(4)
    options = dict(loss="sigmoid", positives=case["positives"], query_groups=rng.integers(0, 3, 5),
                   key_groups=rng.integers(0, 4, 9), false_negative_margin=0.2)
    inputs = (case["queries"], case["keys"], case["scale"], case["bias"])
    assert_same(objective_gradients(*inputs, group_positives="any", **options),
                objective_gradients(*inputs, group_positives="each", **options), tolerance=0)


# ------------------------------------------------------------------------------------------------
# The definitions transcribed set by set, on random inputs


class Definitions:
    """docs/contract.md's sets and terms for one input, written as the text reads (Python sets)."""

    def __init__(self, z, g, positives, query_groups, key_groups, mode, margin, strategy):
        self.z, self.g, self.p = z, g, list(positives)
        self.qg, self.kg, self.mode = query_groups, key_groups, mode
        self.margin, self.strategy = margin, strategy
        self.m, self.k = z.shape

    def same_group(self, i, j):
        return self.qg is not None and self.qg[i] == self.kg[j]

    def P(self, i):
        if self.mode is None:
            return {self.p[i]}
        return {self.p[i]} | {j for j in range(self.k) if self.same_group(i, j)}

    def R(self, key):
        rows = {i for i in range(self.m) if self.p[i] == key}
        if self.mode is None:
            return rows
        return rows | {i for i in range(self.m) if self.same_group(i, key)}

    def tau(self, i):
        positive_score = self.g[i, self.p[i]]
        if self.strategy == "absolute":
            return positive_score - self.margin
        return positive_score - abs(positive_score) * self.margin

    def row_allowed(self, i, j):
        if j in self.P(i):
            return True
        if self.mode is None and self.same_group(i, j):
            return False
        return not (self.margin is not None and self.g[i, j] > self.tau(i))

    def column_allowed(self, i, other):
        """Row ``other`` in row i's column term (key p(i))."""
        key = self.p[i]
        if other in self.R(key):
            return True
        if self.mode is None and self.same_group(other, key):
            return False
        return not (self.margin is not None and self.g[other, key] > self.tau(i))

    def positive_part(self, values, positive_set, own):
        if self.mode is None:
            return own
        if self.mode == "any":
            return lse(*values)
        return float(np.mean(values))

    def row_term(self, i):
        allowed = [self.z[i, j] for j in range(self.k) if self.row_allowed(i, j)]
        positives = [self.z[i, j] for j in sorted(self.P(i))]
        return lse(*allowed) - self.positive_part(positives, self.P(i), self.z[i, self.p[i]])

    def column_term(self, i):
        key = self.p[i]
        allowed = [self.z[other, key] for other in range(self.m) if self.column_allowed(i, other)]
        positives = [self.z[other, key] for other in sorted(self.R(key))]
        return lse(*allowed) - self.positive_part(positives, self.R(key), self.z[i, key])

    def sigmoid_term(self, i):
        return sum(softplus(-self.z[i, j]) if j in self.P(i) else softplus(self.z[i, j])
                   for j in range(self.k) if self.row_allowed(i, j))

    def loss(self, loss, symmetric):
        if loss == "sigmoid":
            return [self.sigmoid_term(i) for i in range(self.m)]
        if symmetric:
            return [(self.row_term(i) + self.column_term(i)) / 2 for i in range(self.m)]
        return [self.row_term(i) for i in range(self.m)]

    def logit_gradient(self, loss, symmetric, weights):
        """The contract's closed form dL/dz_ij ("Several positives per row", gradients)."""
        z, G = self.z, np.zeros_like(self.z)
        half = 0.5 if symmetric and loss == "softmax" else 1.0
        for i in range(self.m):
            w = weights[i]
            if loss == "sigmoid":
                for j in range(self.k):
                    if self.row_allowed(i, j):
                        G[i, j] += w * (1 / (1 + np.exp(-z[i, j])) - (j in self.P(i)))
                continue
            allowed = [j for j in range(self.k) if self.row_allowed(i, j)]
            r = lse(*z[i, allowed])
            r_plus = lse(*[z[i, j] for j in self.P(i)])
            for j in allowed:
                pi = self.share(j, self.P(i), self.p[i], z[i, j], r_plus)
                G[i, j] += half * w * (np.exp(z[i, j] - r) - pi)
            if symmetric:
                key = self.p[i]
                rows = [other for other in range(self.m) if self.column_allowed(i, other)]
                c = lse(*z[rows, key])
                c_plus = lse(*[z[other, key] for other in self.R(key)])
                for other in rows:
                    G[other, key] += half * w * (np.exp(z[other, key] - c)
                                                 - self.share(other, self.R(key), i, z[other, key], c_plus))
        return G

    def share(self, member, positive_set, own, value, positive_lse):
        """π (rows) or ρ (columns): the positive's share of the subtracted term's gradient."""
        if self.mode is None:
            return float(member == own)
        if member not in positive_set:
            return 0.0
        return np.exp(value - positive_lse) if self.mode == "any" else 1.0 / len(positive_set)


def definition_cases():
    for mode, loss, symmetric, margin, guide in itertools.product(
            MODES, LOSSES, [True, False], [None, 0.3, -0.2], [False, True]):
        if loss == "sigmoid" and not symmetric:
            continue  # symmetric means nothing to the sigmoid loss
        if guide and margin is None:
            continue
        direction = "sym" if symmetric else "rows"
        scorer = "guide" if guide else "self"
        name = f"{mode}-{loss}-{direction}-{margin}-{scorer}"
        yield pytest.param(mode, loss, symmetric, margin, guide, id=name)


def definition_inputs(seed, margin, guide):
    rng = np.random.default_rng(seed)
    m, k = 6, 10
    case = dict(queries=rng.standard_normal((m, 4)), keys=rng.standard_normal((k, 4)),
                scale=float(rng.uniform(0.5, 2.0)), bias=float(rng.uniform(-2.0, 1.0)),
                query_groups=rng.integers(0, 3, m), key_groups=rng.integers(0, 4, k))
    # two rows share a positive key where the filter and the column term allow it
    case["positives"] = rng.permutation(k)[:m] if margin is not None else np.array([2, 5, 5, 0, 9, 1])
    if guide:
        case["guide_queries"], case["guide_keys"] = rng.standard_normal((m, 3)), rng.standard_normal((k, 3))
    return case


@pytest.mark.parametrize("mode, loss, symmetric, margin, guide", list(definition_cases()))
def test_matches_the_definitions_set_by_set(mode, loss, symmetric, margin, guide):
    case = definition_inputs(seed=21, margin=margin, guide=guide)
    x = case["queries"] @ case["keys"].T
    z = case["scale"] * x + case["bias"]
    g = case["guide_queries"] @ case["guide_keys"].T if guide else x
    definitions = Definitions(z, g, case["positives"], case["query_groups"], case["key_groups"], mode, margin,
                              "absolute")
    options = dict(loss=loss, symmetric=symmetric, group_positives=mode, false_negative_margin=margin)
    per_row = objective_loss(reduction="none", **case, **options)
    np.testing.assert_allclose(per_row.numpy(), definitions.loss(loss, symmetric), rtol=1e-13, atol=1e-13)

    value, grads = objective_gradients(**case, **options)
    m = len(case["queries"])
    G = definitions.logit_gradient(loss, symmetric, np.full(m, 1.0 / m))
    s = case["scale"]
    np.testing.assert_allclose(grads["queries"], s * G @ case["keys"], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads["keys"], s * G.T @ case["queries"], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads["scale"], np.sum(G * x), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads["bias"], np.sum(G), rtol=1e-12, atol=1e-13)


def test_definition_cases_filter_something_and_keep_something():
    """The random inputs above exercise the filter (a test that masks nothing cannot fail)."""
    for margin, guide in [(0.3, False), (-0.2, False), (0.3, True), (-0.2, True)]:
        case = definition_inputs(seed=21, margin=margin, guide=guide)
        x = case["queries"] @ case["keys"].T
        g = case["guide_queries"] @ case["guide_keys"].T if guide else x
        d = Definitions(x, g, case["positives"], None, None, None, margin, "absolute")
        allowed = [d.row_allowed(i, j) for i in range(6) for j in range(10)]
        assert 6 < sum(allowed) < 60
        column = [d.column_allowed(i, other) for i in range(6) for other in range(6)]
        assert 6 < sum(column) < 36


# ------------------------------------------------------------------------------------------------
# The filter is GIST's masking


def gist_style_loss(z, g, positives, margin, strategy):
    """GISTEmbedLoss's recipe on a logit matrix: mask scores above the positive's minus the margin,
    except the positive, then cross-entropy."""
    rows = torch.arange(len(positives))
    positive_score = g[rows, positives].view(-1, 1)
    if strategy == "absolute":
        mask = g > positive_score - margin
    else:
        mask = g > positive_score - positive_score.abs() * margin
    mask[rows, positives] = False
    z = z.clone()
    z[mask] = -torch.inf
    return F.cross_entropy(z, positives), mask


@pytest.mark.parametrize("guide", [False, True])
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
@pytest.mark.parametrize("margin", [0.0, 0.1, -0.1])
def test_the_filter_is_gists_masking(margin, strategy, guide):
    case = random_inputs(seed=31)
    generator = torch.Generator().manual_seed(32)
    q = torch.tensor(case["queries"], requires_grad=True)
    k = torch.tensor(case["keys"], requires_grad=True)
    positives = torch.tensor(case["positives"])
    guides = {}
    if guide:
        guides = dict(guide_queries=torch.randn(5, 7, generator=generator, dtype=torch.float64),
                      guide_keys=torch.randn(9, 7, generator=generator, dtype=torch.float64))
    x = q @ k.T
    g = guides["guide_queries"] @ guides["guide_keys"].T if guide else x.detach()
    expected, mask = gist_style_loss(case["scale"] * x, g, positives, margin, strategy)
    assert 0 < int(mask.sum()) < mask.numel() - 5
    expected_grads = torch.autograd.grad(expected, [q, k])
    ours = objective_loss(q, k, case["scale"], symmetric=False, positives=positives,
                          false_negative_margin=margin, false_negative_strategy=strategy, **guides)
    for actual, reference in zip(torch.autograd.grad(ours, [q, k]), expected_grads):
        torch.testing.assert_close(actual, reference, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# sentence-transformers' GISTEmbedLoss and CachedGISTEmbedLoss against the contract's mapping

pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.sentence_transformer.losses import cached_gist_embed, gist_embed  # noqa: E402

from tests.helpers.sentence_transformers_fixtures import build_tiny_model_dir, load_tiny_model  # noqa: E402

BATCH, WIDTH, GUIDE_WIDTH = 6, 5, 4
CONTRASTS = [pytest.param(a, p, id=f"anchors{int(a)}-positives{int(p)}")
             for a, p in itertools.product([True, False], repeat=2)]
MARGINS = [0.0, 0.1, -0.1]
STRATEGIES = ["absolute", "relative"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Two tiny models, only for the constructors (their tokenizers); the embeddings are given."""
    folder = build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert"))
    return load_tiny_model(folder), load_tiny_model(folder)


def gist_embeddings(seed, rows, negative_columns):
    """Model embeddings (leaves that require grad) and the guide's (another width) of the anchor,
    positive and each negatives column."""
    generator = torch.Generator().manual_seed(seed)
    columns = 2 + negative_columns
    model = [torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64).requires_grad_()
             for _ in range(columns)]
    guide = [torch.randn(rows, GUIDE_WIDTH, generator=generator, dtype=torch.float64) for _ in range(columns)]
    return model, guide


def oracle_loss_and_gradients(model, guide, **options):
    leaves = [t.detach().clone().requires_grad_() for t in model]
    value = gist_loss(leaves[0], leaves[1], leaves[2:], guide[0], guide[1], guide[2:], **options)
    return value.detach(), torch.autograd.grad(value, leaves)


def assert_clear_of_thresholds(guide, *, margin, margin_strategy, contrast_anchors, contrast_positives, **_):
    """No guide score within 1e-6 of its threshold: the comparison is the same in any rounding, and
    the filter leaves out something (the loss differs from the unfiltered one)."""
    guide = [F.normalize(t, dim=-1) for t in guide]
    rows, shared, anchors = gist_blocks(guide[0], guide[1], guide[2:], contrast_anchors, contrast_positives)
    scores = rows @ torch.cat([shared, anchors]).T
    positives = torch.arange(len(rows))
    tau = thresholds(scores[positives, positives], margin, margin_strategy)
    gap = (scores - tau[:, None]).abs()
    gap[positives, positives] = torch.inf
    assert gap.min() > 1e-6
    filtered = (scores > tau[:, None])
    filtered[positives, positives] = False
    assert filtered.any()


def gist_options(margin, strategy, contrast_anchors, contrast_positives):
    return dict(temperature=0.05, margin=margin, margin_strategy=strategy, contrast_anchors=contrast_anchors,
                contrast_positives=contrast_positives)


def gist_case_id(negative_columns, margin, strategy):
    return f"negatives{negative_columns}-margin{margin}-{strategy}"


GIST_CASES = [pytest.param(n, margin, strategy, id=gist_case_id(n, margin, strategy))
              for n, margin, strategy in itertools.product([0, 1], MARGINS, STRATEGIES)]


@pytest.mark.parametrize("contrast_anchors, contrast_positives", CONTRASTS)
@pytest.mark.parametrize("negative_columns, margin, strategy", GIST_CASES)
def test_gist_embed_loss_is_the_contracts_mapping(tiny_models, monkeypatch, negative_columns, margin,
                                                  strategy, contrast_anchors, contrast_positives):
    model_embeddings, guide_embeddings = gist_embeddings(41 + negative_columns, BATCH, negative_columns)
    options = gist_options(margin, strategy, contrast_anchors, contrast_positives)
    assert_clear_of_thresholds(guide_embeddings, **options)
    st_loss = st_losses.GISTEmbedLoss(*tiny_models, **options)
    assert not st_loss.must_retokenize

    def embed_columns(module, features):  # their forward, on the embeddings given here
        return list(model_embeddings if module is st_loss.model else guide_embeddings)

    monkeypatch.setattr(gist_embed, "embed_columns", embed_columns)
    theirs = st_loss([{} for _ in model_embeddings], None)
    their_grads = torch.autograd.grad(theirs, model_embeddings)

    ours, our_grads = oracle_loss_and_gradients(model_embeddings, guide_embeddings, **options)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-10)
    for name, actual, expected in zip(["anchor", "positive", "negative"], our_grads, their_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=name)
    # margin -10: every threshold above any cosine, nothing left out
    unfiltered = st_losses.GISTEmbedLoss(*tiny_models, **{**options, "margin": -10.0,
                                                          "margin_strategy": "absolute"})
    assert abs(float(unfiltered([{} for _ in model_embeddings], None).detach()) - float(ours)) > 1e-3


CACHED_CASES = [pytest.param(n, margin, strategy, id=gist_case_id(n, margin, strategy))
                for n, margin, strategy in itertools.product([0, 1, 2], [0.1, -0.1], STRATEGIES)]


@pytest.mark.parametrize("contrast_anchors, contrast_positives", CONTRASTS)
@pytest.mark.parametrize("negative_columns, margin, strategy", CACHED_CASES)
def test_cached_gist_embed_loss_is_the_contracts_mapping(tiny_models, negative_columns, margin, strategy,
                                                         contrast_anchors, contrast_positives):
    """Its loss on the embeddings (calculate_loss, in mini-batches of 4 of 6 rows), any number of
    negatives columns."""
    model_embeddings, guide_embeddings = gist_embeddings(51 + negative_columns, BATCH, negative_columns)
    options = gist_options(margin, strategy, contrast_anchors, contrast_positives)
    assert_clear_of_thresholds(guide_embeddings, **options)
    st_loss = st_losses.CachedGISTEmbedLoss(*tiny_models, mini_batch_size=4, **options)
    theirs = st_loss.calculate_loss([[t] for t in model_embeddings], [[t] for t in guide_embeddings])
    their_grads = torch.autograd.grad(theirs, model_embeddings)

    ours, our_grads = oracle_loss_and_gradients(model_embeddings, guide_embeddings, **options)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-10)
    for actual, expected in zip(our_grads, their_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def simulated_all_gather(full_tensors, rank, rows):
    """sentence-transformers' all_gather_with_grad as process ``rank`` of equal ``rows`` sees it:
    every process's slice of the full tensor, its own being the tensor it passes (gradients of
    every process's loss then reach the full tensors, as the real gather's backward sums them)."""
    def all_gather_with_grad(tensor):
        for full in full_tensors:
            own = slice(rank * rows, (rank + 1) * rows)
            if full.shape[1:] == tensor.shape[1:] and torch.equal(full[own].detach(), tensor.detach()):
                return torch.cat([full[:own.start], tensor, full[own.stop:]])
        raise AssertionError("all_gather_with_grad of a tensor this test did not give")
    return all_gather_with_grad


GATHER_CASES = [pytest.param(n, margin, strategy, id=gist_case_id(n, margin, strategy))
                for n, margin, strategy in itertools.product([0, 1], [0.1, -0.1], STRATEGIES)]


@pytest.mark.parametrize("gathered_as", ["two_statistics", "one_call"])
@pytest.mark.parametrize("cached", [False, True], ids=["GISTEmbedLoss", "CachedGISTEmbedLoss"])
@pytest.mark.parametrize("contrast_anchors, contrast_positives", CONTRASTS)
@pytest.mark.parametrize("negative_columns, margin, strategy", GATHER_CASES)
def test_gathered_gist_is_the_contracts_mapping(tiny_models, monkeypatch, negative_columns, margin, strategy,
                                                contrast_anchors, contrast_positives, cached, gathered_as):
    """gather_across_devices=True over 3 processes of 3 rows, their all-gather simulated: the sum of
    the processes' losses and its gradient, against the contract's two row statistics combined by
    logaddexp, and against the one call whose guide marks the processes."""
    world, rows = 3, 3
    model_embeddings, guide_embeddings = gist_embeddings(61 + negative_columns, world * rows,
                                                         negative_columns)
    options = gist_options(margin, strategy, contrast_anchors, contrast_positives)
    assert_clear_of_thresholds(guide_embeddings, **options)
    module = cached_gist_embed if cached else gist_embed
    if cached:
        st_loss = st_losses.CachedGISTEmbedLoss(*tiny_models, mini_batch_size=2, gather_across_devices=True,
                                                **options)
    else:
        st_loss = st_losses.GISTEmbedLoss(*tiny_models, gather_across_devices=True, **options)
    theirs = 0.0
    for rank in range(world):
        own = slice(rank * rows, (rank + 1) * rows)
        local_model = [t[own] for t in model_embeddings]
        local_guide = [t[own] for t in guide_embeddings]
        monkeypatch.setattr(module, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(module, "all_gather_with_grad",
                            simulated_all_gather([*model_embeddings, *guide_embeddings], rank, rows))
        if cached:
            theirs = theirs + st_loss.calculate_loss([[t] for t in local_model], [[t] for t in local_guide])
        else:
            monkeypatch.setattr(module, "embed_columns", lambda m, f, lm=local_model, lg=local_guide:
                                list(lm if m is st_loss.model else lg))
            theirs = theirs + st_loss([{} for _ in local_model], None)
    their_grads = torch.autograd.grad(theirs, model_embeddings)

    ours, our_grads = oracle_loss_and_gradients(model_embeddings, guide_embeddings, world_size=world,
                                                gathered_as=gathered_as, **options)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-10)
    for actual, expected in zip(our_grads, their_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    if contrast_anchors:  # the local anchor block matters: every anchor in one call is another loss
        anchor, positive, *negatives = [t.detach() for t in model_embeddings]
        everything = world * gist_loss(anchor, positive, negatives, guide_embeddings[0], guide_embeddings[1],
                                       guide_embeddings[2:], **options)
        assert abs(float(everything) - float(ours)) > 1e-6


# ------------------------------------------------------------------------------------------------
# No groups, no margin: InfoNCE, CLIP, SigLIP


def test_plain_infonce_with_extra_keys():
    case = random_inputs(seed=71)
    q, k = torch.tensor(case["queries"]), torch.tensor(case["keys"])
    positives = torch.tensor(case["positives"])
    expected = F.cross_entropy(case["scale"] * q @ k.T, positives)
    ours = objective_loss(q, k, case["scale"], symmetric=False, positives=positives)
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=1e-14)


def test_clip_loss():
    rng = np.random.default_rng(72)
    q, k = torch.tensor(rng.standard_normal((6, 4))), torch.tensor(rng.standard_normal((6, 4)))
    z = 1.7 * q @ k.T
    labels = torch.arange(6)
    expected = (F.cross_entropy(z, labels) + F.cross_entropy(z.T, labels)) / 2
    torch.testing.assert_close(objective_loss(q, k, 1.7), expected, rtol=1e-14, atol=1e-14)


def test_siglip_loss():
    case = random_inputs(seed=73)
    q, k = torch.tensor(case["queries"]), torch.tensor(case["keys"])
    z = case["scale"] * q @ k.T + case["bias"]
    labels = -torch.ones_like(z)
    labels[torch.arange(5), torch.tensor(case["positives"])] = 1.0
    expected = -F.logsigmoid(labels * z).sum(dim=1).mean()
    ours = objective_loss(q, k, case["scale"], case["bias"], loss="sigmoid", positives=case["positives"])
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=1e-14)
