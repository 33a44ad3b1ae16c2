"""Every external input params.yaml pins, and how it lies in a mirror folder (GPTLAB_MIRROR).

A mirror folder holds each of `data.sources` at its `path` (the file itself,
already extracted when its URL serves a zip) and each of `gpt2.weights` at
`gpt2-weights/<name>/<filename>`. `fetch_input` puts one pinned file into a
folder laid out that way, through the same fetch as the pipeline (present with
the right hash -> GPTLAB_MIRROR -> its URL, sha256-verified, atomic); weights
come from the Hugging Face hub client instead of a URL (hub_weights.py) and are
copied out of its cache, since a mirror folder must hold the files themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gptlab.data.config import HFWeights, SourceFile, Sources
from gptlab.data.fetch import Fetched, fetch, fetch_local, safe_relative_path
from gptlab.data.hub_weights import resolve_weights, weights_url

# Where weights files lie inside a mirror folder: gpt2-weights/<name>/<filename>.
WEIGHTS_SUBDIR = "gpt2-weights"


@dataclass(frozen=True)
class PinnedInput:
    """One pinned external file: its params key, its place in a mirror folder, and its pin."""

    key: str  # e.g. data.sources.the_verdict or gpt2.weights.gpt2-small
    path: PurePosixPath  # relative to a mirror folder
    url: str
    sha256: str
    member: str | None = None  # the file to extract when `url` serves a zip archive
    size: int | None = None
    hub: HFWeights | None = None  # weights: obtained through the Hugging Face hub client, not `url`


def data_inputs(sources: Sources) -> list[PinnedInput]:
    """Every file of `data.sources`, in params order; a bad `path` is refused before anything is fetched."""
    pins: list[PinnedInput] = []
    for field in dataclasses.fields(sources):
        src: SourceFile = getattr(sources, field.name)
        key = f"data.sources.{field.name}"
        pins.append(
            PinnedInput(key, safe_relative_path(src.path, f"{key}.path"), src.url, src.sha256, src.member)
        )
    return pins


def weights_inputs(weights: Mapping[str, HFWeights]) -> list[PinnedInput]:
    """Every weights file of `gpt2.weights` (OpenAI's GPT-2 models, hundreds of MB each)."""
    pins: list[PinnedInput] = []
    for name, pin in weights.items():
        key = f"gpt2.weights.{name}"
        path = PurePosixPath(WEIGHTS_SUBDIR) / safe_relative_path(name, key)
        path /= safe_relative_path(pin.filename, f"{key}.filename")
        pins.append(PinnedInput(key, path, weights_url(pin), pin.sha256, size=pin.size, hub=pin))
    return pins


def fetch_input(pin: PinnedInput, folder: Path, mirror: Path | None = None) -> Fetched:
    """`pin` at its place under `folder`: kept if already verified, else from `mirror`, else its URL.

    Raises FetchError (a GptlabError) saying how to supply the file when no source works.
    """
    dest = Path(folder) / pin.path
    mirror_file = Path(mirror) / pin.path if mirror is not None else None
    if pin.hub is None:
        return fetch(
            dest, url=pin.url, sha256=pin.sha256, mirror_file=mirror_file, member=pin.member, size=pin.size
        )
    got = resolve_weights(pin.hub, pin.key, dest, mirror_file)
    if got.origin != "huggingface":
        return got
    copied = fetch_local(dest, url=pin.url, sha256=pin.sha256, mirror_file=got.path, size=pin.size)
    assert copied is not None, f"{got.path} was verified a moment ago"
    return dataclasses.replace(copied, origin="huggingface")
