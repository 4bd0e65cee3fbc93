"""``examples/train_clip.py`` run as usual (one process, or one of torchrun's), recording the
training rows it reads into ``$CLIP_ROWS_DIR/rows-<rank>-<pid>.jsonl``, one line per row, where
the row is decoded (``"pid"``: a DataLoader worker's, unless there are none):

- streaming: ``{"rank", "epoch", "caption", "pid"}`` of every row that went into a piece of a batch;
- in memory: ``{"rank", "epoch", "batch", "index", "pid"}`` of every row a piece of a batch was
  made of (its index in the train split, a row whose image does not decode included; ``"batch"``:
  the batch's number in its epoch).

``$CLIP_PIECE_ROWS``, where set, is the rows of a piece (``image_text_batches.PIECE_ROWS``).
The patches are made before ``main`` starts the DataLoader workers, which inherit them (fork).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_clip  # noqa: E402

import image_text_batches  # noqa: E402
import image_text_stream  # noqa: E402


def record(**row) -> None:
    path = Path(os.environ["CLIP_ROWS_DIR"]) / f"rows-{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl"
    with path.open("a") as handle:
        handle.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), **row}) + "\n")


def install(set_attribute=setattr) -> None:
    """Patch the two classes and the piece size (a test passes ``monkeypatch.setattr`` to have them
    undone)."""
    piece = image_text_stream.DecodedPairPieces._piece

    def recording_piece(self, images, captions, skipped):
        for caption in captions:
            record(epoch=self.rows.epoch, caption=caption)
        return piece(self, images, captions, skipped)

    getitems = image_text_batches.PairDataset.__getitems__

    def recording_getitems(self, piece):
        epoch, number, _, indices = piece
        for index in indices:
            record(epoch=epoch, batch=number, index=index)
        return getitems(self, piece)

    set_attribute(image_text_stream.DecodedPairPieces, "_piece", recording_piece)
    set_attribute(image_text_batches.PairDataset, "__getitems__", recording_getitems)
    if "CLIP_PIECE_ROWS" in os.environ:
        set_attribute(image_text_batches, "PIECE_ROWS", int(os.environ["CLIP_PIECE_ROWS"]))


def read_rows(folder) -> list[dict]:
    return [json.loads(line) for path in sorted(Path(folder).glob("rows-*.jsonl"))
            for line in path.read_text().splitlines()]


if __name__ == "__main__":
    install()
    record(training_process=True)
    train_clip.main(sys.argv[1:])
