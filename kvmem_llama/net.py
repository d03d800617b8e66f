"""Network addresses: is a host this machine only?

One answer for both places that ask: the hub client allows plain http only to such a host, and a
server listening on one needs no API-key warning (serving.readiness).
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (bracketed too). Names are not resolved: `127.example.com` is not loopback."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
