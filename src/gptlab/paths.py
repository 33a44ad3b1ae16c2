"""Where the stages write their models and reports, project-relative (DVC runs each stage from the root).

Defined once here; dvc.yaml's `outs:` name the same folders.
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
# Each stage's JSON/CSV/PNG reports, REPORTS/<stage>/ (DVC metrics and plots).
REPORTS = Path("reports")
