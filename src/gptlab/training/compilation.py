"""`train.compile`: the training step through torch.compile, its compiled code kept between runs.

Inductor's FX-graph and AOT-autograd caches go to the project's git-ignored
`.gptlab/compile-cache/` (unless TORCHINDUCTOR_CACHE_DIR names another folder),
so a compile is paid once per machine and torch version and later runs load it.
Where compiling fails (no C++ compiler, an op the compiler cannot take), the step
runs eager after one line on stderr, rather than the run failing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gptlab.training.losses import LossFn

COMPILE_CACHE = Path(".gptlab") / "compile-cache"


def use_project_compile_cache() -> None:
    """Point inductor's caches at COMPILE_CACHE, unless the user named a folder of their own.

    Importing torch._dynamo already set TORCHINDUCTOR_CACHE_DIR to inductor's default
    (a folder in /tmp, gone at the next reboot), so that value counts as not set.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports torch._dynamo: ~1.5 s

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(COMPILE_CACHE.resolve())


class CompiledOrEager:
    """`loss_fn` compiled on first call; eager from then on if the compile fails."""

    def __init__(self, loss_fn: LossFn) -> None:
        use_project_compile_cache()
        self.eager = loss_fn
        self.compiled: LossFn | None = torch.compile(loss_fn)

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if self.compiled is not None:
            from torch._dynamo.exc import TorchDynamoException  # loaded by torch.compile already

            try:
                return self.compiled(model, batch)
            except TorchDynamoException as error:
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                message = f"train.compile: torch.compile failed, training eager instead ({reason})"
                tqdm.write(message, file=sys.stderr)  # a line of its own beside the progress bar
                self.compiled = None
        return self.eager(model, batch)
