"""Test hosts on one machine: each worker in its own network namespace, joined through a bridge,
with its link shaped by tc on each host's egress: the rate by a token bucket (tbf, see
:func:`tbf_args`), a one-way delay by netem where the kernel has it (``netem_available()``; some
kernels ship without it).

Everything lives in namespaces this module creates (the bridge too, in a hub namespace), so no
traffic touches the machine's own interfaces; ``__exit__`` removes them all (deleting a namespace
deletes the veth ends inside it). Needs root (``ip netns``, ``tc``).

One test network at a time on a machine: a second one (another benchmark, a test) waits on a
file lock (:data:`LOCK_PATH`) until the first is removed, rather than clear the first's
namespaces as an interrupted run's leftovers (which cut a running benchmark's links), and
rather than share its cores, which would change the seconds it measures.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.77"  # private /24 used only inside the namespaces
LOCK_PATH = Path(tempfile.gettempdir()) / "ds_lowcomm-testnetwork.lock"  # held while a test network exists


class NetworkSetupError(RuntimeError):
    pass


@dataclass(frozen=True)
class LinkShape:
    """One link: ``rate`` like "100mbit" (None: unshaped) and one-way ``delay_ms``."""

    rate: str | None = None
    delay_ms: float = 0.0

    @property
    def label(self) -> str:
        if self.rate is None and not self.delay_ms:
            return "unshaped"
        return f"{self.rate or 'unlimited'} {self.delay_ms:g} ms"


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """"100mbit" -> 1e8 (tc's units: kbit, mbit, gbit)."""
    for unit, scale in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate must look like 100mbit or 1gbit; got {rate!r}")


# Links up to this rate are paced packet by packet (a peak rate); faster ones are rate-only.
PEAK_MAX_BITS = 100e6


def tbf_args(rate: str) -> list[str]:
    """tbf's arguments for a link of ``rate``, chosen so that the rate holds for every message size.

    A token bucket lets a message smaller than its burst leave at the veth's speed (gigabits), so
    the burst alone decides how fast small messages cross: the old 16 KiB burst passed a 14 KB
    message over a "10 Mbit/s" link in 0.2 ms, where size / rate is 11.3 ms. Up to
    ``PEAK_MAX_BITS``, a small burst (6000 bytes) and a second bucket, a peak rate of 1.02 x rate
    with a bucket (``mtu``) of one full frame (1514 bytes) plus 100 us at line rate (at least 1600
    bytes), send every packet at about the line rate: only the first frame of a burst goes at once,
    as a real link would send it in 1514 / rate. The 100 us absorb the late wake-ups of tbf's timer
    on a busy machine; at 100 Mbit/s a bucket of one frame lost 5% of the rate to them.

    Above ``PEAK_MAX_BITS`` (the 1 Gbit/s links) the links are rate-only, burst 0.5 ms at line rate
    (62.5 KB at 1 Gbit/s): pacing single packets there needs a timer every 12 us, which this
    machine's tbf does not keep (a 1 MB transfer took 3.3x size / rate with a peak rate; also with
    a 14 KB peak bucket, 1.3x), so a message under the burst crosses up to 0.5 ms early (a 14 KB one
    in about 0.02 ms instead of 0.11 ms), and bulk transfers hold the rate (1 MB: medians 1.02x and
    1.06x in two sets of runs on a busy machine).
    Measured figures: lab/notes/test-hosts.md."""
    bits = rate_bits(rate)
    if bits <= PEAK_MAX_BITS:
        mtu = max(1600, 1514 + int(bits / 8 * 100e-6))
        return ["rate", rate, "burst", str(max(6000, mtu)), "peakrate", f"{int(bits * 1.02)}bit", "mtu", str(mtu),
                "latency", "200ms"]
    return ["rate", rate, "burst", str(max(6000, int(bits / 8 * 0.5e-3))), "latency", "200ms"]


def netem_available() -> bool:
    """Whether this kernel can add a netem qdisc (checked on a throwaway dummy namespace)."""
    ns = "dslc-probe"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        _run("ip", "netns", "add", ns)
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                               "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkSetupError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def check_can_create() -> None:
    """Refuse clearly, before anything starts, where namespaces cannot be made."""
    if os.geteuid() != 0:
        raise PermissionError("the network benchmark needs root: it creates network namespaces, veth pairs and tc "
                              "qdiscs (run it as root, or run the other benchmarks)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkSetupError(f"the network benchmark needs the '{tool}' command (iproute2)")


class TestNetwork:
    """``with TestNetwork(4, LinkShape("100mbit", 20)) as net:`` then start worker i with
    ``net.command(i, argv)`` and ``net.env(i)``; host 0 is the rendezvous (MASTER_ADDR)."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int, shape: LinkShape = LinkShape(), prefix: str = "dslc"):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be in [1, 200]; got {hosts}")
        self.hosts, self.shape, self.prefix = hosts, shape, prefix
        self.hub = f"{prefix}-hub"
        self._lock = None

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def interface(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def env(self, i: int, port: int = 29600) -> dict[str, str]:
        return {"MASTER_ADDR": self.address(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": self.interface(i)}

    def existing(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(f"{self.prefix}-")]

    def _acquire(self) -> None:
        """The machine's test-network lock: at once, or after waiting (said on stderr) for the
        process that holds it."""
        self._lock = open(LOCK_PATH, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            print(f"TestNetwork: waiting for the test network of {holder} to be removed ({LOCK_PATH})",
                  file=sys.stderr, flush=True)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()}\n")
        self._lock.flush()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def __enter__(self) -> "TestNetwork":
        check_can_create()
        self._acquire()
        self.remove()  # leftovers of an interrupted run (no live test network holds the lock)
        try:
            _run("ip", "netns", "add", self.hub)
            hub = ("ip", "netns", "exec", self.hub)
            _run(*hub, "ip", "link", "add", "br0", "type", "bridge")
            _run(*hub, "ip", "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, dev = self.namespace(i), self.interface(i)
                host = ("ip", "netns", "exec", ns)
                _run("ip", "netns", "add", ns)
                _run(*host, "ip", "link", "set", "lo", "up")
                _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.hub)
                _run(*host, "ip", "addr", "add", f"{self.address(i)}/24", "dev", dev)
                _run(*host, "ip", "link", "set", dev, "up")
                _run(*hub, "ip", "link", "set", f"p{i}", "master", "br0")
                _run(*hub, "ip", "link", "set", f"p{i}", "up")
                self._shape(host, dev)
        except BaseException:
            self.remove()
            self._release()
            raise
        return self

    def _shape(self, host: tuple[str, ...], dev: str) -> None:
        rate, delay = self.shape.rate, self.shape.delay_ms
        parent = ["root"]
        if delay:
            if not netem_available():
                raise NetworkSetupError(f"a {delay:g} ms delay needs the netem qdisc, which this kernel lacks "
                                        "(sch_netem): use a rate-only link shape here")
            _run(*host, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay}ms",
                 "limit", "100000")
            parent = ["parent", "1:1"]
        if rate:
            _run(*host, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf", *tbf_args(rate))

    def __exit__(self, *exc) -> None:
        try:
            self.remove()
        finally:
            self._release()

    def remove(self) -> None:
        for ns in self.existing():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
