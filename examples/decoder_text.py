"""Text handling the decoder (LLM-based) embedder presets of the text examples share.

- :data:`RETRIEVAL_INSTRUCTION`: the instruction a preset puts before each query, in the
  Qwen3-Embedding / gte-Qwen2 / E5-mistral style.
- :func:`train_bpe_tokenizer`: a Qwen2-style byte-level BPE tokenizer trained on the run's own texts,
  so that a preset built from a config with random weights downloads nothing.
- :func:`end_texts_with_eos`: a tokenizer that ends every text with its EOS token, as
  Qwen3-Embedding's does, so that last-token pooling reads the same token in every text.
"""

from __future__ import annotations

RETRIEVAL_INSTRUCTION = "Instruct: Given a definition or a description, retrieve what it describes\nQuery: "


def train_bpe_tokenizer(texts, vocab_size):
    """A byte-level BPE tokenizer trained on ``texts`` (offline, seconds), with ``<|endoftext|>`` as its
    EOS and padding token and no special token added to a text, as Qwen2's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=eos)


def end_texts_with_eos(tokenizer):
    """``tokenizer`` with a post-processor that appends its EOS token to every text (kept when a text
    is truncated), unless it already ends texts with it; a padding token (EOS) where it has none.
    The rule lives in the tokenizer, so it is saved and reloaded with the model."""
    from tokenizers.processors import TemplateProcessing

    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to end texts with (last-token pooling reads it)")
    if tokenizer.pad_token is None:  # Llama-style tokenizers have none
        tokenizer.pad_token = eos
    if tokenizer("a")["input_ids"][-1] != eos_id:
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
        )
    return tokenizer
