"""Where the project is, and where the stages write their models and reports within it.

The output paths are project-relative (DVC runs each stage from the root); dvc.yaml's
`outs:` name the same folders.
"""

from __future__ import annotations

from pathlib import Path

# Stage pretrain: GPT-2 trained from scratch on The Verdict (read by eval and load-gpt2).
PRETRAIN_MODEL = Path("models") / "pretrain"
# Stage load-gpt2: one base model per name, GPT2_MODELS/<name>/ (read by both fine-tunes).
GPT2_MODELS = Path("models") / "gpt2"
# Stage spam-finetune: the classifier (read by `gptlab classify`).
SPAM_MODEL = Path("models") / "spam"
# Stage instruct-finetune: the instruction-tuned model (read by `gptlab chat`).
INSTRUCT_MODEL = Path("models") / "instruct"
# Stage preference-finetune: the instruct model tuned with DPO (`gptlab chat --model models/preference`).
PREFERENCE_MODEL = Path("models") / "preference"
# Each stage's JSON/CSV/PNG reports, REPORTS/<stage>/ (DVC metrics and plots).
REPORTS = Path("reports")
# In a copy of the project that runs apart (a `gptlab smoke` workspace, wherever it is): the
# project's root, one line. Inside the copy's own git folder, so git never tracks it.
PROJECT_POINTER = Path(".git") / "gptlab-project"


def project_root(start: Path | None = None) -> Path:
    """The project a command runs in, from `start` (default: the working directory) or any folder below.

    The outermost folder above holding a dvc.yaml, so DVC's temporary experiment copies
    (`.dvc/tmp/exps/...`) and the smoke workspace (`.gptlab/smoke/`) belong to the project
    that holds them; a copy elsewhere names its project in PROJECT_POINTER. Without any
    dvc.yaml above, `start` itself.
    """
    here = (start or Path.cwd()).resolve()
    found = [folder for folder in (here, *here.parents) if (folder / "dvc.yaml").is_file()]
    if not found:
        return here
    pointer = found[-1] / PROJECT_POINTER
    if pointer.is_file():
        project = Path(pointer.read_text(encoding="utf-8").strip())
        if (project / "dvc.yaml").is_file():
            return project
    return found[-1]
