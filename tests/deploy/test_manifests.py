"""deploy/kubernetes: every manifest valid against the Kubernetes API schemas, offline, and the
references between them right.

The schemas are kubernetes-validate's (a dev dependency that carries them, so nothing is fetched),
in strict mode: an unknown or misspelt field fails as a wrong type does. The base is read from the
files its kustomization.yaml lists; the CPU overlay, whose strategic-merge patch only kustomize can
apply, is rendered by `kubectl kustomize` (client-side, offline) and skipped where kubectl is not
installed. The references are what no schema sees: selectors against pod labels, probes against
the served port, the mounted ConfigMap and Secret keys, the grace period against drain_s, the
preStop and the container commands against the CLI, and the ConfigMap's talaria.toml against
`talaria config check`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from talaria.cli.main import cli
from talaria.config.loader import default_config_path, load_config, parse_config

K8S_VERSION = "1.32"  # the Kubernetes API the manifests are validated against (kubectl here is 1.32)
ALSO = ("1.29", "1.37")  # the oldest still in common use, and the newest kubernetes-validate carries
DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
BASE = DEPLOY / "base"


def base_resources() -> list[dict]:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [d for name in listed for d in yaml.safe_load_all((BASE / name).read_text()) if d]


def rendered(folder: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the CPU overlay's patch needs kustomize to apply it")
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    [found] = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    return found


def example_secret() -> dict:
    return yaml.safe_load((BASE / "secret.example.yaml").read_text())


class Node:
    """The StatefulSet's pod as the tests read it: its one container, its config and its commands."""

    def __init__(self, resources: list[dict], secret: dict, scratch: Path) -> None:
        self.resources = resources
        self.set = one(resources, "StatefulSet")
        self.pod = self.set["spec"]["template"]
        self.labels = self.pod["metadata"]["labels"]
        [self.container] = self.pod["spec"]["containers"]
        self.ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.secret = secret
        command = self.container["command"]
        assert command[:2] == ["talaria", "up"], command
        self.config_path, text = self._mounted_config(command[2:])
        self.config = parse_config(text, self.config_path) if self.config_path else load_config(default_config_path())
        # the CLI takes these arguments (the config file written where the test can read it: click checks it exists)
        (scratch / "talaria.toml").write_text(text or "")
        args = [str(scratch / "talaria.toml") if a == str(self.config_path) else a for a in command[2:]]
        self.up = cli.commands["up"].make_context("up", args)
        self.pre_stop = self.container["lifecycle"]["preStop"]["exec"]["command"]

    def _mounted_config(self, args: list[str]) -> tuple[Path | None, str | None]:
        """The file `--config` names, read through the ConfigMap item mounted there; (None, None)
        without --config: the embedded default."""
        if "--config" not in args:
            return None, None
        path = args[args.index("--config") + 1]
        mount = next(m for m in self.container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in self.pod["spec"]["volumes"] if v["name"] == mount["name"])
        item = next(i for i in volume["configMap"]["items"] if f"{mount['mountPath']}/{i['path']}" == path)
        configmap = one(self.resources, "ConfigMap", volume["configMap"]["name"])
        return Path(path), configmap["data"][item["key"]]

    def matches(self, selector: dict) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Node:
    return Node(base_resources(), example_secret(), tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory) -> Node:
    resources = rendered(DEPLOY / "overlays" / "cpu")
    return Node(resources, one(resources, "Secret"), tmp_path_factory.mktemp("cpu"))


@pytest.mark.parametrize("version", [K8S_VERSION, *ALSO])
def test_every_manifest_is_valid_kubernetes_offline(version: str):
    resources = [*base_resources(), example_secret()]
    assert {r["kind"] for r in resources} == {"ConfigMap", "Secret", "StatefulSet", "Service", "PodDisruptionBudget",
                                              "NetworkPolicy"}
    for r in resources:
        assert kubernetes_validate.validate(r, version, strict=True) == version, r["metadata"]["name"]


def test_the_cpu_overlay_renders_to_valid_kubernetes(cpu: Node):
    for r in cpu.resources:
        assert kubernetes_validate.validate(r, K8S_VERSION, strict=True) == K8S_VERSION, r["metadata"]["name"]


def test_a_schema_violation_is_caught():
    """The validation bites: a misspelt probe and a port written as text both fail."""
    s = one(base_resources(), "StatefulSet")
    container = s["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(s, K8S_VERSION, strict=True)


def test_selectors_match_the_pod_labels(base: Node):
    set_, resources = base.set, base.resources
    assert base.matches(set_["spec"]["selector"]["matchLabels"])
    for service in (one(resources, "Service", "talaria"), one(resources, "Service", "talaria-peers")):
        assert base.matches(service["spec"]["selector"]), service["metadata"]["name"]
    assert base.matches(one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    [term] = base.pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert base.matches(term["labelSelector"]["matchLabels"]) and term["topologyKey"] == "kubernetes.io/hostname"


def test_the_pods_find_each_other_through_the_headless_service_on_the_peer_port(base: Node):
    peers = one(base.resources, "Service", "talaria-peers")
    assert peers["spec"]["clusterIP"] == "None" and not peers["spec"].get("publishNotReadyAddresses")
    assert base.set["spec"]["serviceName"] == "talaria-peers"
    [port] = peers["spec"]["ports"]
    server, router = base.config.server, base.config.router
    assert base.ports[port["targetPort"]] == server.peer_port and port["port"] == server.peer_port
    name, _, dns_port = router.peer_dns.rpartition(":")
    assert name.split(".")[0] == "talaria-peers" and int(dns_port) == server.peer_port
    [client] = one(base.resources, "Service", "talaria")["spec"]["ports"]
    assert base.ports[client["targetPort"]] == server.port == base.ports["http"]
    assert server.host == "0.0.0.0"  # the pod's own address, not loopback


def test_only_the_sets_pods_reach_the_peer_port(base: Node):
    policy = one(base.resources, "NetworkPolicy")
    assert base.matches(policy["spec"]["podSelector"]["matchLabels"]) and policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert set(rules) == {base.config.server.port, base.config.server.peer_port}
    [peers_only] = rules[base.config.server.peer_port]
    assert set(peers_only) == {"podSelector"} and base.matches(peers_only["podSelector"]["matchLabels"])


@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_probes_hit_the_served_port(overlay: str, request):
    node: Node = request.getfixturevalue(overlay)
    c = node.container
    for probe in ("startupProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and node.ports[get["port"]] == node.config.server.port, probe
    live = c["livenessProbe"]["httpGet"]  # answered by the event loop alone: a long switch cannot trip it
    assert live["path"] == "/metrics" and node.ports[live["port"]] == node.config.server.port
    assert c["readinessProbe"]["periodSeconds"] * c["readinessProbe"]["failureThreshold"] <= 15  # within --settle-s


def test_a_startup_probe_waits_long_enough_for_100b_weights(base: Node):
    probe = base.container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30 * 60


@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_the_grace_period_covers_the_prestop_drain_and_sigterms_drain_s(overlay: str, request):
    node: Node = request.getfixturevalue(overlay)
    drain = cli.commands["drain"].make_context("drain", list(node.pre_stop[2:]))  # the CLI takes these arguments
    assert node.pre_stop[:2] == ["talaria", "drain"], node.pre_stop
    assert drain.params["url"] == f"http://127.0.0.1:{node.config.server.port}"  # the client port: admin is there
    settle, drain_s = drain.params["settle_s"], node.config.server.drain_s
    grace = node.pod["spec"]["terminationGracePeriodSeconds"]
    # preStop waits at most max(settle, drain_s); SIGTERM then gives calls in flight drain_s more
    assert grace > max(settle, drain_s) + drain_s > drain_s, (grace, settle, drain_s)


@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_every_secret_key_the_pod_reads_exists(overlay: str, request):
    node: Node = request.getfixturevalue(overlay)
    keys = set(node.secret.get("stringData") or node.secret.get("data"))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in node.container["env"] if "valueFrom" in e}
    assert set(refs) == {"TALARIA_API_KEY", "TALARIA_ADMIN_KEY", "TALARIA_PEER_KEY"}  # what `talaria up` reads
    for env, ref in refs.items():
        assert ref["name"] == node.secret["metadata"]["name"] and ref["key"] in keys, env
    envvars = {p.envvar for p in cli.commands["up"].params if p.envvar}
    assert set(refs) <= envvars


def test_the_configmap_key_mounted_is_the_file_talaria_up_reads(base: Node):
    assert base.config_path == base.config.path == Path("/etc/talaria/talaria.toml")  # the mounted item's file
    assert base.up.params["config_path"] is not None


def test_the_configmaps_talaria_toml_passes_talaria_config_check(base: Node, tmp_path):
    configmap = one(base.resources, "ConfigMap", "talaria-config")
    path = tmp_path / "talaria.toml"
    path.write_text(configmap["data"]["talaria.toml"])
    result = CliRunner().invoke(cli, ["config", "check", str(path)])
    assert result.exit_code == 0 and result.output.rstrip().endswith("OK"), result.output
    cold = base.config.instances[0]
    assert cold.tp == int(base.container["resources"]["limits"]["nvidia.com/gpu"]) == 8


def test_a_pod_has_eight_gpus_a_memory_backed_shm_and_its_model_cache_on_a_volume(base: Node):
    spec, c = base.pod["spec"], base.container
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 8
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claims = {t["metadata"]["name"] for t in base.set["spec"]["volumeClaimTemplates"]}
    cache = next(e["value"] for e in c["env"] if e["name"] == "TALARIA_CACHE_DIR")
    models = next(path for path, name in mounts.items() if name in claims)
    assert cache.startswith(models + "/")
    assert all(m.source.startswith(models + "/") for m in base.config.models)  # the weights are on it too


def test_the_cpu_overlay_runs_the_embedded_default_config_without_gpus(cpu: Node):
    c = cpu.container
    assert cpu.config_path is None and cpu.up.params["config_path"] is None and cpu.up.params["host"] == "0.0.0.0"
    assert "nvidia.com/gpu" not in str(c["resources"]) and "affinity" not in cpu.pod["spec"]
    assert cpu.set["spec"]["replicas"] == 1
    assert shlex.join(c["command"]) == "talaria up --host 0.0.0.0"
