"""Write deploy/kuberay/rayservice.schema.json.gz, the RayService CRD's v1 OpenAPI schema, from a KubeRay checkout:

    python plugins/ray/scripts/kuberay_schema.py KUBERAY/ray-operator/config/crd/bases/ray.io_rayservices.yaml

tests/test_manifests.py validates the manifests in deploy/kuberay against it (no cluster is reachable in CI)."""

import gzip
import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "deploy" / "kuberay" / "rayservice.schema.json.gz"


def main(crd_path: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    document = {"source": Path(crd_path).name, "kind": crd["spec"]["names"]["kind"], "schema": schema}
    OUT.write_bytes(gzip.compress(json.dumps(document, sort_keys=True, separators=(",", ":")).encode(), mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
