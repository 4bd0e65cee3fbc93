"""Where the time of a gradient-cached step goes: CLIP ViT-B/32, one GPU, bf16 autocast.

Times (medians of CUDA-synchronised wall times, after warm-up), at batch ``--batch``:

- ``plain``: one forward with grad over the whole batch, the loss, one backward (the ceiling of
  any cached step is about 3/4 of its speed: caching adds one forward without grad);
- ``no-grad pass, chunk N``: the first phase of the cached step alone;
- ``fwd+bwd in chunks of N``: the replays alone (each chunk's forward and backward, no loss);
- ``cached, chunk N`` and ``cached, chunk N, no-grad chunk M``: the whole ``cached_step``;
- ``cached, chunk N, CUDA graphs``: the same with ``chunk_graphs`` (CUDA only); ``2 streams``: the
  text tower on a second stream, concurrent with the image tower (what ``chunk_cuda_graphs`` runs).

The floor of a cached step is "no-grad pass" + "fwd+bwd in chunks": what is left over is the
cost of the cache itself (loss on the cached embeddings, RNG bookkeeping, surrogate backward).

    python benchmarks/bench_cached_step.py                      # one H100 or H200, ~1 minute
    python benchmarks/bench_cached_step.py --tiny --steps 2     # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import Column, device_name, median_seconds, print_table  # noqa: E402
from bench_trainer import IMAGE_SIZE, TEXT_LENGTH, clip_b32_config  # noqa: E402

from hf_infcl import contrastive_loss  # noqa: E402
from hf_infcl.chunk_graphs import ChunkGraphs  # noqa: E402
from hf_infcl.grad_cache import cached_step, split_batch  # noqa: E402
from hf_infcl.models import model_family  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1536)
    parser.add_argument("--chunks", default="128,256,512", help="comma list of chunk sizes")
    parser.add_argument("--no-grad-chunks", default="1536", help="comma list of first-pass chunk sizes")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    options = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch_size = 32 if options.tiny else options.batch
    from transformers import CLIPModel

    config = clip_b32_config(options.tiny)
    torch.manual_seed(0)
    with device:
        model = CLIPModel(config).train()
    ids = torch.randint(0, config.text_config.vocab_size - 2, (batch_size, TEXT_LENGTH), device=device)
    ids[:, -1] = config.text_config.eos_token_id
    batch = {"pixel_values": torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, device=device),
             "input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def loss_fn(images, texts, log_scale):
        return contrastive_loss(images, texts, log_scale.exp())

    def encode(chunk):
        return model_family(model).encode_pairs(model, chunk)

    key_stream = torch.cuda.Stream() if cuda else None

    def two_streams(chunk):
        return model_family(model).encode_pairs_on_two_streams(model, chunk, key_stream)

    def plain():
        with autocast():
            images, texts = encode(batch)
        loss_fn(images, texts, model.logit_scale).backward()
        model.zero_grad(set_to_none=True)

    def no_grad_pass(size):
        def run():
            with torch.no_grad(), autocast():
                for chunk in split_batch(batch, size):
                    encode(chunk)
        return run

    def chunked_fwd_bwd(size):
        def run():
            for chunk in split_batch(batch, size):
                with autocast():
                    images, texts = encode(chunk)
                (images.float().sum() + texts.float().sum()).backward()
            model.zero_grad(set_to_none=True)
        return run

    def cached(size, no_grad_size=None, graphs=None, encoder=encode):
        def run():
            cached_step(encoder, batch, loss_fn, size, loss_params=[model.logit_scale],
                        forward_context=autocast, no_grad_chunk_size=no_grad_size, chunk_graphs=graphs)
            model.zero_grad(set_to_none=True)
        return run

    print(f"device: {device_name()}; torch {torch.__version__}; "
          f"CLIP ViT-B/32{' (tiny)' if options.tiny else ''}, "
          f"batch {batch_size}, bf16 autocast", flush=True)
    rows = []

    def measure(label, fn):
        rows.append((label, median_seconds(fn, options.steps, options.warmup)))

    measure("plain (fwd+bwd, whole batch)", plain)
    chunks = [min(int(c), batch_size) for c in options.chunks.split(",")]

    for size in chunks:
        measure(f"no-grad pass, chunk {size}", no_grad_pass(size))
        measure(f"fwd+bwd in chunks of {size}", chunked_fwd_bwd(size))
        measure(f"cached, chunk {size}", cached(size))
        for no_grad in options.no_grad_chunks.split(","):
            no_grad = min(int(no_grad), batch_size)
            if no_grad != size:
                measure(f"cached, chunk {size}, no-grad chunk {no_grad}", cached(size, no_grad))
        if cuda:
            graphs = ChunkGraphs(model.parameters())
            measure(f"cached, chunk {size}, CUDA graphs", cached(size, graphs=graphs))
            graphs = ChunkGraphs(model.parameters())
            measure(f"cached, chunk {size}, CUDA graphs, 2 streams",
                    cached(size, graphs=graphs, encoder=two_streams))
            del graphs
    reference = rows[0][1]
    columns = [Column("step", 44, align="<"), Column("ms", 9, ".1f"), Column("pairs/s", 10, ".0f"),
               Column("vs plain", 9, ".0%")]
    print()
    print_table(columns, [(label, seconds * 1e3, batch_size / seconds, reference / seconds)
                          for label, seconds in rows])


if __name__ == "__main__":
    main()
