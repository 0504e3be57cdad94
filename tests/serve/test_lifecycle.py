"""``serval serve``'s lifecycle, run as a user runs it (the real command in a subprocess, a real Ray head on
127.0.0.1, real HTTP): ``--detach`` with ``serval status`` and ``serval stop``, then nothing of what it
started is left (no process of its head, no listener); a second ``serval serve`` refused while the first
runs, and one whose replica no node can hold given up within seconds with the reason; and a Hugging Face id
resolved from the local cache only.

The foreground lifecycle (one request with an API key, then SIGINT, then nothing left) is proved by
``tests/serval/test_first_start.py``, whose foreground run starts its head anyway: one head start per
lifecycle, not two.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import yaml

from serval.launcher import processes
from serval.launcher.head import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
START_TIMEOUT_S = 900  # a replica's start on 2 shared cores takes minutes


def serval(*args: str) -> list[str]:
    return [sys.executable, "-m", "serval", *args]


def env() -> dict[str, str]:
    """The caller's environment with this checkout first and no cluster named (the command starts its own)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return {**environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class Ports:
    def __init__(self) -> None:
        self.gcs, self.dashboard, self.http, self.metrics = free_port(), free_port(), free_port(), free_port()

    def flags(self) -> list[str]:
        return ["--gcs-port", str(self.gcs), "--dashboard-port", str(self.dashboard), "--port", str(self.http)]

    def head_flags(self) -> list[str]:
        return [*self.flags(), "--metrics-export-port", str(self.metrics), "--num-cpus", "2"]

    def listening(self) -> set[int]:
        """Which of these ports something listens on."""
        mine = {self.gcs, self.dashboard, self.http, self.metrics}
        return {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port in mine}


def tiny_flags() -> list[str]:
    return [str(TINY), "--num-cpus-per-replica", "0.5", "--max-model-len", "256"]


def chat(ports: Ports, model: str, api_key: str = "none") -> str:
    from openai import OpenAI

    # Closed after the call: an idle keep-alive connection keeps an HAProxy that Serve has since reloaded
    # (a later deploy) alive, and `serval stop` waits for that process up to its drain timeout (60 s).
    with OpenAI(base_url=f"http://127.0.0.1:{ports.http}/v1", api_key=api_key, timeout=120) as client:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
    return reply.choices[0].message.content


def never_placed_config() -> dict:
    """An app whose replica's placement group asks for a resource no node has."""
    never = {
        "model_loading_config": {"model_id": "never", "model_source": str(TINY)},
        "placement_group_config": {"bundles": [{"CPU": 0.5, "serval_test_missing": 1}]},
        # A replica that never started has nothing to drain, but Serve's delete waits this long for it.
        "deployment_config": {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 1},
    }
    app = {"name": "never", "route_prefix": "/never", "import_path": "deployments.app:build_openai_app"}
    return {"applications": [{**app, "args": {"llm_configs": [never]}}]}


def run_at_once(*commands: list[str], timeout_s: float, **run) -> list[subprocess.CompletedProcess]:
    """Each command's result, in order, the commands run side by side (their start-ups overlap, and one's
    waits overlap the others' work): only commands none of whose outcomes depends on another's."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda command: subprocess.run(command, timeout=timeout_s, **run), commands))


def unfit_config() -> dict:
    """The P/D example at one CPU per pool: more than this 2-CPU head has, whatever runs on it."""
    unfit = yaml.safe_load((ROOT / "configs" / "serve" / "pd.yaml").read_text())
    for pool in ("prefill_config", "decode_config"):
        unfit["applications"][0]["args"][pool]["deployment_config"]["ray_actor_options"]["num_cpus"] = 1
    return copy.deepcopy(unfit)


def test_detach_status_stop_and_a_second_serve_is_refused(tmp_path):
    """``--detach`` returns once RUNNING with the head left up; ``serval status`` reports it; a second serve
    of the same app and a config that can never fit are refused, the first app untouched; a replica no node
    can hold is given up; ``serval stop`` then ends everything: no process of the head, no listener."""
    ports = Ports()
    run = dict(env=env(), cwd=tmp_path, capture_output=True, text=True)
    status_command = serval("status", "--dashboard-port", str(ports.dashboard))
    (tmp_path / "unfit.yaml").write_text(yaml.safe_dump(unfit_config()))
    (tmp_path / "never.yaml").write_text(yaml.safe_dump(never_placed_config()))
    try:
        up = subprocess.run(
            serval("serve", *tiny_flags(), "--detach", *ports.head_flags()), timeout=START_TIMEOUT_S, **run
        )
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        assert processes.head_processes(ports.gcs) and ports.http in ports.listening()
        assert isinstance(chat(ports, "tiny-llama"), str)
        status = subprocess.run(status_command, timeout=120, **run)
        assert status.returncode == 0 and "llm: RUNNING" in status.stdout, status.stdout + status.stderr
        assert "LLMServer:tiny-llama: HEALTHY (1 RUNNING)" in status.stdout
        assert "Native CPU kernels: built" in status.stdout  # make test builds them first

        # Side by side: a second serve of the running app, refused; a config that can never fit this 2-CPU head,
        # refused before anything is deployed, even with --replace (both read only the app names and the node's
        # total resources, which the third leaves as they are); and a replica no node can ever hold (a resource
        # the cluster lacks), given up within seconds with the reason, which `serval status` shows too
        # (`serval stop` below then ends it with the rest).
        second, refused, never = run_at_once(
            serval("serve", *tiny_flags(), *ports.flags()),
            serval("serve", "--config", "unfit.yaml", "--replace", *ports.flags()),
            serval("serve", "--config", "never.yaml", "--detach", *ports.flags()),
            timeout_s=300,
            **run,
        )
        assert second.returncode == 2 and "already runs" in second.stderr and "--replace" in second.stderr
        assert refused.returncode == 2 and "can never be scheduled" in refused.stderr, refused.stderr
        assert never.returncode == 1 and "no node of the cluster can hold" in never.stderr, never.stderr
        assert "[{CPU: 0.6, serval_test_missing: 1}]" in never.stderr  # the replica's 0.1 CPU and its worker's 0.5
        assert isinstance(chat(ports, "tiny-llama"), str)  # the first app still serves, untouched
        status = subprocess.run(status_command, timeout=120, **run)
        assert status.returncode == 3 and "INFEASIBLE" in status.stdout, status.stdout + status.stderr
        assert "no node of the cluster can hold" in status.stdout and "llm: RUNNING" in status.stdout

        stop = subprocess.run(serval("stop", "--dashboard-port", str(ports.dashboard)), timeout=300, **run)
        assert stop.returncode == 0 and "Stopped the Ray head" in stop.stdout, stop.stdout + stop.stderr
        left, listening = processes.head_processes(ports.gcs), ports.listening()  # before the clean-up ends them
    finally:
        processes.stop_head(ports.gcs)
    assert not left and not listening, (left, listening)
    after = subprocess.run(status_command, timeout=120, **run)
    assert after.returncode == 1 and "No Ray cluster answers" in after.stderr


def test_a_hugging_face_id_is_served_from_the_local_cache_only(tmp_path):
    """``org/name`` resolves offline to its snapshot in the cache (served under that id); one not cached
    fails at once, saying how to get it."""
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in TINY.iterdir():
        (snapshot / file.name).symlink_to(file)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    run = dict(env={**env(), "HF_HUB_CACHE": str(tmp_path / "hub")}, cwd=tmp_path, capture_output=True, text=True)
    found, missing = run_at_once(
        serval("serve", "acme/tiny", "--print-config"),
        serval("serve", "acme/absent", "--print-config"),
        timeout_s=300,
        **run,
    )
    assert found.returncode == 0, found.stderr
    llm_config = yaml.safe_load(found.stdout)["applications"][0]["args"]["llm_configs"][0]
    assert llm_config["model_loading_config"] == {"model_id": "acme/tiny", "model_source": str(snapshot)}
    assert missing.returncode == 1 and "not in the Hugging Face cache" in missing.stderr
    assert "huggingface-cli download acme/absent" in missing.stderr and not missing.stdout
