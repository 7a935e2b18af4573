"""The pretraining recipe's config (`PretrainConfig`) and its checks, made before any work starts."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.corpus import CorpusConfig, validate_corpus_config
from dflash.tracking.loggers import TrackingConfig


DATA_KINDS = ("code", "math")


@dataclass
class PretrainConfig:
    # what the target learns: `code` (the corpus alone: the code reference target) or `math` (the corpus's code
    # mixed with seeded word problems and their worked solutions, dflash.data.math_problems: the math target)
    data: str = "code"
    math_problems: int = 300_000  # data=math: training problems generated (held-out ones never among them)
    math_eval_problems: int = 2000  # data=math: held-out problems in each of val and test
    math_seed: int = 0  # data=math: the generator's seed
    # data=math: the quality bar (dflash.pretrain.math_quality) on the written folder: held-out problems sampled,
    # problems the marginal oracle decodes, rollouts per oracle round, tokens per solution at most
    bar_problems: int = 256
    bar_oracle_prompts: int = 16
    bar_rollouts: int = 64
    bar_max_new_tokens: int = 160  # a solution's length cap (a worked solution is 40-120 tokens)
    # the setting the target is served at, written to its generation_config.json (serve_temperature 0: greedy)
    serve_temperature: float = 1.0
    serve_top_p: float = 1.0
    serve_top_k: int = 0
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    # tokenizer
    vocab_size: int = 4096  # including the 3 special tokens
    tokenizer_min_frequency: int = 2
    tokenizer_file: str = ""  # a tokenizer.json to use instead of training one (e.g. a shipped target's)
    tokenizer_split_newlines: bool = False  # "\n" a token of its own (see dflash.data.corpus.train_tokenizer)
    tokenizer_split_digits: bool = False  # every digit a token of its own (the math target's tokenizer)
    tokenizer_sample_bytes: int = 48_000_000  # train-split text the BPE learns from (0 = all of it)
    token_cache_dir: str = ".cache/dflash/tokens"  # encoded corpus, keyed by corpus + tokenizer ("" = off)
    # model: Qwen3.5 text config (every 4th layer full attention, the rest Gated DeltaNet)
    hidden_size: int = 384
    num_layers: int = 8
    intermediate_size: int = 1024
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False  # untied, like Qwen3.6-27B
    max_position_embeddings: int = 4096
    max_bf16_bytes: int = 40_000_000  # the shipped weights must stay under this
    # training
    seq_len: int = 512
    batch_size: int = 32
    max_steps: int = 20000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # time_budget_s: wall clock for this job (setup included); 0 = none. The job stops training
    # finalize_reserve_s before its end (final eval, save, continuations), checkpoints, and writes the folder.
    time_budget_s: float = 0.0
    finalize_reserve_s: float = 90.0
    # true: the cosine's progress is also pushed on by this job's wall clock (one-job runs end decayed);
    # false: the LR follows max_steps alone, so several jobs that resume each other make one schedule
    schedule_by_time: bool = False
    # false: a job that stops before max_steps (time budget, job_max_steps) only checkpoints: no final eval, no
    # folder, no continuations (the intermediate jobs of a multi-job run; the last job finalizes)
    finalize_every_job: bool = True
    job_max_steps: int = 0  # steps this job may train before it checkpoints and stops (0 = no cap)
    resume: bool = True  # continue from state_dir's checkpoint when there is one
    state_dir: str = ""  # the resume checkpoint's folder; empty → <run_dir>/state
    checkpoint_every: int = 1000  # steps between resume checkpoints (and at every stop); 0 = only at stops
    eval_every: int = 200  # steps between val evals (0 = only at the end)
    eval_tokens: int = 131072  # val tokens per eval (cap)
    final_eval_tokens: int = 2_000_000  # test tokens for the final numbers (cap)
    keep_best: bool = True  # ship the best-val snapshot rather than the last step
    log_every: int = 50  # steps between metric logs (the loop's only host sync)
    device: str = "auto"
    autocast: str = "auto"  # auto: bf16 on CUDA, off on CPU; or bfloat16 / off
    gdn_kernels: str = "auto"  # auto (measure), torch, fla
    # torch.compile of the training forward + loss: off | default | reduce-overhead | max-autotune-no-cudagraphs
    # (benchmarks/gpu/pretrain_step.py measures them side by side; eval and generation stay eager)
    compile: str = "off"
    grad_check_tol: float = 0.05
    seed: int = 0
    # outputs
    out_dir: str = "dflash/assets/reference_target"
    run_dir: str = ""  # metrics.jsonl / params; empty → runs/<timestamp>-pretrain_target
    results_path: str = ""  # results markdown; empty → none
    max_new_tokens: int = 64  # greedy continuation length for the eval prompts
    lookup_draft_len: int = 15  # prompt-lookup τ: tokens proposed per step (a 16-token DFlash block's worth)
    # probes: held-out perplexity on files outside the corpus, name → glob (relative to the working dir);
    # `stdlib_v1_test` (the first reference target's test files) is added when `probe_stdlib_v1` is set
    probes: dict[str, str] = field(default_factory=dict)
    probe_stdlib_v1: bool = True
    layer_ids: list[int] = field(default_factory=list)  # recorded for the drafter; empty → default
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
_POSITIVE = ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
             "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_head_dim", "seq_len",
             "batch_size", "max_steps", "lr", "log_every", "lookup_draft_len")


def validate_pretrain_config(cfg: PretrainConfig) -> None:
    if cfg.data not in DATA_KINDS:
        raise ValueError(f"pretrain.data={cfg.data!r}; expected one of {', '.join(DATA_KINDS)}")
    if cfg.data == "math" and (cfg.math_problems < 1 or cfg.math_eval_problems < 1):
        raise ValueError("pretrain.math_problems and pretrain.math_eval_problems must be >= 1 with data=math")
    for k in _POSITIVE:
        if getattr(cfg, k) <= 0:
            raise ValueError(f"pretrain.{k} must be > 0, got {getattr(cfg, k)}")
    if cfg.seq_len < 2:
        raise ValueError("pretrain.seq_len must be >= 2")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError("pretrain.num_heads must be a multiple of num_kv_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError("pretrain.linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.gdn_kernels not in ("auto", "torch", "fla"):
        raise ValueError(f"pretrain.gdn_kernels={cfg.gdn_kernels!r}; expected auto, torch or fla")
    if cfg.compile not in COMPILE_MODES:
        raise ValueError(f"pretrain.compile={cfg.compile!r}; expected one of {', '.join(COMPILE_MODES)}")
    if cfg.autocast not in ("auto", "bfloat16", "off"):
        raise ValueError(f"pretrain.autocast={cfg.autocast!r}; expected auto, bfloat16 or off")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError("pretrain.min_lr_ratio must lie in [0, 1]")
    if cfg.time_budget_s < 0 or cfg.finalize_reserve_s < 0:
        raise ValueError("pretrain.time_budget_s and finalize_reserve_s must be >= 0")
    for k in ("checkpoint_every", "tokenizer_sample_bytes", "job_max_steps"):
        if getattr(cfg, k) < 0:
            raise ValueError(f"pretrain.{k} must be >= 0, got {getattr(cfg, k)}")
    if cfg.resume and cfg.schedule_by_time and cfg.time_budget_s > 0:
        raise ValueError("pretrain.schedule_by_time=true ties the LR to one job's wall clock, which a resumed "
                         "job cannot continue: set resume=false, or schedule_by_time=false (the LR then "
                         "follows max_steps)")
    if cfg.tokenizer_file and not Path(cfg.tokenizer_file).is_file():
        raise FileNotFoundError(f"pretrain.tokenizer_file={cfg.tokenizer_file!r} is not a file")
    validate_corpus_config(cfg.corpus)
