"""Instructions and preference pairs of the user's own: JSON or JSONL, mapped field names, own splits;
bad files refused in one line naming file and record; degenerate pairs dropped and counted."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data import instruct, preference
from gptlab.data.config import InstructFields, InstructSplit, PreferenceFields, PreferenceSplit
from gptlab.errors import InputError
from gptlab.pipeline.params import Params, load_params
from gptlab.schema import ConfigError, build
from gptlab.tasks.config import PROMPT_TEMPLATE_TOKENS
from gptlab.tracking.lineage import dvc_md5
from stages import tokenize_data as tokenize_stage

from helpers import PROJECT_ROOT, committed_params, committed_params_raw

INSTRUCTIONS = [
    {
        "prompt": f"Name a colour, number {i}.",
        "context": "" if i % 2 else "Be brief.",
        "response": f"Blue {i}.",
    }
    for i in range(10)
]
PAIRS = [
    {"instruction": f"Greet person {i}.", "chosen": f"Hello, person {i}.", "rejected": f"Go away, {i}."}
    for i in range(10)
]
MAPPED = InstructFields(instruction="prompt", input="context", output="response")


def write(path: Path, records: list, kind: str) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps(records), encoding="utf-8")
    return path


def split(path: Path, cls: type = InstructSplit, **changes: object) -> InstructSplit:
    return cls(**{"train_frac": 0.6, "test_frac": 0.2, "max_records": None, "path": path.name, **changes})


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_own_instructions_with_mapped_fields_and_own_fractions(tmp_path: Path, kind: str) -> None:
    path = write(tmp_path / f"own.{kind}", INSTRUCTIONS, kind)
    records = instruct.read_splits(split(path, fields=MAPPED), path)
    assert records.total == 10
    assert {name: len(part) for name, part in records.splits.items()} == {"train": 6, "test": 2, "val": 2}
    first = records.splits["train"][0]
    assert first == {"instruction": "Name a colour, number 0.", "input": "Be brief.", "output": "Blue 0."}
    # an absent input is the book's empty one: no Input section in the prompt
    no_input = [{"prompt": "Say hi.", "response": "Hi."}] * 5
    path = write(tmp_path / f"bare.{kind}", no_input, kind)
    (entry, *_) = instruct.read_splits(split(path, fields=MAPPED), path).splits["train"]
    assert "### Input" not in instruct.format_prompt(entry) and entry["output"] == "Hi."


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_own_pairs_with_and_without_output(tmp_path: Path, kind: str, tokenizer) -> None:
    path = write(tmp_path / f"pairs.{kind}", PAIRS, kind)
    pairs = preference.read_splits(split(path, PreferenceSplit), path, tokenizer, book=False)
    assert not pairs.dropped and pairs.total == 10
    first = pairs.splits["train"][0]
    assert first["output"] == first["chosen"] == "Hello, person 0." and first["input"] == ""


@pytest.mark.parametrize(
    ("kind", "content", "message"),
    [
        (
            "json",
            [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c"}],
            "record 1 has no field 'output'",
        ),
        (
            "jsonl",
            [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": 3}],
            "line 2 has a non-string field 'output'",
        ),
        ("jsonl", [{"instruction": "a", "output": "b"}, ["not", "an", "object"]], "line 2 must be an object"),
    ],
)
def test_an_instruction_without_output_is_named(
    tmp_path: Path, kind: str, content: list, message: str
) -> None:
    path = write(tmp_path / f"bad.{kind}", content, kind)
    with pytest.raises(InputError, match=rf"bad\.{kind}: {message}"):
        instruct.read_splits(split(path), path)


def test_a_mapped_field_missing_names_the_files_own_name(tmp_path: Path) -> None:
    path = write(tmp_path / "own.jsonl", [{"prompt": "a", "answer": "b"}], "jsonl")
    with pytest.raises(InputError, match=r"line 1 has no field 'response' \(params name it for `output`\)"):
        instruct.read_splits(split(path, fields=MAPPED), path)


@pytest.mark.parametrize("missing", ["chosen", "rejected"])
@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_a_pair_without_an_answer_is_named(tmp_path: Path, kind: str, missing: str, tokenizer) -> None:
    records = [dict(r) for r in PAIRS]
    del records[3][missing]
    path = write(tmp_path / f"pairs.{kind}", records, kind)
    label = "line 4" if kind == "jsonl" else "record 3"
    with pytest.raises(InputError, match=rf"pairs\.{kind}: {label} has no field '{missing}'"):
        preference.read_splits(split(path, PreferenceSplit), path, tokenizer, book=False)


def test_a_jsonl_row_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "own.jsonl"
    path.write_text(
        '{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n', encoding="utf-8"
    )
    with pytest.raises(InputError, match=r"own\.jsonl: line 3 is not valid JSON"):
        instruct.read_splits(split(path), path)


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path, kind: str) -> None:
    path = write(tmp_path / f"own.{kind}", INSTRUCTIONS[:2], kind)
    path.write_bytes(path.read_bytes().replace(b"Blue 1", "Bl\u00e9 1".encode("latin-1")))
    with pytest.raises(InputError, match=rf"own\.{kind}: line {2 if kind == 'jsonl' else 1} is not UTF-8"):
        instruct.read_splits(split(path), path)


def test_a_split_with_no_record_is_refused_naming_the_fractions(tmp_path: Path) -> None:
    path = write(tmp_path / "few.json", [{"instruction": "a", "output": "b"}] * 4, "json")
    with pytest.raises(
        InputError, match=r"few\.json: the test split has 0 records \(of 4\).*tokenize\.instruct\.test_frac"
    ):
        instruct.read_splits(split(path), path)


def test_a_path_outside_the_project_or_of_another_kind_is_refused_by_the_params() -> None:
    base = {"train_frac": 0.8, "test_frac": 0.1, "max_records": None}
    for bad, why in (
        ("/tmp/own.json", "outside the project"),
        ("../own.json", "outside the project"),
        ("own.csv", ".json or .jsonl"),
    ):
        with pytest.raises(ConfigError, match=rf"tokenize\.instruct\.path: .*{why}"):
            build(InstructSplit, {**base, "path": bad}, "tokenize.instruct")


def test_degenerate_pairs_are_dropped_named_and_counted(tmp_path: Path, tokenizer) -> None:
    records = [dict(r) for r in PAIRS]
    records[1]["chosen"] = "  "
    records[4]["rejected"] = records[4]["chosen"]
    records[7]["chosen"] = "word " * 200_000  # a 1 MB answer
    path = write(tmp_path / "pairs.jsonl", records, "jsonl")
    cfg = split(path, PreferenceSplit, train_frac=0.5, test_frac=0.25)
    pairs = preference.read_splits(cfg, path, tokenizer, book=False)
    assert pairs.dropped == {
        "empty_answer": ["line 2"],
        "chosen_equals_rejected": ["line 5"],
        "too_long": ["line 8"],
    }
    kept = [r for split_ in pairs.splits.values() for r in split_]
    assert len(kept) == 7 and all(r["chosen"] != r["rejected"] and len(r["chosen"]) < 100 for r in kept)
    counts = preference.write_splits(pairs, tmp_path / "processed")
    assert counts["records"] == 10 and sum(counts[s]["records"] for s in ("train", "val", "test")) == 7
    assert counts["dropped"] == {"empty_answer": 1, "chosen_equals_rejected": 1, "too_long": 1}
    line = preference.describe_dropped(pairs, path)
    assert line == (
        f"{path}: 3 of 10 preference pairs dropped (empty answer: line 2; chosen equals rejected: line 5; "
        "too long: line 8)"
    )
    # the book's file trains on its identical pairs, as the notebook does
    kept_identical = preference.read_splits(cfg, path, tokenizer, book=True)
    assert "chosen_equals_rejected" not in kept_identical.dropped


def test_pairs_all_degenerate_leave_an_empty_split_refused(tmp_path: Path, tokenizer) -> None:
    records = [{**r, "rejected": r["chosen"]} for r in PAIRS]
    path = write(tmp_path / "same.json", records, "json")
    with pytest.raises(InputError, match=r"same\.json: the train split has 0 records \(of 0\)"):
        preference.read_splits(split(path, PreferenceSplit), path, tokenizer, book=False)


# --------------------------------------------------------------------------- the tokenize stage


def own_params(project: Path, raw_dir: Path) -> Params:
    params = committed_params()
    tokenize = params.tokenize
    fields = PreferenceFields(instruction="question", output="answer", chosen="good", rejected="bad")
    tokenize = dataclasses.replace(
        tokenize,
        instruct=dataclasses.replace(tokenize.instruct, path="own/instructions.jsonl", fields=MAPPED),
        preference=dataclasses.replace(tokenize.preference, path="own/pairs.json", fields=fields),
        spam=dataclasses.replace(tokenize.spam, file=str(raw_dir / params.data.sources.sms_spam.path)),
    )
    data = dataclasses.replace(
        params.data, raw_dir=str(raw_dir), processed_dir=str(project / "data" / "processed")
    )
    return dataclasses.replace(params, data=data, tokenize=tokenize)


def test_the_tokenize_stage_reads_own_files_logs_them_and_counts_the_dropped_pairs(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "own").mkdir()
    write(tmp_path / "own" / "instructions.jsonl", INSTRUCTIONS * 2, "jsonl")
    pairs = [{"question": r["instruction"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS * 2]
    pairs[5]["good"] = ""
    write(tmp_path / "own" / "pairs.json", pairs, "json")
    params = own_params(tmp_path, shared_data)
    tokenize_stage.run(params)
    assert (
        "own/pairs.json: 1 of 20 preference pairs dropped (empty answer: record 5)" in capsys.readouterr().err
    )
    counts = json.loads((tmp_path / "reports" / "tokenize" / "counts.json").read_text())
    assert counts["instruct"]["records"] == 20 and counts["instruct"]["train"]["records"] == 17
    assert counts["preference"]["records"] == 20
    assert counts["preference"]["dropped"] == {"empty_answer": 1, "chosen_equals_rejected": 0, "too_long": 0}
    train = preference.load_split(params.data.processed_dir, "train")
    assert train[0] == {
        "instruction": "Greet person 0.",
        "input": "",
        "output": "Hello, person 0.",
        "chosen": "Hello, person 0.",
        "rejected": "Go away, 0.",
    }
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("gptlab").experiment_id])
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    for name, file in (("instruct", "own/instructions.jsonl"), ("preference", "own/pairs.json")):
        assert inputs[name].dataset.digest == dvc_md5(tmp_path / file)
        assert {t.key: t.value for t in inputs[name].tags}["mlflow.data.context"] == "own"
        assert run.data.tags[f"gptlab.data.{name}"] == f"{file} ({dvc_md5(tmp_path / file)})"


def test_a_bad_own_file_stops_the_stage_before_anything_is_written(
    tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "own").mkdir()
    write(tmp_path / "own" / "instructions.jsonl", INSTRUCTIONS, "jsonl")
    write(tmp_path / "own" / "pairs.json", [{"question": "a", "good": "b"}], "json")
    with pytest.raises(InputError, match=r"own/pairs\.json: record 0 has no field 'bad'"):
        tokenize_stage.run(own_params(tmp_path, shared_data))
    assert not (tmp_path / "data").exists() and not (tmp_path / "reports").exists()


# --------------------------------------------------------------------------- room for an answer


def test_the_prompt_template_takes_the_tokens_the_params_check_counts(tokenizer) -> None:
    empty = instruct.format_prompt({"instruction": "", "input": ""})
    assert len(tokenizer.encode(empty)) == PROMPT_TEMPLATE_TOKENS


def test_a_length_that_cuts_a_prompt_before_its_answer_is_refused_naming_the_key(tokenizer) -> None:
    records = [{**r, "input": "", "output": r["chosen"]} for r in PAIRS]
    records[2] = {**records[2], "instruction": "Greet everyone here. " * 20}
    dataset = preference.PreferenceDataset(records, tokenizer)
    longest = dataset.prompt_lengths[2]
    # the prompt ends with its response header: the answer's first token comes next
    assert tokenizer.decode(dataset[2]["chosen"][longest:]) == records[2]["chosen"]
    instruct.require_room({"train": dataset.prompt_lengths}, longest + 1, "preference.allowed_max_length")
    with pytest.raises(
        InputError,
        match=rf"preference\.allowed_max_length: {longest} cannot hold a prompt and its answer: the train "
        rf"split's record 2 has a prompt of {longest} tokens; set it to {longest + 1} or more",
    ):
        instruct.require_room({"train": dataset.prompt_lengths}, longest, "preference.allowed_max_length")


# --------------------------------------------------------------------------- docs/own-data.md and its example


def docs_section() -> str:
    text = (PROJECT_ROOT / "docs" / "own-data.md").read_text(encoding="utf-8")
    return text.split("## Your own instructions and preferences")[1].split("\n## ")[0]


def test_the_docs_params_load_and_read_the_example_files(tmp_path: Path, tokenizer) -> None:
    (block,) = re.findall(r"```yaml\n(.*?)```", docs_section(), re.S)
    raw = committed_params_raw()
    for section, values in yaml.safe_load(block)["tokenize"].items():
        raw["tokenize"][section].update(values)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_params(tmp_path / "params.yaml").tokenize
    for split_ in (cfg.instruct, cfg.preference):
        assert not split_.is_book("data/raw", committed_params().data.sources.instruction_data)
    records = instruct.read_splits(cfg.instruct, PROJECT_ROOT / cfg.instruct.path)
    pairs = preference.read_splits(cfg.preference, PROJECT_ROOT / cfg.preference.path, tokenizer, book=False)
    assert records.total == pairs.total == 20 and not pairs.dropped
    assert {name: len(part) for name, part in pairs.splits.items()} == {"train": 17, "test": 2, "val": 1}
    # the pairs ask what the instructions ask, in the same order
    assert [r["instruction"] for r in records.splits["train"]] == [
        r["instruction"] for r in pairs.splits["train"]
    ]


def test_the_docs_warning_is_what_tokenize_prints(tmp_path: Path, tokenizer) -> None:
    (shown,) = re.findall(r"```\nwarning: (.*)\n```", docs_section())
    lines = (
        (PROJECT_ROOT / "examples" / "own-data" / "preferences.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    records = [json.loads(line) for line in lines]
    records[1]["chosen"] = ""
    records[4]["rejected"] = records[4]["chosen"]
    records[7]["rejected"] = "no " * 2000
    path = tmp_path / "examples" / "own-data" / "preferences.jsonl"
    path.parent.mkdir(parents=True)
    write(path, records, "jsonl")
    cfg = load_params().tokenize.preference
    cfg = dataclasses.replace(cfg, fields=PreferenceFields(instruction="prompt", input="context"))
    pairs = preference.read_splits(cfg, path, tokenizer, book=False)
    assert preference.describe_dropped(pairs, path.relative_to(tmp_path)) == shown
