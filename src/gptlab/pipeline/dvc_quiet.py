"""`python -m gptlab.pipeline.dvc_quiet ARGS`: the dvc CLI, without its warnings for outputs not built yet.

`dvc exp run` first checks out every stage output it has a hash for, and warns
"No file hash info found ... It won't be created" for each it has none for: in a fresh
`gptlab smoke` workspace, every one of them. Those lines say nothing a first run needs;
`gptlab -v smoke` runs the plain `dvc` and keeps them. Everything else DVC prints stays.
"""

from __future__ import annotations

import logging
import sys

from dvc.cli import main

if __name__ == "__main__":
    logging.getLogger("dvc_data.index.checkout").setLevel(logging.ERROR)
    sys.exit(main(sys.argv[1:]))
