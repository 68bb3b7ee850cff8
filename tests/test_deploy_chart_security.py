"""The Helm chart's security (issue 39), rendered by the real `helm`: NetworkPolicies on by
default, the lookup token and integrity key from Secrets the chart generates and keeps
across upgrades (Helm's `lookup`, answered by a stand-in API server), and least-privilege
MinIO users for vLLM and the GC.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import yaml

from support.deploy import (
    CHART,
    TOOL_TIMEOUT,
    arg_value,
)
from support.deploy_chart import (
    RELEASE,
    VARIANTS,
    by_name,
    env_names,
    helm_template,
    pod_spec,
    with_overrides,
)


def workload_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The main container of every workload, by workload name."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            found[doc["metadata"]["name"]] = pod_spec(doc)["containers"][0]
    return found


def env_sources(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Variable -> (Secret, key) for each variable read from a Secret."""
    return {
        item["name"]: (item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"])
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }


def secret_value(secrets: dict[str, dict[str, Any]], ref: tuple[str, str]) -> str:
    import base64

    name, key = ref
    assert name in secrets, f"Secret {name} is not rendered"
    return base64.b64decode(secrets[name]["data"][key]).decode()


def test_helm_default_network_policies_admit_only_the_release_and_named_peers(helm, tmp_path):
    """Issue 39, item 5: the NetworkPolicies are on by default."""
    docs = helm_template(helm, {}, tmp_path)
    policies = by_name(docs, "NetworkPolicy")
    assert set(policies) == {RELEASE, f"{RELEASE}-vllm", f"{RELEASE}-redis", f"{RELEASE}-minio"}
    release = {"app.kubernetes.io/name": "tiercache", "app.kubernetes.io/instance": RELEASE}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                assert peer["podSelector"]["matchLabels"] == release, peer
    # Named peers (a router's namespace) reach the service and vLLM only.
    router = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "routers"}}}
    docs = helm_template(helm, {"networkPolicy": {"ingressFrom": [router]}}, tmp_path)
    for name, policy in by_name(docs, "NetworkPolicy").items():
        peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
        assert (router in peers) == (name in (RELEASE, f"{RELEASE}-vllm")), name


def test_helm_lookup_token_and_integrity_key_come_from_generated_secrets(helm, tmp_path):
    """Issue 39, items 5 and 6: the service gets a lookup token, vLLM a 32+ character
    integrity key, each from a Secret the chart generates, and neither reaches the
    logged connector config."""
    from tiercache.config import build_config
    from tiercache.ops.service.auth import ServiceTokens

    docs = helm_template(helm, {}, tmp_path)
    secrets = by_name(docs, "Secret")
    containers = workload_containers(docs)
    service, vllm = containers[RELEASE], containers[f"{RELEASE}-vllm"]
    service_env = env_sources(service)
    assert service_env["TIERCACHE_LOOKUP_TOKEN"] == (f"{RELEASE}-lookup", "lookup-token")
    lookup_token = secret_value(secrets, service_env["TIERCACHE_LOOKUP_TOKEN"])
    admin_token = secret_value(secrets, service_env["TIERCACHE_ADMIN_TOKEN"])
    assert len(lookup_token) >= 32 and lookup_token != admin_token
    tokens = ServiceTokens.from_environment({"TIERCACHE_LOOKUP_TOKEN": lookup_token})
    assert not tokens.lookups_open

    ref = env_sources(vllm)["TIERCACHE_INTEGRITY_KEY"]
    assert ref == (f"{RELEASE}-integrity", "integrity-key")
    key = secret_value(secrets, ref)
    config = build_config({}, environ={"TIERCACHE_INTEGRITY_KEY": key})
    assert config.integrity_key_bytes() == key.encode() and len(key) >= 32
    # The service and its GC never read pages: no key for them.
    assert "TIERCACHE_INTEGRITY_KEY" not in env_names(service)
    assert "integrity" not in arg_value(vllm["args"], "--kv-transfer-config")
    # Per-namespace tokens: a named Secret, mounted where TIERCACHE_LOOKUP_TOKENS_DIR says.
    docs = helm_template(helm, VARIANTS["everything"], tmp_path)
    deployment = by_name(docs, "Deployment")[RELEASE]
    (container,) = pod_spec(deployment)["containers"]
    folder = {e["name"]: e.get("value") for e in container["env"]}["TIERCACHE_LOOKUP_TOKENS_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "tiercache-namespace-tokens"
    # Switched off, no key and no Secret.
    docs = helm_template(helm, {"tiercache": {"integrityKey": {"enabled": False}}}, tmp_path)
    assert f"{RELEASE}-integrity" not in by_name(docs, "Secret")
    assert all("TIERCACHE_INTEGRITY_KEY" not in env_names(c) for c in workload_containers(docs).values())


class LiveSecrets:
    """A stand-in for a cluster's API server, for `helm template --dry-run=server`: it
    answers version and discovery requests, serves the Secrets in `secrets` (name ->
    data) as this release's, and reports every other object absent. No Kubernetes API
    server can run here (no container runtime, no network), and this is what Helm's
    `lookup` reads on an upgrade."""

    CORE = {
        "secrets": "Secret",
        "configmaps": "ConfigMap",
        "services": "Service",
        "serviceaccounts": "ServiceAccount",
        "persistentvolumeclaims": "PersistentVolumeClaim",
        "persistentvolumes": "PersistentVolume",
    }
    GROUPS = {
        "apps/v1": {"deployments": "Deployment", "statefulsets": "StatefulSet"},
        "batch/v1": {"jobs": "Job"},
        "networking.k8s.io/v1": {"networkpolicies": "NetworkPolicy"},
        "storage.k8s.io/v1": {"storageclasses": "StorageClass"},
    }

    def __init__(self, secrets: dict[str, dict[str, str]], namespace: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body = api.answer(self.path.split("?")[0])
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.secrets, self.namespace = secrets, namespace
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def resources(group_version: str, kinds: dict[str, str]) -> dict[str, Any]:
        return {
            "kind": "APIResourceList",
            "groupVersion": group_version,
            "resources": [
                {
                    "name": name,
                    "singularName": "",
                    "namespaced": kind not in ("PersistentVolume", "StorageClass"),
                    "kind": kind,
                    "verbs": ["get", "list", "create", "update", "patch", "delete"],
                }
                for name, kind in kinds.items()
            ],
        }

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/version":
            return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = [
                {"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}]}
                for gv in self.GROUPS
            ]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        if path == "/api/v1":
            return 200, self.resources("v1", self.CORE)
        if path.startswith("/apis/") and path[len("/apis/") :] in self.GROUPS:
            return 200, self.resources(path[len("/apis/") :], self.GROUPS[path[len("/apis/") :]])
        prefix = f"/api/v1/namespaces/{self.namespace}/secrets/"
        if path.startswith(prefix) and path[len(prefix) :] in self.secrets:
            metadata = {
                "name": path[len(prefix) :],
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": RELEASE,
                    "meta.helm.sh/release-namespace": self.namespace,
                },
            }
            return 200, {
                "kind": "Secret",
                "apiVersion": "v1",
                "metadata": metadata,
                "data": self.secrets[metadata["name"]],
            }
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_helm_generated_secrets_are_kept_across_upgrades(helm, tmp_path):
    """Issue 39, items 5 and 6: every generated secret (tokens, integrity key, MinIO
    users) is read back from the live Secret on upgrade (Helm's `lookup`), so running
    pods keep working; a key missing from a live Secret is generated."""

    def render(secrets: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        api = LiveSecrets(secrets, "kv")
        try:
            result = subprocess.run(
                [
                    helm,
                    "template",
                    RELEASE,
                    str(CHART),
                    "--namespace",
                    "kv",
                    "--dry-run=server",
                    "--disable-openapi-validation",
                    "--kube-apiserver",
                    api.url,
                ],
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT,
                env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")},
            )
        finally:
            api.close()
        assert result.returncode == 0, result.stderr
        docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return {name: doc["data"] for name, doc in by_name(docs, "Secret").items()}

    installed = render({})
    expected = {
        f"{RELEASE}-{suffix}" for suffix in ("s3", "admin", "lookup", "integrity", "s3-vllm", "s3-gc")
    }
    assert set(installed) == expected
    assert render({}) != installed  # a fresh install generates new values ...
    assert render(installed) == installed  # ... an upgrade keeps the live ones
    partial = {name: dict(data) for name, data in installed.items()}
    del partial[f"{RELEASE}-lookup"]
    upgraded = render(partial)
    assert upgraded[f"{RELEASE}-admin"] == installed[f"{RELEASE}-admin"]
    assert upgraded[f"{RELEASE}-lookup"] != installed[f"{RELEASE}-lookup"]


def test_helm_minio_users_are_least_privilege(helm, tmp_path):
    """Issue 39, item 6: with the bundled MinIO, only MinIO and its bucket Job get the
    root credentials; vLLM gets a user that may get and put objects under the prefix,
    the service (the GC) one that may also delete them and list the bucket."""
    docs = helm_template(helm, {}, tmp_path)
    secrets = by_name(docs, "Secret")
    containers = workload_containers(docs)
    root = f"{RELEASE}-s3"
    for name, container in containers.items():
        uses_root = any(secret == root for secret, _ in env_sources(container).values())
        assert uses_root == (name in (f"{RELEASE}-minio", f"{RELEASE}-minio-bucket")), name
    users = {
        "vllm": env_sources(containers[f"{RELEASE}-vllm"]),
        "gc": env_sources(containers[RELEASE]),
    }
    job = containers[f"{RELEASE}-minio-bucket"]
    job_env = env_sources(job)
    policies = {e["name"]: json.loads(e["value"]) for e in job["env"] if e["name"].endswith("_POLICY")}
    prefix = "arn:aws:s3:::tiercache-kv/prod/*"
    granted = {}
    for user, env in users.items():
        assert env["AWS_ACCESS_KEY_ID"] == (f"{RELEASE}-s3-{user}", "AWS_ACCESS_KEY_ID")
        access_key = secret_value(secrets, env["AWS_ACCESS_KEY_ID"])
        secret_key = secret_value(secrets, env["AWS_SECRET_ACCESS_KEY"])
        assert len(secret_key) >= 32 and access_key.startswith(f"tiercache-{user}-")
        # The Job creates exactly this user, from the same Secret.
        assert job_env[f"{user.upper()}_ACCESS_KEY_ID"] == env["AWS_ACCESS_KEY_ID"]
        assert job_env[f"{user.upper()}_SECRET_ACCESS_KEY"] == env["AWS_SECRET_ACCESS_KEY"]
        granted[user] = {
            (action, resource)
            for statement in policies[f"{user.upper()}_POLICY"]["Statement"]
            for action in statement["Action"]
            for resource in statement["Resource"]
            if statement["Effect"] == "Allow"
        }
    assert granted["vllm"] == {("s3:GetObject", prefix), ("s3:PutObject", prefix)}
    assert granted["gc"] == granted["vllm"] | {
        ("s3:DeleteObject", prefix),
        ("s3:ListBucket", "arn:aws:s3:::tiercache-kv"),
        ("s3:GetBucketLocation", "arn:aws:s3:::tiercache-kv"),
    }
    script = job["command"][-1]
    for user in ("vllm", "gc"):
        variable = user.upper()
        call = f'add_user tiercache-{user}-policy "${variable}_ACCESS_KEY_ID" "${variable}_SECRET_ACCESS_KEY"'
        assert call in script
    for step in ("admin policy create", "admin user add", "admin policy attach"):
        assert step in script
    # An external store: the pods share the given credentials, and no users are made ...
    docs = helm_template(helm, VARIANTS["external"], tmp_path)
    for name in (RELEASE, f"{RELEASE}-vllm"):
        assert env_sources(workload_containers(docs)[name])["AWS_ACCESS_KEY_ID"][0] == "aws-creds"
    assert not {f"{RELEASE}-s3-vllm", f"{RELEASE}-s3-gc"} & set(by_name(docs, "Secret"))
    # ... unless the service (the GC) is given its own.
    external = with_overrides(VARIANTS["external"], {"s3Credentials": {"gcExistingSecret": "aws-gc-creds"}})
    containers = workload_containers(helm_template(helm, external, tmp_path))
    assert env_sources(containers[RELEASE])["AWS_SECRET_ACCESS_KEY"] == (
        "aws-gc-creds",
        "AWS_SECRET_ACCESS_KEY",
    )
    assert env_sources(containers[f"{RELEASE}-vllm"])["AWS_SECRET_ACCESS_KEY"][0] == "aws-creds"
