"""A small authoritative DNS server for the discovery tests: UDP on 127.0.0.1, A records from a dict
the test edits while it runs (dnspython parses and builds the messages)."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer:
    """records: name → IPv4 addresses; a name absent from it is NXDOMAIN, a name with [] has no A record."""

    def __init__(self, ttl_s: int = 1):
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port = self._socket.getsockname()[1]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)

    def __enter__(self) -> "DnsServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._socket.close()

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self.records[name] = list(ips)

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                data, peer = self._socket.recvfrom(4096)
            except socket.timeout:
                continue
            self._socket.sendto(self._answer(dns.message.from_wire(data)).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        with self._lock:
            self.queries += 1
            for question in query.question:
                name = question.name.to_text(omit_final_dot=True)
                if name not in self.records:
                    reply.set_rcode(dns.rcode.NXDOMAIN)
                elif question.rdtype == dns.rdatatype.A and self.records[name]:
                    reply.answer.append(dns.rrset.from_text_list(question.name, self._ttl_s, "IN", "A", self.records[name]))
        return reply
