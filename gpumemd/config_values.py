"""What each option accepts, and how a refused value is said.

``CHECKS`` bounds every field (``Config.__post_init__`` runs it), ``tls_problem`` checks the TLS pair,
``parse_value`` reads text (an environment variable, a command-line option) into a value, and
``ConfigError`` says what was refused: where the value came from (``GPUMEMD_PORT=...`` or
``attach(port=...)``), the value, and what is accepted.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from typing import Any

from gpumemd.addresses import is_host_port, is_ip, redacted
from gpumemd.analysis.leak_types import MIN_WINDOW_STEPS

_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class ConfigError(ValueError):
    """A bad configuration value. ``field`` is the Config field it belongs to."""

    def __init__(self, field: str, value: object, accepted: str) -> None:
        self.field = field
        self.value = value
        self.accepted = accepted
        super().__init__(self.render(f"attach({field}={{value}})"))

    def render(self, source: str) -> str:
        """``source`` names where the value came from, with ``{value}`` where the value goes."""
        where = source.replace("{value}", _shown(self.value))
        return f"{where} is not valid: expected {self.accepted}"

    def with_source(self, source: str) -> ConfigError:
        err = ConfigError(self.field, self.value, self.accepted)
        err.args = (self.render(source),)
        return err


_SHOWN_CHARS = 120


def _shown(value: object) -> str:
    """The value in an error line: its credentials redacted, cut to a readable length (an 8 KB value
    echoed whole buries the line that says what is wrong)."""
    text = repr(redacted(value) if isinstance(value, str) else value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS - 20]}... ({len(text):,} characters)"


_MAX_STEPS = 100_000_000  # step counts and intervals: more than any job runs
_MAX_BYTES = 2**50  # a byte rate per step: a PiB


_STEPS = f"an integer from 0 to {_MAX_STEPS:,}"
_BYTES_PER_STEP = "a number of bytes per step from 1 to 2**50, or unset"

CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("keep_steps", lambda v: 1 <= v <= 10_000_000, "an integer from 1 to 10,000,000"),
    ("sample_interval_s", lambda v: v == 0 or 0.01 <= v <= 3600,
     "0 (no sampler thread) or a number of seconds from 0.01 to 3600"),
    ("overhead_budget", lambda v: 0 < v <= 0.5, "a fraction in (0, 0.5], e.g. 0.01 for 1%"),
    ("census_every_steps", lambda v: 0 <= v <= _MAX_STEPS, _STEPS),
    ("leak_min_bytes_per_step", lambda v: v is None or 1 <= v <= _MAX_BYTES, _BYTES_PER_STEP),
    ("leak_horizon_hours", lambda v: 0 < v <= 24 * 366 and math.isfinite(v),
     "a number of hours in (0, 8784], e.g. 168 for a week"),
    ("leak_warmup_steps", lambda v: 0 <= v <= _MAX_STEPS, _STEPS),
    ("leak_host_min_bytes_per_step", lambda v: v is None or 1 <= v <= _MAX_BYTES, _BYTES_PER_STEP),
    ("leak_window_steps", lambda v: MIN_WINDOW_STEPS <= v <= _MAX_STEPS,
     f"an integer from {MIN_WINDOW_STEPS} to {_MAX_STEPS:,}"),
    ("leak_check_every_steps", lambda v: 1 <= v <= _MAX_STEPS, f"an integer from 1 to {_MAX_STEPS:,}"),
    ("port", lambda v: v is None or 0 <= v <= 65535, "an integer 0-65535 (0 picks a free port)"),
    ("bind", is_ip, "an IP address such as 127.0.0.1 or 0.0.0.0"),
    ("textfile", lambda v: v is None or v.endswith(".prom"),
     "a path ending in .prom (node_exporter's textfile collector reads only *.prom)"),
    ("oom_max_reports", lambda v: 0 <= v <= 10_000, "an integer from 0 to 10,000"),
    ("oom_cooldown_s", lambda v: 0 <= v <= 86_400 and math.isfinite(v), "a number of seconds from 0 to 86400"),
    ("oom_linger_s", lambda v: 0 <= v <= 600 and math.isfinite(v), "a number of seconds from 0 (exit at once) to 600"),
    ("history_max_entries", lambda v: 1 <= v <= 10_000_000,
     "an integer from 1 to 10,000,000 (it bounds the CUDA allocation history)"),
    ("step_profile_every_steps", lambda v: 1 <= v <= _MAX_STEPS, f"an integer from 1 to {_MAX_STEPS:,}"),
    ("pushgateway", lambda v: v is None or is_host_port(v),
     "host:port or an http(s):// URL, e.g. pushgateway.monitoring:9091"),
    ("output_dir", bool, "a non-empty directory path"),
)
"""Each field's bounds, checked in this order at construction (``Config.__post_init__``): (field, test of
its value, what is accepted, as the error says it)."""


def tls_problem(certfile: str | None, keyfile: str | None) -> tuple[str, str] | None:
    """(field, what is expected) when the TLS pair cannot serve HTTPS, checked at attach: one of the two
    set without the other, or a file that cannot serve (a missing file was reported later as "port could
    not be bound", with advice about ports). None when both are unset or both serve."""
    import ssl

    if (certfile is None) != (keyfile is None):
        pair = ("tls_certfile", "tls_keyfile")
        given, missing = pair if keyfile is None else pair[::-1]
        return given, f"{missing} to be set as well (TLS needs both, or neither)"
    if certfile is None or keyfile is None:
        return None
    for field, path in (("tls_certfile", certfile), ("tls_keyfile", keyfile)):
        if not os.path.isfile(path):
            return field, "a readable PEM file (no such file)"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        return "tls_certfile", f"a PEM certificate matching tls_keyfile ({exc.reason or exc})"
    except OSError as exc:
        return "tls_certfile", f"readable PEM files ({exc.strerror or exc})"
    return None


ACCEPTED = {
    int: "an integer",
    float: "a number",
    bool: "one of 1/0, true/false, yes/no, on/off",
    str: "a string",
}


def parse_value(kind: type, raw: str) -> Any:
    """Text (env var, command line) -> a field value; '' means None for optional fields."""
    text = raw.strip()
    value: Any = None
    if kind is bool:
        value = _BOOLS.get(text.lower())
    elif kind is int:
        value = _parse_int(text)
    elif kind is float:
        with contextlib.suppress(ValueError):
            value = float(text)
    else:
        return text
    if value is None:
        raise ConfigError("", raw, ACCEPTED[kind])
    return value


_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*")
_EXPONENT_TEXT = re.compile(r"([+-]?[0-9]+)[eE]\+?([0-9]{1,2})")


def _parse_int(text: str) -> int | None:
    """ASCII digits, or digits times a power of ten (``1e6``): an integer as typed. Not ``1e-5`` (0),
    ``0.5e1`` (5), ``1e999``, nor other scripts' digits (``int("٣")`` is 3)."""
    if _INT_TEXT.fullmatch(text):
        return int(text) if len(text) <= 1000 else None  # int() refuses over 4,300 digits: no setting is that large
    match = _EXPONENT_TEXT.fullmatch(text)
    if match:
        return int(match.group(1)) * 10 ** int(match.group(2))
    return None
