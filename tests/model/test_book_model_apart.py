"""gpt.py holds the book's chapter 4 model alone: its six classes, no speed path, no cache, no kernel choice."""

from __future__ import annotations

import ast
import inspect

from gptlab.model import gpt

SPEED_NAMES = {
    "DecodeWeight",
    "DecodeLinear",
    "DecodeProjection",
    "decoding_projection",
    "decoding_qkv",
    "is_decoding_step",
    "linear_class",
    "dropout_class",
    "_biased_softmax",
    "biased_softmax",
    "scaled_dot_product_attention",
    "_sdpa",
}


def test_gpt_py_names_no_speed_path_and_chooses_no_kernel() -> None:
    source = inspect.getsource(gpt)
    identifiers = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            identifiers.add(node.id)
        elif isinstance(node, ast.Attribute):
            identifiers.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            identifiers.add(node.name)
        elif isinstance(node, ast.alias):
            identifiers.add(node.asname or node.name)
    assert not {name for name in SPEED_NAMES if name in source}
    # No choice on cfg.kernels or cfg.attention, and no torch.nn.functional (F.layer_norm, F.gelu, ...).
    assert not identifiers & (SPEED_NAMES | {"kernels", "attention", "F", "functional"})
    assert "gptlab.model.dropout" not in source and "fast_kernels import" not in source


CHAPTER_4 = {"LayerNorm", "GELU", "FeedForward", "MultiHeadAttention", "TransformerBlock", "GPTModel"}


def test_gpt_py_defines_chapter_4s_classes_and_nothing_else() -> None:
    """Its six classes and chapter 3's causal mask; the cache (kv_cache.py) and the rest live elsewhere."""
    classes, functions, other = set(), set(), []
    for node in ast.parse(inspect.getsource(gpt)).body:
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
        elif isinstance(node, ast.FunctionDef):
            functions.add(node.name)
        elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports, for the cache's annotations
            assert all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body), ast.unparse(node)
        elif not isinstance(node, ast.Import | ast.ImportFrom) and not (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)  # the docstring
        ):
            other.append(ast.unparse(node))
    assert classes == CHAPTER_4
    assert not functions
    assert not other
