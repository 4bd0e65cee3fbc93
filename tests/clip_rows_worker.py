"""``examples/train_clip.py`` run as usual (one process, or one of torchrun's), recording the
training rows it reads into ``$CLIP_ROWS_DIR/rows-<rank>-<pid>.jsonl``, one line per row, where
the row is decoded (``"pid"``: a DataLoader worker's, unless there are none):

- streaming: ``{"rank", "epoch", "caption", "pid"}`` of every row that went into a batch (or into
  a worker's rest after its last full batch);
- in memory: ``{"rank", "epoch", "index", "pid"}`` of every row a batch was made of (its index in
  the train split, a row whose image does not decode included).

The patches are made before ``main`` starts the DataLoader workers, which inherit them (fork).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train_clip  # noqa: E402

import image_text_stream  # noqa: E402


def record(**row) -> None:
    path = Path(os.environ["CLIP_ROWS_DIR"]) / f"rows-{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl"
    with path.open("a") as handle:
        handle.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), **row}) + "\n")


def install(set_attribute=setattr) -> None:
    """Patch the two classes (a test passes ``monkeypatch.setattr`` to have them undone)."""
    items = image_text_stream.DecodedPairBatches._items

    def recording_items(self, images, captions):
        for caption in captions:
            record(epoch=self.rows.epoch, caption=caption)
        return items(self, images, captions)

    getitems = train_clip.PairDataset.__getitems__

    def recording_getitems(self, batch):
        epoch, indices = batch
        for index in indices:
            record(epoch=epoch, index=index)
        return getitems(self, batch)

    set_attribute(image_text_stream.DecodedPairBatches, "_items", recording_items)
    set_attribute(train_clip.PairDataset, "__getitems__", recording_getitems)


def read_rows(folder) -> list[dict]:
    return [json.loads(line) for path in sorted(Path(folder).glob("rows-*.jsonl"))
            for line in path.read_text().splitlines()]


if __name__ == "__main__":
    install()
    record(training_process=True)
    train_clip.main(sys.argv[1:])
