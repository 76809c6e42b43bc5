"""Environment capture: schema, git state, missing tools, env vars, GPU inventory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from qualify.evidence import environment
from qualify.resources import load_schema

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _validate(doc: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(load_schema("environment")).validate(doc)


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(load_schema("environment"))


def test_capture_validates_and_names_versions() -> None:
    env = environment.capture_environment()
    _validate(env)
    assert env["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert env["packages"]["numpy"] is not None
    assert set(environment.PACKAGES) <= set(env["packages"])
    assert env["torch"] is not None
    assert isinstance(env["torch"]["num_threads"], int)
    assert env["cpu"]["logical_cores"] >= 1


def test_capture_imports_no_engine() -> None:
    code = ("import sys; from qualify.evidence.environment import capture_environment; "
            "capture_environment(import_torch=False); "
            "bad = [m for m in ('vllm', 'deepspeed', 'megatron') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_capture_without_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env = environment.capture_environment(repo=tmp_path, import_torch=False)
    _validate(env)
    assert env["torch"] is None
    assert env["gpus"] == []
    assert env["cuda"]["available"] is False


# --------------------------------------------------------------------------- git

def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org",
                    "-c", "commit.gpgsign=false", *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q", "-b", "main")
    (r / "a.txt").write_text("one\n")
    _git(r, "add", "a.txt")
    _git(r, "commit", "-q", "-m", "first")
    return r


GIT_CASES: dict[str, tuple[list[tuple[str, ...]], str | None, bool]] = {
    # name: (steps, branch, dirty); a step is ("write", file, text) or ("git", *args)
    "clean": ([], "main", False),
    "tracked-modified": ([("write", "a.txt", "two\n")], "main", True),
    "tracked-deleted": ([("rm", "a.txt")], "main", True),
    "staged-new-file": ([("write", "b.txt", "x\n"), ("git", "add", "b.txt")], "main", True),
    "untracked-only": ([("write", "evidence.json", "{}\n")], "main", False),
    "other-branch": ([("git", "checkout", "-q", "-b", "feature")], "feature", False),
    "detached-head": ([("git", "checkout", "-q", "--detach")], None, False),
}


@needs_git
@pytest.mark.parametrize("case", list(GIT_CASES), ids=list(GIT_CASES))
def test_git_state(repo: Path, case: str) -> None:
    steps, branch, dirty = GIT_CASES[case]
    for step in steps:
        if step[0] == "write":
            (repo / step[1]).write_text(step[2])
        elif step[0] == "rm":
            (repo / step[1]).unlink()
        else:
            _git(repo, *step[1:])
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    state = environment.git_state(repo / ".")
    assert state == {"commit": head, "branch": branch, "dirty": dirty}
    env = environment.capture_environment(repo=repo, import_torch=False)
    _validate(env)
    assert env["git"] == state


@needs_git
def test_git_state_in_subdirectory_and_empty_repo(repo: Path, tmp_path: Path) -> None:
    (repo / "sub").mkdir()
    assert environment.git_state(repo / "sub")["commit"] is not None
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run(["git", "-C", str(empty), "init", "-q"], check=True)
    state = environment.git_state(empty)
    assert state["commit"] is None
    assert state["dirty"] is False


def _timeout(*_a: Any, **_k: Any) -> None:
    raise subprocess.TimeoutExpired(cmd="git", timeout=10)


def _not_found(*_a: Any, **_k: Any) -> None:
    raise FileNotFoundError("git")


NO_GIT: dict[str, tuple[str, Any]] = {
    "git-not-on-path": ("which", lambda _name: None),
    "git-times-out": ("run", _timeout),
    "git-binary-vanished": ("run", _not_found),
}


@pytest.mark.parametrize("case", list(NO_GIT), ids=list(NO_GIT))
def test_missing_git_is_tolerated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    attr, fake = NO_GIT[case]
    if attr == "which":
        monkeypatch.setattr(environment.shutil, "which", fake)
    else:
        monkeypatch.setattr(environment.shutil, "which", lambda _name: "/usr/bin/git")
        monkeypatch.setattr(environment.subprocess, "run", fake)
    null = {"commit": None, "branch": None, "dirty": None}
    assert environment.git_state(tmp_path) == null
    env = environment.capture_environment(repo=tmp_path, import_torch=False)
    _validate(env)
    assert env["git"] == null


@pytest.mark.parametrize("where", ["not-a-repo", "missing-dir", "none"])
def test_not_a_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = {"not-a-repo": tmp_path, "missing-dir": tmp_path / "nope", "none": None}[where]
    assert environment.git_state(repo) == {"commit": None, "branch": None, "dirty": None}


# --------------------------------------------------------------------------- env vars

def test_numerics_env_names_prefixes_and_redaction() -> None:
    environ = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_ALGO": "Ring",
        "OMP_NUM_THREADS": "2",
        "VLLM_USE_V1": "1",
        "VLLM_API_KEY": "hunter2",
        "DS_ACCELERATOR": "cpu",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",
        "NVIDIA_TF32_OVERRIDE": "0",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "HF_TOKEN": "secret",
        "HOME": "/root",
        "PATH": "/bin",
    }
    got = environment.numerics_env(environ)
    assert got["VLLM_API_KEY"] == "<redacted>"
    assert "hunter2" not in got.values()
    for name in ("HF_TOKEN", "HOME", "PATH"):
        assert name not in got
    expected = set(environ) - {"HF_TOKEN", "HOME", "PATH"}
    assert set(got) == expected
    assert list(got) == sorted(got)


def test_slurm_and_env_in_capture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    env = environment.capture_environment(repo=tmp_path, import_torch=False)
    _validate(env)
    assert env["slurm"]["job_id"] == "1234"
    assert env["slurm"]["nodelist"] == "gpu[01-04]"
    assert env["env"]["NCCL_PROTO"] == "Simple"


def test_no_slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert environment.capture_environment(repo=tmp_path, import_torch=False)["slurm"] is None


def test_package_versions_missing_is_null() -> None:
    got = environment.package_versions(["numpy", "surely-not-installed-pkg-qualify"])
    assert got["numpy"] is not None
    assert got["surely-not-installed-pkg-qualify"] is None


# --------------------------------------------------------------------------- GPU (faked)

def _fake_torch(n_gpus: int) -> Any:
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0,
                                  total_memory=141 * 2**30, multi_processor_count=132,
                                  uuid="GPU-1234")
    cuda = types.SimpleNamespace(
        is_available=lambda: n_gpus > 0,
        device_count=lambda: n_gpus,
        get_device_properties=lambda _i: props,
    )
    return types.SimpleNamespace(
        version=types.SimpleNamespace(cuda="12.8", hip=None),
        cuda=cuda,
        backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 90100)),
        _C=types.SimpleNamespace(_cuda_getDriverVersion=lambda: 12080),
    )


@pytest.mark.parametrize("n_gpus", [0, 2])
def test_gpu_inventory_from_torch(monkeypatch: pytest.MonkeyPatch, n_gpus: int) -> None:
    monkeypatch.setattr(environment.shutil, "which", lambda _name: None)  # no nvidia-smi
    gpus, cuda = environment._accelerators(_fake_torch(n_gpus))
    assert len(gpus) == n_gpus
    assert cuda["available"] is (n_gpus > 0)
    assert cuda["torch_cuda_version"] == "12.8"
    if n_gpus:
        assert gpus[1] == {"index": 1, "name": "NVIDIA H200", "capability": "9.0",
                           "total_memory_bytes": 141 * 2**30, "multiprocessors": 132,
                           "uuid": "GPU-1234"}
        assert cuda["cudnn_version"] == 90100
        assert cuda["cuda_driver_api_version"] == 12080
    doc = environment.capture_environment(repo=Path("/nonexistent"), import_torch=False)
    _validate({**doc, "gpus": gpus, "cuda": cuda})


def test_torch_settings_lists_numerics_flags() -> None:
    settings = environment.torch_settings(torch)
    assert settings is not None
    assert settings["num_threads"] == torch.get_num_threads()
    assert settings["default_dtype"] == "torch.float32"
    assert settings["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert isinstance(settings["cuda_matmul_allow_tf32"], bool)
    assert isinstance(settings["cudnn_allow_tf32"], bool)
