"""Stage `download`: every external input params.yaml pins, verified, into data.raw_dir.

Each file comes from data.raw_dir if already there with the right hash, else
from the mirror folder named by GPTLAB_MIRROR, else from its URL.
Offline: set GPTLAB_MIRROR to a folder of the pinned files (`gptlab mirror DIR` writes one).
With corpus.name gutenberg, the books the corpus takes too, several at once; a rerun
after an interruption fetches only the books still missing.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses

from gptlab.data.config import SourceFile
from gptlab.data.fetch import fetch, mirror_dir, safe_relative_path
from gptlab.data.gutenberg import corpus_books, list_digest
from gptlab.data.gutenberg_fetch import fetch_books
from gptlab.files import project_folder
from gptlab.pipeline.params import Params
from gptlab.schema import flatten
from gptlab.tracking.runs import stage_run


def run(params: Params) -> None:
    raw_dir = project_folder(params.data.raw_dir, "data.raw_dir")
    mirror = mirror_dir()
    sources: dict[str, SourceFile] = {
        field.name: getattr(params.data.sources, field.name)
        for field in dataclasses.fields(params.data.sources)
    }
    # Refuse a bad path in params before anything is fetched.
    paths = {name: safe_relative_path(src.path, f"data.sources.{name}.path") for name, src in sources.items()}
    corpus = params.corpus.gutenberg
    books = corpus_books(corpus) if params.corpus.name == "gutenberg" else []
    logged = flatten(params.data, "data") | (flatten(params.corpus, "corpus") if books else {})
    with stage_run(
        "download", params.tracking.experiment, logged, system_metrics=params.tracking.system_metrics
    ) as tracker:
        manifest = {}
        for name, src in sources.items():
            got = fetch(
                raw_dir / paths[name],
                url=src.url,
                sha256=src.sha256,
                mirror_file=mirror / paths[name] if mirror is not None else None,
                member=src.member,
            )
            manifest[name] = {
                "path": str(got.path),
                "origin": got.origin,
                "bytes": got.size,
                "sha256": src.sha256,
            }
            print(f"{name}: {got.path} ({got.size:,} bytes, {got.origin})")
            tracker.log_input(name, got.path, context="source", profile={"bytes": got.size, "url": src.url})
        tracker.log_params({f"bytes.{name}": entry["bytes"] for name, entry in manifest.items()})
        tracker.set_tags({f"origin.{name}": entry["origin"] for name, entry in manifest.items()})
        if books:
            origins = fetch_books(books, raw_dir, corpus.path, mirror)
            print(f"gutenberg: {len(books)} books in {raw_dir / corpus.path} ({origins})")
            profile = {"books": len(books), "bytes": sum(book.bytes for book in books)}
            tracker.log_input("gutenberg_books", raw_dir / corpus.path, context="source", profile=profile)
            tracker.set_tags({f"origin.gutenberg.{origin}": count for origin, count in origins.items()})
            manifest["gutenberg"] = profile | {"list_sha256": list_digest(books), "origins": origins}
        tracker.log_dict(manifest, "download/manifest.json")


if __name__ == "__main__":
    stage_main(run, __doc__)
