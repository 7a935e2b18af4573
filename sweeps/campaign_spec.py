"""A campaign file (`conf/campaign/*.yaml`): its stages, their cells, and the winner of a stage.

What `sweeps.campaign` runs and `sweeps.campaign_report` reads; the format is described in `sweeps/campaign.py`'s
docstring and docs/sweeps.md."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import yaml

from dflash.config import ConfigError
from dflash.overrides import split_override

CAMPAIGN_DIR = Path(__file__).resolve().parent.parent / "conf" / "campaign"


@dataclasses.dataclass
class Stage:
    factor: str  # a config group (loss, noise, buffer, ...) or, with `sets`, any name for what varies
    options: list[str]
    on_best: list[str] = dataclasses.field(default_factory=list)  # earlier factors whose winner this stage uses
    # option name -> the run overrides that make it (the campaign file's `options:` as a mapping), for a factor that
    # is not one config group, e.g. how many views of how many distinct sequences; None: option = `+factor=option`
    sets: dict[str, list[str]] | None = None
    # option name -> the learning rates (`trainer.lr`) it is trained at, for options that change the effective step
    # (an optimizer, the depth): a cell per (option, lr, seed); the report compares each such option at its best lr
    lr_grid: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def overrides(self, option: str) -> list[str]:
        """The run overrides that select `option` of this stage's factor."""
        return list(self.sets[option]) if self.sets is not None else [f"+{self.factor}={option}"]


@dataclasses.dataclass
class Campaign:
    name: str
    experiment: str
    budget_tokens: int
    max_steps: int  # the LR schedule's length: the same for every cell, longer than the budget needs
    objective: str
    base: list[str]
    stages: list[Stage]
    # training seeds of every cell: three by default, since an interval over two seeds is 9× wider than the
    # percentile bootstrap's (dflash.evaluation.stats.small_sample_factor; docs/evaluation.md)
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    workers: int = 1
    description: str = ""
    # earlier campaigns (their names, in the same `out` store) whose stages of the same factor the report ranks this
    # one's against: the served campaign's loss stage against the old protocol's (sweeps/protocol_agreement.py)
    compare_with: list[str] = dataclasses.field(default_factory=list)
    # factors whose cells start first where stages share one pool of workers (`stage_groups`), in this order: the
    # slowest cells (more layers, uncompiled) first, so the pool's last wave is short cells, not one long straggler
    start_first: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Cell:
    stage: int
    factor: str
    option: str
    seed: int
    overrides: list[str]
    lr: float | None = None  # a point of its option's `lr_grid`; None: the option's own learning rate

    @property
    def id(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        return f"s{self.stage}-{self.factor}-{self.option}{lr}-seed{self.seed}"

    def labels(self) -> dict[str, Any]:
        """What names this cell in a result record (`cell.json`, `summary.json`)."""
        out = {"cell": self.id, "stage": self.stage, "factor": self.factor, "option": self.option, "seed": self.seed}
        return out if self.lr is None else {**out, "lr": self.lr}


def _fields(cls) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _strict(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_fields(cls)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected {sorted(_fields(cls))}")
    missing = [n for n, f in _fields(cls).items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    return raw


def parse_campaign(raw: Any, where: str) -> Campaign:
    d = dict(_strict(Campaign, raw, where))
    stages = []
    for i, s in enumerate(d.pop("stages")):
        s = _strict(Stage, s, f"{where}: stages[{i}]")
        if "sets" in s:
            raise ConfigError(f"{where}: stages[{i}]: unknown key 'sets' (named overrides are `options:` as a mapping)")
        stage = Stage(factor=str(s["factor"]), options=[], on_best=[str(f) for f in s.get("on_best", [])])
        stage.options, stage.sets = _options(s["options"], f"{where}: stages[{i}].options")
        stage.lr_grid = _lr_grid(s.get("lr_grid", {}), stage.options, f"{where}: stages[{i}].lr_grid")
        earlier = {st.factor for st in stages}
        if not set(stage.on_best) <= earlier:
            raise ConfigError(f"{where}: stages[{i}].on_best {stage.on_best}: not all are factors of earlier "
                              f"stages {sorted(earlier)}")
        if not stage.options:
            raise ConfigError(f"{where}: stages[{i}].options is empty")
        stages.append(stage)
    c = Campaign(stages=stages, **d)
    for key in ("budget_tokens", "max_steps", "workers"):
        v = getattr(c, key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: {key}={v!r}; expected a positive integer")
    if not isinstance(c.seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in c.seeds) \
            or not c.seeds or len(set(c.seeds)) != len(c.seeds):
        raise ConfigError(f"{where}: seeds={c.seeds!r}; expected a non-empty list of distinct integers")
    factors = [st.factor for st in c.stages]
    if not isinstance(c.start_first, list) or not set(c.start_first) <= set(factors):
        raise ConfigError(f"{where}: start_first={c.start_first!r}; expected a list of the stages' factors {factors}")
    return c


def _options(raw: Any, where: str) -> tuple[list[str], dict[str, list[str]] | None]:
    """A stage's options: a list of a config group's option names, or a mapping of option name -> run overrides
    (a list of `key=value` strings; an empty list is the base config itself)."""
    if isinstance(raw, list):
        return [str(o) for o in raw], None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a list of option names or a mapping name -> [overrides], "
                          f"got {type(raw).__name__}")
    sets = {}
    for name, ovr in raw.items():
        if not isinstance(ovr, list) or not all(isinstance(o, str) and "=" in o for o in ovr):
            raise ConfigError(f"{where}.{name}: expected a list of key=value overrides, got {ovr!r}")
        sets[str(name)] = list(ovr)
    return list(sets), sets


def _lr_grid(raw: Any, options: list[str], where: str) -> dict[str, list[float]]:
    """A stage's `lr_grid`: option -> a non-empty list of distinct positive learning rates, every option one of
    the stage's."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping option -> [learning rates], got {type(raw).__name__}")
    out = {}
    for opt, lrs in raw.items():
        if opt not in options:
            raise ConfigError(f"{where}: {opt!r} is not an option of the stage {options}")
        if not isinstance(lrs, list) or not lrs or len(set(lrs)) != len(lrs) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in lrs):
            raise ConfigError(f"{where}.{opt}: {lrs!r}; expected a non-empty list of distinct positive numbers")
        out[str(opt)] = [float(x) for x in lrs]
    return out


def load_campaign(ref: str, edits: list[str] = ()) -> Campaign:
    """A campaign by name (conf/campaign/<name>.yaml) or path, with `campaign.KEY=VALUE` edits on top."""
    path = Path(ref) if ref.endswith((".yaml", ".yml")) else CAMPAIGN_DIR / f"{ref}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CAMPAIGN_DIR.glob("*.yaml"))
        raise ConfigError(f"campaign {ref!r}: no file {path} (known: {known})")
    raw = yaml.safe_load(path.read_text())
    for edit in edits:
        key, value = split_override(edit.removeprefix("campaign."), "argument")
        if key not in _fields(Campaign) or key == "stages":
            raise ConfigError(f"{edit!r}: campaign has no editable key {key!r}")
        raw[key] = yaml.safe_load(value)
    return parse_campaign(raw, str(path))


def stage_cells(c: Campaign, index: int, winners: dict[str, str],
                winner_lrs: dict[str, float] | None = None) -> list[Cell]:
    """The cells of stage `index`, built on the winners of the factors it names in `on_best`, each winner at its
    best learning rate where its stage had an `lr_grid` for it (`winner_lrs`: factor -> lr)."""
    stage = c.stages[index]
    by_factor = {st.factor: st for st in c.stages}
    lrs = winner_lrs or {}
    fixed = [o for f in stage.on_best for o in [*by_factor[f].overrides(winners[f]),
                                                 *([f"trainer.lr={lrs[f]:g}"] if f in lrs else [])]]
    budget = [f"trainer.token_budget={c.budget_tokens}", f"trainer.max_steps={c.max_steps}",
              f"tracking.experiment={c.experiment}"]
    # the option last: one that names its own budget (reference_recipe's `budget` stage: what 30 H200-minutes
    # allow, against the campaign's 131 M) trains at it; every other option trains at the campaign's
    # an lr of the option's grid after the option's own overrides: it replaces a learning rate the option names
    return [Cell(index, stage.factor, opt, seed,
                 [*c.base, *fixed, f"seed={seed}", *budget, *stage.overrides(opt),
                  *([] if lr is None else [f"trainer.lr={lr:g}"])], lr)
            for opt in stage.options for lr in stage.lr_grid.get(opt, [None]) for seed in c.seeds]


def start_order(c: Campaign, cells: Sequence[Cell], runs: Sequence[int]) -> list[int]:
    """`runs` (indices into `cells`) in the order a pool starts them: seed by seed (every option's first seed
    before any second seed), and within a seed the factors of `c.start_first` first, in that order, then the rest
    as listed (a stable sort). A launch its deadline cuts short then leaves whole single-seed stages to compare,
    not some options with both seeds and others with none."""
    rank = {f: i for i, f in enumerate(c.start_first)}
    seed_rank = {s: i for i, s in enumerate(c.seeds)}
    return sorted(runs, key=lambda i: (seed_rank.get(cells[i].seed, len(seed_rank)),
                                       rank.get(cells[i].factor, len(rank))))


def lr_means(results: list[dict]) -> dict[str, dict[float | None, float]]:
    """option -> {learning rate (None: the option's own) -> mean objective over its seeds}."""
    by: dict[str, dict[float | None, list[float]]] = {}
    for r in results:
        v = float(r["value"]) if r.get("value") is not None else float("-inf")
        by.setdefault(r["option"], {}).setdefault(r.get("lr"), []).append(v)
    return {o: {lr: sum(v) / len(v) for lr, v in lrs.items()} for o, lrs in by.items()}


def best_lrs(results: list[dict]) -> dict[str, float | None]:
    """Each option's learning rate of the highest mean objective over its seeds (ties: the first listed)."""
    return {o: max(lrs, key=lambda lr: lrs[lr]) for o, lrs in lr_means(results).items()}


def at_best_lr(results: list[dict]) -> list[dict]:
    """The cells of each option at its best learning rate (`best_lrs`): what a stage's tables, Δs and call
    compare (one cell per option and seed). Cells without an lr grid are all kept."""
    best = best_lrs(results)
    return [r for r in results if r.get("lr") == best[r["option"]]]


def record_winner_lr(summary: dict, factor: str, results: list[dict]) -> None:
    """Note in `summary["winner_lrs"]` the learning rate the stage's winner won at, where it had an lr grid: later
    stages built on it (`on_best`) train at that lr (`stage_cells`)."""
    lr = best_lrs(results).get(summary["winners"][factor])
    if lr is not None:
        summary.setdefault("winner_lrs", {})[factor] = lr


def best_option(results: list[dict]) -> str:
    """The option with the highest mean objective over its seeds, each option at its best learning rate where it
    has an `lr_grid` (ties: the first listed)."""
    means = lr_means(results)
    return max(means, key=lambda o: max(means[o].values()))


def check_only(c: Campaign, only: Sequence[str]) -> None:
    """`only=` names factors or factor/option pairs of the campaign (a typo would start nothing, silently)."""
    known = {st.factor for st in c.stages} | {f"{st.factor}/{o}" for st in c.stages for o in st.options}
    unknown = [o for o in only if o not in known]
    if unknown:
        raise ConfigError(f"only={list(only)}: {unknown} name no factor or factor/option of campaign {c.name} "
                          f"(known: {sorted(known)})")
