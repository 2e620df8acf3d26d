"""The typed recipe schema: one YAML file describes a run completely.

Sections are keyword-only dataclasses that validate on construction (a bad value names its key).
Reading a YAML file, `--set a.b=c` overrides and refusing unknown keys and wrong types is
`headstart.recipe_io`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_TTT_STEPS = 16  # train.ttt_steps: unrolled draft steps, bounded (activations grow with each)

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
DataFormat = Literal["auto", "sharegpt", "messages", "prompt"]
HeadType = Literal["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash"]


@dataclass(kw_only=True)
class TargetConfig:
    """The target model whose hidden states the heads learn from."""

    model: str = "smollm2-135m"  # an embedded name (`headstart assets`) or a local HF model directory
    # Compute dtype of the target's forward passes; auto: bf16 where the device computes it natively
    # (CUDA, CPUs with avx512_bf16 or AMX), fp32 otherwise (headstart.hardware).
    dtype: Dtype = "auto"
    # The target's config.json alone (shapes, no weights; e.g. recipes/targets/llama-3.1-8b.json): what
    # `headstart plan` reads on a machine where target.model is not present. Relative to the working directory.
    config: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.model.strip()), "target.model", "must not be empty")
        _require(self.config is None or bool(self.config.strip()), "target.config", "must not be empty (or null)")


@dataclass(kw_only=True)
class DataConfig:
    """Conversations, how they are rendered with the target's chat template, and the split."""

    source: str = "sharegpt"  # an embedded name or a .json/.jsonl file
    format: DataFormat = "auto"  # auto: detected per row (ShareGPT `conversations`, OpenAI `messages`)
    max_length: int = 2048  # tokens per rendered conversation; longer ones are truncated (and counted)
    limit: int | None = None  # read only the first N rows of the source (None: all)
    # Keep each conversation up to its N-th assistant reply (None: all of them). 1 trains on first turns only,
    # the turns a held-out first-prompt eval measures (benchmarks/head_budget.md: 39 % of all-turn supervision).
    max_turns: int | None = None
    heldout_fraction: float = 0.02  # share of conversations, chosen by a hash of their id, held out
    # What the split hashes: the whole id, or its prefix before a trailing "_<digits>" so that the
    # chunks of one chat (ShareGPT's "X_0", "X_1", ...) land on the same side.
    split_key: Literal["id", "id_prefix"] = "id"
    num_proc: int | None = None  # worker processes for tokenisation (None: by dataset size and cores)

    def __post_init__(self) -> None:
        _require(bool(self.source.strip()), "data.source", "must not be empty")
        _require(self.max_length >= 8, "data.max_length", f"must be >= 8, got {self.max_length}")
        _require(self.limit is None or self.limit > 0, "data.limit", f"must be > 0 or null, got {self.limit}")
        _require(self.max_turns is None or self.max_turns > 0, "data.max_turns",
                 f"must be > 0 or null, got {self.max_turns}")
        _require(
            0.0 <= self.heldout_fraction < 1.0,
            "data.heldout_fraction",
            f"must be in [0, 1), got {self.heldout_fraction}",
        )
        _require(self.num_proc is None or self.num_proc >= 1, "data.num_proc", "must be >= 1 or null")


@dataclass(kw_only=True)
class HeadSection:
    """Which draft head to train (headstart.heads; one line per family in the README: Head families)."""

    type: HeadType = "mtp"
    num_layers: int = 1  # decoder layers in the head (draft_lm: its depth)
    aux_layer_ids: list[int] | None = None  # eagle3: target layers to fuse (None: 2, L//2, L-3)
    draft_vocab_size: int | None = None  # drafts over the V_d most frequent supervised tokens (None: full vocab)
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    init_from_target: bool = True  # start from the target's last layer / final norm where shapes allow
    # A trained head checkpoint (config.json + model.safetensors: a shipped head, a run's head-final) to
    # start from instead: fine-tuning it on this recipe's data. Its shape and draft vocabulary are kept and
    # must be the recipe's head's; init_from_target is then not applied. Null: a new head.
    init_from: str | None = None
    k: int = 3  # draft tokens per speculative step when the head is validated / evaluated
    # mtp / eagle1 / deepseek_mtp: read the target's last state AFTER its final norm. That is what vLLM
    # and SGLang feed every drafter but EAGLE-3 (the model's output), so a head exported to them must
    # be trained this way. None: the family default (mtp, deepseek_mtp: before the norm; eagle1: after).
    postnorm_features: bool | None = None
    # eagle1: a bias on fc, as the original EAGLE (None: true). vLLM's EAGLE-1 drafter has none: false
    # trains a head vLLM serves (--format vllm); SGLang's keeps it (--format sglang).
    fc_bias: bool | None = None
    # deepseek_mtp on a DeepSeek target: the block is the target's own kind (MLA, and MoE where the
    # target routes experts at the MTP layer's index, as DeepSeek-V3's MTP layer does); true: a dense MLP.
    dense_block: bool = False
    # dflash: positions per drafted block, the anchor (the verified bonus token) and block_size - 1 drafts
    # (None: 8, speculators' default); head.k may be at most block_size - 1.
    block_size: int | None = None
    mask_token_id: int | None = None  # dflash: the token in the draft slots (None: the tokenizer's mask/unk/pad)
    # dflash training: anchored blocks per micro-batch (speculators' max_anchors), drawn among its supervised rows
    max_anchors: int = 512
    # eagle3, EAGLE-3.1 (headstart.heads.eagle3): one RMSNorm over the concatenated aux states before fc /
    # one per aux state (exclusive), the first layer's residual normed, the post-norm state fed back to the
    # next draft step. None: speculators' trainer defaults (true, false, true, true).
    norm_before_fc: bool | None = None
    fc_norm: bool | None = None
    norm_before_residual: bool | None = None
    norm_output: bool | None = None

    def __post_init__(self) -> None:
        _require(self.num_layers >= 1, "head.num_layers", f"must be >= 1, got {self.num_layers}")
        _require(self.init_from is None or (isinstance(self.init_from, str) and self.init_from.strip() != ""),
                 "head.init_from", "must be a head checkpoint's directory or null, got an empty value")
        _require(self.type == "dflash" or (self.block_size is None and self.mask_token_id is None),
                 "head.block_size", f"block_size and mask_token_id apply to dflash heads, not {self.type}")
        _require(self.block_size is None or 2 <= self.block_size <= 32, "head.block_size",
                 f"must be in 2..32, got {self.block_size}")
        _require(self.type != "dflash" or self.k <= (self.block_size or 8) - 1, "head.k",
                 f"a dflash block of {self.block_size or 8} drafts at most {(self.block_size or 8) - 1} tokens, "
                 f"got k={self.k}")
        _require(self.aux_layer_ids is None or bool(self.aux_layer_ids), "head.aux_layer_ids",
                 "is empty: list the target layers to fuse, or leave it out for the defaults")
        _require(self.aux_layer_ids is None or (len(set(self.aux_layer_ids)) == len(self.aux_layer_ids)
                                                 and list(self.aux_layer_ids) == sorted(self.aux_layer_ids)),
                 "head.aux_layer_ids", f"must be distinct and ascending (the order vLLM and SGLang concatenate "
                 f"the states in), got {str(self.aux_layer_ids)[:40]}")
        _require(self.max_anchors >= 1, "head.max_anchors", "must be >= 1")
        _require(self.type == "dflash" or self.max_anchors == 512, "head.max_anchors",
                 f"applies to dflash heads, not {self.type}")
        _require(not self.dense_block or self.type == "deepseek_mtp", "head.dense_block",
                 f"applies to deepseek_mtp heads, not {self.type}")
        _require(1 <= self.k <= 16, "head.k", f"must be in [1, 16], got {self.k}")
        _require(self.medusa_num_heads >= 1, "head.medusa_num_heads", "must be >= 1")
        _require(self.draft_vocab_size is None or self.draft_vocab_size > 0, "head.draft_vocab_size", "must be > 0")
        _require(self.postnorm_features is None or self.type in ("mtp", "eagle1", "deepseek_mtp"),
                 "head.postnorm_features", f"applies to mtp, eagle1 and deepseek_mtp heads, not {self.type}")
        _require(self.fc_bias is None or self.type == "eagle1", "head.fc_bias",
                 f"applies to eagle1 heads, not {self.type}")
        for flag in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
            _require(getattr(self, flag) is None or self.type == "eagle3", f"head.{flag}",
                     f"applies to eagle3 heads, not {self.type}")
        _require(not (self.norm_before_fc and self.fc_norm), "head.fc_norm",
                 "and head.norm_before_fc are exclusive (one norm over the concatenated aux states, or one per state)")


@dataclass(kw_only=True)
class EngineSection:
    """How the engine runs the target (precompute, online training's target forward, validation, eval)."""

    # Ranks a target is sharded over (Megatron-style, headstart.nn.parallel); launch that many processes
    # per model copy with torchrun, e.g. `torchrun --nproc-per-node 8 -m headstart.cli eval RECIPE`.
    # 1: the whole target on each device.
    tensor_parallel: int = 1
    # Attention backend of every engine a verb builds (precompute, online / validation forwards, eval,
    # regenerate): auto = FlashInfer on CUDA where it takes the target's attention shape (not DeepSeek's
    # MLA latent cache), torch otherwise and always on CPU.
    backend: Literal["auto", "torch", "flashinfer"] = "auto"

    def __post_init__(self) -> None:
        _require(self.tensor_parallel >= 1, "engine.tensor_parallel", "must be >= 1")


@dataclass(kw_only=True)
class PrecomputeConfig:
    """Target hidden states on disk (headstart precompute)."""

    output_dir: str | None = None  # default: <output_dir>/precompute
    storage: Literal["bf16", "fp8"] = "bf16"  # fp8 = e4m3 with a per-token fp32 scale (half the disk)
    shard_tokens: int = 262144  # a shard closes once it holds at least this many tokens
    batch_tokens: int = 4096  # tokens per target forward
    split: Literal["train", "heldout", "all"] = "train"
    backend: Literal["engine", "hf"] = "engine"  # hf: transformers (device_map="auto") for huge targets

    def __post_init__(self) -> None:
        _require(self.shard_tokens >= 1, "precompute.shard_tokens", "must be >= 1")
        _require(self.batch_tokens >= 1, "precompute.batch_tokens", "must be >= 1")


@dataclass(kw_only=True)
class RegenerateConfig:
    """Rewrite the assistant turns with the target itself (headstart regenerate)."""

    output: str | None = None  # default: <output_dir>/regenerated.jsonl
    source: str | None = None  # conversations to rewrite (None: data.source; data.source then names the output)
    limit: int | None = None  # read only the first N rows of the source (None: data.limit)
    max_turns: int | None = None  # keep each conversation up to its N-th assistant turn (None: all turns)
    max_prompt_tokens: int | None = None  # skip conversations whose first prompt is longer (None: no limit)
    # stop a conversation at the first turn whose prompt (the conversation so far, templated) reaches this
    # many tokens, keeping the turns before it: training cuts at data.max_length, so later turns would
    # only cost decoding (None: every turn)
    max_context_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512  # per assistant turn
    batch_size: int = 16  # conversations decoded together
    # headstart: our engine; vllm: vLLM in its own interpreter (make vllm-env / $HEADSTART_VLLM_PYTHON),
    # as SpecForge and speculators users regenerate (benchmarks/regenerate.md measures both here)
    engine: str = "headstart"
    # our engine keeps the K/V of finished turns' full pages and reuses them for the conversation's next
    # turn (the history is not prefilled again); vLLM's worker uses its own prefix caching either way
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        _require(self.engine in ("headstart", "vllm"), "regenerate.engine", "must be headstart or vllm")
        _require(self.temperature >= 0, "regenerate.temperature", "must be >= 0")
        _require(0 < self.top_p <= 1, "regenerate.top_p", "must be in (0, 1]")
        _require(self.max_tokens >= 1, "regenerate.max_tokens", "must be >= 1")
        _require(self.batch_size >= 1, "regenerate.batch_size", "must be >= 1")
        _require(self.limit is None or self.limit > 0, "regenerate.limit", "must be > 0 or null")
        _require(self.max_turns is None or self.max_turns > 0, "regenerate.max_turns", "must be > 0 or null")
        _require(self.max_prompt_tokens is None or self.max_prompt_tokens > 0, "regenerate.max_prompt_tokens",
                 "must be > 0 or null")
        _require(self.max_context_tokens is None or self.max_context_tokens > 0, "regenerate.max_context_tokens",
                 "must be > 0 or null")
        _require(self.source is None or bool(self.source.strip()), "regenerate.source", "must not be empty")


@dataclass(kw_only=True)
class LossWeights:
    """Weights of the training losses (docs/training.md, Losses)."""

    kl: float = 1.0  # forward KL to the target's distribution (soft cross-entropy minus its entropy)
    feature: float = 0.1  # smooth-L1 between the head's output and the target's next hidden state

    def __post_init__(self) -> None:
        _require(self.kl >= 0 and self.feature >= 0, "train.loss_weights", "weights must be >= 0")
        _require(self.kl + self.feature > 0, "train.loss_weights", "at least one weight must be > 0")


@dataclass(kw_only=True)
class TrainConfig:
    """How the head is fitted (headstart train)."""

    source: Literal["shards", "online"] = "shards"  # shards: precompute's output; online: target runs per step
    shards_dir: str | None = None  # default: precompute's output directory for this recipe
    max_steps: int = 1000  # optimizer steps (the schedule's length)
    epochs: int | None = None  # stop after this many passes over the data if that comes first (None: steps only)
    # Train on the first N sequences (conversations) of the training split only, shards or online (None: all): a
    # data-size ablation that keeps the held-out split, the validation prompts and the shards of the whole data.
    max_sequences: int | None = None
    batch_tokens: int = 4096  # tokens per micro-batch per device (packed sequences, never split)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm (0: off)
    loss_weights: LossWeights = field(default_factory=LossWeights)
    # The distribution loss (weighted by loss_weights.kl, whichever it is; train.losses): kl = forward KL to the
    # target; the LK losses (arXiv 2602.23881) train the acceptance rate a = sum_x min(p(x), q(x)) itself:
    # lk_alpha = -log a per token; lk_lambda (= lk) = l KL + (1 - l)(1 - mean a), l = lk_kl_scale *
    # exp(-lk_kl_decay * mean a) (mean a: the micro-batch's, per draft step, no gradient through l).
    loss: Literal["kl", "lk", "lk_lambda", "lk_alpha"] = "kl"
    lk_kl_scale: float = 1.0  # lk_lambda: the KL's weight at a = 0
    lk_kl_decay: float = 3.0  # lk_lambda: eta, how fast the KL's weight falls as acceptance rises (the paper's 3)
    ttt_steps: int = 1  # training-time test: unrolled draft steps (1 = plain teacher forcing)
    ttt_decay: float = 0.8  # step j's loss is weighted by ttt_decay ** j
    # Which rows each unrolled step learns from: all (every supervised row), or reached: step j only from the rows
    # the greedy chain reaches, where the head's drafts 1..j of that block were right (train.ttt.reached_rows; the
    # states greedy verification reads, as on-policy training argues): a device mask weighing the rows, the step's
    # row count unchanged (its mean over the reached rows times the fraction reached).
    ttt_rows: Literal["all", "reached"] = "all"
    block_decay_gamma: float = 4.0  # dflash: draft slot i's loss is weighted exp(-(i - 1) / gamma) (speculators')
    # Rows per vocabulary-sized chunk of the loss (no [tokens x vocab] tensor is kept). null: by device
    # (headstart.sizing.loss_chunk_rows): 256 on CPU; on a GPU as many as fit LOSS_CHUNK_GPU_BYTES (fewer launches).
    loss_chunk_tokens: int | None = None
    val_every_steps: int = 200  # engine validation interval (0: only at the end)
    val_prompts: int = 16  # held-out prompts (first user turns) decoded by the engine at each validation
    val_max_tokens: int = 64  # new tokens per validation prompt
    val_loss_batches: int = 8  # held-out micro-batches for val_loss / top-1 per step
    ckpt_every_steps: int = 100  # Lightning checkpoint (last.ckpt) interval, for --resume
    max_bad_steps: int = 10  # consecutive non-finite losses before training stops
    num_workers: int = 0  # DataLoader workers
    # Compile the head's forward and its logits (torch.compile, inductor; CPU too). What does not compile
    # runs eagerly, and the run says which function fell back and why.
    compile: bool = False

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_tokens", "grad_accum", "ttt_steps", "ckpt_every_steps", "max_bad_steps"):
            _require(getattr(self, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        _require(self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1, "train.loss_chunk_tokens",
                 f"must be >= 1 or null (by device), got {self.loss_chunk_tokens}")
        for key in ("epochs", "max_sequences"):
            _require(getattr(self, key) is None or getattr(self, key) >= 1, f"train.{key}", "must be >= 1 or null")
        _require(self.block_decay_gamma > 0, "train.block_decay_gamma", f"must be > 0, got {self.block_decay_gamma}")
        _require(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        for key in ("warmup_steps", "weight_decay", "grad_clip", "val_every_steps", "val_prompts", "val_loss_batches"):
            _require(getattr(self, key) >= 0, f"train.{key}", f"must be >= 0, got {getattr(self, key)}")
        # Each unrolled step keeps its activations for the backward pass: memory grows linearly with
        # ttt_steps (100 steps on 128-token sequences needed ~20 GB); EAGLE-3 trains with 7.
        _require(self.ttt_steps <= MAX_TTT_STEPS, "train.ttt_steps",
                 f"must be in 1..{MAX_TTT_STEPS}, got {self.ttt_steps}")
        _require(0 < self.ttt_decay <= 1, "train.ttt_decay", "must be in (0, 1]")
        _require(0 < self.lk_kl_scale <= 1, "train.lk_kl_scale", f"must be in (0, 1], got {self.lk_kl_scale}")
        _require(self.lk_kl_decay >= 0, "train.lk_kl_decay", f"must be >= 0, got {self.lk_kl_decay}")
        _require(self.loss == "kl" or self.loss_weights.kl > 0, "train.loss_weights",
                 f"kl weighs the distribution loss ({self.loss}): it must be > 0")
        _require(self.val_max_tokens >= 1, "train.val_max_tokens", "must be >= 1")
        _require(self.num_workers >= 0, "train.num_workers", "must be >= 0")


@dataclass(kw_only=True)
class TrainerSection:
    """Where training runs; only this section changes between this CPU and 8xH100 nodes."""

    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int = 1  # processes per node (GPUs, or CPU processes with gloo)
    num_nodes: int = 1  # with torchrun / SLURM setting the usual environment
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # auto: ddp when devices * num_nodes > 1
    precision: Literal["auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed"] = "auto"  # auto: bf16-mixed if native

    def __post_init__(self) -> None:
        _require(self.devices >= 1, "trainer.devices", "must be >= 1")
        _require(self.num_nodes >= 1, "trainer.num_nodes", "must be >= 1")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: bool = True  # Weights & Biases (offline automatically without WANDB_API_KEY)
    project: str = "headstart"
    every_steps: int = 10  # metrics.csv / logger interval

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "logging.every_steps", "must be >= 1")


@dataclass(kw_only=True)
class Recipe:
    """A complete run: target, data and where results go."""

    name: str | None = None  # a label for logs and reports
    output_dir: str = "runs/default"  # every artefact of the run is written under this directory
    seed: int = 0  # seeds sampling, shuffling and initialisation
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    head: HeadSection = field(default_factory=HeadSection)
    engine: EngineSection = field(default_factory=EngineSection)
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _FieldError(ValueError):
    """Raised inside __post_init__; turned into a ConfigError that names the file."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise _FieldError(key, message)
