from __future__ import annotations

import dataclasses
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumemd.config import Config, ConfigError, field_docs, field_types, parse_value


def test_defaults_are_valid_and_frozen() -> None:
    config = Config()
    assert config.port is None and config.bind == "127.0.0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


def test_every_field_has_a_docstring() -> None:
    names = [f.name for f in dataclasses.fields(Config)]
    docs = field_docs()
    assert sorted(docs) == sorted(names)
    assert all(len(doc) > 20 for doc in docs.values())


def test_precedence_defaults_then_env_then_kwargs() -> None:
    env = {"GPUMEMD_PORT": "9400", "GPUMEMD_CENSUS": "off", "GPUMEMD_OVERHEAD_BUDGET": "0.02"}
    config = Config.from_sources(env)
    assert (config.port, config.census, config.overhead_budget) == (9400, False, 0.02)
    config = Config.from_sources(env, port=0)
    assert config.port == 0 and config.census is False


def test_unrelated_env_vars_are_ignored() -> None:
    assert Config.from_sources({"GPUMEMD_SOMETHING_ELSE": "x", "PATH": "/bin"}) == Config()


@pytest.mark.parametrize(
    ("env", "kwargs", "fragment"),
    [
        ({"GPUMEMD_PORT": "abc"}, {}, "GPUMEMD_PORT='abc' is not valid: expected an integer"),
        ({"GPUMEMD_PORT": "70000"}, {}, "GPUMEMD_PORT=70000 is not valid: expected an integer 0-65535"),
        ({"GPUMEMD_CENSUS": "maybe"}, {}, "GPUMEMD_CENSUS='maybe' is not valid: expected one of 1/0"),
        ({}, {"port": "9400"}, "attach(port='9400') is not valid: expected an integer or None"),
        ({}, {"overhead_budget": 2.0}, "attach(overhead_budget=2.0) is not valid: expected a fraction"),
        ({}, {"bind": "localhost:80"}, "attach(bind='localhost:80') is not valid: expected an IP address"),
        ({}, {"tls_certfile": "c.pem"}, "attach(tls_certfile='c.pem') is not valid"),
        ({"GPUMEMD_HISTORY_STEPS": "0"}, {}, "GPUMEMD_HISTORY_STEPS=0 is not valid: expected an integer from 1"),
        # Bad numbers: each names the variable, never a traceback from deeper down.
        ({"GPUMEMD_HISTORY_STEPS": "1e999"}, {}, "GPUMEMD_HISTORY_STEPS='1e999' is not valid: expected an integer"),
        ({}, {"history_steps": 2**63}, f"attach(history_steps={2**63}) is not valid: expected an integer from 1"),
        ({}, {"sample_interval_s": float("inf")}, "attach(sample_interval_s=inf) is not valid"),
        ({}, {"sample_interval_s": 1e-9}, "attach(sample_interval_s=1e-09) is not valid: expected 0 (no sampler"),
        ({"GPUMEMD_SAMPLE_INTERVAL_S": "nan"}, {}, "GPUMEMD_SAMPLE_INTERVAL_S=nan is not valid"),
        ({}, {"oom_cooldown_s": float("inf")}, "attach(oom_cooldown_s=inf) is not valid"),
        ({}, {"leak_window_steps": 10**12}, "attach(leak_window_steps=1000000000000) is not valid"),
        ({}, {"pushgateway": "not a host:port"}, "attach(pushgateway='not a host:port') is not valid: expected host"),
        ({}, {"pushgateway": "gw:99999"}, "attach(pushgateway='gw:99999') is not valid"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_what_is_accepted(env, kwargs, fragment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        Config.from_sources(env, **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("address", ["127.0.0.1:9091", "pushgateway.monitoring:9091", "http://gw:9091",
                                     "https://gw.example.com", "[::1]:9091"])
def test_pushgateway_addresses_that_prometheus_client_accepts(address: str) -> None:
    assert Config.from_sources({}, pushgateway=address).pushgateway == address


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="unknown option.*prot.*accepted: output_dir"):
        Config.from_sources({}, prot=1)


def test_parse_value_kinds() -> None:
    assert parse_value(bool, "Yes") is True and parse_value(bool, "0") is False
    assert parse_value(int, "262144") == 262144 and parse_value(int, "1e6") == 1_000_000
    assert parse_value(float, "0.5") == 0.5
    with pytest.raises(ConfigError):
        parse_value(float, "half")


def test_field_types_unwrap_optional() -> None:
    types = field_types()
    assert types["port"] is int and types["pushgateway"] is str and types["census"] is bool


@settings(max_examples=200, deadline=None, derandomize=True)  # CI: a fixed set
@given(field=st.sampled_from(sorted(field_docs())),
       raw=st.one_of(st.text(max_size=40), st.sampled_from(["1e999", "-1e999", "nan", "inf", "-inf", "9" * 5000,
                                                             "0x10", "1_000", " 5 ", "", "1e-9", str(2**63)])))
def test_any_environment_value_gives_a_config_or_a_config_error(field: str, raw: str) -> None:
    """Outside input: every GPUMEMD_* value is accepted or refused with a ConfigError naming
    the variable; nothing else escapes, and an accepted value is within its bounds (Config validates)."""
    key = "GPUMEMD_" + field.upper()
    try:
        Config.from_sources({key: raw})
    except ConfigError as err:
        assert key in str(err)


def test_a_misspelled_variable_is_reported_with_the_closest_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    Config.from_sources({"GPUMEMD_PROT": "9400", "GPUMEMD_REQUIRE_PROMETHEUS": "1", "GPUMEMD_PORT": "0"})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpumemd: GPUMEMD_PROT is not a gpumemd option (did you mean GPUMEMD_PORT?); ignored"]


def test_tls_files_are_checked_at_attach(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    tls = Path(__file__).resolve().parents[1] / "data" / "tls"
    cert, key = str(tls / "cert.pem"), str(tls / "key.pem")
    assert Config.from_sources({}, tls_certfile=cert, tls_keyfile=key).tls_certfile == cert
    with pytest.raises(ConfigError, match=r"GPUMEMD_TLS_KEYFILE='/nowhere/key.pem' is not valid: expected a readable"):
        Config.from_sources({"GPUMEMD_TLS_CERTFILE": cert, "GPUMEMD_TLS_KEYFILE": "/nowhere/key.pem"})
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"attach\(tls_certfile=.*\) is not valid: expected a PEM certificate"):
        Config.from_sources({}, tls_certfile=str(not_pem), tls_keyfile=key)


@pytest.fixture
def fresh_log_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deprecation lines are said once per process: start each test with none said yet."""
    import gpumemd.log_once

    monkeypatch.setattr(gpumemd.log_once, "_logged", set())


@pytest.mark.usefixtures("fresh_log_once")
def test_renamed_options_keep_their_old_names_with_one_deprecation_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    env = {"GPUMEMD_HISTORY_STEPS": "77", "GPUMEMD_PHASE_EVERY_STEPS": "9"}
    for _ in range(2):  # `gpumemd run` validates, then attaches: still one line each
        config = Config.from_sources(env, phases=True)
    assert (config.keep_steps, config.step_profile, config.step_profile_every_steps) == (77, True, 9)
    assert sorted(r.getMessage() for r in caplog.records) == [
        "gpumemd: GPUMEMD_HISTORY_STEPS is deprecated; use GPUMEMD_KEEP_STEPS (same meaning)",
        "gpumemd: GPUMEMD_PHASE_EVERY_STEPS is deprecated; use GPUMEMD_STEP_PROFILE_EVERY_STEPS (same meaning)",
        "gpumemd: attach(phases=...) is deprecated; use attach(step_profile=...) (same meaning)",
    ]


@pytest.mark.usefixtures("fresh_log_once")
def test_the_new_name_wins_over_the_old_and_nothing_is_said_for_new_names(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    assert Config.from_sources({"GPUMEMD_KEEP_STEPS": "5", "GPUMEMD_STEP_PROFILE": "1"}).keep_steps == 5
    assert not caplog.records
    config = Config.from_sources({"GPUMEMD_KEEP_STEPS": "5", "GPUMEMD_HISTORY_STEPS": "6"},
                                 step_profile=False, phases=True)
    assert config.keep_steps == 5 and config.step_profile is False


def test_bad_values_under_an_old_name_name_the_old_name() -> None:
    with pytest.raises(ConfigError, match=r"attach\(phase_every_steps=0\) is not valid: expected an integer from 1"):
        Config.from_sources({}, phase_every_steps=0)
    with pytest.raises(ConfigError, match=r"GPUMEMD_KEEP_STEPS=0 is not valid"):
        Config.from_sources({"GPUMEMD_KEEP_STEPS": "0"})
