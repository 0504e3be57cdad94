"""Two test hosts on this machine: network namespaces joined by a veth pair, a Ray node in each.

``two_host_cluster()`` creates two namespaces, ``serval-<tag>-h0`` (10.213.7.1) and
``serval-<tag>-h1`` (10.213.7.2), joined by one veth pair on the private /30 10.213.7.0/30 and
each with its own loopback; nothing is added to the machine's own namespace (the veth ends are
created inside the namespaces) and eth0 is never touched. The Ray head runs in h0, a worker node in
h1, each on its host's address; the Ray processes are started with ``ip netns exec`` and so can
listen and connect only inside their host. Ports are fixed (``GCS_PORT``...): each namespace has
its own port space. Whatever happens, the context manager stops every process inside the two
namespaces (by id, ``ray_processes.stop_processes``; never ``ray stop``) and deletes them, which
deletes the veth pair too.

The root namespace cannot reach 10.213.7.x, so drivers run in the head host
(``TwoHostCluster.run_driver``: a Python module in h0 whose last line is a JSON result).
Needs root and iproute2 (``make test`` installs it); ``NamespacesUnavailable`` otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from serval.launcher import lifecycle as launcher
from serval.launcher import processes as ray_processes

SUBNET = "10.213.7.0/30"  # private (RFC 1918), used only between the two namespaces
ADDRESSES = HEAD_ADDRESS, WORKER_ADDRESS = "10.213.7.1", "10.213.7.2"
GCS_PORT, DASHBOARD_PORT, HTTP_PORT = 6379, 8265, 8000  # inside the namespaces: no clash with other clusters
HOST_LABEL = "serval-host"  # the Ray node label naming each host ("h0", "h1"), for placement
NODE_CPUS = 1  # logical CPUs per host: two one-CPU pipeline stages cannot share a host
OBJECT_STORE_BYTES = 80 * 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]  # the drivers are modules of this repository
RESULT_PREFIX = "RESULT "  # a driver's result line: this prefix, then JSON

# GCS health checks every second, a node dead after 3 misses (Ray's defaults: 3 s and 5): a killed
# raylet's node is declared dead in about 3 s instead of 15 s.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no CAP_NET_ADMIN)."""


@dataclass(frozen=True)
class Host:
    """One test host: a network namespace with a veth end holding ``address``."""

    netns: str
    address: str
    label: str  # its Ray node's HOST_LABEL value

    def exec_command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def pids(self) -> set[int]:
        """Every process inside this host (all of them ours: the namespace is the test's own)."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False)
        return {int(word) for word in out.stdout.split()}

    def listeners(self) -> list[tuple[str, int, int]]:
        """(address, port, pid) of each listening TCP socket inside this host, from ``ss -ltnpH``."""
        out = subprocess.run(self.exec_command("ss", "-ltnpH"), capture_output=True, text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            fields = line.split()
            address, _, port = fields[3].rpartition(":")
            for pid in re.findall(r"pid=(\d+)", line) or ["0"]:
                found.append((address.strip("[]").removeprefix("::ffff:"), int(port), int(pid)))
        return found

    def raylet_pid(self) -> int:
        """The pid of the raylet running in this host."""
        commands = ray_processes.command_lines()
        raylets = [pid for pid in self.pids() if "/raylet/raylet " in commands.get(pid, (0, ""))[1]]
        assert len(raylets) == 1, f"{self.netns}: expected one raylet, found {raylets}"
        return raylets[0]


@dataclass(frozen=True)
class TwoHostCluster:
    head: Host
    worker: Host
    temp_dir: Path  # the cluster's Ray session files and logs (not /tmp/ray: ray_current_cluster is left alone)

    def run_driver(self, module: str, *args: str, timeout_s: float) -> dict:
        """Runs ``python -m module args`` inside the head host and returns its result line's JSON."""
        command = self.head.exec_command(sys.executable, "-m", module, *args)
        try:
            done = subprocess.run(
                command, cwd=REPO_ROOT, env=ray_host_env(), capture_output=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as expired:
            raise AssertionError(f"{module} {args}: no result in {timeout_s} s:\n{_tail(expired)}") from None
        lines = [line for line in done.stdout.decode().splitlines() if line.startswith(RESULT_PREFIX)]
        assert done.returncode == 0 and lines, f"{module} {args} failed ({done.returncode}):\n{_tail(done)}"
        return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def _tail(done: subprocess.CompletedProcess | subprocess.TimeoutExpired) -> str:
    """The end of a driver's stdout and stderr, for a failure's message."""
    return "\n".join(
        (stream or b"").decode(errors="replace")[-limit:]
        for stream, limit in ((done.stdout, 2000), (done.stderr, 6000))
    )


def ray_host_env() -> dict[str, str]:
    """The Ray processes' environment in the test hosts: ``make serve``'s (``launcher.ray_env``), but
    with multi-node clusters allowed: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray on 127.0.0.1
    and makes ``ray start --address`` refuse to join a head; here every address is a test host's."""
    return {**launcher.ray_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", **HEALTH_CHECK_ENV}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def create_hosts(head: Host, worker: Host) -> None:
    """The two namespaces, each end of the veth pair created inside its own namespace, links up."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("iproute2's `ip` is not installed")
    try:
        _ip("netns", "add", head.netns)
    except subprocess.CalledProcessError as error:
        raise NamespacesUnavailable(f"`ip netns add` failed: {error.stderr.strip()}") from None
    _ip("netns", "add", worker.netns)
    _ip("link", "add", "sv-h0", "netns", head.netns, "type", "veth", "peer", "name", "sv-h1", "netns", worker.netns)
    for host, device in ((head, "sv-h0"), (worker, "sv-h1")):
        _ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", device)
        _ip("-n", host.netns, "link", "set", device, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")


def remove_host(host: Host) -> None:
    """Stops every process inside ``host`` (SIGTERM, then SIGKILL), then deletes the namespace."""
    if shutil.which("ip") is None:  # nothing was created
        return
    ray_processes.stop_processes(host.pids())
    if host.pids():  # a process forked while we stopped the others
        ray_processes.stop_processes(host.pids())
    subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True, check=False)


def remove_stale_hosts() -> None:
    """Removes the hosts of earlier runs whose process is gone (a run killed before its clean-up)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for name in set(re.findall(r"^serval-(\d+)-h[01]\b", listing, flags=re.MULTILINE)):
        if not ray_processes.is_running(int(name)):
            for i, address in enumerate(ADDRESSES):
                remove_host(Host(f"serval-{name}-h{i}", address, f"h{i}"))


def start_ray(head: Host, worker: Host, temp_dir: Path) -> None:
    """A Ray head in ``head`` (dashboard on its loopback), a worker node in ``worker``; each labelled."""
    common = ["--num-cpus", str(NODE_CPUS), "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
    if launcher.ray_auth_token() is None and ray_host_env()["RAY_AUTH_MODE"] == "token":
        # `ray start` with token auth refuses to make the token (launcher.start_ray_head does the same).
        subprocess.run([launcher.ray_bin("ray"), "get-auth-token", "--generate"], env=ray_host_env(), check=True)
    head_command = [
        *("--head", "--node-ip-address", head.address, "--port", str(GCS_PORT), "--temp-dir", str(temp_dir)),
        *("--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(DASHBOARD_PORT)),
    ]
    worker_command = ["--address", f"{head.address}:{GCS_PORT}", "--node-ip-address", worker.address]
    for host, command in ((head, head_command), (worker, worker_command)):
        subprocess.run(
            host.exec_command(
                launcher.ray_bin("ray"), "start", *command, *common, "--labels", f"{HOST_LABEL}={host.label}"
            ),
            env=ray_host_env(),
            check=True,
            stdout=subprocess.DEVNULL,
        )


@contextlib.contextmanager
def two_host_cluster() -> Iterator[TwoHostCluster]:
    """Two hosts with a Ray node each; everything inside them stopped and both removed on exit.

    Raises ``NamespacesUnavailable`` when the namespaces cannot be created (nothing is left behind).
    """
    tag = os.getpid()  # unique names: two runs on one machine never share a host
    head, worker = (Host(f"serval-{tag}-h{i}", address, f"h{i}") for i, address in enumerate(ADDRESSES))
    temp_dir = Path(tempfile.mkdtemp(prefix="serval-2h-"))  # short: Ray's socket paths live under it
    try:
        create_hosts(head, worker)
        remove_stale_hosts()
        start_ray(head, worker, temp_dir)
        yield TwoHostCluster(head, worker, temp_dir)
    finally:
        for host in (worker, head):
            remove_host(host)
        shutil.rmtree(temp_dir, ignore_errors=True)
