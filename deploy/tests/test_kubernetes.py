"""deploy/kubernetes: every manifest is a valid Kubernetes object (kubernetes-validate, against the API's own
schemas, offline and strict: an unknown field fails), the objects name each other consistently, and what they
say about textgen holds against a real launcher: the probes' paths answer, liveness does not wait on a shard,
the grace period outlasts the launcher's drain, and the autoscaler's metric is one the router exports."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from testing.launcher import LauncherProcess
from textgen_launcher.args import parse_args

DEPLOY = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes release still maintained when these were written, and the newest the package knows.
VERSIONS = ("1.32.0", kubernetes_validate.latest_version())


def objects() -> dict[str, dict[str, Any]]:
    """Every object of deploy/kubernetes by kind (one of each)."""
    found: dict[str, dict[str, Any]] = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"two {doc['kind']} objects"
            found[doc["kind"]] = doc
    return found


def container() -> dict[str, Any]:
    (only,) = objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_fails_validation() -> None:
    deployment = objects()["Deployment"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 120
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_the_objects_name_each_other() -> None:
    found = objects()
    assert {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler", "ConfigMap"} <= set(found)
    deployment = found["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert found["Service"]["spec"]["selector"].items() <= pod_labels.items()
    (port,) = container()["ports"]
    assert {p["targetPort"] for p in found["Service"]["spec"]["ports"]} == {port["name"]}
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == found["PersistentVolumeClaim"]["metadata"]["name"]
    assert {m["mountPath"] for m in container()["volumeMounts"]} == {"/data"}
    target = found["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def test_the_ports_are_the_images() -> None:
    # The image listens on PORT=80 (Dockerfile), and /metrics is on the serving port.
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    image_port = int(re.search(r"\bPORT=(\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    assert f"EXPOSE {image_port}" in dockerfile
    (port,) = container()["ports"]
    assert port["containerPort"] == image_port
    annotations = objects()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(image_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container()[probe]["httpGet"]["port"] == port["name"]


def test_the_grace_period_outlasts_the_launchers_drain() -> None:
    args = container()["args"]
    flag = "--graceful-termination-timeout"
    drain = (
        int(args[args.index(flag) + 1])
        if flag in args
        else parse_args(["--model-id", "m"]).graceful_termination_timeout
    )
    grace = objects()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # the router drains for `drain` seconds, then the shards get their SIGTERM and need a few seconds more
    assert grace >= drain + 15


def test_the_container_args_are_launcher_flags() -> None:
    args = parse_args(container()["args"])
    assert args.model_id and args.dtype == "bfloat16"


def test_the_probes_answer_on_a_running_launcher(llama_server: LauncherProcess) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container()[probe]
        timeout = spec.get("timeoutSeconds", 1)
        response = httpx.get(llama_server.base_url + spec["httpGet"]["path"], timeout=timeout)
        assert response.status_code == 200, probe


def test_liveness_does_not_wait_on_a_busy_shard(llama_server: LauncherProcess) -> None:
    # A stopped shard answers nothing, as one inside a long prefill does until the forward ends: the readiness
    # probe waits on it (the replica leaves the Service meanwhile), the liveness probe must not (no restart).
    liveness, readiness = container()["livenessProbe"], container()["readinessProbe"]
    shards = llama_server.shard_pids()
    for pid in shards:
        os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.get(llama_server.base_url + readiness["httpGet"]["path"], timeout=1.0)
        for _ in range(liveness["failureThreshold"]):
            response = httpx.get(
                llama_server.base_url + liveness["httpGet"]["path"], timeout=liveness["timeoutSeconds"]
            )
            assert response.status_code == 200
    finally:
        for pid in shards:
            os.kill(pid, signal.SIGCONT)
    assert httpx.get(llama_server.base_url + readiness["httpGet"]["path"], timeout=30).status_code == 200


def test_the_scrape_and_the_autoscaler_read_a_metric_the_router_exports(llama_server: LauncherProcess) -> None:
    found = objects()
    annotations = found["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    # the router exports a series once it has been set, as TGI's does: after the first request
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
    assert httpx.post(llama_server.base_url + "/generate", json=body, timeout=60).status_code == 200
    scrape = httpx.get(llama_server.base_url + annotations["prometheus.io/path"], timeout=10)
    assert scrape.status_code == 200
    exported = {re.split(r"[{ ]", line)[0] for line in scrape.text.splitlines() if not line.startswith("#")}
    (metric,) = found["HorizontalPodAutoscaler"]["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    (rule,) = yaml.safe_load(found["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == name
    series = rule["seriesQuery"].split("{")[0].strip("'")
    assert series == "tgi_queue_size" and series in exported
    # the adapter maps the series to pods through the labels Prometheus' pod scrape adds
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
