"""Offline sentence-transformers models and texts for the adapter tests (nothing from the Hub).

``build_tiny_model_dir`` writes a 2-layer BERT (random weights, dropout 0.1 unless told) and a word-level
tokenizer to a folder; ``load_tiny_model`` wraps it as a SentenceTransformer (Transformer + mean
pooling). The multi-process workers load the same folder, so every rank starts from the same weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import sentence_transformers
import torch
from packaging.version import Version

# sentence-transformers before 6.2 (6.0.0, 6.0.1 and 6.1.0 read) multiplies a cached replay's
# embeddings with their cached gradients in fp32 even for a float64 model, so a cached float64
# step's parameter gradients are fp32-rounded there (up to 8e-8 apart in the tests' gradients):
# under those releases, float64 comparisons that involve a cached replay use FP32_REPLAY_TOLERANCE.
FP32_REPLAY = Version(sentence_transformers.__version__) < Version("6.2")
FP32_REPLAY_TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def replay_tolerance(tolerance: dict | None) -> dict | None:
    """``tolerance`` for a float64 comparison that involves a cached replay (None: the comparison's
    own default), or fp32's precision where sentence-transformers replays in fp32 (:data:`FP32_REPLAY`)."""
    return FP32_REPLAY_TOLERANCE if FP32_REPLAY else tolerance


WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "it", "on", "for", "cat", "dog", "car", "house", "tree",
    "river", "red", "blue", "green", "big", "small", "old", "new", "runs", "jumps", "eats", "sleeps",
    "reads", "writes", "sings", "under", "over", "near", "quickly", "slowly", "today", "night",
]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HIDDEN = 32


def build_tiny_model_dir(folder: Path, seed: int = 0, dropout: float = 0.1) -> Path:
    """Save a tiny BERT (dropout ``dropout``: on by default) and its tokenizer to ``folder``; return
    the folder."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
    BertTokenizerFast(vocab=vocab).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder)
    return folder


def load_tiny_model(folder: Path):
    """The SentenceTransformer over a folder made by ``build_tiny_model_dir``, in training mode."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    model = SentenceTransformer(
        modules=[Transformer(str(folder), max_seq_length=32), Pooling(HIDDEN, "mean")], device="cpu"
    )
    model.train()  # dropout on: the parity tests must replay it exactly
    return model


class EmbeddingBatchNorm(torch.nn.Module):
    """A sentence-transformers module normalising the sentence embeddings with BatchNorm1d (batch
    statistics in training mode), as some projection heads do."""

    def __init__(self, dim: int = HIDDEN):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(dim)

    def forward(self, features: dict, **kwargs) -> dict:
        features["sentence_embedding"] = self.norm(features["sentence_embedding"])
        return features


def load_tiny_model_with_batch_norm(folder: Path):
    """``load_tiny_model``'s Transformer and mean pooling, then ``EmbeddingBatchNorm`` (training mode)."""
    from sentence_transformers import SentenceTransformer

    plain = load_tiny_model(folder)
    model = SentenceTransformer(modules=[plain[0], plain[1], EmbeddingBatchNorm()], device="cpu")
    model.train()
    return model


def random_sentences(count: int, seed: int) -> list[str]:
    """``count`` sentences of 2-9 words: different lengths, so every column has padding."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) for _ in range(count)]


def text_columns(rows: int, columns: int, seed: int) -> list[list[str]]:
    """``columns`` columns (anchor, positive, negatives...) of ``rows`` sentences each."""
    return [random_sentences(rows, seed * 100 + column) for column in range(columns)]


def features(model, columns: list[list[str]]) -> list[dict]:
    """Tokenised features of each column (``preprocess`` in sentence-transformers >= 6)."""
    tokenize = getattr(model, "preprocess", None) or model.tokenize
    return [dict(tokenize(column)) for column in columns]


def loss_and_gradients(model, loss_module, columns, seed: int):
    """Loss value and every parameter gradient of one forward/backward, with dropout seeded."""
    model.zero_grad(set_to_none=True)
    batch = features(model, columns)
    torch.manual_seed(seed)
    loss = loss_module(batch, None)
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), gradients


def st_reference_loss(model, symmetric: bool, mini_batch_size: int | None, gather_across_devices=False,
                      **options):
    """sentence-transformers' own loss with the semantics InfCLLoss reproduces.

    ``options``: more of MNRL's arguments (``directions``, ``partition_mode``, ...), as given.

    symmetric=True is MultipleNegativesSymmetricRankingLoss; sentence-transformers >= 5.x deprecates
    that class in favour of MNRL(directions=("query_to_doc", "doc_to_query"),
    partition_mode="per_direction"), which is the same loss: use that spelling where it exists.
    """
    import inspect

    from sentence_transformers import losses as st_losses

    cached = mini_batch_size is not None
    cls = st_losses.CachedMultipleNegativesRankingLoss if cached else st_losses.MultipleNegativesRankingLoss
    kwargs = {"gather_across_devices": gather_across_devices, **options}
    if cached:
        kwargs["mini_batch_size"] = mini_batch_size
    if symmetric:
        if "directions" in inspect.signature(cls.__init__).parameters:
            kwargs.update(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
        else:
            cls = (
                st_losses.CachedMultipleNegativesSymmetricRankingLoss
                if cached else st_losses.MultipleNegativesSymmetricRankingLoss
            )
    return cls(model, **kwargs)
