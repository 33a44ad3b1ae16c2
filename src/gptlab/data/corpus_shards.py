"""Any corpus's documents tokenized as a stream into uint16 shards, in a memory budget fixed whatever their number.

Every corpus is a source of documents (gutenberg_corpus.py: the books; files_corpus.py: the
user's own files) read one at a time. Each document is cut into pieces that encode to exactly
its ids (pieces_of), encoded a batch of pieces at a time on every core by tiktoken's batch
encoding, ended with `<|endoftext|>`, and appended to the train or val shards
(token_shards.ShardWriter): memory is one document, one batch and one shard per split,
whatever the number or length of the documents. Validation holds out whole documents
(is_validation), so no document is split between the two.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken
from tqdm import tqdm

from gptlab.data.token_shards import ShardWriter

# Characters encoded per text: documents are cut into pieces of about this size, so memory does not
# grow with a document's length and every core gets its share of each batch.
PIECE_CHARS = 1 << 16
# Characters encoded at once: the batch's text and token lists are most of the stage's own memory.
BATCH_CHARS = 2 << 20
SPLITS = ("train", "val")


@dataclass
class Document:
    """One document of a corpus, as its source read it."""

    text: str
    size: int  # its bytes on disk, for the progress bar
    # The source's report row for it, if it keeps one: its "split" is set and its "tokens" counted here.
    record: dict[str, Any] | None = None


@dataclass(frozen=True)
class Shards:
    """What tokenize_documents wrote, per split: the shard files, documents and tokens."""

    paths: dict[str, list[Path]]
    documents: dict[str, int]
    tokens: dict[str, int]

    def counts(self, unit: str = "documents") -> dict[str, dict[str, int]]:
        """Each split's documents (named `unit`: books, ...), tokens and shards, for counts.json."""
        return {
            split: {unit: self.documents[split], "tokens": self.tokens[split], "shards": len(paths)}
            for split, paths in self.paths.items()
        }


def is_validation(index: int, count: int, val_every: int) -> bool:
    """Whole documents held out: every `val_every`-th of the `count`, or the last when fewer."""
    if count < val_every:
        return index == count - 1
    return (index + 1) % val_every == 0


def tokenize_documents(
    documents: Iterable[Document],
    count: int,
    out_dir: Path,
    tokenizer: tiktoken.Encoding,
    *,
    val_every: int,
    shard_tokens: int,
    total_bytes: int,
) -> Shards:
    """`out_dir`/{train,val}-NNNNN.bin from the `count` documents, in their order."""
    writers = {split: ShardWriter(out_dir, split, shard_tokens) for split in SPLITS}
    taken = dict.fromkeys(SPLITS, 0)
    pending: list[tuple[str, Document, str, bool]] = []  # (split, its document, piece, the document's last)
    pending_chars = 0

    def encode_pending() -> None:
        encoded = tokenizer.encode_ordinary_batch(
            [p for _, _, p, _ in pending], num_threads=os.cpu_count() or 1
        )
        for (split, doc, _, last), ids in zip(pending, encoded, strict=True):
            ids.extend([tokenizer.eot_token] if last else [])
            writers[split].write(ids)
            if doc.record is not None:
                doc.record["tokens"] += len(ids)
        pending.clear()

    index = -1
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize") as bar:
        for index, doc in enumerate(documents):
            split = "val" if is_validation(index, count, val_every) else "train"
            taken[split] += 1
            if doc.record is not None:
                doc.record["split"] = split
            pieces = pieces_of(doc.text, PIECE_CHARS)
            pending += [(split, doc, piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            pending_chars += len(doc.text)
            if pending_chars >= BATCH_CHARS:
                encode_pending()
                pending_chars = 0
            bar.update(doc.size)
        encode_pending()
    if index + 1 != count:
        raise ValueError(f"{count} documents announced, {index + 1} read")
    paths = {split: writer.close() for split, writer in writers.items()}
    return Shards(paths, taken, {split: writer.tokens_written for split, writer in writers.items()})


@contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh folder beside `out_dir`, put in its place only when the block ends without error.

    A failure leaves the previous output (or none), never a mix of two runs' shards.
    """
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def pieces_of(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each encoding to exactly its share of the ids.

    Cut only before a line break that follows a non-space character: GPT-2's pre-tokenizer
    always ends a word there and starts the whitespace run anew, so no token spans a cut.
    """
    pieces, begin = [], 0
    while len(text) - begin > size:
        cut = text.find("\n", begin + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        pieces.append(text[begin:cut])
        begin = cut
    pieces.append(text[begin:])
    return pieces
