"""The book's optimized single-GPU training step (chapter 5 bonus, "training speed"), written out.

What the bonus's final single-GPU script does, so bench_corpus_pretrain.py can time it beside
ours on the same GPU, model, context and batch: TF32 matmuls, a GPT whose attention is one
fused Q/K/V projection into `scaled_dot_product_attention(is_causal=True)` (FlashAttention on
CUDA), torch's `nn.LayerNorm` and tanh `nn.GELU`, the vocabulary padded to 50,304, the whole
model in bf16 weights (`model.to(torch.bfloat16)`, no autocast), `torch.compile`, fused AdamW
(lr 5e-4, weight decay 0.1), and a step of `zero_grad`, cross entropy over every logit,
`backward`, `step`. Only the speed matters here: no evaluation, sampling or plotting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.model.config import ModelConfig

PADDED_VOCAB = 50_304  # GPT-2's 50,257 rounded up to a multiple of 64


class BonusAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.n_heads, cfg.drop_rate
        self.qkv = nn.Linear(cfg.emb_dim, 3 * cfg.emb_dim, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.emb_dim, cfg.emb_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> (3, b, heads, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(out.transpose(1, 2).contiguous().view(b, t, d))


class BonusBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.emb_dim), nn.LayerNorm(cfg.emb_dim)
        self.att = BonusAttention(cfg)
        self.ff = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),
        )
        self.drop = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.att(self.norm1(x)))
        return x + self.drop(self.ff(self.norm2(x)))


class BonusGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int = PADDED_VOCAB) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*(BonusBlock(cfg) for _ in range(cfg.n_layers)))
        self.final_norm = nn.LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop_emb(self.tok_emb(idx) + self.pos_emb(positions))
        return self.out_head(self.final_norm(self.trf_blocks(x)))


def bonus_step(cfg: ModelConfig, device: torch.device, compile_model: bool):
    """The bonus's model and optimizer on `device`; returns (step(inputs, targets) -> loss, parameter count)."""
    torch.set_float32_matmul_precision("high")  # TF32 on tensor cores
    torch.manual_seed(123)
    model: nn.Module = BonusGPT(cfg)
    parameters = sum(p.numel() for p in model.parameters())
    if compile_model:
        model = torch.compile(model)
    model.to(device).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1, fused=device.type == "cuda")
    model.train()

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        return loss

    return step, parameters
