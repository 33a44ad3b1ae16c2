"""OpenAI's GPT-2 weights through the Hugging Face hub client, checked against their pins before use.

A weights file is taken, in this order, from: its place under gpt2.download_dir
(hand-placed, or copied there from GPTLAB_MIRROR before) if it verifies; the
mirror folder, copied into that place; the Hugging Face cache, through
`huggingface_hub.hf_hub_download` at the pinned revision. The hub client reads
HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE itself, shows its own progress bar, and
returns a file already cached at a commit revision without any request. The
cached file is used where it lies, not copied (it is hundreds of MB, and DVC
tracks the converted checkpoint, not this file), once its size and sha256 match
the pin; a file that does not is refused, in one line naming it and the key.
"""

from __future__ import annotations

from pathlib import Path

from gptlab.data.config import HFWeights
from gptlab.data.fetch import MIRROR_ENV, Fetched, FetchError, fetch_local, sha256_file

# Where the pins point, recorded with each checkpoint whatever HF_ENDPOINT served the file.
CANONICAL_ENDPOINT = "https://huggingface.co"


def weights_url(pin: HFWeights) -> str:
    """The canonical Hugging Face URL of a pinned weights file, at its pinned revision."""
    # The hub client is imported where it is used: `gpt2.source: pretrain` never loads it.
    from huggingface_hub import hf_hub_url

    return hf_hub_url(pin.repo_id, pin.filename, revision=pin.revision, endpoint=CANONICAL_ENDPOINT)


def resolve_weights(
    pin: HFWeights, key: str, dest: Path, mirror_file: Path | None, *, or_else: str | None = None
) -> Fetched:
    """`pin`'s verified file: at `dest`, copied there from `mirror_file`, or in the Hugging Face cache.

    `key` (gpt2.weights.<name>) is named in every error, and `or_else`, the
    caller's last way out, ends it. Raises FetchError.
    """
    try:
        local = fetch_local(
            dest, url=weights_url(pin), sha256=pin.sha256, mirror_file=mirror_file, size=pin.size
        )
    except FetchError as exc:
        raise FetchError(f"{exc}\nOr {or_else}." if or_else else str(exc)) from exc
    if local is not None:
        return local
    mirror = (
        str(mirror_file) if mirror_file is not None else f"set {MIRROR_ENV} to a mirror folder holding it"
    )
    elsewhere = f"place the file with the pinned sha256 at {dest} or {mirror}" + (
        f", or {or_else}" if or_else else ""
    )
    path = hub_file(pin, key, elsewhere)
    return Fetched(path, "huggingface", path.stat().st_size)


def hub_file(pin: HFWeights, key: str, elsewhere: str) -> Path:
    """`pin`'s file in the Hugging Face cache, downloaded there first if missing, verified against the pin.

    Every failure is one line: what went wrong, then the network, HF_ENDPOINT and `elsewhere`.
    """
    # the hub client on first use: `gpt2.source: pretrain` never loads it
    from huggingface_hub import constants, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import LocalEntryNotFoundError

    url = hf_hub_url(pin.repo_id, pin.filename, revision=pin.revision)  # at HF_ENDPOINT, as downloaded
    try:
        path = Path(hf_hub_download(pin.repo_id, pin.filename, revision=pin.revision))
    except LocalEntryNotFoundError as exc:  # offline, or the hub out of reach, and nothing cached
        cause = type(exc.__cause__).__name__ if exc.__cause__ else "no answer"
        offline = constants.HF_HUB_OFFLINE  # as the client read it, when imported
        reason = "HF_HUB_OFFLINE is set" if offline else f"{constants.ENDPOINT} did not serve it ({cause})"
        raise FetchError(
            f"{key}: {pin.filename} of {pin.repo_id} at revision {pin.revision} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {reason}; get it with network access ({url}) or from a hub mirror "
            f"named by HF_ENDPOINT, {elsewhere}"
        ) from exc
    except OSError as exc:  # the hub refused (no such repo, revision or file; gated), or the disk did
        detail = next(iter(str(exc).strip().splitlines()), "")
        raise FetchError(
            f"{key}: {url} could not be downloaded ({type(exc).__name__}: {detail}); {elsewhere}"
        ) from exc
    check_pinned(path, pin, key)
    return path


def check_pinned(path: Path, pin: HFWeights, key: str) -> None:
    """Refuse a file whose size or sha256 is not the pin's, in one line naming the file and the key."""
    size = path.stat().st_size
    actual = sha256_file(path)
    if actual == pin.sha256.lower() and (pin.size is None or size == pin.size):
        return
    pinned_size = f" ({pin.size:,} bytes)" if pin.size is not None else ""
    raise FetchError(
        f"{key}: {path} in the Hugging Face cache has sha256 {actual} ({size:,} bytes), not the pinned "
        f"{pin.sha256}{pinned_size}, and is not used; download it again with `hf download {pin.repo_id} "
        f"{pin.filename} --revision {pin.revision} --force-download`, or correct the pin in params.yaml"
    )
