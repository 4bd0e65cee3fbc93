"""The training data of ``train_clip.py``, from the rows to the batches the loop trains on.

- :func:`load_datasets`: ``--dataset`` (the bundled sets, your files in memory, or a stream) and
  ``--eval_dataset``.
- :func:`training_batches`: the batches from an optimizer step on. DataLoader workers decode and
  transform the images in pieces of at most :data:`PIECE_ROWS` rows (:class:`PairDataset` in
  memory, ``image_text_stream.DecodedPairPieces`` streamed), so that the training process never
  decodes an image and many workers make one big batch together; a background thread of the
  training process (:class:`Prefetched`) joins a batch's pieces and tokenizes its captions
  (:class:`PairCollate`) while the previous batch trains.
- In memory, :class:`RankBatches` gives each process its share of every global batch, every row
  once per epoch, in an order drawn from (seed, epoch), so that a resumed run sees the batches the
  uninterrupted run would have.
- :func:`preprocess_images` and :func:`group_ids`: the held-out images' inputs and the caption
  groups (same class or same text: not each other's negatives).
"""

from __future__ import annotations

import copy
import math
import random
from collections import Counter

import torch

from hf_infcl.models import IMAGE_INPUTS

from bundled_data import (
    BUNDLED,
    SKIP_REASONS,
    ImageCaptionData,
    SkippedRow,
    decoded_or_skipped,
    load_classification_set,
    load_image_caption_data,
)
from image_text_stream import (
    DecodedPairPieces,
    endless_batches,
    image_inputs,
    load_image_caption_stream,
    piece_length,
    transformed_piece,
)

# Rows of a piece of a batch, what one DataLoader worker makes at a time: pieces rather than whole
# batches, so that many workers decode one big batch together and each holds little memory (256
# rows of 224 px images: 77 MB of bf16 pixel values); large enough that a piece's costs (one image
# processor call, one transfer between processes) are small beside its decoding.
PIECE_ROWS = 256


class PairDataset(torch.utils.data.Dataset):
    """Image-caption examples made into pieces of batches where a piece is fetched: in a
    DataLoader worker (--dataloader_num_workers > 0), so that the training process never decodes
    an image.

    Load it with ``batch_sampler=EpochBatches(RankBatches(...), piece_rows)`` and
    ``collate_fn=batch_as_is``: the DataLoader hands each piece, (epoch, batch number, last piece
    of its batch?, indices), to ``__getitems__``, which decodes the images, transforms them in one
    image-processor call (pixel values in ``pixel_dtype``) and draws one caption per row:
    :func:`transformed_piece`, with ``"batch"`` (the piece's first three fields) and ``"skipped"``
    ({index: reason}: a row whose image does not decode is left out of its piece).
    :func:`epoch_batches` joins a batch's pieces.

    The caption draw is a function of (seed, epoch, index), not of a running generator, so a run
    resumed from a checkpoint sees exactly the captions the uninterrupted run would have seen.
    """

    def __init__(self, examples, caption_groups, image_processor, seed, base=None, pixel_dtype=torch.float32):
        self.examples = examples
        self.caption_groups = caption_groups
        self.image_processor = image_processor
        self.seed = seed
        self.base = base  # folder that relative image paths start from
        self.pixel_dtype = pixel_dtype

    def __len__(self):
        return len(self.examples)

    def __getitems__(self, piece):
        epoch, number, last, indices = piece
        images, captions, groups, skipped = [], [], [], {}
        for index in indices:
            example = self.examples[index]
            image = decoded_or_skipped(example.image, self.base)
            if isinstance(image, SkippedRow):
                skipped[index] = image.reason
                if epoch == 0:  # once, not in every epoch
                    print(f"skipping a training row ({example.captions[0]!r}): {image}", flush=True)
                continue
            draw = random.Random((self.seed * 1_000_003 + epoch) * 1_000_003 + index)
            choice = draw.randrange(len(example.captions))
            images.append(image)
            captions.append(example.captions[choice])
            groups.append(self.caption_groups[index][choice])
        made = transformed_piece(self.image_processor, images, captions, groups, self.pixel_dtype)
        return {**made, "batch": (epoch, number, last), "skipped": skipped}


def batch_as_is(batch):
    """The DataLoader's ``collate_fn`` for :class:`PairDataset`, whose pieces come made."""
    return batch


def load_training_data(data_args, seed, log) -> ImageCaptionData:
    """--dataset: the bundled sets, your files in memory, or (--streaming) a stream whose
    training rows are read during training (``extra["stream"]``)."""
    options = {"image_column": data_args.image_column, "caption_column": data_args.caption_column, "log": log}
    if data_args.streaming:
        return load_image_caption_stream(data_args.dataset, held_out_rows=data_args.held_out_samples,
                                         **options)
    options["max_held_out"] = data_args.held_out_samples
    data = load_image_caption_data(data_args.dataset, seed=seed,
                                   **(options if data_args.dataset not in BUNDLED else {}))
    if data_args.max_train_samples is not None:
        data.train = data.train[: data_args.max_train_samples]
    return data


def load_datasets(data_args, seed, log) -> tuple[ImageCaptionData, ImageCaptionData | None]:
    """--dataset (:func:`load_training_data`) and --eval_dataset (a labelled image set for zero-shot
    accuracy, or None). A problem with the data is a ValueError naming the flag."""
    data = load_training_data(data_args, seed, log)
    if data_args.eval_dataset is None:
        return data, None
    classification = load_classification_set(
        data_args.eval_dataset, data_args.eval_image_column, data_args.label_column, data_args.class_names,
        data_args.prompt_template, log=log)
    # the tiny default model's word vocabulary must know the prompts' words
    data.extra.setdefault("vocabulary", []).extend(classification.vocabulary_text())
    return data, classification


def training_batches(data, sampler, collate, image_processor, *, batch_size, rank, world, seed, num_workers,
                     shuffle_buffer_size, mixed_precision="no", step=0, skipped=None) -> Prefetched:
    """The batches of ``batch_size`` rows to train on from optimizer step ``step`` on, made one ahead
    (:class:`Prefetched`; close it at the end): with a ``sampler`` (:class:`RankBatches`) the rows of
    ``data.train`` in memory, epoch after epoch; without, the stream ``data.extra["stream"]`` pass
    after pass. ``collate`` joins a batch's pieces (:class:`PairCollate`); the rows the workers
    skip are collected into ``skipped`` ({row key: reason}); the pixel values are made in the
    dtype of ``mixed_precision`` (Accelerate's: no, bf16 or fp16)."""
    piece_rows = min(PIECE_ROWS, batch_size)
    skipped = {} if skipped is None else skipped
    # Under --mixed_precision bf16 / fp16 the vision tower's first layer runs in that dtype under
    # autocast whatever the pixels' dtype (CLIP and SigLIP cast the pixels to the weights' dtype,
    # which autocast rounds to bf16 / fp16 again: the same values), so the workers make the pixel
    # values in it: half the bytes to make, send between processes, join and copy.
    pixel_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    if sampler is None:
        stream = DecodedPairPieces(
            data.extra["stream"], rank=rank, world_size=world, seed=seed,
            shuffle_buffer_size=shuffle_buffer_size, batch_size=batch_size, piece_rows=piece_rows,
            image_processor=image_processor, collate=collate, pixel_dtype=pixel_dtype)
        loader = data_loader(stream, num_workers, batch_size=None)
        return Prefetched(endless_batches(loader, stream, skipped, skip_batches=step))
    dataset = PairDataset(data.train, group_ids(data, data.train), image_processor, seed=seed,
                          base=data.extra.get("base"), pixel_dtype=pixel_dtype)
    loader = data_loader(dataset, num_workers, persistent_workers=True,
                         batch_sampler=EpochBatches(sampler, piece_rows), collate_fn=batch_as_is)
    return Prefetched(epoch_batches(loader, sampler, skipped, collate, step))


def data_loader(dataset, num_workers, persistent_workers=False, **options):
    """A DataLoader with ``num_workers`` workers (--dataloader_num_workers). Its pieces are not
    pinned: they are copied once more, into the batch, which :class:`PairCollate` allocates pinned
    (pinned pieces would hold a second pinned copy of the batch's rows, and a batch joined from
    them would not be pinned)."""
    return torch.utils.data.DataLoader(dataset, num_workers=num_workers,
                                       persistent_workers=persistent_workers and num_workers > 0, **options)


def epoch_batches(loader, sampler, skipped: dict, collate, step: int = 0):
    """The batches of ``loader`` epoch after epoch, each joined from its pieces by ``collate``,
    from optimizer step ``step`` on (a resumed run skips the batches its epoch had already
    trained on, without reading them), collecting each piece's skipped rows into ``skipped``
    ({index: reason}). The DataLoader gives the pieces in the sampler's order, whichever workers
    made them, so a batch's pieces come one after the other."""
    epoch, skip = divmod(step, len(sampler))
    while True:
        sampler.set_epoch(epoch, skip_batches=skip)
        pieces = []
        for piece in loader:
            skipped.update(piece.pop("skipped"))
            if pieces and pieces[-1]["batch"][:2] != piece["batch"][:2]:
                raise RuntimeError(f"a piece of batch {piece['batch'][:2]} (epoch, number) came before "
                                   f"batch {pieces[-1]['batch'][:2]} was complete")
            pieces.append(piece)
            if piece["batch"][2]:  # the batch's last piece
                yield joined_batch(pieces, collate)
                pieces = []
        epoch, skip = epoch + 1, 0


def joined_batch(pieces, collate):
    """One batch of its ``pieces`` (tagged with the batch's (epoch, number)), those with rows."""
    with_rows = [piece for piece in pieces if piece_length(piece)]
    if not with_rows:
        epoch, number, _ = pieces[-1]["batch"]
        raise ValueError(f"no image of this process's batch {number} of epoch {epoch} decodes")
    return collate(with_rows)


class Prefetched:
    """The batches of the generator ``batches`` made one ahead in a background thread, so that
    joining a batch's pieces (copying gigabytes of pixel values) and tokenizing its captions
    overlap the training step instead of stalling the GPU: ``torch.cat`` and the Rust tokenizers
    release the GIL (a Python loop in the training thread ran as fast during a join as alone).
    Two batches are in host memory: the one training and the next, made while it trains.
    An exception of the thread is raised again by ``next`` (the same exception, with its
    message); :meth:`close` ends the thread and the generator (and so its DataLoader iterator).

    A plain ``threading.Thread``, not a ``ThreadPoolExecutor``: the DataLoader forks its workers
    from this thread, and a process forked from an executor's thread exits with code 1 (Python
    3.11), which the DataLoader reports as a worker that died."""

    def __init__(self, batches):
        import queue
        import threading

        self._batches = batches
        self._wanted, self._made = queue.Queue(), queue.Queue()  # True: make one more; False: stop
        self._thread = threading.Thread(target=self._make, name="join-batches", daemon=True)
        self._thread.start()
        self._wanted.put(True)

    def _make(self):
        while self._wanted.get():
            try:
                self._made.put((next(self._batches), None))
            except BaseException as error:  # for the training thread to raise
                self._made.put((None, error))
                return

    def __iter__(self):
        return self

    def __next__(self):
        batch, error = self._made.get()
        if error is not None:
            raise error
        self._wanted.put(True)
        return batch

    def close(self):
        self._wanted.put(False)  # after the batch being made, if any
        self._thread.join()
        self._batches.close()


def preprocess_images(image_processor, examples, batch_size=512) -> dict:
    """The image inputs (:func:`image_inputs`) of every (decoded) example: the held-out and
    zero-shot sets, computed once."""
    chunks = [image_inputs(image_processor, [ex.image for ex in examples[start : start + batch_size]])
              for start in range(0, len(examples), batch_size)]
    return {name: torch.cat([chunk[name] for chunk in chunks]) for name in chunks[0]}


def group_ids(data: ImageCaptionData, examples):
    """Per caption, the id of the things it is interchangeable with: its class, else its text."""
    text_ids: dict[str, int] = {}
    groups = []
    for ex in examples:
        if ex.label is not None and data.class_names is not None:
            groups.append([ex.label] * len(ex.captions))
        else:
            groups.append([text_ids.setdefault(c, len(text_ids)) for c in ex.captions])
    return groups


class PairCollate:
    """Pieces of a batch (:func:`transformed_piece`) -> the batch, in the training process (in
    :class:`Prefetched`'s thread): the pixel values copied into one tensor (allocated pinned
    when ``pin_memory``, so that the copies to the GPU are fast and asynchronous, several times
    faster than from pageable memory; pinning a large batch the first time takes seconds, after
    which PyTorch's host allocator hands the same block to later batches), the
    captions tokenized together, padded as one batch whatever the pieces.

    ``padding="max_length"`` for SigLIP, whose text tower pools the last position and was trained
    on captions padded to the full length. The tokenizer is a copy of the one given: this one
    tokenizes in a background thread while evaluation tokenizes in the training thread, and a fast
    tokenizer's padding and truncation settings are shared state."""

    def __init__(self, tokenizer, max_length, padding="longest", pin_memory=False):
        self.tokenizer, self.max_length, self.padding = copy.deepcopy(tokenizer), max_length, padding
        self.pin_memory = pin_memory

    def __call__(self, pieces):
        batch = {name: self._joined([piece[name] for piece in pieces])
                 for name in IMAGE_INPUTS if name in pieces[0]}
        captions = [caption for piece in pieces for caption in piece["captions"]]
        text = self.tokenizer(captions, padding=self.padding, truncation=True, max_length=self.max_length,
                              return_tensors="pt")
        batch.update(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                     groups=torch.cat([piece["groups"] for piece in pieces]))
        return batch

    def _joined(self, tensors):
        joined = torch.empty((sum(map(len, tensors)), *tensors[0].shape[1:]), dtype=tensors[0].dtype,
                             pin_memory=self.pin_memory)
        return torch.cat(tensors, out=joined)


def make_collate(tokenizer, max_length, padding="longest", pin_memory=False):
    return PairCollate(tokenizer, max_length, padding, pin_memory)


class RankBatches(torch.utils.data.Sampler):
    """This process's share of every contrastive batch of an epoch (a DataLoader ``batch_sampler``).

    An epoch is one permutation of the rows, drawn from (seed, epoch) so that a resumed run sees
    the same order, cut into global batches of ``per_device * world`` rows, each split between the
    processes. Nothing is dropped or repeated: the last, shorter batch is split as evenly as it
    goes (shares differ by at most one row; the loss's ring takes uneven shares), and when it has
    fewer rows than there are processes it joins the batch before it, so that every process has
    rows. ``equal_shares`` (FSDP2 or --reduce_every_chunk with chunks, where every process must
    run as many chunks as the others) cuts that last batch to a multiple of ``world`` instead:
    at most ``world - 1`` rows, different ones every epoch, are left out of an epoch.
    """

    def __init__(self, rows: int, per_device: int, rank: int, world: int, seed: int, equal_shares=False):
        if rows < per_device * world:
            largest = rows - rows % world
            fix = (f"the largest --global_batch_size that works is {largest}" if largest
                   else f"it has fewer pairs than the {world} processes")
            raise ValueError(f"--global_batch_size {per_device * world} is larger than the train split "
                             f"({rows} pairs): {fix}")
        self.rows, self.per_device, self.rank, self.world = rows, per_device, rank, world
        self.seed, self.equal_shares = seed, equal_shares
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def _global_batches(self) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.rows, generator=generator)
        if self.equal_shares:
            order = order[: self.rows - self.rows % self.world]
        batches = list(order.split(self.per_device * self.world))
        if len(batches[-1]) < self.world:  # too few to give every process a row
            batches[-2:] = [torch.cat(batches[-2:])]
        return batches

    def __iter__(self):
        for batch in self._global_batches()[self.skip:]:
            yield batch.tensor_split(self.world)[self.rank].tolist()

    def __len__(self) -> int:
        full, rest = divmod(self.rows - (self.rows % self.world if self.equal_shares else 0),
                            self.per_device * self.world)
        return full + (rest >= self.world)


class EpochBatches(torch.utils.data.Sampler):
    """``sampler``'s batches cut into pieces of at most ``piece_rows`` rows, each as (epoch, batch
    number, last piece of its batch?, indices): the DataLoader's workers make the pieces, several
    workers one batch, and :func:`epoch_batches` joins them. The epoch travels with each piece to
    the workers, which can then live from epoch to epoch (their copy of the dataset would not see
    a ``set_epoch``), instead of starting anew every epoch."""

    def __init__(self, sampler: RankBatches, piece_rows: int):
        self.sampler, self.piece_rows = sampler, piece_rows

    def __iter__(self):
        epoch = self.sampler.epoch
        for number, batch in enumerate(self.sampler, start=self.sampler.skip):
            for start in range(0, len(batch), self.piece_rows):
                end = start + self.piece_rows
                yield epoch, number, end >= len(batch), batch[start:end]

    def __len__(self) -> int:
        return sum(math.ceil(len(batch) / self.piece_rows) for batch in self.sampler)


def skipped_rows(loading: dict, met: dict) -> dict:
    """{reason: count} of the rows the run skipped: ``loading``, those skipped while loading
    ({reason: count}, the same in every process), and ``met``, those this process's DataLoader
    workers met ({row key: reason}), gathered from every process so that a row met by several
    (in memory, a row goes to another process next epoch) or in several passes counts once."""
    from accelerate.utils import gather_object

    met_anywhere = {}
    for part in gather_object([met]):
        met_anywhere.update(part)
    counts = Counter(loading) + Counter(met_anywhere.values())
    return {reason: counts[reason] for reason in SKIP_REASONS if counts[reason]}
