"""``serval serve`` on a machine whose native CPU kernels are not built (issue 53, "a silent first start"):
it says so, starts their build in the background, serves on plain torch ops meanwhile (no replica
compiles nor waits for the build's lock), says when the build ended and how long it took, and names
that time in the start-up report.

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

import pytest

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
    code = "from engine.kernels import cpu; print(cpu.build_directory())"
    out = subprocess.run([sys.executable, "-c", code], env=environment(extensions), capture_output=True, text=True)
    return Path(out.stdout.strip())


def wait_for(log: Path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        output = log.read_text(errors="replace")
        if text in output:
            return output
        assert process.poll() is None, f"serval serve exited ({process.returncode}):\n{output[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")


def chat(port: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    return reply.choices[0].message.content


@pytest.mark.ray
def test_the_replicas_serve_on_plain_torch_while_the_build_runs_and_its_end_is_reported(tmp_path):
    extensions = tmp_path / "torch_extensions"
    directory = build_directory(extensions)
    lock = directory / "lock"
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # a build in progress, as torch's loader holds it
    gcs, dashboard, http = free_port(), free_port(), free_port()
    flags = ["--gcs-port", str(gcs), "--dashboard-port", str(dashboard), "--port", str(http), "--num-cpus", "2"]
    command = [sys.executable, "-m", "serval", "serve", str(TINY), "--served-model-name", "tiny", *flags]
    command += ["--num-cpus-per-replica", "0.5", "--max-model-len", "256", "--metrics-export-port", str(free_port())]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment(extensions))
    try:
        output = wait_for(log, "Serving until Ctrl-C", server, START_TIMEOUT_S)
        assert f"Serval's native CPU kernels are being built by another process (lock: {lock})" in output
        assert "the replicas serve with plain torch ops until then" in output
        assert "Self-check: '" in output and "native CPU kernels: compiling in the background for " in output
        assert isinstance(chat(http), str)  # answered while the build still holds its lock
        assert sorted(p.name for p in directory.iterdir()) == ["lock"]  # no replica compiled (nor waited)
        # The build ends: its module and its sources' stamp are there (stand-ins: nothing loads them here).
        code = "from engine.kernels import cpu; print(cpu._MODULE_NAME, cpu._sources_digest())"
        found = subprocess.run([sys.executable, "-c", code], env=environment(extensions), capture_output=True)
        name, digest = found.stdout.decode().split()
        (directory / f"{name}.so").write_bytes(b"")
        (directory / "sources.sha1").write_text(digest)
        os.close(held)
        lock.unlink()
        output = wait_for(log, "Serval's native CPU kernels built in ", server, 60)
        assert "replicas started from now on use them; those running keep plain torch ops" in output
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=300) == 0
    finally:
        if server.poll() is None:
            server.kill()
        processes.stop_head(gcs)
    assert "Stopped the Ray head" in log.read_text()


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
