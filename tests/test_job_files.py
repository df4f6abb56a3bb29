"""job.yaml against the official schemas and the defects it must not have; the shell scripts under
shellcheck; the ConfigMap as kubectl renders it; the pod's Python environment step."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from podlab import BUCKET, ROOT, VENV_BIN, tool_env

JOB = yaml.safe_load((ROOT / "job.yaml").read_text())
POD = JOB["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]


def bundled_kubernetes_versions() -> list[str]:
    import kubernetes_validate

    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    found = {m.group(1) for p in schemas.iterdir() if (m := re.match(r"v(1\.(\d+)\.\d+)-local-strict$", p.name))}
    return sorted((v for v in found if int(v.split(".")[1]) >= 29), key=lambda v: int(v.split(".")[1]))


VERSIONS = bundled_kubernetes_versions()


def test_every_version_from_1_29_to_the_newest_bundled_is_checked():
    assert VERSIONS[0] == "1.29.0" and len(VERSIONS) >= 8


@pytest.mark.parametrize("version", VERSIONS)
def test_job_yaml_is_valid_for_kubernetes(version):
    result = subprocess.run([str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", version, str(ROOT / "job.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout


def test_failure_policy_ignores_preemption_and_fails_on_bad_input():
    spec = JOB["spec"]
    assert POD["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [64]
    assert rules[1]["onExitCodes"]["containerName"] == CONTAINER["name"]
    assert spec["backoffLimit"] >= 1


def test_pod_has_gpus_volumes_and_a_grace_period_for_the_final_upload():
    assert CONTAINER["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert POD["terminationGracePeriodSeconds"] >= 120
    volumes = {v["name"]: v for v in POD["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["job"]["configMap"] == {"name": "script-configmap", "defaultMode": 0o555}
    mounts = {m["mountPath"]: m for m in CONTAINER["volumeMounts"]}
    assert mounts["/opt/job"]["readOnly"] and "/dev/shm" in mounts and "/tmp" in mounts
    assert CONTAINER["command"] == ["/bin/bash", "/opt/job/script.sh"], "run through bash: no chmod"
    env = {e["name"]: e.get("value") for e in CONTAINER["env"]}
    assert env["HOME"].startswith(mounts["/home/eai_role"]["mountPath"])
    assert CONTAINER["envFrom"] == [{"secretRef": {"name": "aws-credentials", "optional": True}}]


def test_env_suits_an_image_without_a_passwd_entry_for_the_pods_user():
    # torch < 2.13 (pytorch/pytorch images) crashes in getpass.getuser() without a passwd entry
    # unless USER/LOGNAME or TORCHINDUCTOR_CACHE_DIR are set; caches go to the workspace, not /tmp.
    env = {e["name"]: e.get("value") for e in CONTAINER["env"]}
    mounts = {m["mountPath"]: m["name"] for m in CONTAINER["volumeMounts"]}
    assert env["USER"] and env["LOGNAME"] == env["USER"]
    for name in ("HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        owner = max((path for path in mounts if env[name] == path or env[name].startswith(path + "/")), key=len)
        assert mounts[owner] == "home", f"{name}={env[name]} is not on the workspace volume"


def test_ephemeral_storage_request_covers_the_disk_empty_dirs():
    resources = CONTAINER["resources"]
    size_limits = [quantity(v["emptyDir"]["sizeLimit"]) for v in POD["volumes"]
                   if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
    assert quantity(resources["requests"]["ephemeral-storage"]) > sum(size_limits)
    # No limit: the sizeLimits cap each volume, and a limit would be one more no-grace eviction.
    assert "ephemeral-storage" not in resources["limits"]


def quantity(text: str) -> int:
    import local_pod

    return local_pod.quantity_bytes(text)


def test_pod_is_hardened():
    pod_security, security = POD["securityContext"], CONTAINER["securityContext"]
    assert isinstance(pod_security["runAsUser"], int) and pod_security["runAsUser"] > 0
    assert pod_security["runAsNonRoot"] and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
    assert security["readOnlyRootFilesystem"] is True


def run_probe(probe: str, tmp_path: Path, **env: str) -> int:
    command = CONTAINER[probe]["exec"]["command"]
    full = {"PATH": os.environ["PATH"], "HEALTH_FILE": str(tmp_path / "healthy"),
            "READY_FILE": str(tmp_path / "ready"), **env}
    return subprocess.run(command, env=full, capture_output=True).returncode


def test_liveness_fails_only_when_the_heartbeat_is_stale(tmp_path):
    assert run_probe("livenessProbe", tmp_path) != 0, "no heartbeat yet: startupProbe gates this"
    health = tmp_path / "healthy"
    health.touch()
    assert run_probe("livenessProbe", tmp_path) == 0
    old = time.time() - 601
    os.utime(health, (old, old))
    assert run_probe("livenessProbe", tmp_path) != 0
    assert run_probe("livenessProbe", tmp_path, HEALTH_MAX_AGE_SECONDS="3600") == 0
    assert CONTAINER["livenessProbe"]["timeoutSeconds"] >= 1


def test_startup_probe_waits_for_the_ready_file_generously(tmp_path):
    assert run_probe("startupProbe", tmp_path) != 0
    (tmp_path / "ready").touch()
    assert run_probe("startupProbe", tmp_path) == 0
    probe = CONTAINER["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800


def shell_scripts() -> list[str]:
    found = [ROOT / ".ci" / "run", *ROOT.glob("job/*.sh"), *ROOT.glob("scripts/**/*.sh")]
    return [str(p.relative_to(ROOT)) for p in found if p.is_file()]


def test_shell_scripts_are_shellcheck_clean():
    scripts = shell_scripts()
    assert "job/script.sh" in scripts
    result = subprocess.run([str(VENV_BIN / "shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_no_script_traces_commands():
    for name in shell_scripts():
        text = (ROOT / name).read_text()
        assert not re.search(r"^\s*set\s+-[a-z]*x|set -o xtrace|bash -x", text, re.M), name


@pytest.mark.parametrize("name", ["checkpoint.py", "contract.py", "trainer_kit.py", "safe_dcp.py", "hf_resume.py"])
def test_stage_uploads_the_runtime_modules_code_links_as_their_files(s3, name):
    # code/checkpoint.py and code/contract.py are links to job/'s: a trainer synced from S3 without
    # job/ imports them, so they must arrive as files, not as links or not at all.
    subprocess.run([str(ROOT / "scripts" / "stage.sh"), f"s3://{BUCKET}/code/"], check=True, capture_output=True,
                   env=tool_env())
    assert s3.get_object(Bucket=BUCKET, Key=f"code/{name}")["Body"].read() == (ROOT / "job" / name).read_bytes()


def test_stage_checks_every_uri_before_uploading_anything(tmp_path):
    env = {**tool_env(), "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
           "AWS_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    result = subprocess.run([str(ROOT / "scripts" / "stage.sh"), "s3://a-bucket/code/", "--data", str(tmp_path),
                             "https://a-bucket/data/"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 64
    assert result.stderr.splitlines() == ["stage.sh: error: https://a-bucket/data/ is not an s3://bucket/prefix/ URI"]
    assert "staged code" not in result.stdout


def test_configmap_renders_from_job_folder_with_kubectl():
    result = subprocess.run([str(VENV_BIN / "kubectl"), "create", "configmap", "script-configmap",
                             f"--from-file={ROOT / 'job'}", "--dry-run=client", "-o", "yaml"],
                            capture_output=True, text=True, check=True)
    data = yaml.safe_load(result.stdout)["data"]
    assert {"script.sh", "uploader.py", "restore.py", "lease.py", "s3.py", "python_env.sh"} <= set(data)
    assert len(result.stdout.encode()) < 1 << 20, "a ConfigMap holds at most 1 MiB"


def test_every_command_that_applies_the_configmap_applies_it_server_side():
    # A client-side `kubectl apply` copies the whole object into its last-applied-configuration
    # annotation, and an object's annotations may hold 262144 bytes: job/'s ConfigMap is about that.
    places = [ROOT / "README.md", ROOT / "job.yaml", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [(path.name, line) for path in places for line in path.read_text().splitlines()
                if re.search(r"kubectl apply .*(-f -|gpt-run\.yaml)", line) and "`" not in line]
    assert len(commands) >= 5, commands  # README (2), job.yaml, cluster.md (2), multi-node.md
    assert [c for c in commands if "--server-side" not in c[1]] == []


# -- the pod's Python environment ------------------------------------------------------------------

def fake_wheel(folder: Path, name: str = "tinydep", version: str = "1.0") -> Path:
    """A real (if minimal) wheel, so pip can install it offline."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VALUE = 42\nVERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for file, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{file},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return folder


def python_env(work: Path, *requirements: Path, **env: str) -> subprocess.CompletedProcess:
    """Run the pod's environment step; its `stdout` becomes the Python it chose."""
    full = {**tool_env(), **env}
    chosen = work.parent / f"{work.name}.python"
    chosen.unlink(missing_ok=True)
    result = subprocess.run(["bash", str(ROOT / "job" / "python_env.sh"), str(work), str(chosen),
                             *map(str, requirements)], capture_output=True, text=True, env=full)
    result.stdout = chosen.read_text() if chosen.exists() else ""
    return result


def test_image_python_is_used_as_is_when_it_has_every_requirement(tmp_path):
    result = python_env(tmp_path, ROOT / "code" / "requirements.txt", ROOT / "job" / "requirements.txt")
    assert result.returncode == 0, result.stderr
    assert "nothing to install" in result.stderr
    assert Path(result.stdout.strip()).name.startswith("python3")
    assert not list(tmp_path.glob(".venv-*"))


def test_missing_requirement_goes_into_a_cached_venv_that_still_sees_torch(tmp_path):
    wheels = fake_wheel(tmp_path / "wheels")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch>=2.4\ntinydep==1.0\n")
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    first = python_env(tmp_path / "work", requirements, **offline)
    assert first.returncode == 0, first.stderr
    python = first.stdout.strip()
    assert ".venv-" in python and "installed what was missing" in first.stderr
    check = subprocess.run([python, "-c", "import tinydep, torch; print(tinydep.VALUE)"], capture_output=True, text=True)
    assert check.stdout.strip() == "42", check.stderr
    second = python_env(tmp_path / "work", requirements, **offline)
    assert second.stdout.strip() == python and "reusing" in second.stderr


def test_requirements_that_cannot_install_exit_64_with_one_line(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("no-such-package-anywhere==9.9\n")
    result = python_env(tmp_path / "work", requirements, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))
    assert result.returncode == 64
    errors = [l for l in result.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "cannot be installed" in errors[0] and "fix requirements.txt" in errors[0]
    assert not list((tmp_path / "work").glob(".venv-*")), "a failed venv is not left to be reused"


def fake_image(folder: Path, wheels: Path, *installed: str) -> dict:
    """An image whose python3 sees this venv's packages (pip, torch) and has `installed` of its own;
    returns the environment that puts it first on PATH."""
    subprocess.run([str(VENV_BIN / "python"), "-m", "venv", "--without-pip", str(folder)], check=True)
    site = subprocess.run([str(folder / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    base = subprocess.run([str(VENV_BIN / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_base.pth").write_text(base + "\n")
    subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                    str(wheels), *installed], check=True)
    return {"PATH": f"{folder / 'bin'}{os.pathsep}{tool_env()['PATH']}", "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheels)}


@pytest.fixture
def image_with_tinydep_1(tmp_path):
    wheels = tmp_path / "wheels"
    for version in ("1.0", "2.5", "3.0"):
        fake_wheel(wheels, version=version)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("tinydep>=2,<3  # the tested range\n")
    return fake_image(tmp_path / "image", wheels, "tinydep==1.0"), constraints


def test_a_package_the_image_has_outside_the_supported_range_gets_one_inside_it_in_the_venv(tmp_path,
                                                                                         image_with_tinydep_1):
    env, constraints = image_with_tinydep_1
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch>=2.4\n")
    result = python_env(tmp_path / "work", "--constraints", constraints, requirements, **env)
    assert result.returncode == 0, result.stderr
    assert "tinydep 1.0 (outside tinydep<3,>=2" in result.stderr
    assert "for tinydep 1.0 (supported: <3,>=2) in the image" in result.stderr
    python = result.stdout.strip()
    check = subprocess.run([python, "-c", "from importlib import metadata; import torch; print(metadata.version('tinydep'))"],
                           capture_output=True, text=True)
    assert check.stdout.strip() == "2.5", check.stderr  # the newest in range, not 3.0
    plain = python_env(tmp_path / "plain", requirements, **env)  # without constraints: train.py's pod
    assert plain.returncode == 0 and "nothing to install" in plain.stderr, plain.stderr


def test_no_version_in_the_supported_range_to_be_had_exits_64_naming_the_one_found(tmp_path, image_with_tinydep_1):
    env, constraints = image_with_tinydep_1
    constraints.write_text("tinydep>=4\n")
    result = python_env(tmp_path / "work", "--constraints", constraints, ROOT / "job" / "requirements.txt", **env)
    assert result.returncode == 64, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "the image has tinydep 1.0 (supported: >=4)" in errors[0], result.stderr
    assert not list((tmp_path / "work").glob(".venv-*"))


def test_a_requirement_pinned_outside_the_supported_range_exits_64_before_pip(tmp_path, image_with_tinydep_1):
    env, constraints = image_with_tinydep_1
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("tinydep==3.0\n")
    result = python_env(tmp_path / "work", "--constraints", constraints, requirements, **env)
    assert result.returncode == 64, result.stderr
    assert f"{requirements} asks for tinydep==3.0, outside tinydep<3,>=2" in result.stderr
    assert not (tmp_path / "work").exists() or not list((tmp_path / "work").glob(".venv-*"))
