"""``examples/train_clip.py`` run as usual (one process, or one of torchrun's), recording the
training rows it reads into ``$CLIP_ROWS_DIR/rows-<rank>-<pid>.jsonl``, one line per row:

- streaming: ``{"rank", "epoch", "caption"}`` of every row that went into a batch, recorded in the
  DataLoader worker that decoded it;
- in memory: ``{"rank", "epoch", "index"}`` of every row a batch was made of (its index in the
  train split), recorded where the DataLoader fetched it.

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
        handle.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), **row}) + "\n")


def install(set_attribute=setattr) -> None:
    """Patch the two classes (a test passes ``monkeypatch.setattr`` to have them undone)."""
    batch = image_text_stream.DecodedPairBatches._batch

    def recording_batch(self, images, captions, skipped):
        for caption in captions:
            record(epoch=self.rows.epoch, caption=caption)
        return batch(self, images, captions, skipped)

    item = train_clip.PairDataset.__getitem__

    def recording_item(self, index):
        record(epoch=self.epoch, index=index)
        return item(self, index)

    set_attribute(image_text_stream.DecodedPairBatches, "_batch", recording_batch)
    set_attribute(train_clip.PairDataset, "__getitem__", recording_item)


def read_rows(folder) -> list[dict]:
    return [json.loads(line) for path in sorted(Path(folder).glob("rows-*.jsonl"))
            for line in path.read_text().splitlines()]


if __name__ == "__main__":
    install()
    train_clip.main(sys.argv[1:])
