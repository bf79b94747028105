"""Rendering and validating the Helm chart in deploy/helm/userdp, without a cluster.

The chart is rendered by Helm's own engine (the ``helm-python-sdk`` package binds Helm v4's Go
SDK; no ``helm`` binary needed) and every object is validated against the Kubernetes OpenAPI
schemas bundled by ``kubernetes-validate``. Both are in the ``[dev]`` extra; a test that needs one fails, naming
it, when it is not installed. ``kubectl apply --dry-run=client`` runs against a stand-in API server
(discovery only, see :class:`_DiscoveryServer`) and is skipped when no ``kubectl`` is installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "userdp"
RELEASE = "demo"
NAMESPACE = "userdp-test"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema bundled.
KUBE_VERSIONS = ("1.28", "1.37")


class Rendered(list):
    """The rendered objects, with look-ups by kind and name; the manifest text Helm rendered
    (every YAML template, as ``helm template`` prints them) and the rendered NOTES.txt."""

    manifest: str = ""
    notes: str = ""

    def find(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        """The one object of ``kind`` whose name ends with ``name_suffix``."""
        matches = [
            o for o in self if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)
        ]
        assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {len(matches)}"
        return matches[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self)

    @staticmethod
    def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
        return obj["spec"]["template"]["spec"]

    @staticmethod
    def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
        (match,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        return match


def _need(module: str, package: str) -> None:
    # Fail, not skip: the test command installs [dev], so a missing package is a broken install
    # that would otherwise turn every chart check into a silent skip.
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{package} is not installed; install userdp's [dev] extra")


@pytest.fixture
def render_chart() -> Callable[..., Rendered]:
    """``render(values=None, release=RELEASE) -> [object, ...]`` with Helm's template engine."""
    _need("helm_python", "helm-python-sdk (Helm's template engine)")
    import helm_python

    def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> Rendered:
        with helm_python.Chart.load(str(CHART_DIR)) as chart:
            files = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
        objects = Rendered()
        objects.notes = files.get(f"{CHART_DIR.name}/templates/NOTES.txt", "")
        for path, text in sorted(files.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            objects.manifest += f"---\n# Source: {path}\n{text}\n"
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return objects

    return render


@pytest.fixture
def validate_k8s() -> Callable[[dict[str, Any]], None]:
    """Validate one object against the Kubernetes OpenAPI schemas (strict: unknown fields fail)."""
    _need("kubernetes_validate", "kubernetes-validate (Kubernetes OpenAPI schemas)")
    import kubernetes_validate

    def validate(obj: dict[str, Any]) -> None:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)

    return validate


class _DiscoveryServer:
    """What ``kubectl apply --dry-run=client`` asks of an API server, for one Kubernetes version.

    A client dry run sends nothing that changes the cluster; it needs the server's version, the
    API discovery (which kinds exist in which group/version, to map each object to a resource:
    an unknown kind or apiVersion fails there), the OpenAPI document (served empty, so kubectl's
    own schema pass finds nothing to check; kubernetes-validate checks the schemas, strictly) and
    a GET of each object (404: kubectl reports it as created). The kinds are those of the
    kubernetes-validate schemas of ``version``.
    """

    def __init__(self, version: str) -> None:
        import kubernetes_validate

        folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
        definitions = json.loads(
            (folder / f"v{version}.0-local" / "_definitions.json").read_text()
        )["$defs"]
        kinds: dict[str, set[str]] = {}
        for schema in definitions.values():
            properties = schema.get("properties", {})
            api_version = properties.get("apiVersion", {}).get("enum")
            kind = properties.get("kind", {}).get("enum")
            if api_version and kind and not kind[0].endswith("List"):
                kinds.setdefault(api_version[0], set()).add(kind[0])
        major, minor = version.split(".")
        routes: dict[str, Any] = {
            "/version": {"major": major, "minor": minor, "gitVersion": f"v{version}.0"},
            "/api": {"kind": "APIVersions", "versions": ["v1"]},
        }
        groups: dict[str, list[str]] = {}
        for group_version, names in kinds.items():
            group, _, _ = group_version.rpartition("/")
            prefix = f"/apis/{group_version}" if group else f"/api/{group_version}"
            routes[prefix] = {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": group_version,
                "resources": [
                    {"name": _plural(k), "namespaced": True, "kind": k, "verbs": ["get", "patch"]}
                    for k in sorted(names)
                ],
            }
            if group:
                groups.setdefault(group, []).append(group_version)
        routes["/apis"] = {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": group,
                    "versions": [
                        {"groupVersion": gv, "version": gv.rpartition("/")[2]} for gv in gvs
                    ],
                    "preferredVersion": {"groupVersion": gvs[0], "version": gvs[0].split("/")[1]},
                }
                for group, gvs in sorted(groups.items())
            ],
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path == "/openapi/v2":  # an empty protobuf document
                    return self._send(
                        200, b"", "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
                    )
                if path in routes:
                    return self._send(200, json.dumps(routes[path]).encode(), "application/json")
                status = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                    "message": f"{path} not found",
                }
                self._send(404, json.dumps(status).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    return re.sub(r"y$", "ie", lower) + "s"


@pytest.fixture(scope="session")
def kubectl_dry_run(tmp_path_factory) -> Iterator[Callable[[list[dict[str, Any]]], list[str]]]:
    """``apply(objects) -> [stdout, ...]``: Helm's rendered manifest (of a :class:`Rendered`; other
    objects are dumped as YAML) applied with ``kubectl apply --dry-run=client -f FILE`` against a
    stand-in API server of every supported Kubernetes version (:class:`_DiscoveryServer`); fails
    with kubectl's message, else gives kubectl's output for each version. Skips when ``kubectl``
    is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    _need("kubernetes_validate", "kubernetes-validate (Kubernetes OpenAPI schemas)")
    root = tmp_path_factory.mktemp("kubectl")
    servers = {version: _DiscoveryServer(version) for version in KUBE_VERSIONS}
    counter = iter(range(1 << 30))

    def apply(objects: list[dict[str, Any]]) -> list[str]:
        manifest = root / f"rendered-{next(counter)}.yaml"
        text = getattr(objects, "manifest", "") or yaml.safe_dump_all(list(objects))
        manifest.write_text(text)
        outputs = []
        for version, server in servers.items():
            kubeconfig = root / f"kubeconfig-{version}"
            kubeconfig.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "stub", "cluster": {"server": server.url}}],
                        "contexts": [
                            {"name": "stub", "context": {"cluster": "stub", "namespace": NAMESPACE}}
                        ],
                        "current-context": "stub",
                        "users": [],
                    }
                )
            )
            argv = [kubectl, "apply", "--dry-run=client", "-f", str(manifest)]
            argv += ["--kubeconfig", str(kubeconfig), "--cache-dir", str(root / f"cache-{version}")]
            result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, (
                f"kubectl apply --dry-run=client (Kubernetes {version} discovery) failed:\n"
                f"{result.stderr}"
            )
            outputs.append(result.stdout)
        return outputs

    try:
        yield apply
    finally:
        for server in servers.values():
            server.close()
