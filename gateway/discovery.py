"""Where the replicas of a model service are: fixed addresses, or DNS names re-resolved while serving.

A configured address is one of
  host:port                    fixed: one replica (gRPC resolves the host itself, as any channel does)
  dns:///name:port             every A/AAAA record of `name` is a replica (the system resolver, as in a
                               Kubernetes pod, with its search domains and /etc/hosts)
  dns://server:53/name:port    the same, asking that DNS server (gRPC's target syntax for an authority)
The gateway resolves DNS names itself, because gRPC's resolver hides the addresses it finds and the
gateway must pin each session to one pod (deploy/README.md, "Scale-out"): every resolved address gets
its own channel, dialled as `ipv4:IP:port` / `ipv6:[IP]:port`, so an RPC on it reaches exactly that pod.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Optional

import dns.exception
import dns.resolver

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:"


@dataclass(frozen=True)
class Target:
    """One configured address. name is empty for a fixed address."""

    text: str
    name: str = ""  # DNS name to resolve
    port: int = 0
    nameserver: str = ""  # DNS server host ('' = the system resolver)
    nameserver_port: int = 53

    @property
    def discovered(self) -> bool:
        return bool(self.name)


def parse_target(text: str) -> Target:
    """'host:port', 'dns:///name:port' or 'dns://server[:port]/name:port' → Target (ValueError says what is wrong)."""
    text = text.strip()
    if not text.startswith(DNS_SCHEME):
        return Target(text)
    rest = text[len(DNS_SCHEME):]
    if not rest.startswith("//") or "/" not in rest[2:]:
        raise ValueError(f"{text!r}: write dns:///NAME:PORT or dns://DNS_SERVER:PORT/NAME:PORT")
    authority, _, name_port = rest[2:].partition("/")
    name, port = split_host_port(name_port, text)
    if not port:
        raise ValueError(f"{text!r} names no port: write dns:///{name}:PORT")
    server, server_port = split_host_port(authority, text) if authority else ("", 0)
    return Target(text, name, port, server, server_port or 53)


def split_host_port(text: str, whole: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or 'host' → (host, port or 0)."""
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"{whole!r}: {text!r} is not HOST:PORT")
    return host, int(port or 0)


def channel_address(ip: str, port: int) -> str:
    """The gRPC target that dials exactly this IP (no resolution, no balancing)."""
    return f"ipv6:[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"ipv4:{ip}:{port}"


def resolve(target: Target, timeout_s: float) -> Optional[list[str]]:
    """The channel addresses of a target's replicas, sorted; None when the lookup failed (the caller
    keeps what it had: a DNS outage must not drain a healthy pool). A name with no records → []."""
    if not target.discovered:
        return [target.text]
    try:
        ips = _lookup(target, timeout_s)
    except (OSError, dns.exception.DNSException) as error:
        log.warning("resolving %s failed (%s); keeping the replicas found before", target.text, error)
        return None
    return sorted({channel_address(ip, target.port) for ip in ips})


def _lookup(target: Target, timeout_s: float) -> list[str]:
    if not target.nameserver:
        try:
            infos = socket.getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            if error.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []  # the name exists in no record: an empty pool, not a failed lookup
            raise
        return [info[4][0] for info in infos]
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [_nameserver_ip(target.nameserver)]
    resolver.port = target.nameserver_port
    resolver.lifetime = timeout_s
    ips: list[str] = []
    for kind in ("A", "AAAA"):
        try:
            ips += [record.to_text() for record in resolver.resolve(target.name, kind, search=False)]
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
    return ips


def _nameserver_ip(host: str) -> str:
    """dnspython needs the DNS server as an IP."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, 53, type=socket.SOCK_DGRAM)[0][4][0]
