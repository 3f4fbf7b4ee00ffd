"""The run config: pydantic models, ``extra="forbid"`` everywhere.

Components are named by string (``precision.scheme: bf16``) or as ``{name: ..., options: {...}}``;
their options are checked against the component's own ``Config`` when the run is resolved
(:func:`gem_model.resolve.resolve_components`). The defaults are the tiny CPU run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

OUTPUT_DIR_PLACEHOLDERS = ("name",)
"""What ``trainer.output_dir`` may name in braces: ``{name}`` is the run's ``name``."""


class Strict(BaseModel):
    # no NaN or infinity in any float: `trainer.dense_lr=.inf` is a typo, not a learning rate
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _placeholder_problem(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"unknown placeholder {{{exc.args[0]}}}"
    if isinstance(exc, IndexError):
        return "a positional placeholder {} (name one)"
    return f"malformed braces ({exc})"


class ComponentRef(Strict):
    """A registered component by name, with options for its ``Config``."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


def ref(name: str, **options: Any) -> ComponentRef:
    return ComponentRef(name=name, options=options)


class ModelConfig(Strict):
    """Sizes of the GEM model. Table sizes come from the data source's feature spec."""

    embedding_dim: int = Field(32, gt=0, description="width of embeddings and of the HSTU residual stream")
    num_blocks: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)
    attention_dim: int = Field(16, gt=0, description="Dqk per head")
    value_dim: int = Field(16, gt=0, description="Dv per head")
    max_seq_len: int = Field(64, gt=0, description="N in the attention normalisation; longer histories are cut")
    max_attn_len: int = Field(0, ge=0, description="local attention window, 0 for none")
    alpha: float | None = Field(None, description="attention scale; default 1/attention_dim")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    position_embedding: bool = True
    interaction_layers: int = Field(1, ge=0, description="self-attention layers over non-sequence tokens")
    cross_layers: int = Field(1, ge=0, description="layers where sequence summary and feature tokens mix")
    mlp_hidden: int = Field(64, gt=0)
    temperature: float = Field(0.05, gt=0.0, description="sampled-softmax temperature")
    l2_normalize: bool = Field(True, description="L2-normalise query and item embeddings in the next-item loss")
    next_item_weight: float = Field(1.0, ge=0.0)
    task_weight: float = Field(1.0, ge=0.0)
    use_candidate: bool = Field(True, description="append the candidate item to the sequence as a target")
    use_side_features: bool = Field(True, description="feed the non-sequence tower into the cross step")
    embedding_init_std: float | None = Field(
        None, gt=0.0, description="draw the sequence tables (items, actions) from N(0, std); None: uniform, small"
    )
    table_init: Literal["host", "device"] = Field(
        "host",
        description="host: the tables are drawn on the CPU from the seed, identical for every world size and "
        "planner; device: they are built on the meta device and the planner draws them on the training device "
        "(uniform, same bounds), which takes seconds instead of minutes for tables of tens of GB",
    )
    relative_position_bias: bool = Field(
        False,
        description="a learned bias per relative position added to the attention scores in every block "
        "(HSTU's positional attention bias); needs an attention kernel that supports it (gem-kernels: torch, triton)",
    )
    relative_time_bias: bool = Field(
        False,
        description="a learned bias per bucket of log time difference added to the attention scores in every "
        "block (the time half of HSTU's relative attention bias; the query's time is that of the action it "
        "predicts); needs timestamps from the data source and an attention kernel that supports it (torch)",
    )
    time_bias_buckets: int = Field(128, ge=1, description="buckets of the relative time bias (ln(|dt|) / 0.301 each)")
    scale_item_input: bool = Field(
        False, description="multiply the item embeddings entering the sequence by sqrt(embedding_dim) (SASRec, HSTU)"
    )
    position_init_std: float | None = Field(
        None, gt=0.0, description="draw the position embedding from N(0, std); None: Xavier uniform like other weights"
    )
    uvqk_init_std: float | None = Field(
        None, gt=0.0, description="draw the HSTU blocks' uvqk projections from N(0, std); None: Xavier uniform"
    )
    lookup_bags_per_sample: int | None = Field(
        32,
        ge=1,
        description="the sequence features' ids go to the table lookup in this many even bags per sample (the same "
        "rows come back): FBGEMM's unpooled lookup runs one warp per bag, so long histories in one bag each leave "
        "the GPU mostly idle; null looks them up in one bag per sample and feature",
    )
    context_token: bool = Field(
        False,
        description="prepend one token made from the non-sequence tower to every sequence (HSTU's contextual "
        "token), so the side features reach every position, the next-item loss and the retrieval query; "
        "needs use_side_features",
    )

    @model_validator(mode="after")
    def _context_needs_side_features(self) -> ModelConfig:
        if self.context_token and not self.use_side_features:
            raise ValueError("model.context_token needs model.use_side_features: true (it is built from that tower)")
        return self


class DataConfig(Strict):
    source: ComponentRef = Field(default_factory=lambda: ref("synthetic"))
    balancer: ComponentRef = Field(default_factory=lambda: ref("round_robin"))
    global_batch_size: int = Field(64, gt=0)


class PrecisionConfig(Strict):
    scheme: ComponentRef = Field(default_factory=lambda: ref("fp32"))
    overrides: dict[str, str] = Field(
        default_factory=dict, description="module-name pattern (fnmatch) -> scheme name; first match wins"
    )
    exclude: list[str] = Field(default_factory=list, description="module-name patterns left in fp32")
    min_dim: int = Field(0, ge=0, description="linears with a smaller in or out dim stay fp32")
    activation_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the activations between the model's ops (gem_model.precision); auto: the one "
        "the scheme declares (bfloat16 for bf16, fp8 and MX schemes, float32 for fp32)",
    )


class ActivationConfig(Strict):
    policy: ComponentRef = Field(default_factory=lambda: ref("none"))
    overrides: dict[str, str] = Field(default_factory=dict, description="block-name pattern -> policy")


class ParallelConfig(Strict):
    planner: ComponentRef = Field(default_factory=lambda: ref("single"))


class CommConfig(Strict):
    strategy: ComponentRef = Field(default_factory=lambda: ref("default"))


class TrainerConfig(Strict):
    steps: int = Field(200, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dense_lr: float = Field(2e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.98)
    sparse_optimizer: Literal["rowwise_adagrad", "adam", "sgd"] = Field(
        "rowwise_adagrad", description="optimizer of the embedding tables (gem_model.train.optim)"
    )
    sparse_lr: float = Field(0.05, gt=0.0, description="learning rate of the tables' optimizer")
    sparse_eps: float = Field(1e-8, gt=0.0)
    grad_clip: float | None = Field(None, gt=0.0, description="clip the dense gradients' global norm to this")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="linear learning-rate warm-up over this many steps, of dense_lr and of sparse_lr alike "
        "(torchrec's fused table optimizers take a new rate every step too): step s trains at "
        "min(1, (s + 1) / warmup_steps) times the rate; a function of the step, so a resume continues it; 0: none",
    )
    prefetch: int = Field(
        2,
        ge=0,
        description="batches built ahead in a background thread while the step runs (on CUDA also pinned "
        "and copied to the device on a stream of their own; gem_model.data.prefetch); 0: built inside the step",
    )
    log_every: int = Field(10, gt=0)
    output_dir: str = Field("runs/{name}", description="where metrics and checkpoints go; {name}: the run's name")
    checkpoint_every: int = Field(0, ge=0, description="0: only at the end")
    checkpoint_at_end: bool = True
    resume: bool | None = Field(
        None,
        description="unset (auto): continue from the latest checkpoint in output_dir when it is this run's "
        "(same config, but for how long it trains, logs, evaluates, where it writes), refuse another run's; "
        "true: continue from it regardless; false: refuse when output_dir holds any checkpoint",
    )
    time_limit_s: float | None = Field(
        None,
        gt=0.0,
        description="stop after the first step that reduces its loss past this many seconds of training "
        "(rank 0's clock, read with the step's one host sync), then evaluate",
    )
    eval_every: int = Field(0, ge=0, description="evaluate on the validation split every N steps (0: never)")
    eval_at_end: bool = Field(True, description="evaluate on the validation and test splits after the last step")
    progress: bool = True
    tensorboard: bool = Field(
        False,
        description="also write the metrics (losses, tokens/s, MFU, memory, evaluation) as TensorBoard scalars "
        "to output_dir/tensorboard, beside metrics.jsonl (needs the tensorboard package: gem-model[tensorboard])",
    )
    peak_flops: float | None = Field(None, gt=0.0, description="override the MFU denominator (FLOP/s)")
    compile: bool = False
    pipeline: ComponentRef = Field(
        default_factory=lambda: ref("sequential"),
        description="the registered train pipeline that runs each step's stages (gem_model.lifecycle.TrainPipeline)",
    )
    non_finite: Literal["halt", "skip"] = Field(
        "halt",
        description="a NaN or Inf loss: halt (gem-train exits 3, no update applied), or skip the step's "
        "update (parameters and optimizer state unchanged) and halt after non_finite_max_skips in a row",
    )
    non_finite_max_skips: int = Field(3, ge=1, description="with non_finite=skip: halt at this many consecutive skips")
    loss_check: Literal["before_backward", "before_tables", "auto"] = Field(
        "auto",
        description="where the host reads the step's reduced loss sums (gem_model.train.loss_check): before "
        "backward (one host sync between forward and backward), or inside backward where the gradient reaches "
        "the tables (no wait for the device; needs non_finite=halt and a loss group of every rank); auto: "
        "before_tables where it can run",
    )
    loss_spike_factor: float | None = Field(
        10.0,
        gt=1.0,
        description="warn (log and metrics.jsonl) when a step's loss is at least this many times the running "
        "median of the previous loss_spike_window steps' losses; None: never",
    )
    loss_spike_window: int = Field(20, ge=3, description="steps in the running median of loss_spike_factor")
    collective_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="a collective that waits longer than this for a peer fails, naming the collective and "
        "the rank (the process group's timeout)",
    )
    gc_every: int = Field(
        0,
        ge=0,
        description="Python's cyclic garbage collector at step boundaries: freeze what the set-up built, turn "
        "automatic collection off during the loop, and collect (what was made since) after every N steps "
        "(gem_model.train.collector); 0: Python's own collection, which may pause the host inside a step",
    )
    stop_grace_s: float | None = Field(
        None,
        gt=0.0,
        description="after SIGTERM or SIGINT, a rank that has not finished its step and checkpoint within this "
        "many seconds exits at once (128 + signum) without a checkpoint, so a stalled rank does not outlive its "
        "peers; None: wait however long the step and the checkpoint take",
    )
    @model_validator(mode="after")
    def _loss_check_with_skip(self) -> TrainerConfig:
        if self.loss_check == "before_tables" and self.non_finite == "skip":
            raise ValueError(
                "trainer.loss_check=before_tables cannot go with trainer.non_finite=skip: a skipped step would have "
                "to go on after its backward was abandoned at the tables; use loss_check before_backward or auto "
                "(auto reads the loss before backward under skip)"
            )
        return self

    @field_validator("output_dir")
    @classmethod
    def _output_dir_placeholders(cls, value: str) -> str:
        try:
            value.format(**{k: "x" for k in OUTPUT_DIR_PLACEHOLDERS})
        except (KeyError, IndexError, ValueError) as exc:
            valid = ", ".join("{" + k + "}" for k in OUTPUT_DIR_PLACEHOLDERS)
            raise ValueError(f"{_placeholder_problem(exc)}; the placeholders are {valid} (write {{{{ and }}}} for a "
                             "literal brace)") from None  # fmt: skip
        return value

    resume_partial: bool = Field(
        False,
        description="resume from a checkpoint whose tensors do not all fit: load those that do, keep the "
        "fresh initialisation of the others, and list them; false: such a checkpoint is refused (exit 2)",
    )


class KernelsConfig(Strict):
    jagged_attention: ComponentRef = Field(default_factory=lambda: ref("torch"))
    norm_gate: ComponentRef = Field(default_factory=lambda: ref("torch"))
    sequence_input: ComponentRef = Field(default_factory=lambda: ref("torch"))
    sequence_pool: ComponentRef = Field(default_factory=lambda: ref("torch"))
    next_item_loss: ComponentRef = Field(default_factory=lambda: ref("torch"))


class RunConfig(Strict):
    """A whole run. ``gem-train config`` prints it resolved, with its JSON schema."""

    name: str = "gem-tiny"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    activation: ActivationConfig = Field(default_factory=ActivationConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    callbacks: list[ComponentRef] = Field(
        default_factory=list,
        description="lifecycle plugins (gem_model.lifecycle.Callback) switched on for this run, each "
        "{name, options}; an installed callback not listed here does nothing",
    )

    @field_validator("callbacks")
    @classmethod
    def _callbacks_once(cls, callbacks: list[ComponentRef]) -> list[ComponentRef]:
        names = [c.name for c in callbacks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"callbacks: {twice} listed more than once; list each callback once, with all its options")
        return callbacks

