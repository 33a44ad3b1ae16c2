"""GPT-2's BPE built from the local files: the book's ids, The Verdict, and parity with tiktoken's own."""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import pytest
import tiktoken
import tiktoken_ext.openai_public
import torch

from gptlab.model.tokenizer import (
    END_OF_TEXT_ID,
    VOCAB_SIZE,
    cached_encoding,
    gpt2_tokenizer,
    load_tokenizer,
    text_to_token_ids,
    token_ids_to_text,
)

from helpers import committed_params_text

# Where tiktoken's own "gpt2" encoding fetches its files; it caches them under the SHA-1 of the URL.
VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a socket fails, as on a machine with no network."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer tried to use the network")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize(
    ("text", "ids"),
    [("Hello, I am", [15496, 11, 314, 716]), ("Every effort moves you", [6109, 3626, 6100, 345])],
)
def test_book_token_ids(tokenizer: tiktoken.Encoding, text: str, ids: list[int]) -> None:
    assert tokenizer.encode(text) == ids
    assert text_to_token_ids(text, tokenizer).tolist() == [ids]
    assert token_ids_to_text(torch.tensor([ids]), tokenizer) == text


def test_the_verdict_round_trip(tokenizer: tiktoken.Encoding, shared_data: Path) -> None:
    text = (shared_data / "the-verdict.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    assert len(text) == 20_479
    assert len(ids) == 5_145
    assert tokenizer.decode(ids) == text


def test_end_of_text_and_vocabulary(tokenizer: tiktoken.Encoding) -> None:
    assert tokenizer.n_vocab == VOCAB_SIZE == 50_257
    assert tokenizer.eot_token == END_OF_TEXT_ID == 50_256
    ids = text_to_token_ids("Hello<|endoftext|>world", tokenizer)[0].tolist()
    assert ids.count(END_OF_TEXT_ID) == 1
    # Outside text_to_token_ids the special token is refused, as tiktoken does by default.
    with pytest.raises(ValueError, match="endoftext"):
        tokenizer.encode("<|endoftext|>")


def test_offline_build_equals_tiktoken_gpt2(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    cached_encoding.cache_clear()  # built here, offline, not taken from an earlier test's cache
    ours = load_tokenizer(shared_data)
    # tiktoken's own encoding, fed the same files through its cache so it needs no network either.
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    for url, name in ((VOCAB_BPE_URL, "vocab.bpe"), (ENCODER_JSON_URL, "encoder.json")):
        shutil.copy(shared_data / "gpt2" / name, cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    reference = tiktoken.Encoding(**tiktoken_ext.openai_public.gpt2())
    assert ours._pat_str == reference._pat_str
    assert ours._mergeable_ranks == reference._mergeable_ranks
    assert ours._special_tokens == reference._special_tokens
    text = (shared_data / "the-verdict.txt").read_text(encoding="utf-8")
    assert ours.encode(text) == reference.encode(text)


def test_missing_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "vocab.bpe").write_text(committed_params_text())  # any file but a vocabulary
    with pytest.raises(FileNotFoundError, match=r"encoder\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"vocab\.bpe"):
        load_tokenizer(tmp_path / "nowhere")


def test_a_relative_path_is_looked_up_from_the_current_folder_every_time(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage caches the encoding of `data/raw/gpt2/...`; from a folder without those files it is not found."""
    with_files, without = tmp_path / "with", tmp_path / "without"
    shutil.copytree(shared_data / "gpt2", with_files / "data" / "raw" / "gpt2")
    without.mkdir()
    relative = (Path("data/raw/gpt2/vocab.bpe"), Path("data/raw/gpt2/encoder.json"))
    monkeypatch.chdir(with_files)
    assert gpt2_tokenizer(*relative).n_vocab == VOCAB_SIZE
    monkeypatch.chdir(without)
    with pytest.raises(FileNotFoundError, match="data/raw/gpt2/vocab.bpe not found"):
        gpt2_tokenizer(*relative)
