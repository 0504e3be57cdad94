"""The launcher's pieces without a cluster: what a config needs against what the cluster has, what it
prints while Serve deploys (from Serve's typed status) and when it gives up, the start-up timings from
Serve's status, the native kernels' build as the launcher sees it, the HAProxy drain probe, and stopping
one head's processes by id (psutil; never ``ray stop``)."""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeInstanceDetails
from ray.util.state.common import ActorState, PlacementGroupState

from serval.launcher import haproxy as haproxy_admin
from serval.launcher import head as launcher
from serval.launcher import pending as launcher_pending
from serval.launcher import processes as ray_processes
from serval.launcher import status as launcher_status
from serval.launcher import timings as launcher_timings
from serval.launcher.kernels import KernelBuild, Kernels

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "serve"
TWO_CPUS = [{"CPU": 2.0, "memory": 1e10}]


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def pd_prefill_decode(config: dict) -> tuple[dict, dict]:
    args = config["applications"][0]["args"]
    return args["prefill_config"]["deployment_config"], args["decode_config"]["deployment_config"]


def test_the_cpu_configs_fit_two_cpus_and_the_gpu_examples_do_not():
    for name in ("default.yaml", "pd.yaml"):
        needs = launcher_status.config_needs(load(name))
        assert launcher_status.unfit_reason(needs, TWO_CPUS, name) is None, name
    needs = {n.deployment: n for n in launcher_status.config_needs(load("pd.yaml"))}
    assert sum(n.cpus * n.replicas for n in needs.values()) == pytest.approx(1.7)
    assert needs["OpenAiIngress"].cpus == 0.1 and set(needs) == {
        "PrefillServer:tiny-llama",
        "LLMServer:tiny-llama",
        "OpenAiIngress",
    }
    two_models = {n.deployment: n for n in launcher_status.config_needs(load("gpu-two-models.yaml"))}
    assert two_models["LLMServer:mistral-7b-instruct"].replicas == 2  # the app's `deployments:` override
    assert "OpenAiIngress" in two_models  # two models: the router in front
    single = {n.deployment for n in launcher_status.config_needs(load("default.yaml"))}
    assert single == {"LLMServer:smollm2-135m-instruct", "OpenAiIngress"}  # the router by default, even for one model
    direct = load("default.yaml")
    direct["applications"][0]["args"]["separate_ingress"] = False
    assert {n.deployment for n in launcher_status.config_needs(direct)} == {"LLMServer:smollm2-135m-instruct"}
    assert "GPU" in launcher_status.unfit_reason(list(two_models.values()), [{"CPU": 64.0}], "gpu-two-models.yaml")


def test_pd_at_one_cpu_per_pool_names_what_to_change():
    """The pd.yaml of before (1 + 1 CPUs and the ingress's 0.1 on a 2-CPU machine) never ran."""
    config = copy.deepcopy(load("pd.yaml"))
    for deployment_config in pd_prefill_decode(config):
        deployment_config["ray_actor_options"]["num_cpus"] = 1
    reason = launcher_status.unfit_reason(launcher_status.config_needs(config), TWO_CPUS, "configs/serve/pd.yaml")
    assert "2.1 CPUs" in reason and "the cluster has 2" in reason
    assert "PrefillServer:tiny-llama: 1 x 1" in reason and "OpenAiIngress: 1 x 0.1" in reason
    assert "ray_actor_options.num_cpus" in reason and "configs/serve/pd.yaml" in reason


def test_a_replica_larger_than_any_node_never_fits_even_if_the_sum_does():
    needs = [launcher_status.Need("llm", "LLMServer:m", cpus=3.0, gpus=0.0, replicas=1)]
    reason = launcher_status.unfit_reason(needs, [{"CPU": 2.0}, {"CPU": 2.0}], "c.yaml")
    assert "at most 2 on one node" in reason
    assert launcher_status.unfit_reason(needs, [], "c.yaml") is None  # no nodes known: no verdict


def deployment(status: str, message: str = "", states=("STARTING",), required=None, target=1, started=5.0) -> dict:
    """One deployment as the dashboard's JSON has it (what ``ServeInstanceDetails`` parses)."""
    replica = {"actor_name": "r", "pid": 1, "start_time_s": started}
    return {
        "status": status,
        "status_trigger": "CONFIG_UPDATE_STARTED",
        "message": message,
        "replicas": [{**replica, "replica_id": f"r{i}", "state": s} for i, s in enumerate(states)],
        "required_resources": required or {"CPU": 1},
        "target_num_replicas": target,
    }


def app_json(app: str, message: str = "", **deployments) -> dict:
    named = {name: {"name": name, "deployment_config": {"name": name}, **d} for name, d in deployments.items()}
    llm = {"name": "llm", "route_prefix": "/", "docs_path": None, "status": app, "message": message}
    llm |= {"last_deployed_time_s": 0.0, "deployed_app_config": None, "source": "declarative"}
    llm |= {"external_scaler_enabled": False, "deployments": named}
    return {"controller_info": {}, "proxies": {}, "applications": {"llm": llm}}


def app_status(app: str, message: str = "", **deployments) -> ServeInstanceDetails:
    """Serve's typed status of one app ``llm`` with ``deployments``."""
    return ServeInstanceDetails(**app_json(app, message, **deployments))


UNSCHEDULABLE = (
    "Deployment 'OpenAiIngress' in application 'llm' has 1 replicas that have taken more than 10s to be "
    'scheduled. ... Resources required for each replica: {"CPU": 0.1}, total resources available: {"CPU": 0.0}.'
)
CONSTRUCTOR_FAILED = "A replica failed to start with exception. Retrying 2 more time(s). Error:\n" + "\n".join(
    ["Traceback (most recent call last):", *[f'  File "x{i}.py", line {i}' for i in range(10)]]
    + ["FileNotFoundError: models/tiny-llama has no config.json"]
)


def test_progress_shows_serve_messages_and_cuts_tracebacks():
    status = app_status(
        "DEPLOYING",
        **{
            "LLMServer:m": deployment("UPDATING", CONSTRUCTOR_FAILED, required={"CPU": 0.8}),
            "OpenAiIngress": deployment("UPDATING", UNSCHEDULABLE, states=(), required={"CPU": 0.1}),
            "PrefillServer:m": deployment("HEALTHY", states=("RUNNING",), required={"CPU": 0.8}),
        },
    )
    lines = launcher_status.progress_lines(status, ["llm"], {"LLMServer:m": "compiling kernels"})
    text = "\n".join(lines)
    assert lines[0] == "llm: DEPLOYING"
    assert "  LLMServer:m: UPDATING (1 STARTING)" in lines and "    compiling kernels" in lines
    assert "FileNotFoundError: models/tiny-llama has no config.json" in text and "x0.py" not in text
    assert "  OpenAiIngress: UPDATING (no replicas yet)" in lines and "to be scheduled" in text
    assert "PrefillServer" not in text  # healthy deployments are not repeated
    assert launcher_status.final_reason(status, ["llm"], TWO_CPUS, "c.yaml") is None  # may still start


def test_final_reasons_a_failed_deploy_and_resources_that_never_fit():
    failed = app_status("DEPLOY_FAILED", "", **{"LLMServer:m": deployment("DEPLOY_FAILED", CONSTRUCTOR_FAILED)})
    reason = launcher_status.final_reason(failed, ["llm"], TWO_CPUS, "c.yaml")
    assert reason.startswith("Deployment failed") and "llm/LLMServer:m" in reason and "no config.json" in reason
    unfit = app_status(
        "DEPLOYING",
        **{"LLMServer:m": deployment("UPDATING", target=2), "OpenAiIngress": deployment("UPDATING", required={})},
    )
    assert "asks for 2 CPUs" not in (launcher_status.final_reason(unfit, ["llm"], TWO_CPUS, "c.yaml") or "")
    unfit = app_status(
        "DEPLOYING",
        **{
            "LLMServer:m": deployment("UPDATING", target=2),
            "OpenAiIngress": deployment("UPDATING", required={"CPU": 0.1}),
        },
    )
    assert "2.1 CPUs" in launcher_status.final_reason(unfit, ["llm"], TWO_CPUS, "c.yaml")


GROUP_ID = "c8ec7a94103f4e0771da79c1d02501000000"  # as Ray writes a placement group's id (18 bytes, hex)


def pending_group(name: str, bundles: list[dict], scheduling_state: str) -> PlacementGroupState:
    """A pending placement group as Ray's state API returns it (``ray list placement-groups --detail``)."""
    specs = [{"bundle_id": {"bundle_index": i}, "unit_resources": b, "node_id": ""} for i, b in enumerate(bundles)]
    stats = {"scheduling_state": scheduling_state, "scheduling_attempt": 1}
    return PlacementGroupState(GROUP_ID, name, "01000000", "PENDING", specs, False, stats, {}, {})


def pending_actor(name: str, required: dict, group: str | None = None) -> ActorState:
    return ActorState(
        actor_id="df97184e3de88d3435702d2c01000000", class_name="RayWorker", state="PENDING_CREATION",
        job_id="01000000", name=name, node_id=None, pid=0, ray_namespace="serve", serialized_runtime_env="{}",
        required_resources=required, death_cause=None, is_detached=False, placement_group_id=group,
        repr_name="", num_restarts=0, num_restarts_due_to_lineage_reconstruction=0,
        num_restarts_due_to_node_preemption=0, call_site=None, label_selector={}, fallback_strategy=None,
    )  # fmt: skip


def test_pending_work_is_shown_with_its_demands_and_an_infeasible_replica_is_final():
    replica = "SERVE_REPLICA::llm#LLMServer:m#wg78fgga"
    waiting = launcher_pending.Pending(
        groups=[pending_group(replica, [{"CPU": 2.5}], "INFEASIBLE")],
        actors=[pending_actor("", {f"CPU_group_0_{GROUP_ID}": 0.5, f"bundle_group_{GROUP_ID}": 0.001}, GROUP_ID)],
        usage={"CPU": (0.1, 2.0), f"CPUGroup0{GROUP_ID.upper()}": (0.0, 1.5), "objectStoreMemory": (0, 1e9)},
        nodes=TWO_CPUS,
    )
    lines = launcher_pending.lines(waiting)
    assert lines[0] == "Pending on the cluster:"
    assert "placement group llm#LLMServer:m#wg78fgga: bundles [{CPU: 2.5}], INFEASIBLE" in lines[1]
    assert "actor RayWorker df97184e3de8: asks for {CPU: 0.5} in its placement group" in lines[2]
    assert lines[3] == "  free: 1.9 of 2 CPU"  # a placement group's own resources and the object store left out
    reason = launcher_pending.infeasible_reason(waiting, ["llm"])
    assert "replica llm#LLMServer:m#wg78fgga asks for bundles [{CPU: 2.5}]" in reason
    assert "the most any node has: {CPU: 2, memory: 9.31 GiB}" in reason and "bundles[0]" in reason
    assert launcher_pending.infeasible_reason(waiting, ["other"]) is None  # another app's group is not ours
    placeable = dataclasses.replace(waiting, groups=[pending_group(replica, [{"CPU": 1}], "QUEUED")])
    assert launcher_pending.infeasible_reason(placeable, ["llm"]) is None  # it may still be placed
    assert launcher_pending.lines(launcher_pending.Pending()) == []


def hold_lock(lock: Path) -> int:
    """The lock taken as torch's loader takes it for a build (created exclusively, kept open)."""
    return os.open(lock, os.O_CREAT | os.O_EXCL)


def test_the_kernels_state_tells_a_running_build_from_a_stale_lock(monkeypatch, tmp_path):
    from engine.kernels import cpu

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a private cache: the real one is left alone
    assert KernelBuild.observe().state == Kernels.MISSING and KernelBuild.observe().activity() is None
    assert KernelBuild.observe(local=False).report_line() is None  # a cluster elsewhere: nothing to say here
    assert KernelBuild.observe(local=False).status_line() is None
    assert KernelBuild.observe().status_line() == f"Native CPU kernels: {Kernels.MISSING.value}"
    lock = cpu.build_lock()
    held = hold_lock(lock)
    building = KernelBuild.observe()
    assert building.state == Kernels.BUILDING and "being compiled" in building.activity()
    assert "compiling in the background for " in building.report_line() and str(lock) in building.report_line()
    assert "building for " in building.status_line() and str(cpu.build_log()) in building.status_line()
    os.close(held)  # the builder died without removing its lock
    stale = KernelBuild.observe()
    assert stale.state == Kernels.STALE_LOCK and str(lock) in stale.activity() and "rm " in stale.activity()
    assert stale.status_line() == f"Native CPU kernels: {Kernels.STALE_LOCK.value} ({lock})"
    status = app_status(
        "DEPLOYING",
        **{
            "A": deployment("UPDATING"),
            "B": deployment("HEALTHY", states=("RUNNING",)),
            "OpenAiIngress": deployment("UPDATING"),  # the router loads no model: the kernels are not its concern
        },
    )
    assert launcher_status.replica_activities(status, ["llm"], stale.activity()) == {"A": stale.activity()}
    lock.unlink()
    assert launcher_status.replica_activities(status, ["llm"], KernelBuild.observe().activity()) == {}


def test_the_end_of_another_process_build_is_reported_once_with_its_time(monkeypatch, tmp_path):
    """The build's time runs from when it took its lock; it has ended when the lock is gone and the module
    built from these sources is there (a stand-in file here: nothing loads it)."""
    from engine.kernels import cpu

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = cpu.build_lock()
    held = hold_lock(lock)
    os.utime(lock, (time.time() - 42, time.time() - 42))
    build = KernelBuild.observe()
    assert build.poll() is None and build.state == Kernels.BUILDING  # still holding its lock
    (lock.parent / f"{cpu._MODULE_NAME}.so").write_bytes(b"")
    (lock.parent / "sources.sha1").write_text(cpu._sources_digest())
    os.close(held)
    lock.unlink()
    line = build.poll()
    assert line.startswith("Serval's native CPU kernels built in 42 s: replicas started from now on use them")
    assert "those running keep plain torch ops until they restart" in line
    assert build.poll() is None and build.state == Kernels.DONE and build.activity() is None
    assert build.report_line() == "  native CPU kernels: compiled in 42 s, in the background"
    assert KernelBuild.observe().report_line() == "  native CPU kernels: already built (0 s compiling)"


class FakeHAProxy:
    """An admin socket answering ``show stat`` with one Serve backend whose sessions end on cue."""

    def __init__(self, path: Path, in_flight: int) -> None:
        self.path, self.in_flight, self.commands = path, in_flight, []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, _ = self.server.accept()
            with connection:
                line = connection.recv(4096).decode().strip()
                self.commands.append(line)
                if line == "show stat":
                    connection.sendall(self._stat().encode())

    def _stat(self) -> str:
        rows = [
            ("stats", "FRONTEND", 1),
            ("http_frontend", "FRONTEND", self.in_flight + 2),  # + idle keep-alive connections
            ("http-llm", "SERVE_REPLICA_llm-OpenAiIngress-x", self.in_flight),
            ("http-llm", "BACKEND", self.in_flight),
            ("default_backend", "BACKEND", 0),
        ]
        return "# pxname,svname,qcur,qmax,scur\n" + "".join(f"{p},{s},0,0,{n}\n" for p, s, n in rows)


def test_drain_refuses_new_connections_and_waits_for_requests_in_flight(tmp_path):
    fake = FakeHAProxy(tmp_path / "admin.sock", in_flight=2)
    threading.Timer(0.5, lambda: setattr(fake, "in_flight", 0)).start()
    started = time.monotonic()
    assert haproxy_admin.drain([fake.path], timeout_s=10, poll_s=0.05) == 0
    assert 0.4 < time.monotonic() - started < 5
    assert "disable frontend http_frontend" in fake.commands and "disable frontend stats" not in fake.commands
    fake.in_flight = 3
    assert haproxy_admin.drain([fake.path], timeout_s=0.2, poll_s=0.05) == 3  # gave up: 3 left
    # An older HAProxy still finishing its sessions after a reload (not in the live one's stats) counts too.
    fake.in_flight, older = 0, [1]
    threading.Timer(0.3, older.clear).start()
    assert haproxy_admin.drain([fake.path], timeout_s=10, poll_s=0.05, lingering=lambda: len(older)) == 0
    assert not older
    assert haproxy_admin.drain([tmp_path / "missing.sock"], timeout_s=1) == 0


def test_stop_head_ends_that_heads_processes_and_their_children_only():
    port = launcher.free_port()
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    head = subprocess.Popen([sys.executable, "-c", sleeper + "time.sleep(60)", f"--address=127.0.0.1:{port}", "x"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"127.0.0.1:{port + 1} x"])
    try:
        deadline = time.monotonic() + 10
        while len(members := ray_processes.head_processes(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert head.pid in members and other.pid not in members and os.getpid() not in members
        assert ray_processes.stop_head(port, grace_s=1.0) == 2
        head.wait(timeout=5)
        assert not any(map(ray_processes.is_running, members)) and other.poll() is None
    finally:
        other.kill()
        head.kill()
        other.wait()


def test_start_up_lines_split_the_deploy_by_what_serves_status_showed(tmp_path):
    """Serve's typed status, polled: when each replica's actor started, when it was first seen RUNNING."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, stamp in (("gcs_server.out", "14:45:33,127"), ("raylet.out", "14:45:46,185")):
        (logs / name).write_text(f"[2026-12-01 {stamp} I 1 1] (x) main.cc:1: started\n")
    at = launcher_timings.parse_time
    marks = {
        "start": at("2026-12-01 14:45:28,300"),
        "head": at("2026-12-01 14:45:57,300"),
        "deploy": at("2026-12-01 14:45:58,000"),
        "running": at("2026-12-01 14:46:36,500"),
    }
    clock, t0 = launcher_timings.StartClock(["llm"]), marks["deploy"]
    starting, up = deployment("UPDATING", started=t0 + 5), deployment("HEALTHY", states=("RUNNING",), started=t0 + 5)
    clock.observe(app_status("DEPLOYING", **{"LLMServer:m": starting, "OpenAiIngress": starting}), t0)
    clock.observe(app_status("DEPLOYING", **{"LLMServer:m": starting, "OpenAiIngress": up}), t0 + 30)
    clock.observe(app_status("RUNNING", **{"LLMServer:m": up, "OpenAiIngress": up}), t0 + 40)
    clock.observe(app_status("RUNNING", **{"LLMServer:m": up, "OpenAiIngress": up}), t0 + 50)  # seen before: kept
    lines = launcher_timings.start_up_lines(tmp_path, marks, True, clock)
    assert lines == [
        "Up in 68.2 s:",
        "  Ray head: 29.0 s (ray CLI 4.8 s, GCS and dashboard 13.1 s, raylet and agents 11.1 s)",
        "  Serve controller, proxy, app import and build: 5.0 s",
        "  replica LLMServer:m: 35.0 s (its process, imports and constructor)",
        "  replica OpenAiIngress: 25.0 s (its process, imports and constructor)",
    ]
    # Nothing seen (a deploy that found its replicas already RUNNING): the deploy as one phase.
    assert launcher_timings.start_up_lines(None, marks, False, launcher_timings.StartClock(["llm"])) == [
        "Up in 68.2 s:",
        "  deploy until RUNNING: 38.5 s",
    ]
    assert launcher_timings.start_up_lines(None, marks, True, None)[1] == "  Ray head: 29.0 s"
    compiled = "  native CPU kernels: compiled in 84 s, in the background"
    assert launcher_timings.start_up_lines(None, marks, True, None, compiled)[-1] == compiled  # the last line


def test_a_failed_ray_start_is_cleaned_up_and_run_once_more_unless_another_head_has_the_port(tmp_path, capsys):
    port = launcher.free_port()
    runs = tmp_path / "runs"
    # Fails on its first run, leaving a process of "its head" behind (named by the GCS address), like a
    # `ray start` whose raylet did not register in time; succeeds on the second.
    script = (
        "import pathlib, subprocess, sys; runs = pathlib.Path(sys.argv[1]); n = len(runs.read_text()) "
        "if runs.exists() else 0; runs.write_text('x' * (n + 1)); "
        f"n or subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '127.0.0.1:{port} gcs']); "
        "sys.exit(0 if n else 1)"
    )
    ray_processes.start_head([sys.executable, "-c", script, str(runs)], dict(os.environ), port)
    assert runs.read_text() == "xx" and "stopped the 1 processes it left" in capsys.readouterr().out
    assert not ray_processes.head_processes(port)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"127.0.0.1:{port} theirs"])
    try:
        while not ray_processes.head_processes(port):
            time.sleep(0.05)
        with pytest.raises(subprocess.CalledProcessError):
            ray_processes.start_head([sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), port)
        assert other.poll() is None  # another head's process on that port is never stopped
    finally:
        other.kill()
        other.wait()


def test_a_new_machine_without_a_ray_token_finds_no_cluster_rather_than_failing(tmp_path):
    """``serval serve`` on a new machine: token auth on, no ``~/.ray/auth_token`` yet. Asking whether a
    dashboard is up must answer (False where nothing listens, True where something does) and so must
    asking for the token (None), so that the launcher goes on to start the head, which makes the token."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        busy = listening.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        code = (
            "from serval.launcher import head, serve_client as c;"
            f"print(c.is_up('http://127.0.0.1:{free}'), c.is_up('http://127.0.0.1:{busy}'), head.ray_auth_token())"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
        env |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True", "None"]
