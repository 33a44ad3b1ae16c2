"""The training loop's params: `<stage>.train` (the book's loop settings) and `checkpoints`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gptlab.schema import MAX_BATCH_SIZE, MAX_ROUNDS, require, require_count

MAX_PROCESSES = 4096  # per node, and nodes: a bound on typos, far above any job


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of the shared training loop. Defaults in params.yaml follow the book."""

    # Saving is operational, no training setting: its keys moved to their own section.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "checkpoint_every": "checkpoints.every_steps",
        "checkpoint_minutes": "checkpoints.every_minutes",
        "keep_checkpoints": "checkpoints.keep",
    }

    batch_size: int
    epochs: int
    lr: float
    weight_decay: float
    eval_freq: int
    eval_iter: int
    seed: int
    # book: randomness drawn exactly as the book's scripts draw it (shuffled loaders on the global
    # RNG, the stage seeding where the chapter does); per_epoch: each epoch's order from its own
    # generator (seed + epoch), loaders never touching the global RNG; what torchrun uses.
    rng: Literal["book", "per_epoch"]
    # Off by default for fidelity to the book.
    grad_clip: float | None
    warmup_steps: int
    lr_schedule: Literal["constant", "cosine"]
    min_lr: float
    # "auto" picks cuda, then mps, then cpu.
    device: Literal["auto", "cpu", "cuda", "mps"]
    # auto: bf16 autocast where bf16 is fast (AMX / AVX-512 BF16 CPUs, CUDA GPUs), fp32 elsewhere.
    precision: Literal["fp32", "bf16", "auto"]
    # Same maths as the default AdamW in one fused kernel: GPT-2 small's update took 0.11 s on a
    # 2-core CPU against the default's 1.11 s.
    fused_adamw: bool
    # book: logits then F.cross_entropy; chunked: head and cross entropy fused a chunk of tokens at a
    # time, never materialising all logits (next-token stages; see gptlab.training.chunked_loss).
    loss_kernel: Literal["book", "chunked"]
    # Train through torch.compile (first step pays a compile of ~1 min on CPU).
    compile: bool
    # Stop after this many optimizer steps (smoke runs); null trains all epochs.
    max_steps: int | None
    # Batch size of full-split losses; null: the training batch, as the book (it averages
    # per-batch means, so another size changes the number).
    eval_batch_size: int | None = None
    # Score each evaluation's eval_iter batches in one forward pass: the mean over their examples,
    # which is the book's mean of per-batch means while the batches are full and count the same
    # number of targets (pretrain, spam); a token-weighted mean where padding varies (instruct).
    eval_in_one_pass: bool = False
    # Tokens per optimizer step over all processes: each process accumulates the gradients of
    # global_batch_tokens / (batch_size x window x processes) micro-batches; null: one batch per
    # process, the book's step. For fixed-length windows (pretraining).
    global_batch_tokens: int | None = None
    # Train for this many tokens (a token budget, the corpus's alternative to epochs; epochs repeat
    # as needed); null: train.epochs.
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        require(self.eval_freq > 0, "eval_freq", f"expected a positive integer, got {self.eval_freq}")
        for name, cap in (("epochs", MAX_ROUNDS), ("eval_iter", MAX_ROUNDS)):
            require_count(getattr(self, name), name, cap)
        require_count(self.batch_size, "batch_size", MAX_BATCH_SIZE)
        if self.eval_batch_size is not None:
            require_count(self.eval_batch_size, "eval_batch_size", MAX_BATCH_SIZE, " or null")
        require(
            not self.eval_in_one_pass or self.rng == "per_epoch",
            "eval_in_one_pass",
            "needs rng: per_epoch (under rng: book evaluation reads the shuffled training loader, batch by batch)",
        )
        require(self.lr > 0, "lr", f"expected a positive float, got {self.lr}")
        # AdamW's step moves each weight by about lr; beyond 1, training can only diverge.
        require(self.lr <= 1, "lr", f"expected a value in (0, 1], got {self.lr:g}")
        require(self.weight_decay >= 0, "weight_decay", f"expected 0 or more, got {self.weight_decay}")
        require(
            self.weight_decay <= 1,
            "weight_decay",
            f"expected a value in [0, 1] (each step scales the weights by 1 - lr * weight_decay), "
            f"got {self.weight_decay:g}",
        )
        require(
            self.grad_clip is None or self.grad_clip > 0,
            "grad_clip",
            f"expected a positive max gradient norm or null (off), got {self.grad_clip}",
        )
        require(self.warmup_steps >= 0, "warmup_steps", f"expected 0 or more, got {self.warmup_steps}")
        require(
            0 <= self.min_lr <= self.lr,
            "min_lr",
            f"expected a value in [0, lr={self.lr}] (the cosine schedule's floor), got {self.min_lr}",
        )
        for name in ("global_batch_tokens", "max_tokens"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"expected a positive integer or null, got {value}")
        require(
            self.max_steps is None or self.max_steps > 0,
            "max_steps",
            f"expected a positive integer or null, got {self.max_steps}",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """When the training loop saves its resumable state, and how many saves it keeps.

    Operational: saving changes no number, so these are part of no stage's DVC params
    and of no resume fingerprint; changing them between a crash and its rerun still resumes.
    """

    # Every this many optimizer steps and at epoch ends; null: by time only.
    every_steps: int | None
    # Once this many minutes have passed since the last save; null: by steps only.
    every_minutes: float | None
    keep: int

    def __post_init__(self) -> None:
        for name in ("every_steps", "every_minutes"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"expected a positive number or null, got {value}")
        require(
            self.every_steps is not None or self.every_minutes is not None,
            "every_steps",
            "every_steps and every_minutes are both null: set one, so a crash can resume",
        )
        require(self.keep > 0, "keep", f"expected a positive integer, got {self.keep}")


@dataclass(frozen=True)
class DistributedConfig:
    """How many processes the training stages train on, started through PyTorch's elastic launcher.

    One process on one node (the default) is the plain single process, the book's run. More:
    the stage starts itself under torch.distributed.run (gptlab.training.distributed.launch).
    The process count determines the numbers (each process trains its share of the batches), so
    it is part of the stages' DVC params; the rendezvous and the timeout are operational.
    """

    nproc_per_node: int = 1
    nnodes: int = 1
    # host:port where node 0 (the one running the stage through DVC) hosts the rendezvous; the
    # other nodes join it with torchrun by hand (docs/pipeline.md#scaling-out). null: one node.
    rdzv_endpoint: str | None = None
    # A collective that waits longer than this for a peer ends the stage (torch's default, 30).
    timeout_minutes: float = 30

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes"):
            require_count(getattr(self, name), name, MAX_PROCESSES)
        require(
            self.nnodes == 1 or self.rdzv_endpoint is not None,
            "rdzv_endpoint",
            f"nnodes is {self.nnodes}: set rdzv_endpoint to host:port of node 0, which the others can reach",
        )
        host, _, port = (self.rdzv_endpoint or "").rpartition(":")
        require(
            self.rdzv_endpoint is None or (host != "" and port.isdigit()),
            "rdzv_endpoint",
            f"expected host:port (e.g. node1.example:29400) or null, got {self.rdzv_endpoint!r}",
        )
        require(
            self.timeout_minutes > 0,
            "timeout_minutes",
            f"expected a positive number, got {self.timeout_minutes}",
        )

    @property
    def processes(self) -> int:
        """The number of processes of the job, on all nodes."""
        return self.nproc_per_node * self.nnodes
