"""Head surgery, pooling, loss, accuracy and metrics of the spam classifier, on a tiny GPT."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import load_model, save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.tasks.classifier import (
    PAD_TOKEN_ID,
    accuracy,
    class_logits,
    classification_loss,
    classification_metrics,
    confusion_counts,
    count_trainable,
    last_token_classification_loss,
    make_classifier,
    mean_pooled_classification_loss,
    predict,
)

TINY = ModelConfig(context_length=32, emb_dim=32, n_heads=2, n_layers=3, drop_rate=0.0, qkv_bias=True)


def tiny_classifier(trainable: str = "last_blocks", trainable_blocks: int = 1, seed: int = 123) -> GPTModel:
    torch.manual_seed(0)
    model = build_gpt(TINY)
    return make_classifier(model, 2, trainable=trainable, trainable_blocks=trainable_blocks, seed=seed)


def block_params(cfg: ModelConfig) -> int:
    d = cfg.emb_dim
    attention = 4 * d * d + (3 * d if cfg.qkv_bias else 0) + d  # q, k, v (+ biases), out_proj + bias
    feed_forward = d * 4 * d + 4 * d + 4 * d * d + d
    norms = 2 * 2 * d
    return attention + feed_forward + norms


def expected_trainable(cfg: ModelConfig, trainable: str, blocks: int, num_classes: int = 2) -> int:
    head = cfg.emb_dim * num_classes + num_classes
    final_norm = 2 * cfg.emb_dim
    if trainable == "head":
        return head
    if trainable == "last_blocks":
        return blocks * block_params(cfg) + final_norm + head
    embeddings = (cfg.vocab_size + cfg.context_length) * cfg.emb_dim
    return embeddings + cfg.n_layers * block_params(cfg) + final_norm + head


@pytest.mark.parametrize(
    ("trainable", "blocks"), [("head", 1), ("last_blocks", 1), ("last_blocks", 2), ("all", 1)]
)
def test_trainable_parameter_counts(trainable: str, blocks: int) -> None:
    model = tiny_classifier(trainable, blocks)
    assert count_trainable(model) == expected_trainable(TINY, trainable, blocks)
    assert model.cfg.num_classes == 2
    assert model.out_head.weight.shape == (2, TINY.emb_dim) and model.out_head.bias is not None


def test_last_blocks_unfreezes_exactly_the_last_blocks_and_final_norm() -> None:
    model = tiny_classifier("last_blocks", 2)
    trainable = {
        ".".join(name.split(".")[:2]) if name.startswith("trf_blocks") else name.split(".")[0]
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    assert trainable == {"trf_blocks.1", "trf_blocks.2", "final_norm", "out_head"}


def test_gradients_reach_only_trainable_parameters() -> None:
    model = tiny_classifier("last_blocks", 1)
    inputs = torch.randint(0, 1000, (4, 10))
    last_token_classification_loss(model, (inputs, torch.tensor([0, 1, 1, 0]))).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_new_head_is_the_seeded_linear_of_the_book() -> None:
    torch.manual_seed(123)
    reference = nn.Linear(TINY.emb_dim, 2)
    for weights_seed in (0, 1):  # the base weights differ, the head does not
        torch.manual_seed(weights_seed)
        model = make_classifier(build_gpt(TINY), 2, trainable="head", trainable_blocks=1, seed=123)
        assert torch.equal(model.out_head.weight, reference.weight)
        assert torch.equal(model.out_head.bias, reference.bias)


def test_trainable_blocks_out_of_range_is_an_error_naming_the_key() -> None:
    # The base model's depth is known only here; trainable's allowed values are the schema's (test_config).
    with pytest.raises(ValueError, match=r"spam\.trainable_blocks: expected 1 to 3"):
        tiny_classifier("last_blocks", 4)


def test_last_token_pooling_uses_the_last_position() -> None:
    model = tiny_classifier().eval()
    inputs = torch.randint(0, 1000, (3, 12))
    full = model(inputs)  # (3, 12, 2)
    logits = class_logits(model, inputs, "last")
    assert logits.shape == (3, 2)
    torch.testing.assert_close(logits, full[:, -1, :])
    assert not torch.allclose(logits, full[:, -2, :])


def test_mean_pooling_ignores_padding() -> None:
    model = tiny_classifier().eval()
    text = torch.randint(0, 1000, (1, 7))
    padded = torch.cat([text, torch.full((1, 9), PAD_TOKEN_ID)], dim=1)  # (1, 16)
    unpadded_mean = model(text).mean(dim=1)
    torch.testing.assert_close(class_logits(model, padded, "mean"), unpadded_mean)
    # The last position of the padded row is padding: last-token pooling does see it.
    assert not torch.allclose(class_logits(model, padded, "last"), class_logits(model, text, "last"))


def test_losses_match_cross_entropy_of_their_pooling() -> None:
    model = tiny_classifier().eval()
    inputs = torch.cat([torch.randint(0, 1000, (4, 6)), torch.full((4, 3), PAD_TOKEN_ID)], dim=1)
    labels = torch.tensor([1, 0, 0, 1])
    full = model(inputs)  # (4, 9, 2)
    last = last_token_classification_loss(model, (inputs, labels))
    mean = mean_pooled_classification_loss(model, (inputs, labels))
    torch.testing.assert_close(last, F.cross_entropy(full[:, -1, :], labels))
    torch.testing.assert_close(mean, F.cross_entropy(full[:, :6, :].mean(dim=1), labels))
    assert classification_loss("last") is last_token_classification_loss
    assert classification_loss("mean") is mean_pooled_classification_loss


def test_saved_classifier_is_rebuilt_with_its_head(tmp_path) -> None:
    model = tiny_classifier().eval()
    save_model(model, tmp_path / "clf", {"labels": {"0": "ham", "1": "spam"}})
    loaded, metadata = load_model(tmp_path / "clf")
    assert loaded.cfg.num_classes == 2 and metadata["labels"]["1"] == "spam"
    inputs = torch.randint(0, 1000, (2, 8))
    torch.testing.assert_close(class_logits(loaded, inputs), class_logits(model, inputs))


def _loader_with_known_accuracy(model: GPTModel, n: int, wrong: list[int]) -> DataLoader:
    """Labels equal the model's own predictions except at the `wrong` indices."""
    inputs = torch.randint(0, 1000, (n, 8))
    with torch.no_grad():
        labels = class_logits(model, inputs).argmax(dim=-1)
    labels[wrong] = 1 - labels[wrong]
    return DataLoader(TensorDataset(inputs, labels), batch_size=4)


def test_accuracy_counts_correct_predictions_over_the_first_batches() -> None:
    model = tiny_classifier().eval()
    loader = _loader_with_known_accuracy(model, 12, wrong=[1, 5, 6, 10, 11])
    model.train()
    assert accuracy(model, loader) == pytest.approx(7 / 12)
    assert accuracy(model, loader, num_batches=1) == pytest.approx(3 / 4)
    assert accuracy(model, loader, num_batches=2) == pytest.approx(5 / 8)
    assert accuracy(model, loader, num_batches=99) == pytest.approx(7 / 12)
    assert model.training, "accuracy must restore the training mode"
    assert math.isnan(accuracy(model, []))


def test_predict_returns_labels_predictions_and_probabilities() -> None:
    model = tiny_classifier().eval()
    loader = _loader_with_known_accuracy(model, 10, wrong=[0, 3])
    actual, predicted, probs = predict(model, loader)
    assert probs.shape == (10, 2)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    assert (predicted == probs.argmax(axis=1)).all()
    assert (actual != predicted).sum() == 2 and (actual[[0, 3]] != predicted[[0, 3]]).all()


def test_bf16_scores_are_autocasts_and_close_to_fp32() -> None:
    """precision bf16 (the fast profile's train.precision where bf16 is fast): scored under autocast."""
    model = tiny_classifier().eval()
    loader = _loader_with_known_accuracy(model, 12, wrong=[2])
    _, _, full = predict(model, loader)
    actual, predicted, half = predict(model, loader, precision="bf16")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.cat([class_logits(model, ids) for ids, _ in loader])
    np.testing.assert_allclose(half, torch.softmax(logits.float(), dim=-1).numpy(), rtol=0, atol=1e-6)
    assert half.dtype == np.float32 and not np.array_equal(half, full)  # other rounding...
    np.testing.assert_allclose(half, full, rtol=0, atol=0.02)  # ...close to fp32's
    expected = float((logits.argmax(dim=-1).numpy() == actual).mean())
    assert accuracy(model, loader, precision="bf16") == pytest.approx(expected)
    assert (predicted == half.argmax(axis=1)).all()


def test_metrics_agree_with_scikit_learn_and_hand_counts() -> None:
    # 4 spam (1) then 6 ham (0): 3 spam caught, 1 missed, 2 ham flagged as spam.
    actual = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    predicted = [1, 1, 1, 0, 1, 1, 0, 0, 0, 0]
    metrics = classification_metrics(actual, predicted)
    assert metrics["accuracy"] == pytest.approx(0.7) == accuracy_score(actual, predicted)
    assert metrics["precision"] == pytest.approx(3 / 5) == precision_score(actual, predicted)
    assert metrics["recall"] == pytest.approx(3 / 4) == recall_score(actual, predicted)
    assert metrics["f1"] == pytest.approx(2 / 3) == f1_score(actual, predicted)
    # Rows actual (ham, spam), columns predicted (ham, spam).
    assert metrics["confusion_matrix"] == [[4, 2], [1, 3]]
    assert metrics["confusion_matrix"] == confusion_matrix(actual, predicted).tolist()


def test_metrics_without_any_spam_prediction_stay_defined() -> None:
    metrics = classification_metrics([0, 0, 1], [0, 0, 0])
    assert metrics["precision"] == 0.0 and metrics["recall"] == 0.0 and metrics["f1"] == 0.0
    assert metrics["confusion_matrix"] == [[2, 0], [1, 0]]
    assert classification_metrics([0, 0], [0, 0])["confusion_matrix"] == [[2, 0], [0, 0]]


def test_three_class_metrics_agree_with_scikit_learn() -> None:
    names = ("billing", "bug", "feature")
    # 4 billing, 3 bug, 3 feature; two bugs read as billing, one feature as bug, one billing as feature.
    actual = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    predicted = [0, 0, 0, 2, 0, 0, 1, 2, 2, 1]
    metrics = classification_metrics(actual, predicted, class_names=names)
    assert metrics["accuracy"] == pytest.approx(6 / 10) == accuracy_score(actual, predicted)
    # No positive class among three: the book's spam scores are left out, the macro averages stand in.
    assert not {"precision", "recall", "f1"} & set(metrics)
    for average in ("precision", "recall", "f1"):
        score = {"precision": precision_score, "recall": recall_score, "f1": f1_score}[average]
        per_class = score(actual, predicted, average=None, labels=[0, 1, 2], zero_division=0.0)
        assert [metrics["classes"][n][average] for n in names] == pytest.approx(per_class.tolist())
        macro = score(actual, predicted, average="macro", labels=[0, 1, 2], zero_division=0.0)
        assert metrics[f"macro_{average}"] == pytest.approx(macro)
    # billing by hand: 3 of the 5 predicted billing are billing, 3 of the 4 billing are found.
    assert metrics["classes"]["billing"]["precision"] == pytest.approx(3 / 5)
    assert metrics["classes"]["billing"]["recall"] == pytest.approx(3 / 4)
    assert metrics["confusion_matrix"] == [[3, 0, 1], [2, 1, 0], [0, 1, 2]]
    assert metrics["confusion_matrix"] == confusion_matrix(actual, predicted).tolist()
    assert confusion_counts(metrics, names)["actual_bug"] == {
        "predicted_billing": 2,
        "predicted_bug": 1,
        "predicted_feature": 0,
    }


def test_two_class_metrics_keep_the_positive_class_scores_and_add_each_class() -> None:
    actual = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    predicted = [1, 1, 1, 0, 1, 1, 0, 0, 0, 0]
    metrics = classification_metrics(actual, predicted)
    assert metrics["classes"]["spam"] == {
        "precision": metrics["precision"],
        "recall": metrics["recall"],
        "f1": metrics["f1"],
    }
    assert metrics["classes"]["ham"]["recall"] == pytest.approx(4 / 6)
    assert metrics["macro_f1"] == pytest.approx(f1_score(actual, predicted, average="macro"))
