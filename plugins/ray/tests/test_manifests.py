"""The deployment files in deploy/ are checked as a cluster would check them, since none is reachable here: the
Serve config files by Ray Serve's own schema and leat's options; the KubeRay manifest by KubeRay's RayService CRD
schema (deploy/kuberay/rayservice.schema.json.gz, from KubeRay's repository: scripts/kuberay_schema.py), with
unknown fields refused as ``kubectl apply --validate=strict`` refuses them, and its serveConfigV2 as a config file."""

import copy
import gzip
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from leat.cli import cli
from leat.errors import LeatError
from leat_ray.config import check_config, read_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFEST = DEPLOY / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def crd_schema():
    document = json.loads(gzip.decompress((DEPLOY / "kuberay" / "rayservice.schema.json.gz").read_bytes()))
    assert document["kind"] == "RayService"
    return document["schema"]


def unknown_fields(value, schema, where="") -> list[str]:
    """Paths of the fields ``schema`` does not declare (Kubernetes prunes them silently; strict validation
    refuses them): an object with ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields`` declares only those."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in schema["properties"]:
                found += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
            elif not schema.get("additionalProperties") and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{where}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_fields(item, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{where}[{i}]")
    return found


def problems(manifest, crd_schema) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    errors += [f"{path}: unknown field" for path in unknown_fields(manifest, crd_schema)]
    if (manifest.get("apiVersion"), manifest.get("kind")) != ("ray.io/v1", "RayService"):
        errors.append("not a ray.io/v1 RayService")
    return errors


def test_the_kuberay_manifest_is_a_valid_rayservice(crd_schema):
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert problems(manifest, crd_schema) == []
    check_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]), "serveConfigV2")


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParam"), {}, "unknown field"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"), "one", "is not of type 'integer'"),
        (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "imagee"), "x", "unknown"),
        (
            ("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0),
            {"image": "x"},
            "'name'",
        ),
    ],
)
def test_the_schema_check_refuses_a_broken_manifest(crd_schema, path, value, complaint):
    manifest = copy.deepcopy(yaml.safe_load(MANIFEST.read_text()))
    target = manifest
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    assert any(complaint in p for p in problems(manifest, crd_schema)), problems(manifest, crd_schema)


@pytest.mark.parametrize("name", ["serve-config.yaml", "serve-config.gpu.yaml"])
def test_the_serve_config_files_are_valid(name):
    document = read_config(DEPLOY / name)
    (application,) = document["applications"]
    assert application["import_path"] == "leat_ray:app"


def test_the_manifest_and_the_gpu_config_deploy_the_same_application():
    manifest = yaml.safe_load(MANIFEST.read_text())
    inside = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]
    gpu = yaml.safe_load((DEPLOY / "serve-config.gpu.yaml").read_text())["applications"][0]
    assert inside["args"] == gpu["args"]


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda a: a["args"].update(batchsize=8), "args.batchsize is not a leat option"),
        (lambda a: a["args"].update(api_workers=2), "does not apply on Ray Serve"),
        (lambda a: a["args"].update(batch_size="eight"), "Expected `int`"),
        (lambda a: a["args"].pop("model"), "need 'model'"),
        (lambda a: a["deployments"][0].update(name="Replica"), "has no deployment 'Replica'"),
        (lambda a: a["deployments"][0].update(num_replicas="two"), "not a valid Ray Serve config"),
        (lambda a: a["args"].update(port=8001), "must be where Serve listens"),
        (lambda a: a["args"].update(host="0.0.0.0"), "refusing to serve on 0.0.0.0 without API keys"),
    ],
)
def test_a_bad_config_is_refused_with_what_is_wrong(change, complaint):
    document = yaml.safe_load((DEPLOY / "serve-config.yaml").read_text())
    change(document["applications"][0])
    with pytest.raises(LeatError, match=complaint):
        check_config(document)


def test_leat_ray_check_prints_what_a_config_deploys(tmp_path):
    result = CliRunner().invoke(cli, ["ray", "check", str(DEPLOY / "serve-config.yaml")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["applications"][0]["deployments"]["LeatReplica"]["num_replicas"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [{name: leat, import_path: leat_ray:app, args: {model: m, kv: [1]}}]\n")
    result = CliRunner().invoke(cli, ["ray", "check", str(bad)])
    assert isinstance(result.exception, LeatError) and "args.kv" in str(
        result.exception
    )  # main() prints it as one line
