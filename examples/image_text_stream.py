"""Image-caption data streamed through ``datasets`` (``train_clip.py --streaming``): data larger
than memory, read shard by shard, decoded in the DataLoader's workers.

- :func:`load_image_caption_stream` opens ``--dataset`` as an ``IterableDataset`` (the same forms
  as without ``--streaming``: parquet and webdataset ``.tar`` shards, CSV / JSON-lines files, an
  image folder, a Hub id). It reads only the first rows: ``held_out_rows`` of them become the
  held-out split (decoded here: they are few), and the first captions give the tiny default
  model its word vocabulary. The training rows are the whole stream less the held-out ones,
  recognised by a digest of their caption and image bytes (so that sharding cannot let them
  leak into training, as ``skip(n)`` would: it skips ``n`` rows spread over the shards).
- :class:`DecodedPairPieces` is this process's share of the training rows as pieces of batches:
  the stream is shuffled (shard order and a buffer of ``--shuffle_buffer_size`` rows, the same
  seed on every process) and split between processes with ``split_dataset_by_node`` (whole shards
  when their number is a multiple of the processes, else every ``world``-th row); ``datasets``
  splits a process's shards again between the DataLoader workers. Each worker decodes, checks and
  transforms (the model's image processor) pieces of ``piece_rows`` good rows (and, at the end of
  its shards, the rows left): pieces rather than whole batches, so that many workers make one big
  batch together and none holds a whole batch.
- :func:`endless_batches` joins the pieces, in the order they come, into batches of exactly
  ``batch_size`` rows (cutting a piece where a batch ends), pass after pass (each pass reshuffled;
  training length is ``--max_steps``). The rows that do not fill a batch at the end of a pass open
  the next pass's first batch, so that no row is lost. A resumed run replays the stream up to
  where it stopped (its batches read and dropped).

Bad rows are skipped with one line each (in the first pass), in the worker that meets them. The
training process learns of them through the pieces: every piece carries the rows its worker
skipped while filling it (``"skipped"``: {row digest: reason}). :func:`endless_batches` collects
them by digest, so that a bad row met again in a later pass is counted once.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass

import torch

from bundled_data import (
    ImageCaptionData,
    ImageCaptionExample,
    SkippedRow,
    _require_datasets,
    _table_of,
    checked_columns,
    usable_pair,
)

# The tiny default model's word vocabulary comes from this many first captions (a pretrained
# model, --model_name_or_path, brings its own tokenizer).
VOCABULARY_ROWS = 10_000


def pair_key(row: dict, image_column: str, caption_column: str) -> bytes:
    """A digest of a row's caption and (undecoded) image: the same row gives the same key in any
    process or worker."""
    image = row.get(image_column)
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    digest = hashlib.blake2b(str(row.get(caption_column)).encode(), digest_size=16)
    digest.update(image if isinstance(image, (bytes, bytearray)) else repr(image).encode())
    return digest.digest()


def caption_group(caption: str) -> int:
    """A 63-bit id of a caption's text, equal in every process, so that identical captions in two
    processes' rows are masked as false negatives across the ring."""
    return int.from_bytes(hashlib.blake2b(caption.encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class PairStream:
    """The training rows of a stream and how to read them (picklable: it travels to the workers)."""

    rows: object  # datasets.IterableDataset
    path: str
    image_column: str
    caption_column: str
    base: str | None  # folder that relative image paths start from
    held_out_keys: frozenset


def load_image_caption_stream(
    path: str,
    image_column: str = "image_path",
    caption_column: str = "caption",
    held_out_rows: int = 256,
    log=print,
) -> ImageCaptionData:
    """``path`` as a stream: an :class:`ImageCaptionData` with no ``train`` list, the held-out
    examples (the first ``held_out_rows`` rows, less bad ones), ``extra["stream"]`` (a
    :class:`PairStream` of the rest), ``extra["vocabulary"]`` (the first captions) and
    ``extra["skipped"]`` (the held-out rows skipped, by reason)."""
    datasets = _require_datasets()
    stream, base, builder = _table_of(path, datasets, streaming=True)
    stream, image_column = checked_columns(stream, path, builder, image_column, caption_column, datasets)
    held_out, keys, skipped = [], set(), Counter()
    for index, row in enumerate(stream.take(held_out_rows)):
        keys.add(pair_key(row, image_column, caption_column))
        pair = usable_pair(row, image_column, caption_column, base)
        if isinstance(pair, SkippedRow):
            skipped[pair.reason] += 1
            log(f"skipping row {index} of {path}: {pair}")
            continue
        held_out.append(ImageCaptionExample(pair[0], (pair[1],)))
    if not held_out:
        raise ValueError(f"--dataset {path}: no usable rows among the first {held_out_rows} "
                         f"(skipped: {dict(skipped)})")
    captions = stream.select_columns([caption_column]).take(VOCABULARY_ROWS)
    vocabulary = [str(row[caption_column]) for row in captions if row[caption_column] is not None]
    return ImageCaptionData(
        name=os.path.basename(os.path.normpath(path.split("*")[0] or path)),
        train=[],
        held_out=held_out,
        description=f"user data streamed from {path}",
        extra={
            "skipped": dict(skipped),
            "vocabulary": vocabulary,
            "stream": PairStream(stream, path, image_column, caption_column, base, frozenset(keys)),
        },
    )


def image_inputs(image_processor, images, pixel_dtype=torch.float32) -> dict:
    """The model's image inputs of ``images`` from one call of its image processor: ``pixel_values``
    (in ``pixel_dtype``) and, for NaFlex models (SigLIP 2), ``pixel_attention_mask`` and
    ``spatial_shapes`` (each image's patches, padded to the processor's ``max_num_patches``)."""
    from hf_infcl.models import IMAGE_INPUTS

    made = image_processor(images=images, return_tensors="pt")
    inputs = {name: made[name] for name in IMAGE_INPUTS if name in made}
    inputs["pixel_values"] = inputs["pixel_values"].to(pixel_dtype)
    return inputs


def transformed_piece(image_processor, images, captions, groups, pixel_dtype=torch.float32) -> dict:
    """A piece of a batch, made in a DataLoader worker: the images' :func:`image_inputs` (one call
    of the model's image processor), ``captions`` (text: the training process tokenizes a whole
    batch's at once, padded as one batch) and ``groups`` (a tensor). Without images (every row of
    the piece skipped) the piece is empty: ``{"captions": []}``."""
    if not images:
        return {"captions": []}
    return {**image_inputs(image_processor, images, pixel_dtype), "captions": list(captions),
            "groups": torch.tensor(groups, dtype=torch.long)}


def piece_length(piece: dict) -> int:
    return len(piece["captions"])


def cut_pieces(pieces: list[dict], rows: int) -> tuple[list[dict], list[dict]]:
    """``pieces`` cut after their first ``rows`` rows: (the pieces of those rows, the rest), a
    piece that straddles the cut split in two (its pixel values as views, not copies)."""
    head, rest = [], list(pieces)
    while rows > 0:
        piece = rest.pop(0)
        if piece_length(piece) > rows:
            rest.insert(0, {name: value[rows:] for name, value in piece.items()})
            piece = {name: value[:rows] for name, value in piece.items()}
        head.append(piece)
        rows -= piece_length(piece)
    return head, rest


class DecodedPairPieces(torch.utils.data.IterableDataset):
    """This process's training pairs as pieces of at most ``piece_rows`` good pairs, made in the
    DataLoader's workers (load it with ``batch_size=None``): :func:`transformed_piece` and
    ``"skipped"``, {digest: reason} of the rows skipped while filling the piece. A worker's last
    piece holds the rows after its last full one (maybe none, only skipped rows)."""

    def __init__(self, pairs: PairStream, *, rank: int, world_size: int, seed: int, shuffle_buffer_size: int,
                 batch_size: int, piece_rows: int, image_processor, collate, pixel_dtype=torch.float32):
        from datasets.distributed import split_dataset_by_node

        super().__init__()
        # The same seed on every process: they agree on the shard order, so that each process
        # gets different shards (datasets' own advice for distributed shuffling).
        rows = pairs.rows.shuffle(seed=seed, buffer_size=shuffle_buffer_size)
        self.rows = split_dataset_by_node(rows, rank=rank, world_size=world_size)
        self.pairs = pairs
        self.batch_size, self.piece_rows = batch_size, piece_rows
        self.image_processor, self.pixel_dtype = image_processor, pixel_dtype
        self.collate = collate  # joins pieces into a batch, in the training process

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for pass ``epoch`` (call before iterating: workers get a copy of this object)."""
        self.rows.set_epoch(epoch)

    def _piece(self, images, captions, skipped) -> dict:
        groups = [caption_group(c) for c in captions]
        piece = transformed_piece(self.image_processor, images, captions, groups, self.pixel_dtype)
        return {**piece, "skipped": skipped}

    def __iter__(self):
        pairs = self.pairs
        images, captions, skipped = [], [], {}
        for row in self.rows:  # in a worker, datasets reads only that worker's shards
            key = pair_key(row, pairs.image_column, pairs.caption_column)
            if key in pairs.held_out_keys:
                continue
            pair = usable_pair(row, pairs.image_column, pairs.caption_column, pairs.base)
            if isinstance(pair, SkippedRow):
                skipped[key] = pair.reason
                if self.rows.epoch == 0:  # once, not in every pass
                    where = f" (key {row['__key__']})" if "__key__" in row else ""
                    print(f"skipping a row of {pairs.path}{where}: {pair}", flush=True)
                continue
            images.append(pair[0])
            captions.append(pair[1])
            if len(images) == self.piece_rows:
                yield self._piece(images, captions, skipped)
                images, captions, skipped = [], [], {}
        if images or skipped:
            yield self._piece(images, captions, skipped)


def endless_batches(loader, dataset: DecodedPairPieces, skipped: dict, skip_batches: int = 0):
    """The batches of ``batch_size`` rows joined from ``loader``'s pieces, pass after pass (each
    pass reshuffled), collecting every piece's skipped rows into ``skipped`` ({digest: reason}).

    The pieces wait in arrival order until they hold a batch's rows; the rows left at the end of
    a pass (at most ``batch_size - 1``) wait for the next pass's: no row of a pass is lost, a few
    are trained on at the start of the next pass instead.

    ``skip_batches``: a resumed run's optimizer step. The stream is replayed from its start and
    that many batches are read (decoded in the workers) and dropped unjoined, so that the run goes
    on with the batch the uninterrupted run would have trained on next, at the cost of reading
    them again (``datasets`` can restore a stream's position, but not one split between
    DataLoader workers without torchdata's StatefulDataLoader)."""
    epoch, waiting, given = 0, [], 0
    while True:
        dataset.set_epoch(epoch)
        given_before = given
        for piece in loader:
            skipped.update(piece.pop("skipped"))
            if piece_length(piece):
                waiting.append(piece)
            while sum(map(piece_length, waiting)) >= dataset.batch_size:
                batch, waiting = cut_pieces(waiting, dataset.batch_size)
                given += 1
                if given > skip_batches:
                    yield dataset.collate(batch)
        if given == given_before:  # fewer usable rows in a pass than one batch
            raise ValueError(
                f"a whole pass over this process's share of {dataset.pairs.path} gave fewer than "
                f"{dataset.batch_size} usable pairs: lower --per_device_train_batch_size"
            )
        epoch += 1
