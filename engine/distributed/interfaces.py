"""Which local network interface a process group should bind to (Linux).

gloo and NCCL pick an address from the machine's hostname unless told an
interface; that may be an address the rendezvous host cannot reach, or one this
deployment must not listen on. The right one is the interface holding the
address this machine uses to reach the rendezvous host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_IF_INET6 = "/proc/net/if_inet6"


def local_address_towards(host: str, port: int) -> str:
    """The local IP the kernel routes to ``host`` from (``host`` itself when it is local)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the interface that holds ``address`` (e.g. "lo" for 127.0.0.1), or None."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        return _ipv4_interface(ip)
    return _ipv6_interface(ip)


def _ipv4_interface(ip: ipaddress.IPv4Address) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if ipaddress.IPv4Address(reply[20:24]) == ip:  # struct ifreq: sockaddr_in's address at 20
                return name
    return None


def _ipv6_interface(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open(_IF_INET6, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
        fields = line.split()
        if len(fields) == 6 and ipaddress.IPv6Address(bytes.fromhex(fields[0])) == ip:
            return fields[5]
    return None
