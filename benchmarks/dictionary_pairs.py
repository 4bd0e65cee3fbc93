"""Definition -> word pairs from two dictionaries that install offline, split by word.

- WordNet glosses -> their synset's lemmas (``examples/text_pairs.py``'s ``wordnet_pairs``, Debian's
  ``wordnet-base``): "a domesticated carnivorous mammal ..." -> "dog, domestic dog, Canis familiaris";
- the GNU Collaborative International Dictionary of English (Debian's ``dict-gcide``, GPL-3+), read
  from its dictd files (``gcide.index`` and ``gcide.dict.dz`` / ``gcide.dict``): each numbered sense
  of an entry -> its headword, lower-cased ("to distribute or assign; to allot." -> "allocate").

:func:`merge_pairs` keeps the first pair of each normalised definition (GCIDE copies many WordNet
1.5 glosses); :func:`split_by_word` holds out whole words, so that no word of a held-out passage is
in any training passage.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

from text_pairs import find_wordnet_dir, wordnet_pairs  # noqa: E402  (examples/ is put on the path above)

GCIDE_DIRS = ("/usr/share/dictd", "/usr/local/share/dictd")
GCIDE_LICENSE = "GCIDE: GNU General Public License v3 or later (dict-gcide)"
BASE64_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
MIN_DEFINITION_CHARS = 8  # the shortest definition kept, as wordnet_pairs does

__all__ = [
    "DictionarySplit",
    "cap_senses",
    "decode_dictd_number",
    "dictd_entries",
    "find_gcide_dir",
    "gcide_pairs",
    "merge_pairs",
    "normalise_definition",
    "read_pairs",
    "split_by_word",
    "wordnet_pairs",
    "write_pairs",
    "find_wordnet_dir",
]


def decode_dictd_number(text: str) -> int:
    """A dictd index offset or length: base64 digits, most significant first ("Bfk" -> 6116)."""
    value = 0
    for digit in text:
        position = BASE64_DIGITS.find(digit)
        if position < 0:
            raise ValueError(f"not a dictd base64 number: {text!r}")
        value = value * 64 + position
    return value


def find_gcide_dir(gcide_dir: str | None = None) -> str | None:
    """The folder holding ``gcide.index``, or None when dict-gcide is not installed; a folder given
    without one is an error naming ``--gcide-dir``."""
    for folder in [gcide_dir] if gcide_dir else GCIDE_DIRS:
        if os.path.isfile(os.path.join(folder, "gcide.index")):
            return folder
    if gcide_dir:
        raise FileNotFoundError(f"--gcide-dir {gcide_dir} has no gcide.index")
    return None


def _read_dictd_data(path_without_suffix: str) -> bytes:
    """The whole text of ``NAME.dict.dz`` (dictzip is gzip-compatible) or ``NAME.dict``."""
    if os.path.isfile(path_without_suffix + ".dict.dz"):
        with gzip.open(path_without_suffix + ".dict.dz") as handle:
            return handle.read()
    if os.path.isfile(path_without_suffix + ".dict"):
        with open(path_without_suffix + ".dict", "rb") as handle:
            return handle.read()
    raise FileNotFoundError(f"no {path_without_suffix}.dict.dz or .dict beside its index")


def dictd_entries(folder: str, name: str = "gcide"):
    """Each distinct entry text of the dictd dictionary ``name`` in ``folder``, in index order.
    Index lines are ``word<TAB>offset<TAB>length`` (base64); several words may point at one entry,
    and the ``00-database-*`` lines point at the dictionary's own description, left out."""
    data = _read_dictd_data(os.path.join(folder, name))
    seen = set()
    with open(os.path.join(folder, f"{name}.index"), encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3:
                raise ValueError(f"{name}.index line {number}: expected word, offset, length; got {line!r}")
            if fields[0].startswith("00-"):
                continue
            span = (decode_dictd_number(fields[1]), decode_dictd_number(fields[2]))
            if span in seen:
                continue
            seen.add(span)
            yield data[span[0] : span[0] + span[1]].decode("utf-8", errors="replace")


_HEADWORD = re.compile(r"^\s*(.+?)\s*\\")  # "Allocate \Al"lo*cate\, v. t. ..." -> "Allocate"
_SENSE_NUMBER = re.compile(r"^(\d+\.|\([a-z]\))\s+")
_SOURCE_TAG = re.compile(r"\[[^\]]*\]")  # [1913 Webster], [Obs.], [WordNet 1.5]
# synonym lists, notes, citations, sub-entries, sources, and bare cross-references ("See Guanaco.")
_SKIPPED_PARAGRAPHS = ("Syn:", "Note:", "Ant:", "Usage:", "--", "{", "[", "See ")


def _entry_definitions(text: str):
    """(headword, [definition, ...]) of one GCIDE entry: its numbered or plain sense paragraphs
    without sources, citations ("--Bacon."), synonym lists, notes or sub-entries ("{Dog days}")."""
    lines = text.split("\n")
    match = _HEADWORD.match(lines[0])
    if match is None:
        return None, []
    headword = match.group(1).strip().lower()
    body, depth = [], lines[0].count("[") - lines[0].count("]")
    for line in lines[1:]:
        if depth > 0:  # the etymology "[LL. allocatus, ...]" runs over the header's next lines
            depth += line.count("[") - line.count("]")
            continue
        body.append(line.strip())
    definitions = []
    for paragraph in "\n".join(body).split("\n\n"):
        paragraph = " ".join(paragraph.split())
        paragraph = _SENSE_NUMBER.sub("", paragraph)
        if not paragraph or paragraph.startswith(_SKIPPED_PARAGRAPHS):
            continue
        paragraph = paragraph.split(" --")[0]  # the citation's author
        paragraph = _SOURCE_TAG.sub("", paragraph).replace("{", "").replace("}", "")
        paragraph = " ".join(paragraph.split()).strip(" ;,")
        if len(paragraph) >= MIN_DEFINITION_CHARS:
            definitions.append(paragraph)
    return headword, definitions


def gcide_pairs(folder: str, name: str = "gcide"):
    """(definition, headword) for every sense of every entry of the dictd dictionary in ``folder``."""
    for text in dictd_entries(folder, name):
        headword, definitions = _entry_definitions(text)
        for definition in definitions:
            yield definition, headword


def normalise_definition(text: str) -> str:
    """The key definitions are deduplicated by: lower case, letters and digits, single spaces."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def merge_pairs(*sources) -> list[tuple[str, str]]:
    """The pairs of every source in order, the first of each normalised definition kept."""
    kept: dict[str, tuple[str, str]] = {}
    for pairs in sources:
        for definition, passage in pairs:
            kept.setdefault(normalise_definition(definition), (definition, passage))
    return list(kept.values())


def write_pairs(path: str, pairs) -> int:
    """``pairs`` as gzipped JSON lines ([definition, passage] each), for a machine without the
    dictionaries (the merged pairs of both are a few MB); returns how many were written."""
    count = 0
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for definition, passage in pairs:
            handle.write(json.dumps([definition, passage], ensure_ascii=False) + "\n")
            count += 1
    return count


def read_pairs(path: str) -> list[tuple[str, str]]:
    """The pairs :func:`write_pairs` wrote, in order; a line that is not a [definition, passage]
    pair is an error naming the file and line."""
    pairs = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            pair = json.loads(line)
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise ValueError(f"{path}, line {number}: not a [definition, passage] pair")
            pairs.append((pair[0], pair[1]))
    return pairs


def cap_senses(pairs, max_senses: int, seed: int = 0) -> list[tuple[str, str]]:
    """At most ``max_senses`` pairs per passage (a seeded random choice), in the pairs' order."""
    if max_senses < 1:
        raise ValueError(f"--max-senses must be at least 1, got {max_senses}")
    pairs = list(pairs)
    order = random.Random(seed).sample(range(len(pairs)), len(pairs))
    counts: dict[str, int] = {}
    kept = set()
    for index in order:
        passage = pairs[index][1]
        if counts.get(passage, 0) < max_senses:
            counts[passage] = counts.get(passage, 0) + 1
            kept.add(index)
    return [pair for index, pair in enumerate(pairs) if index in kept]


def passage_words(passage: str) -> list[str]:
    """The lower-cased words a passage names ("dog, domestic dog" -> ["dog", "domestic dog"])."""
    return [word.strip().lower() for word in passage.split(",") if word.strip()]


@dataclass
class DictionarySplit:
    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    dropped: int  # pairs sharing a word with a held-out passage but not held out themselves

    def candidates(self) -> list[str]:
        """Every distinct passage of both splits: what a held-out definition is ranked against."""
        return list(dict.fromkeys(passage for _, passage in self.train + self.held_out))


def split_by_word(pairs, held_out_pairs: int, seed: int = 0) -> DictionarySplit:
    """Hold out random words until at least ``held_out_pairs`` pairs name one of them. Held out: the
    pairs naming a held-out word; training: the pairs naming no word of any held-out passage (so a
    held-out synset's other lemmas are not trained on either); the pairs in between are dropped."""
    if held_out_pairs < 1:
        raise ValueError(f"--held-out-pairs must be at least 1, got {held_out_pairs}")
    pairs = list(pairs)
    by_word: dict[str, list[int]] = {}
    for index, (_, passage) in enumerate(pairs):
        for word in passage_words(passage):
            by_word.setdefault(word, []).append(index)
    words = sorted(by_word)
    random.Random(seed).shuffle(words)
    held = set()
    for word in words:
        if len(held) >= held_out_pairs:
            break
        held.update(by_word[word])
    if len(held) >= len(pairs):
        raise ValueError(f"--held-out-pairs {held_out_pairs} leaves no training pairs of {len(pairs)}")
    held_words = {word for index in held for word in passage_words(pairs[index][1])}
    train = [
        pair
        for index, pair in enumerate(pairs)
        if index not in held and held_words.isdisjoint(passage_words(pair[1]))
    ]
    held_out = [pairs[index] for index in sorted(held)]
    return DictionarySplit(train, held_out, len(pairs) - len(train) - len(held_out))
