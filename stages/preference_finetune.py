"""Stage `preference-finetune`: the chapter 7 bonus, direct preference optimization (DPO) of the instruct model.

Reads models/instruct, which is both the policy that trains and its frozen
reference, and the preference splits of the tokenize stage; trains with the
shared loop and the DPO loss (gptlab.tasks.preference), whose evaluations also
average each split's chosen and rejected rewards. Then scores every test pair
before and after training, and answers every test record with both models.

Writes models/preference/ and, under reports/preference/, metrics.json (the
final losses and reward margins; on the test split before and after, the DPO
loss, the rewards and the shares of pairs whose chosen answer wins: DVC
metrics), counts.json, losses.csv (one row per evaluation, a DVC plot),
loss.png and reward_margins.png, and responses.json (the test answers before
and after). The MLflow run links the instruct run that wrote its model.
"""

from __future__ import annotations

from gptlab.pipeline.stage import answer_arguments_first, stage_main

answer_arguments_first(__name__, __doc__)  # before torch and mlflow load: --help answers at once

import dataclasses
import functools
import json
from pathlib import Path

import tiktoken
import torch

from gptlab.data.instruct import SPLITS, require_room
from gptlab.data.preference import SUBDIR, PreferenceDataset, load_split, preference_collate, split_path
from gptlab.files import write_figure, write_json
from gptlab.model.checkpoint import load_model, read_config
from gptlab.model.gpt import GPTModel
from gptlab.model.lora import add_lora, has_lora, merge_lora
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.paths import INSTRUCT_MODEL, PREFERENCE_MODEL, REPORTS
from gptlab.pipeline.params import Params
from gptlab.pipeline.plots import plot_reward_margins
from gptlab.pipeline.training_stage import (
    DatasetRead,
    Reports,
    TrainingRun,
    loss_table,
    trainable_metadata,
    training_run,
)
from gptlab.schema import flatten
from gptlab.tasks.config import PreferenceConfig
from gptlab.tasks.fine_tune import adds_lora, require_language_model, select_trainable
from gptlab.tasks.preference import (
    DpoLoss,
    answers_before_after,
    count_chosen_tokens,
    preference_metrics,
    score_pairs,
)
from gptlab.training.loop import require_one_batch
from gptlab.training.runtime import resolve_device

STAGE = "preference-finetune"
REPORT_DIR = REPORTS / "preference"
REWARDS = ["train_chosen_reward", "train_rejected_reward", "val_chosen_reward", "val_rejected_reward"]
LOSS_COLUMNS = ["step", "tokens_seen", "train_loss", "val_loss", *REWARDS]
# What answering reads: a crash while answering resumes after training even if they changed.
NOT_TRAINING = ("max_new_tokens", "generate")


def run(params: Params) -> None:
    cfg = params.preference
    processed_dir = Path(params.data.processed_dir)
    base_cfg, base_metadata = read_config(INSTRUCT_MODEL)
    require_language_model(base_cfg, INSTRUCT_MODEL, "the instruct-finetune stage's model")
    splits = {split: load_split(processed_dir, split) for split in SPLITS}
    tokenizer = gpt2_tokenizer(*params.data.bpe_files())
    datasets = {split: PreferenceDataset(records, tokenizer) for split, records in splits.items()}
    require_one_batch(len(datasets["train"]), cfg.train.batch_size, "preference.train.batch_size")
    lengths = {split: datasets[split].prompt_lengths for split in ("train", "val")}
    require_room(lengths, cfg.allowed_max_length, "preference.allowed_max_length")
    collate = functools.partial(
        preference_collate, allowed_max_length=cfg.allowed_max_length, mask_prompt=cfg.mask_prompt
    )
    with training_run(
        STAGE,
        params,
        logged=flatten(cfg, "preference"),
        fingerprint={k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_TRAINING},
        inputs=[INSTRUCT_MODEL, *(split_path(processed_dir, split) for split in SPLITS)],
        dataset=DatasetRead(
            "preference", processed_dir / SUBDIR, {f"{s}_records": len(r) for s, r in splits.items()}
        ),
        upstream=(INSTRUCT_MODEL, base_metadata),
    ) as stage:
        # The notebook's reference_model: the instruct model, frozen, on the device the policy trains on.
        reference, _ = load_model(INSTRUCT_MODEL, resolve_device(cfg.train.device))
        model, _ = load_model(INSTRUCT_MODEL, drop_rate=cfg.drop_rate)
        select_trainable(model, cfg.trainable)
        if adds_lora(cfg.trainable):
            torch.manual_seed(cfg.train.seed)  # A's draws, reproducible
            add_lora(model, cfg.lora.rank, cfg.lora.alpha)
        trainable = stage.report_trainable(model, "instruct", cfg.trainable, cfg.lora)
        torch.manual_seed(cfg.train.seed)  # the notebook seeds just before training
        loss_fn = DpoLoss(reference, cfg.beta)
        result = stage.fit(
            model,
            datasets["train"],
            datasets["val"],
            cfg.train,
            loss_fn,
            collate_fn=collate,
            count_seen=count_chosen_tokens,
        )
        if not stage.main:  # another torchrun process: rank 0 scores, answers and writes the outputs
            return
        if has_lora(model):  # scored, answered and saved as a plain GPT-2
            merge_lora(model)
        score = functools.partial(
            score_pairs, dataset=datasets["test"], batch_size=cfg.train.batch_size, collate_fn=collate
        )
        before, after = score(reference, desc="test pairs before"), score(model, desc="test pairs after")
        metrics = preference_metrics(result.history[-1] if result.history else {}, before, after, cfg.beta)
        counts = {"steps": result.steps, "tokens_seen": result.seen, "trainable_params": trainable}
        counts |= {f"{split}_records": len(records) for split, records in splits.items()}
        _answer_test_records({"before": reference, "after": model}, tokenizer, splits["test"], cfg, stage)
        if result.history:
            write_figure(REPORT_DIR / "reward_margins.png", plot_reward_margins(result.history))
        metadata = {
            "stage": STAGE,
            "base_model": str(INSTRUCT_MODEL),
            "base_metadata": base_metadata,
            "steps": result.steps,
            "tokens_seen": result.seen,
            **trainable_metadata(cfg.trainable, trainable, cfg.lora),
            "beta": cfg.beta,
            "mask_prompt": cfg.mask_prompt,
            "allowed_max_length": cfg.allowed_max_length,
            "generation": {"max_new_tokens": cfg.max_new_tokens},  # how it answered: `gptlab chat`'s default
        }
        stage.publish(
            model,
            PREFERENCE_MODEL,
            metadata,
            Reports(REPORT_DIR, metrics, counts, loss_table(result.history, LOSS_COLUMNS), "loss.png"),
            result,
            kind="preference",
            model_defaults={"max_new_tokens": cfg.max_new_tokens},
        )
    print(json.dumps(metrics | counts, indent=2, sort_keys=True))


def _answer_test_records(
    models: dict[str, GPTModel],
    tokenizer: tiktoken.Encoding,
    records: list[dict[str, str]],
    cfg: PreferenceConfig,
    stage: TrainingRun,
) -> None:
    """responses.json: each test record answered by the model before and after; in MLflow as a table."""
    responses = answers_before_after(
        models, tokenizer, records, max_new_tokens=cfg.max_new_tokens, generate=cfg.generate
    )
    write_json(REPORT_DIR / "responses.json", responses, sort_keys=False)
    if responses:  # the MLflow UI shows a table in its evaluation view
        stage.tracker.log_table(
            {k: [r[k] for r in responses] for k in responses[0]}, "preference/answers.json"
        )


if __name__ == "__main__":
    stage_main(run, __doc__, trains=True)
