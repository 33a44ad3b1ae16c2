"""GPT-2 in Hugging Face's layout <-> our GPTModel, with the conversion written as data.

Hugging Face's GPT-2 (OpenAI's weights on the hub) differs from the book's model in
three ways, each handled by a table below:
- names: `h.0.mlp.c_fc.weight` is our `trf_blocks.0.ff.layers.0.weight` (NAME_MAP);
- `Conv1D` layers store weights as [in, out], nn.Linear as [out, in] (CONV1D_WEIGHTS);
- query, key and value are one fused `c_attn` projection, split along its output
  dimension into W_query, W_key, W_value (FUSED_QKV).
OpenAI's GPT-2 ties its output head to the token embedding (`tie_word_embeddings`): on
import the embedding is copied into our separate `out_head`, as the book does. A folder
with `tie_word_embeddings: false` has its own `lm_head.weight`, loaded into out_head.

Two key layouts are read: OpenAI's hub file (`wte.weight`, `h.0.attn.c_attn.weight`)
and the `transformer.`-prefixed one `save_pretrained` writes. The causal-mask buffers
older files carry (`h.N.attn.bias`, `h.N.attn.masked_bias`) are not weights and are
ignored. Every tensor is checked against the shape our model expects, and a mismatch
is an error naming the tensor.

Export writes a folder that `transformers.GPT2LMHeadModel.from_pretrained` loads with
the same logits. transformers is never imported here: config.json is written by hand.
- Models without qkv bias are exported with zero c_attn biases (the same function).
- A head equal to the token embedding is exported tied, as GPT-2's own (no
  `lm_head.weight`, `tie_word_embeddings: true`); any other head is written as
  `lm_head.weight` ([vocab, emb], nn.Linear's layout, no transpose) with
  `tie_word_embeddings: false`, so export -> import gives back the same tensors.
- `tie_head=True` forces a tied export: the token embedding becomes the head and
  `out_head` is dropped (the logits then change unless the two were equal).
- Classifier checkpoints (num_classes set) have no language-model head: refused.
- `export_checkpoint` never writes into the checkpoint, another gptlab checkpoint or a
  non-empty folder (unless forced), and renames a complete temporary folder into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.errors import InputError
from gptlab.files import UMASK, WriteError, atomic_path, fsync_dir, remove_orphans, temp_prefix
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, read_config
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import END_OF_TEXT_ID
from gptlab.schema import ConfigError

# Our name -> Hugging Face name, outside the blocks.
TOP_LEVEL_MAP: dict[str, str] = {
    "tok_emb.weight": "wte.weight",
    "pos_emb.weight": "wpe.weight",
    "final_norm.scale": "ln_f.weight",
    "final_norm.shift": "ln_f.bias",
}
# Our name -> Hugging Face name inside block i (prefixed `trf_blocks.{i}.` and `h.{i}.`).
BLOCK_MAP: dict[str, str] = {
    "norm1.scale": "ln_1.weight",
    "norm1.shift": "ln_1.bias",
    "att.out_proj.weight": "attn.c_proj.weight",
    "att.out_proj.bias": "attn.c_proj.bias",
    "norm2.scale": "ln_2.weight",
    "norm2.shift": "ln_2.bias",
    "ff.layers.0.weight": "mlp.c_fc.weight",
    "ff.layers.0.bias": "mlp.c_fc.bias",
    "ff.layers.2.weight": "mlp.c_proj.weight",
    "ff.layers.2.bias": "mlp.c_proj.bias",
}
# Hugging Face's fused projection in block i -> our three, in the order they are stacked.
FUSED_QKV: tuple[str, tuple[str, str, str]] = ("attn.c_attn", ("att.W_query", "att.W_key", "att.W_value"))
# Conv1D weights (stored [in, out]): transposed to and from nn.Linear's [out, in].
CONV1D_WEIGHTS: frozenset[str] = frozenset(
    {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
)
HEAD = "lm_head.weight"
PREFIX = "transformer."
# Causal-mask buffers stored by older transformers versions: not weights.
IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
# Every GPT-2 size (small to xl) uses 64-dimensional heads; a bare weights file has no
# config, and the number of heads is the one dimension its shapes do not reveal.
GPT2_HEAD_DIM = 64
# The dropout the book configures for OpenAI's models (it does not change their outputs in eval).
GPT2_DROP_RATE = 0.1


def name_map(n_layers: int) -> dict[str, str]:
    """Our tensor name -> Hugging Face's, for every tensor except c_attn and the head."""
    names = dict(TOP_LEVEL_MAP)
    for i in range(n_layers):
        names.update({f"trf_blocks.{i}.{ours}": f"h.{i}.{hf}" for ours, hf in BLOCK_MAP.items()})
    return names


def expected_hf_shapes(cfg: ModelConfig, *, untied_head: bool = False) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor a model with `cfg` needs, derived from our model."""
    check_language_model(cfg)
    with torch.device("meta"):  # shapes only, no memory, no random init
        ours = {k: tuple(v.shape) for k, v in build_gpt(cfg).state_dict().items()}
    shapes = {hf: _hf_shape(hf, ours[name]) for name, hf in name_map(cfg.n_layers).items()}
    fused, _ = FUSED_QKV
    for i in range(cfg.n_layers):
        d_out, d_in = ours[f"trf_blocks.{i}.att.W_query.weight"]
        shapes[f"h.{i}.{fused}.weight"] = (d_in, 3 * d_out)
        shapes[f"h.{i}.{fused}.bias"] = (3 * d_out,)
    if untied_head:
        shapes[HEAD] = ours["out_head.weight"]
    return shapes


def check_language_model(cfg: ModelConfig) -> None:
    """Refuse classifiers: GPT-2's layout has a language-model head only."""
    if not cfg.is_language_model:
        raise InputError(
            f"a classifier (num_classes={cfg.num_classes}) has no GPT-2 language-model head; "
            "only language models convert to and from Hugging Face's GPT-2"
        )


def _hf_shape(hf_name: str, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    return our_shape[::-1] if _is_conv1d(hf_name) else our_shape


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.split(".", 2)[-1] in CONV1D_WEIGHTS


# --------------------------------------------------------------------------- #
# Hugging Face -> ours
# --------------------------------------------------------------------------- #


def normalise_keys(hf_state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Hub-layout names (no `transformer.` prefix), without the causal-mask buffers."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in hf_state.items():
        name = key.removeprefix(PREFIX)
        if IGNORED.fullmatch(name):
            continue
        if name in state:
            raise InputError(f"{source}: tensor {name} appears both with and without the {PREFIX!r} prefix")
        state[name] = tensor
    return state


def check_tensors(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Every expected tensor present with its exact shape, and nothing else; errors name the tensor."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InputError(
            f"{source}: missing tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; is this a GPT-2 weights file of the expected size?"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InputError(
            f"{source}: unexpected tensor {unexpected[0]}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + "; is this a GPT-2 language model of the expected size?"
        )
    for name, shape in expected.items():
        actual = tuple(state[name].shape)
        if actual != tuple(shape):
            raise InputError(f"{source}: tensor {name} has shape {list(actual)}, expected {list(shape)}")
        if not state[name].is_floating_point():
            raise InputError(
                f"{source}: tensor {name} has dtype {state[name].dtype}, expected floating point"
            )


def hf_to_gptlab(
    hf_state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    tie_head: bool = True,
    source: str = "weights",
) -> dict[str, torch.Tensor]:
    """Our state dict for `cfg` from a Hugging Face GPT-2 state dict (either key layout).

    With `tie_head` (GPT-2's own setting) the token embedding is copied into out_head
    and any stored `lm_head.weight` is ignored, as transformers itself does; without
    it, `lm_head.weight` is required and loaded into out_head.
    """
    if not cfg.qkv_bias:
        raise ConfigError("model.qkv_bias: GPT-2's c_attn has biases; import into a model with qkv_bias true")
    state = normalise_keys(hf_state, source)
    if tie_head:
        state.pop(HEAD, None)
    check_tensors(state, expected_hf_shapes(cfg, untied_head=not tie_head), source)

    ours: dict[str, torch.Tensor] = {}
    for name, hf in name_map(cfg.n_layers).items():
        tensor = state[hf]
        ours[name] = tensor.T if _is_conv1d(hf) else tensor  # Conv1D [in, out] -> Linear [out, in]
    fused, qkv = FUSED_QKV
    for i in range(cfg.n_layers):
        weights = state[f"h.{i}.{fused}.weight"].T.chunk(3, dim=0)  # [in, 3*out] -> 3 x [out, in]
        biases = state[f"h.{i}.{fused}.bias"].chunk(3, dim=0)  # [3*out] -> 3 x [out]
        for ours_name, weight, bias in zip(qkv, weights, biases, strict=True):
            ours[f"trf_blocks.{i}.{ours_name}.weight"] = weight
            ours[f"trf_blocks.{i}.{ours_name}.bias"] = bias
    # A separate copy, as in the book: fine-tuning then updates the head and the embedding independently.
    ours["out_head.weight"] = (state["wte.weight"] if tie_head else state[HEAD]).clone()
    return {k: v.to(torch.float32).contiguous() for k, v in ours.items()}


def model_from_hf_state(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, *, tie_head: bool = True, source: str = "weights"
) -> GPTModel:
    """A GPTModel (eval mode, cpu) holding the converted tensors, with no second copy in memory."""
    state = hf_to_gptlab(hf_state, cfg, tie_head=tie_head, source=source)
    with torch.device("meta"):
        model = build_gpt(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def config_from_hf_state(
    hf_state: Mapping[str, torch.Tensor], *, n_heads: int | None = None, source: str = "weights"
) -> ModelConfig:
    """The architecture of a bare GPT-2 weights file, read from its tensor shapes.

    The number of heads is not visible in any shape: GPT-2's 64-dimensional heads
    are assumed unless `n_heads` is given. Context length = rows of `wpe`.
    """
    state = normalise_keys(hf_state, source)
    for name in ("wte.weight", "wpe.weight"):
        if name not in state:
            raise InputError(f"{source}: missing tensor {name}; is this a GPT-2 weights file?")
    vocab_size, emb_dim = state["wte.weight"].shape
    context_length = state["wpe.weight"].shape[0]
    blocks = {int(m.group(1)) for key in state if (m := re.match(r"h\.(\d+)\.", key))}
    if not blocks:
        raise InputError(f"{source}: no transformer blocks (h.N.*) found; is this a GPT-2 weights file?")
    if n_heads is None:
        if emb_dim % GPT2_HEAD_DIM:
            raise InputError(
                f"{source}: embedding size {emb_dim} is not a multiple of GPT-2's head size {GPT2_HEAD_DIM}; "
                "give the number of heads explicitly"
            )
        n_heads = emb_dim // GPT2_HEAD_DIM
    return ModelConfig(
        vocab_size=vocab_size,
        context_length=context_length,
        emb_dim=emb_dim,
        n_heads=n_heads,
        n_layers=max(blocks) + 1,
        drop_rate=GPT2_DROP_RATE,
        qkv_bias=True,
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a truncated or garbled file is a ValueError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{path}: not a readable safetensors file, corrupted or truncated ({exc})") from exc


def load_hf_weights(path: Path | str, *, n_heads: int | None = None) -> GPTModel:
    """Our model from a bare Hugging Face GPT-2 `model.safetensors` (such as OpenAI's on the hub)."""
    path = Path(path)
    state = read_safetensors(path)
    cfg = config_from_hf_state(state, n_heads=n_heads, source=str(path))
    return model_from_hf_state(state, cfg, source=str(path))


def config_from_hf(hf_config: Mapping[str, Any], source: str = CONFIG_FILE) -> tuple[ModelConfig, bool]:
    """Our ModelConfig and whether the head is tied, from a Hugging Face GPT-2 config.json.

    Settings our model does not implement (another activation, a different layer-norm
    epsilon or feed-forward width, rescaled attention) are refused, naming the key.
    """

    def value(key: str, default: Any) -> Any:
        return hf_config.get(key, default)

    if value("model_type", None) != "gpt2":
        raise InputError(f"{source}: model_type {value('model_type', None)!r} is not 'gpt2'")
    emb_dim = value("n_embd", 768)
    unsupported = {
        "activation_function": (value("activation_function", "gelu_new"), {"gelu_new", "gelu_pytorch_tanh"}),
        "layer_norm_epsilon": (value("layer_norm_epsilon", 1e-5), {1e-5}),
        "n_inner": (value("n_inner", None), {None, 4 * emb_dim}),
        "scale_attn_weights": (value("scale_attn_weights", True), {True}),
        "scale_attn_by_inverse_layer_idx": (value("scale_attn_by_inverse_layer_idx", False), {False}),
    }
    for key, (actual, allowed) in unsupported.items():
        if actual not in allowed:
            raise InputError(
                f"{source}: {key}={actual!r} is not supported by GPTModel (expected one of {allowed})"
            )
    cfg = ModelConfig(
        vocab_size=value("vocab_size", 50257),
        context_length=value("n_positions", 1024),
        emb_dim=emb_dim,
        n_heads=value("n_head", 12),
        n_layers=value("n_layer", 12),
        drop_rate=value("resid_pdrop", GPT2_DROP_RATE),
        qkv_bias=True,
    )
    return cfg, bool(value("tie_word_embeddings", True))


def load_hf_folder(directory: Path | str) -> GPTModel:
    """Our model from a Hugging Face GPT-2 folder (config.json + model.safetensors)."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: is {directory} a Hugging Face model folder?")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_path}: not valid JSON ({exc})") from exc
    cfg, tied = config_from_hf(hf_config, str(config_path))
    weights = directory / WEIGHTS_FILE
    return model_from_hf_state(read_safetensors(weights), cfg, tie_head=tied, source=str(weights))


# --------------------------------------------------------------------------- #
# Ours -> Hugging Face
# --------------------------------------------------------------------------- #


def gptlab_to_hf(model: GPTModel, *, tie_head: bool = False) -> dict[str, torch.Tensor]:
    """A `save_pretrained`-layout state dict from our model.

    A head equal to the token embedding is left out (tied, as GPT-2's); any other head
    is `lm_head.weight`, unless `tie_head` drops it and the embedding serves as the head.
    """
    cfg = model.cfg
    check_language_model(cfg)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    untied = not tie_head and not torch.equal(state["out_head.weight"], state["tok_emb.weight"])
    hf: dict[str, torch.Tensor] = {}
    for name, hf_name in name_map(cfg.n_layers).items():
        tensor = state[name]
        hf[hf_name] = tensor.T if _is_conv1d(hf_name) else tensor  # Linear [out, in] -> Conv1D [in, out]
    fused, qkv = FUSED_QKV
    for i in range(cfg.n_layers):
        linears = [f"trf_blocks.{i}.{name}" for name in qkv]
        hf[f"h.{i}.{fused}.weight"] = torch.cat(
            [state[f"{p}.weight"] for p in linears], dim=0
        ).T  # [in, 3*out]
        if cfg.qkv_bias:
            bias = torch.cat([state[f"{p}.bias"] for p in linears], dim=0)  # [3*out]
        else:
            bias = torch.zeros(3 * cfg.emb_dim)  # no bias is the same function as a zero bias
        hf[f"h.{i}.{fused}.bias"] = bias
    out = {PREFIX + name: tensor.contiguous().clone() for name, tensor in hf.items()}
    if untied:  # GPT2LMHeadModel's lm_head is an nn.Linear: [vocab, emb] as ours, and unprefixed
        out[HEAD] = state["out_head.weight"].contiguous().clone()
    return out


def hf_config(cfg: ModelConfig, *, tied: bool = True) -> dict[str, Any]:
    """The config.json of GPT2LMHeadModel for `cfg` (the fields transformers reads for GPT-2).

    `tied` false means the weights carry their own `lm_head.weight`.
    """
    # bos/eos must be ids inside the vocabulary; tiny test vocabularies have no <|endoftext|>.
    eos = END_OF_TEXT_ID if cfg.vocab_size > END_OF_TEXT_ID else None
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context_length,
        "n_ctx": cfg.context_length,
        "n_embd": cfg.emb_dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.drop_rate,
        "embd_pdrop": cfg.drop_rate,
        "attn_pdrop": cfg.drop_rate,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": "float32",
    }


def save_hf(model: GPTModel, out_dir: Path | str, *, tie_head: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` for GPT2LMHeadModel into `out_dir`; returns it.

    An untied head is kept (`lm_head.weight`) unless `tie_head`; see `gptlab_to_hf`.
    """
    out_dir = Path(out_dir)
    state = gptlab_to_hf(model, tie_head=tie_head)
    config = hf_config(model.cfg, tied=HEAD not in state)
    with atomic_path(out_dir / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    with atomic_path(out_dir / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def export_checkpoint(
    checkpoint_dir: Path | str, out_dir: Path | str, *, tie_head: bool = False, force: bool = False
) -> Path:
    """A gptlab checkpoint folder as a Hugging Face GPT-2 folder; classifiers are refused before loading.

    `out_dir` must be new or empty, unless it holds an earlier export and `force` is given (then
    it is replaced as a whole). It is never the checkpoint itself, a folder holding it or inside it, another gptlab checkpoint, or the
    current folder. The export is written into a temporary folder beside `out_dir` and renamed
    into place once complete, so a failure leaves `out_dir` as it was.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    cfg, _ = read_config(checkpoint_dir)
    check_language_model(cfg)  # before reading the weights
    check_export_target(checkpoint_dir, out_dir, force=force)
    model, _ = load_model(checkpoint_dir)
    write_folder_atomically(out_dir, lambda tmp: save_hf(model, tmp, tie_head=tie_head))
    return out_dir


def is_gptlab_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a gptlab checkpoint (a config.json with our `model` section)."""
    payload = _config_payload(directory)
    return isinstance(payload, dict) and "model" in payload


def is_earlier_export(directory: Path) -> bool:
    """Whether `directory` holds what an export writes and nothing else: the only folder --force replaces.

    Its entries are config.json (a Hugging Face GPT-2 config) and at most model.safetensors, both
    plain files: a project, a git repository or a folder of notes is never one.
    """
    entries = {entry.name: entry for entry in directory.iterdir()}
    if CONFIG_FILE not in entries or not set(entries) <= {CONFIG_FILE, WEIGHTS_FILE}:
        return False
    if any(entry.is_symlink() or not entry.is_file() for entry in entries.values()):
        return False
    payload = _config_payload(directory)
    return isinstance(payload, dict) and payload.get("model_type") == "gpt2"


def _config_payload(directory: Path) -> Any:
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_export_target(checkpoint_dir: Path, out_dir: Path, *, force: bool = False) -> None:
    """Refuse an export folder whose replacement would destroy a checkpoint or anything else unasked.

    --force replaces an earlier export only: whatever else a non-empty folder holds may be a
    user's work (a clone, notes), which no flag of this command deletes.
    """
    source, target = checkpoint_dir.resolve(), out_dir.resolve()
    hint = "export into a new or empty folder"
    if target == source:
        raise InputError(f"{out_dir} is the checkpoint being exported ({checkpoint_dir}); {hint}")
    if target in source.parents:
        raise InputError(f"{out_dir} holds the checkpoint being exported ({checkpoint_dir}); {hint}")
    for folder in target.parents:
        if is_gptlab_checkpoint(folder):
            raise InputError(f"{out_dir} is inside the gptlab checkpoint {folder}; {hint} outside it")
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a folder; {hint}")
    if is_gptlab_checkpoint(out_dir):
        raise InputError(
            f"{out_dir} is a gptlab checkpoint and exporting would destroy it (even with --force); {hint}"
        )
    entries = sorted(entry.name for entry in out_dir.iterdir())
    if not entries:
        return
    if not is_earlier_export(out_dir):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise InputError(
            f"{out_dir} is not empty and not an earlier export (it holds {shown}); {hint} "
            "(--force replaces only a folder that holds exactly what export writes)"
        )
    if not force:
        raise InputError(f"{out_dir} is not empty: it holds an earlier export; pass --force to replace it")
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise InputError(f"{out_dir} holds the current folder and --force would replace it; {hint}")


def write_folder_atomically(out_dir: Path, write: Callable[[Path], object]) -> None:
    """Fill a temporary folder beside `out_dir` with `write`, then rename it into place.

    An existing `out_dir` (already checked by the caller) is moved aside first and deleted only
    once the new folder is in place; on any failure it is put back and the temporary folder goes.
    A folder that cannot be written is an InputError naming `out_dir`, a file that cannot (a full
    disk) a WriteError naming it at its place in `out_dir`. The temporary folder of an export
    killed before (kill -9) goes first.
    """
    parent = out_dir.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_orphans(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), suffix=".tmp", dir=parent))
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot write the export here ({exc.strerror or exc})") from exc
    old: Path | None = None
    try:
        try:
            write(tmp)
        except WriteError as exc:
            raise exc.moved(tmp, out_dir) from exc.__cause__
        os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes it private; give it the mode mkdir would
        if os.path.lexists(out_dir):
            old = parent / f".{out_dir.name}.{uuid.uuid4().hex[:12]}.old"
            os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if old is not None:
                os.rename(old, out_dir)
                old = None
            raise
        fsync_dir(parent)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise InputError(f"{out_dir}: cannot write the export here: {exc.strerror or exc}{where}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def roundtrip_checkpoint(checkpoint_dir: Path | str, *, tie_head: bool = False) -> GPTModel:
    """A checkpoint taken through export and import, as OpenAI's weights are (via a temp folder).

    Without `tie_head` the result holds exactly the checkpoint's tensors (qkv biases
    become zeros if it had none), so its logits are the checkpoint's own.
    """
    with tempfile.TemporaryDirectory(prefix="gptlab-hf-") as tmp:
        export_checkpoint(checkpoint_dir, tmp, tie_head=tie_head)
        return load_hf_folder(tmp)
