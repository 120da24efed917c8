"""The one configuration object: defaults, ``GPUMEMD_*`` environment variables, ``attach(**kw)``.

Precedence, lowest first: field defaults, then the environment, then keyword arguments. Every
value is validated in ``__post_init__``, so a bad value fails at ``attach()`` time with a message
that names the variable (``GPUMEMD_PORT`` or ``attach(port=...)``), the value and what is accepted,
never later inside the training loop. What each field accepts, and how a refused value is said, is
``config_values``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gpumemd.analysis.leak_types import DetectorConfig
from gpumemd.config_renamed import RENAMED, current_names, old_name
from gpumemd.config_values import ACCEPTED, CHECKS, ConfigError, parse_value, tls_problem
from gpumemd.log_once import log_once

__all__ = ["ENV_PREFIX", "Config", "ConfigError", "field_docs", "field_types", "is_optional", "parse_value",
           "renamed_env_lines", "unknown_env_lines"]

ENV_PREFIX = "GPUMEMD_"
OptionsT = TypeVar("OptionsT")


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything the agent can be told. Field docstrings double as CLI and env-var help."""

    output_dir: str = "gpumemd-out"
    """Directory for everything gpumemd writes (findings, OOM reports); relative paths are resolved
    against the working directory at attach time; created on first write. Checked at attach: one that
    cannot be written is said in the start line, and a temporary directory, named there, is used
    instead. (Not ``gpumemd``: a folder named like the package next to a script shadows it on the next
    run.)"""

    keep_steps: int = 10_000
    """How many step records the ring buffer keeps (older ones are dropped; memory stays bounded). On
    fast steps the agent records every Nth step (N <= 10, see the overhead section), so this spans
    up to ten times as many steps."""

    sample_interval_s: float = 5.0
    """Seconds between background samples of allocator, NVML and host between steps (0 disables the
    sampler thread)."""

    overhead_budget: float = 0.01
    """Share of the job's step time the agent may cost it (0..1). One table (``gpumemd.budget``) divides
    it between the agent's parts (sampled step ends, leak checks, heap looks, censuses), each spacing its
    work to fit, and leaves a quarter for the costs the agent cannot clock."""

    census: bool = True
    """Take tensor censuses at step boundaries, spaced to stay inside ``overhead_budget``."""

    census_every_steps: int = 0
    """Take a census every N steps; 0 lets the agent choose N from the overhead budget."""

    leak_detection: bool = True
    """Run the leak detector on the per-step series."""

    leak_horizon_hours: float = 168.0
    """A growth is reported when, at the job's measured step rate, it would exhaust the memory it draws
    on (device, or host RAM) within this many hours; below that it is immaterial. Default: a week."""

    leak_min_bytes_per_step: int | None = None
    """Fixed effect size in bytes per step for allocator and census series, instead of the one derived
    from ``leak_horizon_hours`` (unset: headroom / steps in the horizon, never below the noise floor)."""

    leak_warmup_steps: int = DetectorConfig.default("warmup_steps")  # 50
    """Steps ignored by the leak detector at the start (optimizer state, compile, first eval)."""

    leak_host_min_bytes_per_step: int | None = None
    """Fixed effect size in bytes per step for host RSS, instead of the one derived from
    ``leak_horizon_hours`` (unset: host RAM available / steps in the horizon, never below RSS's noise
    floor)."""

    leak_window_steps: int = DetectorConfig.default("window_steps")  # 500
    """The leak detector's short window in steps (the long one is 5x); widened automatically to 2.5x
    the period of accumulations it has seen reset (metric lists, epoch caches)."""

    leak_check_every_steps: int = DetectorConfig.default("check_every_steps")  # 50
    """Steps between leak evaluations; between them the detector only folds values into block floors.
    While only confirmed findings are tracked, up to 16 times that when the overhead budget asks."""

    leak_history_on_suspect: bool = False
    """On CUDA, switch on allocation history (``history_max_entries``) when a leak is suspected, so the
    confirmed finding names the allocation sites (costs about 2 µs per allocation from then on)."""

    port: int | None = None
    """Serve Prometheus metrics on this port plus LOCAL_RANK; 0 picks a free port; unset: no server."""

    bind: str = "127.0.0.1"
    """Address the metrics server binds to; use 0.0.0.0 to let a cluster Prometheus scrape it."""

    tls_certfile: str | None = None
    """PEM certificate for serving metrics over HTTPS (with ``tls_keyfile``)."""

    tls_keyfile: str | None = None
    """PEM private key for serving metrics over HTTPS (with ``tls_certfile``)."""

    pushgateway: str | None = None
    """Pushgateway address (host:port) to push the final metrics to once at exit, or at once when an uncaught
    out-of-memory error is about to end the process."""

    textfile: str | None = None
    """Path of a node_exporter textfile-collector ``.prom`` file written at exit, or at once when an uncaught
    out-of-memory error is about to end the process."""

    oom_linger_s: float = 30.0
    """After an uncaught out-of-memory error, before the process exits: keep serving ``/metrics`` until
    one scrape has fetched the OOM, for at most this many seconds (30 covers a 15 s scrape interval; 0
    exits at once). Only with a metrics port, never in forked workers; the traceback and exit status are
    unchanged. The textfile and the Pushgateway get the OOM at once, before this wait. It also bounds the
    wait at any other end of a job that Prometheus scrapes (at most 1.5 scrape intervals and 20 s) for
    the scrape that records the end, so that no alert takes it for a kill."""

    oom_reports: bool = True
    """Write a post-mortem directory when an out-of-memory error propagates."""

    oom_max_reports: int = 5
    """At most this many OOM reports per process (jobs that OOM and recover must not fill the disk)."""

    oom_cooldown_s: float = 60.0
    """Seconds after one OOM report during which further OOMs are counted but not reported."""

    record_history: bool = False
    """Record CUDA allocation history (stacks in snapshots; about 2 µs per allocation); off by default."""

    history_max_entries: int = 100_000
    """Ring-buffer size of the CUDA allocation history when it is recorded."""

    step_profile: bool = False
    """Measure forward / backward / optimizer-step memory on sampled steps (saved-tensor hooks);
    on CUDA, sampled steps reset torch's peak counters at forward start and before the optimizer step,
    so your own ``torch.cuda.max_memory_allocated()`` then covers only the time since that reset (with
    both this and ``reset_peak_each_step`` off, the default, gpumemd never resets them)."""

    step_profile_every_steps: int = 50
    """Profile one step in this many (when ``step_profile`` is on)."""

    reset_peak_each_step: bool = False
    """Reset torch's peak counters at each recorded step end, so each record's peak covers exactly its
    steps (``record.steps``). This changes what your own ``torch.cuda.max_memory_allocated()``
    returns, hence off by default."""

    nvml: bool = True
    """Read device totals and this process's use from NVML (creates no CUDA context)."""

    quiet: bool = False
    """No start line (output, metrics URL, devices, absent probes) and no exit summary on stderr;
    warnings and findings are still logged. Only rank 0 prints them in any case."""

    def __post_init__(self) -> None:
        # Every number is bounded above too: a value that passes here must not fail later
        # inside the job (``deque(maxlen=2**63)``, a sampler thread that waits ``inf`` or spins).
        for field, ok, accepted in CHECKS:
            value = getattr(self, field)
            if not ok(value):
                raise ConfigError(field, value, accepted)
        problem = tls_problem(self.tls_certfile, self.tls_keyfile)
        if problem is not None:
            field, accepted = problem
            raise ConfigError(field, getattr(self, field), accepted)

    def options(self, kind: type[OptionsT]) -> OptionsT:
        """The options of one component: ``kind`` is a dataclass whose fields are named as this
        config's fields (``LeakOptions``...), filled from them. One source of truth for defaults and
        validation, and each component sees only what it reads."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})  # type: ignore[arg-type]

    # --- construction from the outside world -------------------------------------------------

    @classmethod
    def from_sources(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults < ``GPUMEMD_*`` in ``env`` < ``overrides``; errors name the variable that was wrong."""
        env_map = os.environ if env is None else env
        env_values = cls.parse_env(env_map)
        for line in (*unknown_env_lines(env_map), *renamed_env_lines(env_map)):
            log_once(line, "gpumemd: %s", line)  # once: `gpumemd run` validates, then attaches
        return cls._build(env_map, env_values, overrides)

    @classmethod
    def resolve(cls, env: Mapping[str, str], overrides: Mapping[str, Any]) -> Config:
        """``from_sources`` without its lines about the variables (``gpumemd doctor`` shows them as checks)."""
        return cls._build(env, cls.parse_env(env), overrides)

    @classmethod
    def _build(cls, env_map: Mapping[str, str], env_values: dict[str, Any], overrides: Mapping[str, Any]) -> Config:
        # The fields' names, not field_docs(): that parses this module's source (80-90 ms), which
        # attach() pays only when it refuses an option.
        unknown = sorted(set(overrides) - set(field_types()) - set(RENAMED))
        if unknown:
            raise ValueError(
                f"attach() got unknown option(s) {', '.join(unknown)}; accepted: {', '.join(field_docs())}"
            )
        source = {name: f"{_env_key(name, env_map)}={{value}}" for name in env_values}
        values, given = current_names(overrides)
        source.update({name: f"attach({given[name]}={{value}})" for name in values})
        for name, value in values.items():
            try:
                _check_type(name, value)
            except ConfigError as err:
                raise err.with_source(source[name]) from None
        try:
            return cls(**{**env_values, **values})
        except ConfigError as err:
            raise err.with_source(source.get(err.field, f"{err.field}={{value}}")) from None

    @classmethod
    def parse_env(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """The ``GPUMEMD_*`` variables of ``env`` converted to field values (pure; no os.environ)."""
        known = field_types()
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name in RENAMED:
                if _env_key(RENAMED[name], env) != key:
                    continue  # the variable under the option's name now is set too, and wins
                name = RENAMED[name]
            if name not in known:
                continue  # GPUMEMD_* variables of other tools or later versions are not our business
            try:
                values[name] = parse_value(known[name], raw)
            except ConfigError as err:
                raise ConfigError(name, raw, err.accepted).with_source(key + "={value}") from None
        return values


_TEST_SWITCHES = ENV_PREFIX + "REQUIRE_"  # the test suite's own switches (GPUMEMD_REQUIRE_PROMETHEUS, ...)


def unknown_env_lines(env: Mapping[str, str]) -> list[str]:
    """One line per ``GPUMEMD_*`` variable that names no option, with the closest option's variable:
    a misspelled ``GPUMEMD_PROT=9400`` must not be ignored silently (it is not an error: a later
    version's variable, or another tool's, may share the prefix)."""
    import difflib

    names = [f"{ENV_PREFIX}{name.upper()}" for name in field_types()]
    old_names = {f"{ENV_PREFIX}{name.upper()}" for name in RENAMED}
    out = []
    for key in sorted(env):
        if key.startswith(ENV_PREFIX) and key not in names and key not in old_names \
                and not key.startswith(_TEST_SWITCHES):
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else "see `gpumemd run --help` for the options"
            out.append(f"{key} is not a gpumemd option ({hint}); ignored")
    return out


def renamed_env_lines(env: Mapping[str, str]) -> list[str]:
    """One deprecation line per ``GPUMEMD_*`` variable set under an option's old name."""
    return [f"{ENV_PREFIX}{old.upper()} is deprecated; use {ENV_PREFIX}{new.upper()} (same meaning)"
            for old, new in RENAMED.items() if f"{ENV_PREFIX}{old.upper()}" in env]


def _env_key(name: str, env: Mapping[str, str]) -> str:
    """The variable that set option ``name``: its own, or its old name's when only that is set."""
    key = f"{ENV_PREFIX}{name.upper()}"
    old_key = f"{ENV_PREFIX}{old_name(name).upper()}"
    return old_key if key not in env and old_key in env else key


@functools.cache
def field_types() -> dict[str, type]:
    """Field name -> its base type (int, float, bool or str), Optional unwrapped."""
    hints = typing.get_type_hints(Config)
    out: dict[str, type] = {}
    for f in dataclasses.fields(Config):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[f.name] = args[0] if isinstance(hint, types.UnionType) or typing.get_origin(hint) else hint
    return out


def is_optional(name: str) -> bool:
    hint = typing.get_type_hints(Config)[name]
    return type(None) in typing.get_args(hint)


def _check_type(name: str, value: object) -> None:
    kind = field_types()[name]
    if value is None and is_optional(name):
        return
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(name, value, ACCEPTED[kind] + (" or None" if is_optional(name) else ""))


@functools.cache
def field_docs() -> dict[str, str]:
    """Field name -> its attribute docstring, read from this module's source (for CLI and README)."""
    tree = ast.parse(inspect.getsource(Config))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
