"""What the launcher says while a Serve config deploys, and when it gives up early.

Pure functions over plain data (the Serve config as loaded from YAML, Serve's typed status
``ServeInstanceDetails``, the nodes' total resources), so they can be tested without a cluster:

- ``config_needs``: a lower bound on what each deployment of a config takes (CPUs and GPUs per replica
  times its replicas, TP/PP worker bundles not counted), read from the YAML before deploying; once the
  app is built, ``status_needs`` has Serve's own figures.
- ``unfit_reason``: why some needs can never fit the cluster (a sentence naming what to change), or None.
- ``progress_lines``: one line per application and, under it, each deployment that is not yet healthy
  with Serve's own message (unschedulable resources, a slow or failing constructor), tracebacks cut to
  their last lines.
- ``final_reason``: a reason to stop waiting (a failed deploy, resources that can never fit), or None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ray.serve.schema import (
    ApplicationStatus,
    DeploymentDetails,
    DeploymentStatus,
    ReplicaState,
    ServeInstanceDetails,
)

INGRESS_NAME = "OpenAiIngress"  # deployments.app.INGRESS_DEPLOYMENT_NAME (not imported: it pulls in the engine)
TERMINAL_FAILURES = (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)
MESSAGE_LINES = 6  # lines of a deployment's message shown while waiting (a traceback's last ones)
FAILURE_LINES = 20  # lines of each message shown when the deploy failed


@dataclass(frozen=True)
class Need:
    """One deployment's resources: ``cpus`` and ``gpus`` per replica, ``replicas`` of them."""

    app: str
    deployment: str
    cpus: float
    gpus: float
    replicas: int


def _replica_count(deployment_config: dict) -> int:
    autoscaling = deployment_config.get("autoscaling_config") or {}
    count = deployment_config.get("num_replicas")
    if isinstance(count, int):
        return count
    return int(autoscaling.get("initial_replicas") or autoscaling.get("min_replicas") or 1)


def _need(app: str, name: str, deployment_config: dict, default_cpus: float, overrides: dict) -> Need:
    merged = {**deployment_config, **overrides.get(name, {})}
    actor = {**deployment_config.get("ray_actor_options", {}), **overrides.get(name, {}).get("ray_actor_options", {})}
    cpus = float(actor.get("num_cpus", default_cpus))
    return Need(app, name, cpus, float(actor.get("num_gpus", 0)), _replica_count(merged))


def _server_name(prefix: str, llm_config: dict) -> str:
    model_id = llm_config.get("model_loading_config", {}).get("model_id", "?")
    return prefix + re.sub(r"[^A-Za-z0-9_.-]", "--", str(model_id))


def _servers(builder: str, args: dict) -> tuple[list[tuple[str, dict]], bool]:
    """(name prefix, llm_config) of each LLM-server deployment an app builder makes, and whether it adds
    the ``OpenAiIngress``: a pd app always; one model's servers are their own HTTP ingress only with
    ``separate_ingress: false``."""
    if builder == "build_openai_app":
        configs = args.get("llm_configs", [])
        servers = [("LLMServer:", c) for c in configs if isinstance(c, dict)]
        return servers, len(configs) > 1 or args.get("separate_ingress", True) is not False
    if builder == "build_pd_openai_app":
        return [("PrefillServer:", args.get("prefill_config", {})), ("LLMServer:", args.get("decode_config", {}))], True
    return [], False


def config_needs(config: dict) -> list[Need]:
    """Each deployment of Serval's app builders in ``config`` (others are skipped): the LLM servers at
    1 CPU per replica unless ``ray_actor_options`` say otherwise, the ``OpenAiIngress`` at 0.1."""
    needs = []
    for app in config.get("applications", []):
        name, args = app.get("name", "default"), app.get("args") or {}
        overrides = {d["name"]: d for d in app.get("deployments", []) if "name" in d}
        servers, has_ingress = _servers(str(app.get("import_path", "")).rsplit(":", 1)[-1], args)
        for prefix, llm_config in servers:
            deployment_config = llm_config.get("deployment_config", {})
            needs.append(_need(name, _server_name(prefix, llm_config), deployment_config, 1.0, overrides))
        if has_ingress:
            ingress = args.get("ingress_deployment_config") or {"ray_actor_options": {"num_cpus": 0.1}}
            needs.append(_need(name, INGRESS_NAME, ingress, 0.1, overrides))
    return needs


def status_needs(details: ServeInstanceDetails, app_names: list[str]) -> list[Need]:
    """The needs Serve itself reports once an app is built (``required_resources``, ``target_num_replicas``)."""
    needs = []
    for app_name in app_names:
        app = details.applications.get(app_name)
        for name, deployment in (app.deployments if app else {}).items():
            required = deployment.required_resources or {}
            cpus, gpus = float(required.get("CPU", 0)), float(required.get("GPU", 0))
            needs.append(Need(app_name, name, cpus, gpus, deployment.target_num_replicas))
    return needs


def unfit_reason(needs: list[Need], nodes: list[dict[str, float]], config_path: str) -> str | None:
    """Why ``needs`` can never be scheduled on ``nodes`` (each node's total resources), or None.

    Final on a cluster that does not grow (a local head). Names the deployments and what to change.
    """
    if not nodes:
        return None
    for kind, key in (("CPU", "cpus"), ("GPU", "gpus")):
        total = sum(node.get(kind, 0.0) for node in nodes)
        largest = max(node.get(kind, 0.0) for node in nodes)
        wanted = sum(getattr(n, key) * n.replicas for n in needs)
        too_big = [n for n in needs if getattr(n, key) > largest + 1e-9]
        if not too_big and wanted <= total + 1e-9:
            continue
        items = ", ".join(f"{n.deployment}: {n.replicas} x {getattr(n, key):g}" for n in needs if getattr(n, key) > 0)
        ingress_note = (
            " (the OpenAiIngress's: ingress_deployment_config)"
            if any(n.deployment == INGRESS_NAME and getattr(n, key) > 0 for n in needs)
            else ""
        )
        return (
            f"The config asks for {wanted:g} {kind}s ({items}) but the cluster has {total:g}"
            f"{f' (at most {largest:g} on one node)' if too_big else ''}: it can never be scheduled. "
            f"Lower ray_actor_options.num_{kind.lower()}s or num_replicas in {config_path}{ingress_note}, "
            f"or run on a machine with more {kind}s."
        )
    return None


def summarize(message: str, max_lines: int = MESSAGE_LINES) -> str:
    """A Serve message cut to its last ``max_lines`` non-empty lines (a traceback's end: the error)."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= max_lines:
        return "\n".join(lines)
    return "\n".join(["...", *lines[-max_lines:]])


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _deployment_lines(name: str, deployment: DeploymentDetails, activity: str | None) -> list[str]:
    states = [replica.state.value for replica in deployment.replicas]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)) or "no replicas yet"
    lines = [f"  {name}: {deployment.status.value} ({counts})"]
    if deployment.message:
        lines.append(_indent(summarize(deployment.message), "    "))
    if activity:
        lines.append(f"    {activity}")
    return lines


def progress_lines(
    details: ServeInstanceDetails, app_names: list[str], activities: dict[str, str] | None = None
) -> list[str]:
    """Each app's status and message, then each of its deployments that is not HEALTHY with its
    replicas' states, Serve's message and ``activities[deployment]`` (what its replicas are doing)."""
    activities = activities or {}
    lines = []
    for name in app_names:
        app = details.applications.get(name)
        lines.append(f"{name}: {app.status.value if app else 'NOT_STARTED'}")
        if app is None:
            continue
        if app.message:
            lines.append(_indent(summarize(app.message), "    "))
        for deployment_name, deployment in app.deployments.items():
            if deployment.status != DeploymentStatus.HEALTHY:
                lines += _deployment_lines(deployment_name, deployment, activities.get(deployment_name))
    return lines


def status_lines(details: ServeInstanceDetails) -> list[str]:
    """Every app with its status, route and endpoint, then each of its deployments (replica states,
    Serve's message when it has one: why it is stuck)."""
    http = details.http_options
    base = f"http://{http.host}:{http.port}" if http else ""
    lines = []
    for name, app in details.applications.items():
        lines.append(f"{name}: {app.status.value}  {base}{app.route_prefix or ''}")
        if app.message:
            lines.append(_indent(summarize(app.message), "    "))
        for deployment_name, deployment in app.deployments.items():
            lines += _deployment_lines(deployment_name, deployment, None)
    return lines


def is_running(details: ServeInstanceDetails, app_names: list[str]) -> bool:
    """Whether every app of ``app_names`` is RUNNING."""
    apps = details.applications
    return all(name in apps and apps[name].status == ApplicationStatus.RUNNING for name in app_names)


def final_reason(
    details: ServeInstanceDetails, app_names: list[str], nodes: list[dict[str, float]], config_path: str
) -> str | None:
    """Why waiting longer cannot help: an app or deployment failed (its messages), or what Serve says it
    needs can never fit ``nodes``; None while it may still become RUNNING."""
    failed = {}
    for name in app_names:
        app = details.applications.get(name)
        if app is None or app.status not in TERMINAL_FAILURES:
            continue
        failed[name] = summarize(app.message, FAILURE_LINES)
        for deployment_name, deployment in app.deployments.items():
            if deployment.status != DeploymentStatus.HEALTHY and deployment.message:
                failed[f"{name}/{deployment_name}"] = summarize(deployment.message, FAILURE_LINES)
    if failed:
        return "Deployment failed:\n" + "\n".join(f"  {key}:\n{_indent(text, '    ')}" for key, text in failed.items())
    return unfit_reason(status_needs(details, app_names), nodes, config_path)


def replica_activities(
    details: ServeInstanceDetails, app_names: list[str], kernel_state: str | None = None
) -> dict[str, str]:
    """deployment -> what its starting replicas should know that Serve does not say (``kernel_state``:
    ``kernels.KernelBuild.activity``), for the deployments that run a model (not the router in front)."""
    if kernel_state is None:
        return {}
    return {
        name: kernel_state
        for app_name in app_names
        if app_name in details.applications
        for name, deployment in details.applications[app_name].deployments.items()
        if name != INGRESS_NAME and any(replica.state == ReplicaState.STARTING for replica in deployment.replicas)
    }
