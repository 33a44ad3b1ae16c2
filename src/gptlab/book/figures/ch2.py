"""Chapter 2, working with text data: the regex tokenizers, GPT-2's BPE, sliding windows, embeddings."""

from __future__ import annotations

from gptlab.book.figures.inputs import FigureInputs, tokenizer, verdict_text

__all__ = [
    "verdict_opening",
    "regex_split",
    "verdict_words",
    "vocabulary_size",
    "vocabulary_ids",
    "simple_encode",
    "simple_round_trip",
    "bpe_ids",
    "bpe_ids_batch",
    "bpe_round_trip",
    "bpe_pieces",
    "bpe_vocabulary_size",
    "verdict_tokens",
    "verdict_ids",
    "loader_batches",
    "seeded_embedding",
]


def verdict_opening(run: FigureInputs | None, chars: int) -> str:
    """The first characters of The Verdict (listing 2.1's `raw_text[:99]`)."""
    return verdict_text(run)[:chars]


def regex_split(run: FigureInputs | None, text: str, pattern: str, strip: bool) -> list[str]:
    """re.split keeping the separators; `strip` drops blank pieces (section 2.2's three steps)."""
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import split_words

    return split_words(text, pattern, strip=strip)


def verdict_words(run: FigureInputs | None) -> int:
    """Words and punctuation marks of The Verdict under listing 2.4's pattern."""
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import split_words

    return len(split_words(verdict_text(run)))


def _vocab(run: FigureInputs | None, specials: bool) -> dict[str, int]:
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import END_OF_TEXT, UNKNOWN, build_vocab, split_words

    return build_vocab(split_words(verdict_text(run)), (END_OF_TEXT, UNKNOWN) if specials else ())


def vocabulary_size(run: FigureInputs | None, specials: bool) -> int:
    """Distinct words of The Verdict (listing 2.2), with or without <|endoftext|> and <|unk|>."""
    return len(_vocab(run, specials))


def vocabulary_ids(run: FigureInputs | None, words: list[str], specials: bool) -> list[int]:
    """The ids these words get in The Verdict's vocabulary."""
    vocab = _vocab(run, specials)
    return [vocab[word] for word in words]


def _simple_tokenizer(run: FigureInputs | None, version: int):  # noqa: ANN202 - one of two demo classes
    # book.demos (torch) on first use: keeps `gptlab --help` fast
    from gptlab.book.demos import SimpleTokenizerV1, SimpleTokenizerV2

    if version == 1:
        return SimpleTokenizerV1(_vocab(run, specials=False))
    return SimpleTokenizerV2(_vocab(run, specials=True))


def simple_encode(run: FigureInputs | None, version: int, text: str) -> list[int]:
    """Listing 2.3's (version 1) or 2.4's (version 2) tokenizer over The Verdict's vocabulary."""
    return _simple_tokenizer(run, version).encode(text)


def simple_round_trip(run: FigureInputs | None, version: int, text: str) -> str:
    """decode(encode(text)): the spaces the simple tokenizers cannot restore, the <|unk|> they put in."""
    simple = _simple_tokenizer(run, version)
    return simple.decode(simple.encode(text))


def bpe_ids(run: FigureInputs | None, text: str) -> list[int]:
    """GPT-2's BPE ids, <|endoftext|> allowed (section 2.5)."""
    return tokenizer(run).encode(text, allowed_special={"<|endoftext|>"})


def bpe_ids_batch(run: FigureInputs | None, texts: list[str]) -> list[list[int]]:
    """BPE ids of several texts, one row each (chapter 4's batch)."""
    return [bpe_ids(run, text) for text in texts]


def bpe_round_trip(run: FigureInputs | None, text: str) -> str:
    return tokenizer(run).decode(bpe_ids(run, text))


def bpe_pieces(run: FigureInputs | None, text: str) -> list[str]:
    """The subword each BPE id stands for: how an unknown word is spelled out."""
    bpe = tokenizer(run)
    return [bpe.decode([token]) for token in bpe_ids(run, text)]


def bpe_vocabulary_size(run: FigureInputs | None) -> int:
    return tokenizer(run).n_vocab


def verdict_tokens(run: FigureInputs | None) -> int:
    """GPT-2 BPE tokens of the whole of The Verdict (the book's `len(tokenizer.encode(raw_text))`)."""
    return len(tokenizer(run).encode(verdict_text(run)))


def verdict_ids(run: FigureInputs | None, start: int, length: int) -> list[int]:
    """A slice of The Verdict's BPE ids (section 2.6's `enc_text[50:]`)."""
    return tokenizer(run).encode(verdict_text(run))[start : start + length]


def loader_batches(
    run: FigureInputs | None, batch_size: int, max_length: int, stride: int, batches: int
) -> list[list[list[list[int]]]]:
    """The first [inputs, targets] batches of the pipeline's GPTDatasetV1 over The Verdict, in order."""
    # torch on first use: keeps `gptlab --help` fast
    from gptlab.data.verdict import GPTDatasetV1
    from gptlab.training.runtime import ordered_loader

    dataset = GPTDatasetV1(tokenizer(run).encode(verdict_text(run)), max_length, stride)
    loader = iter(ordered_loader(dataset, batch_size))
    return [[part.tolist() for part in next(loader)] for _ in range(batches)]


def seeded_embedding(
    run: FigureInputs | None, num_embeddings: int, dim: int, seed: int, ids: list[int] | None = None
) -> list[list[float]]:
    """torch.nn.Embedding after `seed`: its weight (section 2.7), or the rows it returns for `ids`."""
    # torch on first use: keeps `gptlab --help` fast
    import torch

    torch.manual_seed(seed)
    layer = torch.nn.Embedding(num_embeddings, dim)
    with torch.no_grad():
        return (layer.weight if ids is None else layer(torch.tensor(ids))).tolist()
