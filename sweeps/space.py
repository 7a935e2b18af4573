"""Sweep definitions: `conf/sweep/<name>.yaml` → a validated `SweepDef`, its sampling, sampler and pruner.

A sweep file (every top-level key optional except `space`)::

    name: loss_variants                  # default study name (else the file name)
    description: free text
    fixed:                               # Hydra overrides applied to every trial (the short-run budget)
      - +trainer=gpu
      - trainer.max_steps=600
      - trainer.eval_every=150
    space:                               # config key -> distribution
      loss: {type: choice, choices: [hard_ce, soft_kl, streak]}           # a group: emitted as +loss=soft_kl
      loss.temperature: {type: float, low: 0.5, high: 4.0, log: true,
                         when: {loss: [soft_kl]}}                        # only sampled when loss=soft_kl
      buffer.min_ready: {type: int, low: 4, high: 48, log: true}          # emitted as buffer.min_ready=12
      trainer.lr: {type: float, low: 2.0e-4, high: 2.0e-3, log: true}
    objective: {metric: eval/tau_served, direction: maximize}
    sampler: {type: tpe, seed: 0, n_startup_trials: 8, multivariate: true, constant_liar: true}
    pruner: {type: median, n_startup_trials: 4, n_warmup_steps: 150}

Validation is strict and names the key (`SweepError`, a `ConfigError`): unknown keys at any level, bad
types, empty or inverted ranges, `log` with a non-positive bound, a `when` that refers to a later or
unknown parameter, a group option that does not exist, a key that is both fixed and searched.
`check_against_config` then checks every searched key against the composed run config (it must exist
and a numeric range must match the field's type), before any trial runs.

The sampled values of one trial become Hydra overrides (`suggest`); trial configs are composed by
`experiments.config.compose_config(fixed + cli overrides + sampled)`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from dflash.config import ConfigError
from dflash.overrides import split_override
from dflash.registry import Registry, UnknownName
from experiments.config import CONF_DIR, GROUPS, group_options

SWEEP_DIR = CONF_DIR / "sweep"
# Keys a sweep may not search or fix: the launcher owns them.
RESERVED_KEYS = ("run_dir", "resume")

TOP_KEYS = {"name", "description", "fixed", "space", "objective", "sampler", "pruner"}
PARAM_KEYS = {"choice": {"type", "choices", "when"},
              "float": {"type", "low", "high", "log", "step", "when"},
              "int": {"type", "low", "high", "log", "step", "when"}}
OBJECTIVE_KEYS = {"metric", "direction"}
DEFAULT_METRIC = "eval/tau_served"  # τ at the served sampling setting (docs/evaluation.md)


_NONNEGATIVE = {"n_startup_trials", "n_warmup_steps", "min_early_stopping_rate", "bootstrap_count"}
_POSITIVE = {"interval_steps", "n_min_trials", "n_ei_candidates", "min_resource", "max_resource"}
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class SweepError(ConfigError):
    """A sweep definition (or its use) is invalid; the message names the key."""


# --------------------------------------------------------------------------- definitions


@dataclass
class Param:
    key: str
    type: str  # choice | float | int
    choices: list[Any] = field(default_factory=list)
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    when: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def is_group(self) -> bool:
        return self.type == "choice" and self.key in GROUPS

    def suggest(self, trial) -> Any:
        if self.type == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.type == "float":
            return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log,
                                       step=None if self.step is None else float(self.step))
        return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log,
                                 step=1 if self.step is None else int(self.step))

    def override(self, value: Any) -> str:
        if self.is_group:
            return f"+{self.key}={value}"
        return f"{self.key}={format_value(value)}"

    def active(self, values: dict[str, Any]) -> bool:
        return all(k in values and values[k] in vs for k, vs in self.when.items())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "choice":
            d["choices"] = list(self.choices)
        else:
            d.update(low=self.low, high=self.high, log=self.log)
            if self.step is not None:
                d["step"] = self.step
        if self.when:
            d["when"] = {k: list(v) for k, v in self.when.items()}
        return d


@dataclass
class Objective:
    metric: str = DEFAULT_METRIC
    direction: str = "maximize"


@dataclass
class Spec:
    """A sampler or pruner: its type and its (validated) constructor options."""
    type: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.options}


@dataclass
class SweepDef:
    name: str
    space: list[Param]
    fixed: list[str] = field(default_factory=list)
    description: str = ""
    objective: Objective = field(default_factory=Objective)
    sampler: Spec = field(default_factory=lambda: Spec("tpe", {"seed": None}))
    pruner: Spec = field(default_factory=lambda: Spec("median", {}))
    path: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "fixed": list(self.fixed),
                "space": {p.key: p.to_dict() for p in self.space},
                "objective": dataclasses.asdict(self.objective),
                "sampler": self.sampler.to_dict(), "pruner": self.pruner.to_dict()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- loading


def sweep_names() -> list[str]:
    return sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))


def resolve_sweep_path(ref: str) -> Path:
    """A sweep name under conf/sweep/ (`loss_variants`) or a path to a YAML file."""
    p = Path(ref)
    if p.suffix in (".yaml", ".yml") or p.parent != Path("."):
        if not p.is_file():
            raise SweepError(f"sweep file {ref!r} not found")
        return p
    cand = SWEEP_DIR / f"{ref}.yaml"
    if not cand.is_file():
        raise SweepError(f"sweep {ref!r} not found; known sweeps in {SWEEP_DIR}: {', '.join(sweep_names())}")
    return cand


def load_sweep(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> SweepDef:
    """Load and validate a sweep by name or path; `overrides` are dotted `key=value` edits of the file
    itself (e.g. `sampler.seed=3`, `pruner.type=none`, `objective.metric=eval/tau_tree_64`)."""
    path = resolve_sweep_path(ref)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from e
    if raw is None:
        raw = {}
    for ov in overrides:
        _apply_dotted(raw, ov, str(path))
    return parse_sweep(raw, where=str(path), default_name=path.stem, path=str(path.resolve()))


def _apply_dotted(raw: Any, override: str, where: str) -> None:
    key, value = split_override(override, f"{where}: sweep override")  # the entry points' malformed-token check
    parts = key.split(".")
    if not isinstance(raw, dict) or not all(parts):
        raise SweepError(f"{where}: cannot apply sweep override {override!r}")
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise SweepError(f"{where}: sweep override {key!r}: {p!r} is not a mapping")
        node = nxt
    new = yaml.safe_load(value) if value != "" else ""
    if parts[1:] == ["type"] and parts[0] in ("sampler", "pruner") and node.get("type") != new:
        node.clear()  # another sampler / pruner: the file's options were the old one's (`pruner.type=none`)
    node[parts[-1]] = new


def parse_sweep(raw: Any, where: str = "sweep", default_name: str = "sweep", path: str = "") -> SweepDef:
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: a sweep definition must be a mapping, got {type(raw).__name__}")
    _no_unknown(raw, TOP_KEYS, where, "")
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise SweepError(f"{where}: name must be a non-empty string of letters, digits, '_', '-', '.', got {name!r}")
    description = raw.get("description", "") or ""
    if not isinstance(description, str):
        raise SweepError(f"{where}: description must be a string")
    fixed = raw.get("fixed", []) or []
    if not isinstance(fixed, list) or not all(isinstance(o, str) and "=" in o for o in fixed):
        raise SweepError(f"{where}: fixed must be a list of Hydra overrides 'key=value' (strings)")
    for o in fixed:
        if override_key(o) in RESERVED_KEYS:
            raise SweepError(f"{where}: fixed: {override_key(o)!r} is set by the launcher, not by a sweep")
    dup = _duplicates([override_key(o) for o in fixed])
    if dup:
        raise SweepError(f"{where}: fixed sets {', '.join(dup)} more than once")
    space = _parse_space(raw.get("space"), where)
    fixed_keys = {override_key(o) for o in fixed}
    both = [p.key for p in space if p.key in fixed_keys]
    if both:
        raise SweepError(f"{where}: {', '.join(both)} is both fixed and searched (space.{both[0]})")
    objective = _parse_objective(raw.get("objective"), where)
    sampler = _parse_spec(raw.get("sampler"), where, "sampler", SAMPLERS, "tpe")
    pruner = _parse_spec(raw.get("pruner"), where, "pruner", PRUNERS, "median")
    if pruner.type == "threshold" and pruner.options.get("lower") is None and pruner.options.get("upper") is None:
        raise SweepError(f"{where}: pruner.type=threshold needs pruner.lower or pruner.upper")
    if pruner.type == "percentile" and not 0 <= pruner.options.get("percentile", 50.0) <= 100:
        raise SweepError(f"{where}: pruner.percentile must be in [0, 100]")
    if pruner.options.get("reduction_factor", 2) < 2:
        raise SweepError(f"{where}: pruner.reduction_factor must be >= 2")
    for spec, section in ((sampler, "sampler"), (pruner, "pruner")):
        for k, v in spec.options.items():
            if k in _NONNEGATIVE and isinstance(v, int) and v < 0:
                raise SweepError(f"{where}: {section}.{k} must be >= 0, got {v}")
            if k in _POSITIVE and isinstance(v, int) and v < 1:
                raise SweepError(f"{where}: {section}.{k} must be >= 1, got {v}")
    return SweepDef(name=name, space=space, fixed=list(fixed), description=description, objective=objective,
                    sampler=sampler, pruner=pruner, path=path)


def _no_unknown(d: dict, allowed: set[str], where: str, prefix: str) -> None:
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise SweepError(f"{where}: unknown key(s) {', '.join(prefix + k for k in unknown)}; "
                         f"allowed under {prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(allowed))}")


def _duplicates(xs: list[str]) -> list[str]:
    seen, dup = set(), []
    for x in xs:
        if x in seen and x not in dup:
            dup.append(x)
        seen.add(x)
    return dup


def _number(v: Any, where: str, key: str, integer: bool) -> float | int:
    """YAML 1.1 reads `1e-4` as a string: accept numeric strings, reject everything else."""
    if isinstance(v, bool) or v is None:
        raise SweepError(f"{where}: {key} must be a number, got {v!r}")
    if isinstance(v, str):
        try:
            v = float(v) if not integer else int(v)
        except ValueError:
            raise SweepError(f"{where}: {key} must be a number, got {v!r}") from None
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SweepError(f"{where}: {key} must be a finite number, got {v!r}")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise SweepError(f"{where}: {key} must be an integer, got {v!r}")
        return int(v)
    return float(v)


def _parse_space(space: Any, where: str) -> list[Param]:
    if not isinstance(space, dict) or not space:
        raise SweepError(f"{where}: space must be a non-empty mapping of config key -> distribution")
    params: list[Param] = []
    for key, spec in space.items():
        at = f"space.{key}"
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise SweepError(f"{where}: {at}: not a config key (dotted identifiers, e.g. loss.temperature)")
        if key in RESERVED_KEYS or key.split(".")[0] in ("tracking",):
            raise SweepError(f"{where}: {at}: {key!r} cannot be searched (set by the launcher / tracking)")
        if not isinstance(spec, dict):
            raise SweepError(f"{where}: {at} must be a mapping with a 'type' (choice, float or int)")
        typ = spec.get("type")
        if typ not in PARAM_KEYS:
            raise SweepError(f"{where}: {at}.type must be one of choice, float, int; got {typ!r}")
        _no_unknown(spec, PARAM_KEYS[typ], where, f"{at}.")
        p = Param(key=key, type=typ)
        if typ == "choice":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise SweepError(f"{where}: {at}.choices must be a non-empty list")
            for c in choices:
                if not (c is None or isinstance(c, (str, int, float, bool))):
                    raise SweepError(f"{where}: {at}.choices: {c!r} is not a scalar")
            if len({json.dumps(c) for c in choices}) != len(choices):
                raise SweepError(f"{where}: {at}.choices has duplicates: {choices}")
            p.choices = list(choices)
            if key in GROUPS:
                _check_group_options(key, choices, where, at)
        else:
            integer = typ == "int"
            if "low" not in spec or "high" not in spec:
                raise SweepError(f"{where}: {at} needs low and high")
            p.low = _number(spec["low"], where, f"{at}.low", integer)
            p.high = _number(spec["high"], where, f"{at}.high", integer)
            if not p.low < p.high:
                raise SweepError(f"{where}: {at}: low ({p.low}) must be < high ({p.high})")
            log = spec.get("log", False)
            if not isinstance(log, bool):
                raise SweepError(f"{where}: {at}.log must be true or false, got {log!r}")
            p.log = log
            if log and p.low <= 0:
                raise SweepError(f"{where}: {at}: log: true needs low > 0, got {p.low}")
            if spec.get("step") is not None:
                p.step = _number(spec["step"], where, f"{at}.step", integer)
                if p.step <= 0:
                    raise SweepError(f"{where}: {at}.step must be > 0, got {p.step}")
                if log and p.step != 1:
                    raise SweepError(f"{where}: {at}: step cannot be combined with log: true")
            if key in GROUPS:
                raise SweepError(f"{where}: {at}: {key!r} is a config group; search it with type: choice")
        p.when = _parse_when(spec.get("when"), params, where, at)
        params.append(p)
    return params


def _check_group_options(group: str, choices: list[Any], where: str, at: str) -> None:
    known = group_options(group)
    bad = [c for c in choices if not isinstance(c, str) or c not in known]
    if bad:
        raise SweepError(f"{where}: {at}.choices: unknown {group} option(s) {bad}; known: {', '.join(known)}")


def _parse_when(when: Any, earlier: list[Param], where: str, at: str) -> dict[str, list[Any]]:
    if when is None:
        return {}
    if not isinstance(when, dict) or not when:
        raise SweepError(f"{where}: {at}.when must be a mapping of an earlier choice key -> allowed values")
    by_key = {p.key: p for p in earlier}
    out: dict[str, list[Any]] = {}
    for k, vs in when.items():
        ref = by_key.get(k)
        if ref is None or ref.type != "choice":
            raise SweepError(f"{where}: {at}.when.{k}: must name a choice parameter listed before {at}")
        vs = vs if isinstance(vs, list) else [vs]
        bad = [v for v in vs if v not in ref.choices]
        if bad:
            raise SweepError(f"{where}: {at}.when.{k}: {bad} not among space.{k}.choices {ref.choices}")
        out[k] = vs
    return out


def _parse_objective(obj: Any, where: str) -> Objective:
    if obj is None:
        return Objective()
    if not isinstance(obj, dict):
        raise SweepError(f"{where}: objective must be a mapping {{metric, direction}}")
    _no_unknown(obj, OBJECTIVE_KEYS, where, "objective.")
    metric = obj.get("metric", DEFAULT_METRIC)
    if not isinstance(metric, str) or not metric:
        raise SweepError(f"{where}: objective.metric must be a metric name such as {DEFAULT_METRIC}")
    direction = obj.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise SweepError(f"{where}: objective.direction must be maximize or minimize, got {direction!r}")
    return Objective(metric, direction)


def _parse_spec(d: Any, where: str, section: str, table: Registry[Variant], default: str) -> Spec:
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise SweepError(f"{where}: {section} must be a mapping with a 'type'")
    typ = d.get("type", default)
    try:
        allowed = table[typ].options
    except UnknownName as e:
        raise SweepError(f"{where}: {e}") from None
    _no_unknown(d, set(allowed) | {"type"}, where, f"{section}.")
    opts = {k: _option(v, allowed[k], where, f"{section}.{k}") for k, v in d.items() if k != "type"}
    return Spec(typ, opts)


def _option(v: Any, kind: Any, where: str, at: str) -> Any:
    """`v` checked against an option's type (`Variant.options`)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if v is None and None in kinds or v == "auto" and "auto" in kinds:
        return v
    if bool in kinds:
        if not isinstance(v, bool):
            raise SweepError(f"{where}: {at} must be true or false, got {v!r}")
        return v
    return _number(v, where, at, integer=int in kinds)


# --------------------------------------------------------------------------- overrides


def override_key(override: str) -> str:
    """`+loss=soft_kl` -> `loss`; `loss.temperature=2` -> `loss.temperature`."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; an override replaces an earlier one with the same key (so
    `+target=qwen3_6_27b` on the command line replaces a sweep's fixed `+target=tiny_random_gpu`)."""
    out: dict[str, str] = {}
    for lst in lists:
        for o in lst:
            k = override_key(o)
            out.pop(k, None)
            out[k] = o
    return list(out.values())


def format_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    s = str(v)
    if re.fullmatch(r"[A-Za-z0-9_./\-]+", s) and s.lower() not in ("null", "true", "false", "none"):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def suggest(trial, sweep: SweepDef) -> tuple[list[str], dict[str, Any]]:
    """Sample the space on an Optuna trial -> (Hydra overrides, {key: value}). Parameters whose `when`
    does not hold are not sampled (and not in the overrides)."""
    values: dict[str, Any] = {}
    overrides: list[str] = []
    for p in sweep.space:
        if not p.active(values):
            continue
        v = p.suggest(trial)
        values[p.key] = v
        overrides.append(p.override(v))
    return overrides, values


def check_conflicts(sweep: SweepDef, extra: list[str]) -> None:
    searched = {p.key for p in sweep.space}
    for o in extra:
        k = override_key(o)
        if k in RESERVED_KEYS:
            raise SweepError(f"override {o!r}: {k} is set per trial by the launcher")
        if k in searched:
            raise SweepError(f"override {o!r}: {k} is searched by sweep {sweep.name!r} (space.{k}); "
                             f"remove it from the command line or from the sweep's space")


def check_against_config(sweep: SweepDef, cfg: dict[str, Any]) -> None:
    """Every searched key must exist in the composed run config (as a dict) with a compatible type."""
    for p in sweep.space:
        if p.is_group:
            continue
        node: Any = cfg
        for part in p.key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise SweepError(f"{sweep.path or sweep.name}: space.{p.key}: no such key in the run config")
            node = node[part]
        if isinstance(node, dict):
            raise SweepError(f"{sweep.path or sweep.name}: space.{p.key}: is a section, not a value")
        if p.type == "int" and not (isinstance(node, int) and not isinstance(node, bool)):
            raise SweepError(f"{sweep.path or sweep.name}: space.{p.key}: int range on a "
                             f"{type(node).__name__} key (current value {node!r})")
        if p.type == "float" and not isinstance(node, float):
            raise SweepError(f"{sweep.path or sweep.name}: space.{p.key}: float range on a "
                             f"{type(node).__name__} key (current value {node!r})")


# --------------------------------------------------------------------------- samplers / pruners


def _trial_seeded_random_sampler(seed: int | None):
    """Random sampling whose values depend only on (seed, trial number, parameter name): several workers
    and a resumed study never repeat each other's draws, and trial k gets the same parameters whichever
    worker runs it."""
    import optuna

    class _Sampler(optuna.samplers.BaseSampler):
        def __init__(self, seed: int | None):
            self.seed = 0 if seed is None else int(seed)

        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def sample_independent(self, study, trial, param_name, param_distribution):
            s = zlib.crc32(f"{self.seed}:{trial.number}:{param_name}".encode())
            return optuna.samplers.RandomSampler(seed=s).sample_independent(
                study, trial, param_name, param_distribution)

    _Sampler.__name__ = _Sampler.__qualname__ = "TrialSeededRandomSampler"
    return _Sampler(seed)


@dataclass(frozen=True)
class Variant:
    """A sampler or pruner: its builder (Optuna imported lazily) and the Python type of each option it takes;
    a tuple allows each of its members (`None`, the string "auto")."""
    build: Callable[..., Any]
    options: dict[str, Any]


def _pruner(cls_name: str, **defaults: Any) -> Callable[[dict], Any]:
    def build(options: dict) -> Any:
        import optuna
        return getattr(optuna.pruners, cls_name)(**{**defaults, **options})
    return build


def _tpe_sampler(options: dict, seed_offset: int) -> Any:
    """Seeded with seed + seed_offset (give each worker of each launch its own offset, or they all draw the same
    startup points)."""
    import optuna
    opts = dict(options)
    seed = opts.pop("seed", None)
    opts.setdefault("constant_liar", True)
    return optuna.samplers.TPESampler(seed=None if seed is None else int(seed) + int(seed_offset), **opts)


_STEPS = {"n_warmup_steps": int, "interval_steps": int}
SAMPLERS: Registry[Variant] = Registry("sampler.type", {
    "tpe": Variant(_tpe_sampler, {"seed": (int, None), "n_startup_trials": int, "multivariate": bool, "group": bool,
                                  "constant_liar": bool, "n_ei_candidates": int, "consider_endpoints": bool}),
    "random": Variant(lambda options, seed_offset: _trial_seeded_random_sampler(options.get("seed")),
                      {"seed": (int, None)}),
})
PRUNERS: Registry[Variant] = Registry("pruner.type", {
    "none": Variant(_pruner("NopPruner"), {}),
    "median": Variant(_pruner("MedianPruner"), {"n_startup_trials": int, **_STEPS, "n_min_trials": int}),
    "percentile": Variant(_pruner("PercentilePruner", percentile=50.0),
                          {"percentile": float, "n_startup_trials": int, **_STEPS, "n_min_trials": int}),
    "successive_halving": Variant(_pruner("SuccessiveHalvingPruner"),
                                  {"min_resource": (int, "auto"), "reduction_factor": int,
                                   "min_early_stopping_rate": int, "bootstrap_count": int}),
    "hyperband": Variant(_pruner("HyperbandPruner"), {"min_resource": int, "max_resource": (int, "auto"),
                                                      "reduction_factor": int, "bootstrap_count": int}),
    "threshold": Variant(_pruner("ThresholdPruner"), {"lower": (float, None), "upper": (float, None), **_STEPS}),
})


def build_sampler(spec: Spec, seed_offset: int = 0):
    """`random`: trial-seeded (`_trial_seeded_random_sampler`). `tpe`: seeded with seed + seed_offset."""
    return SAMPLERS[spec.type].build(dict(spec.options), seed_offset)


def build_pruner(spec: Spec):
    return PRUNERS[spec.type].build(dict(spec.options))
