"""Addresses a user plainly named: ``host:port`` or an http(s) URL, checked before anything is sent.

``9091`` alone would be read as the host 0.0.35.131, ``-1`` or ``1e999`` looked up in DNS, ``a..b`` or a
non-ASCII name fail deep inside the push at exit; the config refuses each at attach with these checks.
"""

from __future__ import annotations

import ipaddress
import re

# The userinfo of a URL (``http://user:pw@host``), or a ``user:pw@`` that begins a value (``user:pw@host:port``).
_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^\s/?#'\"]*@(?=[^\s@]*[a-z0-9\]])"
                       r"|^()[^\s/?#'\":@]+:[^\s/?#'\"]*@(?=[^\s@]*[a-z0-9\]])")


def redacted(text: str) -> str:
    """``text`` with the user and password of every URL in it written as ``***``: a Pushgateway URL
    with credentials is accepted, and its credentials are never printed (warnings, errors, logs)."""
    return _USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", text) if "@" in text else text


def is_host_port(value: str) -> bool:
    """``host:port``, or an http(s) URL whose port may be left to the scheme: an address the user plainly
    named. ``9091`` alone would be read as the host 0.0.35.131, ``-1`` or ``1e999`` looked up in DNS,
    ``a..b`` or a non-ASCII name fail deep inside the push at exit: each is refused here."""
    from urllib.parse import urlsplit

    url = "://" in value
    text = value if url else "http://" + value
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or parts.hostname is None or (port is None and not url):
        return False
    return (port is None or 0 < port < 65536) and is_host(parts.hostname) and value.isascii() \
        and not parts.path.strip("/") and not parts.query and not parts.fragment \
        and not any(c.isspace() for c in value)


def is_host(name: str) -> bool:
    """An IP address, or a DNS name: labels of letters, digits and inner hyphens, the last not all
    digits (a number is not a name: ``1.2.3`` or ``9091`` would be read as an IPv4 address)."""
    if is_ip(name):
        return True
    labels = name.rstrip(".").split(".")
    if len(name) > 253 or labels[-1].isdigit():
        return False
    return all(0 < len(label) <= 63 and label[0] != "-" and label[-1] != "-"
               and all(c.isascii() and (c.isalnum() or c == "-") for c in label) for label in labels)


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
