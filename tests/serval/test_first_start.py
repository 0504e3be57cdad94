"""``serval serve`` on a machine whose native CPU kernels are not built (issue 53, "a silent first start"):
it says so, starts their build in the background, serves on plain torch ops meanwhile (no replica
compiles nor waits for the build's lock), says when the build ended and how long it took, and names
that time in the start-up report.

The foreground run here is also ``serval serve``'s foreground lifecycle, run as a user runs it (the real
command in a subprocess, a real Ray head on 127.0.0.1, real HTTP with an API key): on SIGINT it stops what
it started and leaves nothing running (no process of its head, no listener). One head start proves both;
the detached lifecycle (``serval status``, ``serval stop``) is in ``tests/serve/test_lifecycle.py``.

The build in progress is simulated by holding its lock as torch's loader does (created exclusively,
kept open), in a private ``TORCH_EXTENSIONS_DIR``, so that nothing here depends on how long a compile
takes; the build the launcher starts itself compiles for a CPU no compiler knows, and fails in seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.kernels import cpu
from serval.launcher import processes
from serval.launcher.head import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
START_TIMEOUT_S = 900  # a replica's start on 2 shared cores takes minutes


def environment(extensions: Path, **extra: str) -> dict[str, str]:
    """The caller's environment with this checkout first, no cluster named, and a private kernel cache."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return environ | {"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions), **extra}


def build_directory(extensions: Path) -> Path:
    """The module's build directory under ``extensions``, as the server's processes find it (torch's loader
    reads ``TORCH_EXTENSIONS_DIR`` at each call; asked here, not in a Python of its own that imports torch)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
        return cpu.build_directory()


def wait_for(log: Path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        output = log.read_text(errors="replace")
        if text in output:
            return output
        assert process.poll() is None, f"serval serve exited ({process.returncode}):\n{output[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")


def chat(port: int, api_key: str) -> str:
    from openai import OpenAI

    # Closed after the call: an idle keep-alive connection would keep HAProxy busy for the stop's drain.
    with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, timeout=120) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
    return reply.choices[0].message.content


class Ports:
    """The head's GCS, dashboard and metrics ports and Serve's HTTP port, all free now."""

    def __init__(self) -> None:
        self.gcs, self.dashboard, self.http, self.metrics = free_port(), free_port(), free_port(), free_port()

    def flags(self) -> list[str]:
        ports = ["--gcs-port", str(self.gcs), "--dashboard-port", str(self.dashboard), "--port", str(self.http)]
        return [*ports, "--metrics-export-port", str(self.metrics), "--num-cpus", "2"]

    def listening(self) -> set[int]:
        """Which of these ports something listens on."""
        mine = {self.gcs, self.dashboard, self.http, self.metrics}
        return {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port in mine}


def end_the_build(directory: Path, held: int) -> None:
    """What the build leaves when it ends: its module and its sources' stamp (stand-ins: nothing loads them
    here), its lock gone."""
    (directory / f"{cpu._MODULE_NAME}.so").write_bytes(b"")
    (directory / "sources.sha1").write_text(cpu._sources_digest())
    os.close(held)
    (directory / "lock").unlink()


def interrupt(server: subprocess.Popen, log: Path) -> None:
    """SIGINT, as Ctrl-C sends it; the server must then exit 0 once it has stopped what it started."""
    server.send_signal(signal.SIGINT)
    try:
        assert server.wait(timeout=300) == 0
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 300 s after SIGINT:\n{log.read_text(errors='replace')[-4000:]}") from None


@pytest.mark.ray
def test_the_replicas_serve_on_plain_torch_while_the_build_runs_and_sigint_then_leaves_nothing_running(tmp_path):
    """The build's messages and report (above); in the foreground the head's ports listen and one request
    with the API key is answered, then SIGINT stops the head: no process of it nor listener is left."""
    extensions = tmp_path / "torch_extensions"
    directory = build_directory(extensions)
    lock = directory / "lock"
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # a build in progress, as torch's loader holds it
    ports, log = Ports(), tmp_path / "serve.log"
    command = [sys.executable, "-m", "serval", "serve", str(TINY), "--served-model-name", "tiny", *ports.flags()]
    command += ["--num-cpus-per-replica", "0.5", "--max-model-len", "256", "--api-key", "k-1"]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment(extensions))
    try:
        output = wait_for(log, "Serving until Ctrl-C", server, START_TIMEOUT_S)
        assert f"Serval's native CPU kernels are being built by another process (lock: {lock})" in output
        assert "the replicas serve with plain torch ops until then" in output
        assert "Self-check: '" in output and "native CPU kernels: compiling in the background for " in output
        assert "Up in " in output and "replica LLMServer:tiny" in output
        started = processes.head_processes(ports.gcs)
        assert started and ports.listening() == {ports.gcs, ports.dashboard, ports.http, ports.metrics}
        assert isinstance(chat(ports.http, api_key="k-1"), str)  # answered while the build still holds its lock
        assert sorted(p.name for p in directory.iterdir()) == ["lock"]  # no replica compiled (nor waited)
        end_the_build(directory, held)
        output = wait_for(log, "Serval's native CPU kernels built in ", server, 60)
        assert "replicas started from now on use them; those running keep plain torch ops" in output
        interrupt(server, log)
        # What is left, seen before the clean-up below (which would end it).
        left, listening = processes.head_processes(ports.gcs), ports.listening()
        running = {pid for pid in started if processes.is_running(pid)}
    finally:
        if server.poll() is None:
            server.kill()
        processes.stop_head(ports.gcs)
    output = log.read_text()
    assert "Stopping ..." in output and "Stopped the Ray head" in output
    assert not left and not running and not listening, (left, running, listening)


def test_the_launcher_starts_the_build_itself_where_nothing_is_built_and_says_how_it_ended(tmp_path):
    """``KernelBuild.start`` as ``serval serve`` calls it before the Ray head starts: the build, started in
    the background, takes its lock (or ends) before the launcher deploys; its end is reported once."""
    script = (
        "import time\n"
        "from serval.launcher.kernels import KernelBuild\n"
        "build = KernelBuild.start(local=True)\n"
        "build.wait_until_locked()\n"
        "while (line := build.poll()) is None: time.sleep(0.1)\n"
        "print(line); print(build.report_line()); print(build.poll())\n"
    )
    env = environment(tmp_path, SERVAL_CPU_MARCH="no-such-cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Building Serval's native CPU kernels in the background (first start only")
    assert "background-build.log" in lines[0] and "the replicas serve with plain torch ops until then" in lines[0]
    assert lines[1].startswith("Serval's native CPU kernels could not be built (") and "plain torch ops" in lines[1]
    assert lines[2].startswith("  native CPU kernels: could not be built (") and lines[3] == "None"
    log = next(tmp_path.glob("*/background-build.log")).read_text()
    assert "-march=no-such-cpu" in log
