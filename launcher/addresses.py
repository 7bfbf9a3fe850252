"""Checking Ray addresses before a client is built: a malformed one is one clear line.

Ray's own parsers fail on these with tracebacks (`Port could not be cast to integer
value`, gRPC target errors) or hang resolving a host named `http`. Two forms exist:

* the Jobs API (`submit`, `status`, `logs`, `stop`): the dashboard,
  `http(s)://HOST[:PORT]` (`HOST:PORT` gets `http://`);
* `ray.address` (a driver joining a cluster): "", `auto`, `local`, `HOST:PORT`
  (the GCS) or `ray://HOST[:PORT]` (Ray Client).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._\-]*[A-Za-z0-9])?$|^\[[0-9A-Fa-f:.]+\]$")


class AddressError(ValueError):
    """A malformed address (the message names it and the expected form)."""


def _check_host_port(netloc: str, what: str, address: str, expected: str, need_port: bool = False) -> None:
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        raise AddressError(f"{what} {address!r}: the port is not a number in 1-65535; expected {expected}") from None
    host = netloc.rsplit("@", 1)[-1]
    host = host[: host.rindex("]") + 1] if host.startswith("[") else host.split(":", 1)[0]
    if not host or not _HOST.match(host):
        problem = f"{host!r} is not a host name" if host else "no host name"
        raise AddressError(f"{what} {address!r}: {problem}; expected {expected}")
    if port == 0 or (need_port and port is None):
        raise AddressError(f"{what} {address!r}: a port in 1-65535 is needed; expected {expected}")


def dashboard_url(address: str, what: str = "--address") -> str:
    """`http(s)://HOST[:PORT]` for the Jobs API (`HOST:PORT` gets http://); AddressError if malformed."""
    expected = "http://HOST:8265 (the Ray dashboard)"
    raw = address.strip()
    url = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise AddressError(f"{what} {address!r}: scheme {parts.scheme!r} is not http or https; expected {expected}")
    if any(c.isspace() for c in raw):
        raise AddressError(f"{what} {address!r}: contains white space; expected {expected}")
    _check_host_port(parts.netloc, what, address, expected)
    return url.rstrip("/")


def check_ray_address(address: str, what: str = "ray.address") -> None:
    """A driver's address: "", auto, local, HOST:PORT or ray://HOST[:PORT]; AddressError if malformed."""
    expected = "auto, HOST:PORT (the GCS, e.g. 10.0.0.1:6379) or ray://HOST:10001"
    if address in ("", "auto", "local"):
        return
    if any(c.isspace() for c in address):
        raise AddressError(f"{what} {address!r}: contains white space; expected {expected}")
    if "://" in address:
        parts = urlsplit(address)
        if parts.scheme != "ray":
            dashboard = parts.scheme in ("http", "https")
            hint = " (that is the dashboard: use it with `loomtrain submit --address`)" if dashboard else ""
            raise AddressError(f"{what} {address!r}: scheme {parts.scheme!r} is not ray{hint}; expected {expected}")
        _check_host_port(parts.netloc, what, address, expected)
        return
    _check_host_port(address, what, address, expected, need_port=True)
