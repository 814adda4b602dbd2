"""deploy/: every kustomization renders (``kubectl kustomize``) and every object it makes
validates offline, against the Kubernetes schemas kubernetes-validate ships and the
vendored schemas of the operators' resources (deploy/schemas/); the manifests say what
the README says (probes, drain, scaling signals); the Grafana dashboard and the KEDA
queries name only metrics modelfleet exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest

import modelfleet.metrics  # noqa: F401  (every metric is defined there)
from modelfleet.settings import BrokerSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/production", "overlays/keda-rabbitmq",
                  "overlays/gpu-pool"]
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_v1alpha1_triggerauthentication.json",
    ("rabbitmq.com/v1beta1", "RabbitmqCluster"): "rabbitmq.com_v1beta1_rabbitmqcluster.json",
}


def kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable)
                                                                        .parent))
    if found is None:
        raise AssertionError("no kubectl: run .ci/tools-up (Debian's kubectl package)")
    return found


@cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    done = subprocess.run([kubectl(), "kustomize", str(DEPLOY / kustomization)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {kustomization}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def exported_metrics() -> set[str]:
    """Every metric name modelfleet's /metrics shows (histograms' series included)."""
    names = set()
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("# TYPE modelfleet_"):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
            if kind == "counter":
                names.add(f"{name}_total" if not name.endswith("_total") else name)
    return names


def metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\bmodelfleet_[a-z0-9_]+", expr))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates_against_its_schema(kustomization: str) -> None:
    docs = render(kustomization)
    assert docs, "rendered nothing"
    version = kubernetes_validate.utils.latest_version()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        where = f"{kustomization}: {doc['kind']}/{doc['metadata']['name']}"
        if key in CRD_SCHEMAS:
            schema = json.loads((SCHEMAS / CRD_SCHEMAS[key]).read_text())
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
            assert not errors, f"{where}: {errors[0].message} at {list(errors[0].path)}"
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from None


def test_the_vendored_schemas_catch_a_wrong_field() -> None:
    """The CRD schemas are real checks, not permissive stubs."""
    scaled = dict(one(render("base"), "ScaledObject", "modelfleet-worker"))
    scaled["spec"] = {**scaled["spec"], "minReplicaCount": "one"}
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")])
                        .read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(scaled))
    cluster = dict(one(render("base"), "RabbitmqCluster", "modelfleet-rabbitmq"))
    cluster["spec"] = {**cluster["spec"], "replicas": -1}
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[("rabbitmq.com/v1beta1", "RabbitmqCluster")])
                        .read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(cluster))
    with pytest.raises(kubernetes_validate.ValidationError):
        bad = json.loads(json.dumps(one(render("base"), "Deployment", "modelfleet-worker")))
        bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = "x"
        kubernetes_validate.validate(bad, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_workers_have_the_readme_probes_and_a_draining_prestop(kustomization: str) -> None:
    docs = render(kustomization)
    worker = one(docs, "Deployment", "modelfleet-worker")["spec"]["template"]["spec"]
    (container,) = worker["containers"]  # coordinator and runtimes: one container
    assert container["args"][0] == "worker" and "--probe-port" in container["args"]
    port = int(container["args"][container["args"].index("--probe-port") + 1])
    assert container["ports"][0]["containerPort"] == port
    # README "Kubernetes probes"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert (container["livenessProbe"]["periodSeconds"],
            container["livenessProbe"]["failureThreshold"]) == (10, 6)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert (container["readinessProbe"]["periodSeconds"],
            container["readinessProbe"]["failureThreshold"]) == (2, 1)
    hook = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in hook and "kill -0 1" in hook  # drains, and waits for it
    config = one(docs, "ConfigMap", "modelfleet-config")["data"]
    drain_s = float(config["MODELFLEET_WORKER__DRAIN_TIMEOUT_S"])
    assert worker["terminationGracePeriodSeconds"] > drain_s
    gateway = one(docs, "Deployment", "modelfleet-gateway")["spec"]["template"]["spec"]
    assert gateway["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["terminationGracePeriodSeconds"] > float(
        config["MODELFLEET_GATEWAY__DRAIN_TIMEOUT_S"])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_settings_in_the_config_map_are_real_settings(kustomization: str) -> None:
    config = one(render(kustomization), "ConfigMap", "modelfleet-config")["data"]
    env = {k: v for k, v in config.items() if k.startswith("MODELFLEET_")}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        settings = Settings()
    assert settings.log_format == "json"
    assert settings.worker.drain_timeout_s == float(env["MODELFLEET_WORKER__DRAIN_TIMEOUT_S"])
    for key in env:  # a misspelt variable would be ignored silently: none is
        if "__" in key:
            section, field = key.removeprefix("MODELFLEET_").lower().split("__")
            assert hasattr(getattr(settings, section), field), key


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_scalers_point_at_what_exists(kustomization: str) -> None:
    docs = render(kustomization)
    scaled = one(docs, "ScaledObject", "modelfleet-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "modelfleet-worker"
    one(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    hpa = one(docs, "HorizontalPodAutoscaler", "modelfleet-gateway")
    one(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    params = json.loads((SCHEMAS / "keda-trigger-metadata.json").read_text())
    exported = exported_metrics()
    for trigger in scaled["spec"]["triggers"]:
        known = params[trigger["type"]]
        metadata = trigger["metadata"]
        assert set(metadata) <= set(known["accepted"]), trigger
        # The RabbitMQ scaler's host may come from its TriggerAuthentication instead.
        required = set(known["required"]) - ({"host"} if "authenticationRef" in trigger
                                             else set())
        assert required <= set(metadata), trigger
        if trigger["type"] == "prometheus":
            assert metrics_in(metadata["query"]) and metrics_in(metadata["query"]) <= exported
            float(metadata["threshold"])
        else:
            prefix = Settings().broker.queue_prefix
            assert metadata["useRegex"] == "true" and metadata["protocol"] == "http"
            pattern = re.compile(metadata["queueName"])
            assert pattern.search(f"{prefix}iris")
            assert not pattern.search(Settings().broker.dead_letter_queue)
            auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == \
                {"username", "password"}
    if kustomization != "overlays/keda-rabbitmq":  # the default: both signals
        queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
        assert "modelfleet_fleet_desired_workers" in queries
        assert "modelfleet_worker_permits_in_use" in queries


def test_the_broker_is_a_rabbitmq_cluster_the_pods_read() -> None:
    docs = render("overlays/production")
    cluster = one(docs, "RabbitmqCluster", "modelfleet-rabbitmq")
    assert cluster["spec"]["replicas"] == 3  # quorum queues survive one node
    assert "default_queue_type = quorum" in cluster["spec"]["rabbitmq"]["additionalConfig"]
    for name in ("modelfleet-gateway", "modelfleet-worker"):
        env = {e["name"]: e for e in one(docs, "Deployment", name)["spec"]["template"]["spec"]
               ["containers"][0]["env"]}
        ref = env["MODELFLEET_BROKER"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{cluster['metadata']['name']}-default-user",
                       "key": "connection_string"}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_rabbitmq_nodes_are_sized_for_the_live_queues_the_pods_expect(
        kustomization: str) -> None:
    """README "The broker at scale": RabbitMQ counts 3 file handles per quorum queue
    against its descriptor limit and holds ~150 MB per 1,000; the pods warn at 80 % of
    broker.max_live_queues, so the node must hold that many with room to spare."""
    docs = render(kustomization)
    cluster = one(docs, "RabbitmqCluster", "modelfleet-rabbitmq")["spec"]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"].startswith("modelfleet-config")]
    max_live = int(config["data"].get("MODELFLEET_BROKER__MAX_LIVE_QUEUES",
                                      BrokerSettings().max_live_queues))
    (limit,) = re.findall(r"^ulimit -S -n (\d+)$", cluster["rabbitmq"]["envConfig"], re.M)
    assert int(limit) >= 3 * max_live + 10_000  # and room for connections, segments
    memory = cluster["resources"]["limits"]["memory"]
    assert memory.endswith("Gi"), memory
    watermark_mb = 0.4 * int(memory[:-2]) * 1024  # RabbitMQ's default relative watermark
    assert watermark_mb >= 100 + 150 * max_live / 1000 * 1.25, (memory, max_live)


def test_grafana_dashboard_names_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "modelfleet-fleet.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set().union(*map(metrics_in, exprs))
    assert used, "no metric in the dashboard"
    missing = used - exported_metrics()
    assert not missing, f"the Grafana dashboard names metrics modelfleet does not export: {missing}"
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    # The same panels as /dashboard: the fleet, the queues, the load-rate panel.
    for needed in ("Resident models against loads per minute", "Backlog by model",
                   "Oldest waiting", "Permits used / cap", "Desired workers"):
        assert needed.lower() in titles.lower(), needed


def test_the_gpu_pool_runs_one_runtime_per_device_on_gpu_nodes_only() -> None:
    docs = render("overlays/gpu-pool")
    pod = one(docs, "Deployment", "modelfleet-worker-gpu")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    with pytest.MonkeyPatch.context() as patch:  # what the worker itself makes of them
        for key, value in env.items():
            if value is not None:
                patch.setenv(key, value)
        worker = Settings().worker
    requested = container["resources"]["requests"]["nvidia.com/gpu"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == requested
    assert worker.gpus == int(requested) > 0  # declares the devices it gets
    assert worker.shared_runtimes == worker.gpus  # one runtime per device
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    assert container["image"] == one(docs, "Deployment", "modelfleet-worker")["spec"][
        "template"]["spec"]["containers"][0]["image"]  # one image for every role
    assert container["args"][0] == "worker"
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    # The CPU pool beside it declares no device: it never pulls a CUDA-only model.
    cpu = one(docs, "Deployment", "modelfleet-worker")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["requests"]
    assert "MODELFLEET_WORKER__GPUS" not in {e["name"] for e in cpu["containers"][0]["env"]}
    assert Settings().worker.gpus == 0
    scaled = one(docs, "ScaledObject", "modelfleet-worker-gpu")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "modelfleet-worker-gpu"
    assert scaled["spec"]["minReplicaCount"] >= 1  # from zero it could never scale up
    for trigger in scaled["spec"]["triggers"]:
        assert metrics_in(trigger["metadata"]["query"]) <= exported_metrics()
    pdb = one(docs, "PodDisruptionBudget", "modelfleet-worker-gpu")
    assert pdb["spec"]["selector"]["matchLabels"] == one(
        docs, "Deployment", "modelfleet-worker-gpu")["spec"]["selector"]["matchLabels"]
