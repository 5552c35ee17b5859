"""deploy/: supervisord starts a broker, two workers and the HTTP gateway; a
job runs through them; stopping supervisord stops everything. The container
image, Compose file and Kubernetes manifests are validated offline (below)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client
from tests.support.cluster import free_port
from tests.support.reference import simulated_references
from tests.support.waits import Deadline, wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SUPERVISORD = shutil.which("supervisord", path=str(BIN)) or shutil.which("supervisord")

needs_supervisord = pytest.mark.skipif(
    SUPERVISORD is None or shutil.which("slotserve", path=str(BIN)) is None,
    reason="needs supervisord and the slotserve command (pip install -e '.[dev]')")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@needs_supervisord
def test_supervisord_runs_broker_two_workers_and_the_gateway(tmp_path):
    front_port, back_port, http_port = free_port(), free_port(), free_port()
    front, back = f"tcp://127.0.0.1:{front_port}", f"tcp://127.0.0.1:{back_port}"
    env = dict(os.environ, SLOTSERVE_RUN_DIR=str(tmp_path), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               SLOTSERVE_BROKER_FRONTEND=front, SLOTSERVE_BROKER_BACKEND=back, SLOTSERVE_WORKER_BROKER=back,
               SLOTSERVE_WORKER_SLOTS="3", SLOTSERVE_SERVE_BROKER=front, SLOTSERVE_SERVE_PORT=str(http_port))
    proc = subprocess.Popen([SUPERVISORD, "-c", str(ROOT / "deploy" / "supervisord.conf")], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        gateway_deadline = Deadline(120)  # the cluster within 60 s, its gateway within 120

        def cluster_up():
            assert proc.poll() is None, (tmp_path / "supervisord.log").read_text()
            try:
                with Client(front, connect_timeout_s=0.5) as c:
                    st = c.status()
            except Exception:  # noqa: BLE001 -- not up yet
                return None
            return st if "simulated" in st.models and st.models["simulated"].workers == 2 else None
        st = wait_until(cluster_up, 60, "the supervisord cluster to come up")
        names = sorted(w.name for w in st.workers)
        assert names == ["worker-0", "worker-1"] and st.models["simulated"].slots_total == 6

        rows = [{"id": i, "prompt": [i + 1, 2], "max_tokens": 1 + i % 9} for i in range(50)]
        inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = subprocess.run([str(BIN / "slotserve"), "run", str(inp), "-o", str(outp), "--broker", front,
                              "--no-progress"], capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0, run.stderr
        ends = simulated_references([(r["prompt"], r["max_tokens"], {}) for r in rows], batch_size=4)
        got = {json.loads(line)["id"]: json.loads(line) for line in outp.read_text().splitlines()}
        assert {k: (v["tokens"], v["finish_reason"]) for k, v in got.items()} == \
            {r["id"]: (tokens, reason.value) for r, (tokens, reason) in zip(rows, ends)}

        httpx = pytest.importorskip("httpx")
        url = f"http://127.0.0.1:{http_port}"

        def healthy():
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(healthy, gateway_deadline.left_s(), "the gateway to become healthy")
        r = httpx.post(url + "/v1/completions", json={"model": "simulated", "prompt": rows[7]["prompt"],
                                                      "max_tokens": rows[7]["max_tokens"]}, timeout=30)
        assert r.json()["choices"][0]["token_ids"] == got[7]["tokens"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:  # the test failed: stop supervisord's programs too (SIGKILL would orphan them)
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert port_free(front_port) and port_free(back_port) and port_free(http_port)  # the children are gone too
    assert "registered" in (tmp_path / "supervisord.log").read_text() or (tmp_path / "broker.log").exists()


# ---------------------------------------------------------------------- container image, Compose, Kubernetes
# No container engine runs here: the files are checked against the schemas
# their tools use (shipped inside PyPI packages, so offline), and every
# command and SLOTSERVE_* variable in them is parsed by the real CLI.

DEPLOY = ROOT / "deploy"


def _yaml_docs(path: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _k8s_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in _yaml_docs(p)]


def test_kubernetes_manifests_match_the_api_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    docs = _k8s_docs()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in docs)
    assert kinds == [("Deployment", "slotserve-broker"), ("Deployment", "slotserve-gateway"),
                     ("Deployment", "slotserve-worker"), ("Secret", "slotserve-api-key"),
                     ("Secret", "slotserve-curve"), ("Service", "slotserve-broker"), ("Service", "slotserve-gateway")]
    for name, d in docs:
        kv.validate(d, kv.latest_version(), strict=True)  # raises ValidationError naming the bad field
    bad = dict(next(d for _, d in docs if d["kind"] == "Service"), spec={"ports": [{"port": "eighty"}]})
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def _compose_schema() -> dict:
    pytest.importorskip("check_jsonschema")
    from importlib.resources import files

    return json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())


def test_compose_file_matches_the_compose_spec():
    jsonschema = pytest.importorskip("jsonschema")
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    (doc,) = _yaml_docs(DEPLOY / "compose.yaml")
    validator.validate(doc)
    assert set(doc["services"]) == {"broker", "worker", "gateway"}
    assert doc["services"]["worker"]["deploy"]["replicas"] == 2
    assert not validator.is_valid({**doc, "services": {"broker": {"image": "x", "comand": ["broker"]}}})  # a typo


def _check_cli(argv: list[str], env: dict[str, str], monkeypatch) -> None:
    """Parse ``slotserve ARGV`` with ``env`` exactly as the CLI would, without running it;
    every SLOTSERVE_* variable must name an option of that command."""
    import click

    from slotserve.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = main.context_class(main, info_name="slotserve", **main.context_settings)  # as `slotserve` would
    name, *rest = argv
    cmd = main.get_command(ctx, name)
    assert cmd is not None, f"no command {name!r}"
    known = set()
    for p in cmd.params:
        if isinstance(p, click.Option):
            known |= {p.envvar} if isinstance(p.envvar, str) else {f"SLOTSERVE_{name.upper()}_{p.name.upper()}"}
    unknown = {k for k in env if k.startswith("SLOTSERVE_")} - known
    assert not unknown, f"`slotserve {name}` has no option for {sorted(unknown)}"
    cmd.make_context(name, rest, parent=ctx)  # raises click.UsageError / BadParameter on a bad value


def _env_file(path: Path) -> dict[str, str]:
    """A Compose env file's ``KEY=VALUE`` lines (``#`` lines are comments)."""
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def _containers() -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    for fname, d in _k8s_docs():
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value", "from-field") for e in c.get("env", [])}
            out.append((f"{fname}:{c['name']}", c["args"], env))
    (compose,) = _yaml_docs(DEPLOY / "compose.yaml")
    for name, svc in compose["services"].items():
        env = {k: v for f in svc.get("env_file", []) for k, v in _env_file(DEPLOY / f).items()}
        env.update({k: str(v) for k, v in svc["environment"].items()})
        out.append((f"compose.yaml:{name}", svc["command"], env))
    cmd = re.search(r"^CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    out.append(("Dockerfile:CMD", json.loads(cmd), {}))
    return out


@pytest.mark.parametrize("where, argv, env", _containers(), ids=lambda v: v if isinstance(v, str) else "")
def test_container_commands_and_variables_parse_with_the_cli(where, argv, env, monkeypatch, tmp_path):
    env = {k: (str(tmp_path) if k.endswith("_CURVE_DIR") else v) for k, v in env.items()}
    _check_cli(argv, env, monkeypatch)


def test_the_cli_check_catches_mistakes(monkeypatch):
    import click

    with pytest.raises(AssertionError, match="SLOTSERVE_WORKER_SLOT"):
        _check_cli(["worker"], {"SLOTSERVE_WORKER_SLOT": "8"}, monkeypatch)
    with pytest.raises(click.BadParameter):
        _check_cli(["worker"], {"SLOTSERVE_WORKER_SLOTS": "eight"}, monkeypatch)


def test_curve_secret_mounts_give_each_role_the_files_it_reads(tmp_path):
    from protocol.curve import broker_paths, peer_paths
    from slotserve.launcher import make_curve_keys

    written = make_curve_keys(str(tmp_path / "keys"))
    keygen_files = {os.path.basename(p) for p in written if os.path.dirname(p) == str(tmp_path / "keys")}
    docs = dict(((d["kind"], d["metadata"]["name"]), d) for _, d in _k8s_docs())
    assert set(docs["Secret", "slotserve-curve"]["stringData"]) == keygen_files
    needs = {"broker": ("SLOTSERVE_BROKER_CURVE_DIR", lambda m: [broker_paths(m).secret_file,
                                                                 broker_paths(m).clients_dir + "/client.key",
                                                                 broker_paths(m).workers_dir + "/worker.key"]),
             "worker": ("SLOTSERVE_WORKER_CURVE_DIR", lambda m: [peer_paths(m, "worker").secret_file,
                                                                peer_paths(m, "worker").broker_public_file]),
             "gateway": ("SLOTSERVE_SERVE_CURVE_DIR", lambda m: [peer_paths(m, "client").secret_file,
                                                                 peer_paths(m, "client").broker_public_file])}
    for role, (var, paths) in needs.items():
        pod = docs["Deployment", f"slotserve-{role}"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        mount = next(v["mountPath"] for v in c["volumeMounts"] if v["name"] == "keys")
        assert {e["name"]: e.get("value") for e in c["env"]}[var] == mount
        vol = next(v for v in pod["volumes"] if v["name"] == "keys")["secret"]
        mounted = {f"{mount}/{i['path']}": i["key"] for i in vol["items"]}
        assert set(paths(mount)) <= set(mounted), (role, sorted(mounted))
        for path, key in mounted.items():  # the file at each path is the keygen file of that name
            assert os.path.basename(path) == key
        assert not any(k.endswith("_secret") and not k.startswith(role if role != "gateway" else "client")
                       for k in mounted.values()), f"{role} mounts another role's secret key"


def test_the_gateway_takes_its_api_key_from_a_secret_and_an_env_file(monkeypatch):
    from click.testing import CliRunner

    import gateway
    from slotserve.cli import main

    docs = dict(((d["kind"], d["metadata"]["name"]), d) for _, d in _k8s_docs())
    (c,) = docs["Deployment", "slotserve-gateway"]["spec"]["template"]["spec"]["containers"]
    (var,) = [e for e in c["env"] if e["name"] == "SLOTSERVE_SERVE_API_KEY"]
    ref = var["valueFrom"]["secretKeyRef"]  # from the Secret, never a literal in the manifest
    secret = docs["Secret", ref["name"]]
    placeholders = [secret["stringData"][ref["key"]]]
    (compose,) = _yaml_docs(DEPLOY / "compose.yaml")
    svc = compose["services"]["gateway"]
    assert not any("API_KEY" in k for k in svc["environment"])  # only in the env file
    (env_file,) = svc["env_file"]
    placeholders.append(_env_file(DEPLOY / env_file)["SLOTSERVE_SERVE_API_KEY"])
    # the committed placeholders are refused at start: no deployment runs with a published key
    monkeypatch.setattr(gateway, "run", lambda *a, **kw: pytest.fail("served with a placeholder key"))
    for placeholder in placeholders:
        r = CliRunner().invoke(main, ["serve"], env={"SLOTSERVE_SERVE_API_KEY": placeholder})
        assert r.exit_code == 2 and "not a usable API key" in r.output, r.output


def test_dockerfile_copies_every_package_the_project_installs():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\1$", text, re.M))
    include = re.search(r'include = \[(.*?)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    packages = {p.strip(' "*') for p in include.split(",")}
    assert packages == copied, f"pyproject packages {sorted(packages)} vs COPY {sorted(copied)}"
    assert "--index-url https://download.pytorch.org/whl/cpu" in text and "torch==2.13.0" in text
    assert re.search(r'"torch==2\.13\.0"', (ROOT / "pyproject.toml").read_text())
