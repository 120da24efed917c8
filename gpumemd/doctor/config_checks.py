"""gpumemd's own configuration as the agent would build it, from ``GPUMEMD_*`` and the given options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumemd.config import (
    ENV_PREFIX,
    Config,
    ConfigError,
    field_types,
    is_optional,
    parse_value,
    renamed_env_lines,
    unknown_env_lines,
)
from gpumemd.config_renamed import RENAMED
from gpumemd.doctor.check import Check


def option_name(field: str) -> str:
    """``leak_min_bytes_per_step`` -> ``--leak-min-bytes-per-step``."""
    return "--" + field.replace("_", "-")


def parse_override(name: str, raw: str) -> Any:
    """Command-line text -> a field value, as ``gpumemd run`` parses it ('' unsets an optional field)."""
    if raw.strip() == "" and is_optional(name):
        return None
    try:
        return parse_value(field_types()[name], raw)
    except ConfigError as err:
        raise ConfigError(name, raw, err.accepted) from None


def _known_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Only the ``GPUMEMD_*`` variables that name options (old names of renamed ones included):
    ``Config.from_sources`` would log the unknown ones as a warning on stderr, and doctor reports
    them as lines of its own instead."""
    names = {ENV_PREFIX + name.upper() for name in [*field_types(), *RENAMED]}
    return {k: v for k, v in environ.items() if k in names}


def check_config(environ: Mapping[str, str], overrides: Mapping[str, str]) -> list[Check]:
    """The configuration the agent would build from ``GPUMEMD_*`` and the given options (raw text by
    field name); a bad value fails naming its variable or option. Unknown ``GPUMEMD_*`` variables
    are warnings with the closest option (config.py's own wording)."""
    out: list[Check] = []
    parsed: dict[str, Any] = {}
    try:
        for name, raw in overrides.items():
            parsed[name] = parse_override(name, raw)
        Config.resolve(_known_env(environ), parsed)
    except ConfigError as err:
        message = err.render(f"{option_name(err.field)}={{value}}") if err.field in overrides else str(err)
        out.append(Check("config", "fail", message, needed=True))
    else:
        given = [f"{k}={v}" for k, v in sorted(_known_env(environ).items())]
        given += [f"{option_name(n)}={overrides[n]}" for n in sorted(overrides)]
        out.append(Check("config", "ok", f"valid ({', '.join(given) if given else 'defaults'})", needed=True))
    out.extend(Check("config", "warn", line) for line in unknown_env_lines(environ) + renamed_env_lines(environ))
    return out


INVALID = object()  # a field whose configured value is not valid (check_config says why)


def resolve_field(name: str, environ: Mapping[str, str], overrides: Mapping[str, str]) -> Any:
    """One Config field as the agent would see it, or ``INVALID``. Field by field, so that a bad
    GPUMEMD_PORT does not stop the output directory from being checked."""
    var = ENV_PREFIX + name.upper()
    env = {var: environ[var]} if var in environ else {}
    try:
        kw = {name: parse_override(name, overrides[name])} if name in overrides else {}
        return getattr(Config.from_sources(env, **kw), name)
    except ValueError:  # ConfigError
        return INVALID
