"""GPT-2's byte-pair encoding through tiktoken, built from local files.

`tiktoken.get_encoding("gpt2")` downloads its BPE files on first use; building
the same Encoding from the pinned `vocab.bpe` and `encoder.json` that the
download stage fetched keeps every stage offline.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import tiktoken
import torch
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_ID = 50256
VOCAB_SIZE = 50257

# The hashes tiktoken itself expects for GPT-2's files.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def gpt2_tokenizer(vocab_bpe: Path | str, encoder_json: Path | str) -> tiktoken.Encoding:
    """The GPT-2 encoding, identical to `tiktoken.get_encoding("gpt2")`.

    The files are looked for on every call and the encoding is cached by their absolute
    paths, so a relative path read from another folder never finds a stale encoding.
    """
    for path in (Path(vocab_bpe), Path(encoder_json)):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: run `dvc repro download` (or set GPTLAB_MIRROR) to fetch GPT-2's BPE files"
            )
    return cached_encoding(Path(vocab_bpe).resolve(), Path(encoder_json).resolve())


@lru_cache(maxsize=4)
def cached_encoding(vocab_bpe: Path, encoder_json: Path) -> tiktoken.Encoding:
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: END_OF_TEXT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


def load_tokenizer(raw_dir: Path | str) -> tiktoken.Encoding:
    """The GPT-2 encoding from the download stage's output folder (or a mirror laid out alike)."""
    raw_dir = Path(raw_dir)
    return gpt2_tokenizer(raw_dir / "gpt2" / "vocab.bpe", raw_dir / "gpt2" / "encoder.json")


def text_to_token_ids(text: str, tokenizer: tiktoken.Encoding) -> torch.Tensor:
    """(1, t) tensor of ids; `<|endoftext|>` in the text is encoded as the special token."""
    return torch.tensor(tokenizer.encode(text, allowed_special={END_OF_TEXT})).unsqueeze(0)


def token_ids_to_text(token_ids: torch.Tensor, tokenizer: tiktoken.Encoding) -> str:
    return tokenizer.decode(token_ids.squeeze(0).tolist())
