"""Addresses and ports a user could not have meant are refused at attach, with the variable and the value."""

from __future__ import annotations

import pytest

from gpumemd.config import Config


@pytest.mark.parametrize("address", ["9091", "-1", "1e999", "٣", "a..b", "a..b:9091", "9091:9091", "1.2.3:9091",
                                     "-gw:9091", "gw", "http://gw:9091/metrics", "ftp://gw:21", "gw:9091?x=1",
                                     "ｇｗ:9091", "gw\u202e:9091"])
def test_pushgateway_addresses_that_name_no_host_and_port_are_refused(address: str) -> None:
    with pytest.raises(ValueError) as env_error:
        Config.from_sources({"GPUMEMD_PUSHGATEWAY": address})
    expected = f"GPUMEMD_PUSHGATEWAY={address!r} is not valid: expected host:port or an http(s):// URL"
    assert expected in str(env_error.value)
    with pytest.raises(ValueError, match=r"attach\(pushgateway="):
        Config.from_sources({}, pushgateway=address)


@pytest.mark.parametrize("address", ["localhost:9091", "pushgateway.monitoring:9091", "gw-1.example.com.:9091",
                                     "10.0.0.7:9091", "[::1]:9091", "http://gw:9091", "https://gw.example.com",
                                     "http://10.0.0.7"])
def test_pushgateway_addresses_plainly_named_are_kept(address: str) -> None:
    assert Config.from_sources({"GPUMEMD_PUSHGATEWAY": address}).pushgateway == address


@pytest.mark.parametrize("raw", ["1e-5", "0.5e1", "9.4e3", "1e999", "٣", "9400.0", "0x24b8"])
def test_ports_are_integers_as_typed(raw: str) -> None:
    with pytest.raises(ValueError) as error:
        Config.from_sources({"GPUMEMD_PORT": raw})
    assert f"GPUMEMD_PORT={raw!r} is not valid: expected an integer" in str(error.value)


def test_integer_spellings_that_are_integers_are_read() -> None:
    assert Config.from_sources({"GPUMEMD_PORT": "9400"}).port == 9400
    assert Config.from_sources({"GPUMEMD_PORT": " 0 "}).port == 0
    assert Config.from_sources({"GPUMEMD_HISTORY_MAX_ENTRIES": "1e6"}).history_max_entries == 1_000_000


def test_credentials_in_a_bad_value_are_never_printed_and_long_values_are_cut() -> None:
    with pytest.raises(ValueError) as err:
        Config.from_sources({"GPUMEMD_PUSHGATEWAY": "http://user:s3cret@gw:99999"})
    assert "GPUMEMD_PUSHGATEWAY='http://***@gw:99999' is not valid" in str(err.value) and "s3cret" not in str(err.value)
    with pytest.raises(ValueError) as err:
        Config.from_sources({}, pushgateway="user:s3cret@gw:99999")  # no scheme: still a credential
    assert "'***@gw:99999'" in str(err.value) and "s3cret" not in str(err.value)
    with pytest.raises(ValueError) as err:
        Config.from_sources({"GPUMEMD_OUTPUT_DIR": "x", "GPUMEMD_PORT": "9" * 8192})
    message = str(err.value)
    assert message.startswith("GPUMEMD_PORT='9999") and "... (8,194 characters)" in message and len(message) < 300


def test_redacted_leaves_text_without_credentials_alone() -> None:
    from gpumemd.addresses import redacted

    assert redacted("push to https://a:b@gw:9091 (refused)") == "push to https://***@gw:9091 (refused)"
    assert redacted("http://u:p@ss@gw:9091 and http://a:b@c:1") == "http://***@gw:9091 and http://***@c:1"
    for text in ("mail a@b.com", "http://gw:9091/metrics", "tensor@step 3", "x" * 50):
        assert redacted(text) == text
