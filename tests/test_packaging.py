"""The built wheel is self-contained: qualify runs from it without the repository.

One module fixture (:func:`installed`) copies the source tree (the files git tracks or
would track) to a temporary directory, builds the wheel there (``pip wheel --no-deps
--no-build-isolation``; about 3 s), creates a bare venv (``--without-pip``, no system site)
and installs the wheel into it. The venv then sees the dependencies (torch, transformers,
...) through a ``.pth`` file naming this environment's ``site-packages`` *directories*:
Python adds such lines to ``sys.path`` without running the ``.pth`` files inside them, so the
editable install of this checkout (``__editable__.qualify-*.pth``) stays inert and the only
``qualify`` the venv imports is the wheel's. Every command runs from a directory outside
the repository with ``PYTHONPATH`` unset.

What must hold (docs/engine-guide.md, :mod:`qualify.resources`): the wheel carries
``harnesses`` (every module and README), the JSON Schemas, the committed contracts, the
trusted public keys and the job scripts, each from its one place in the repository; ``qualify
validate`` finds the embedded default contract; every resource path lies in the install;
``harnesses.torch_tp.harness`` imports, also in a child launched with
:func:`qualify.candidate.launch.launch_env`; pre-redesign evidence verifies. An editable
install of the same tree still reads the tree's own files. The fast part takes about 25 s
on 2 cores; one real cell (``qualify run``, reference stage plus a torchrun launch, over a
minute) is marked ``slow``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "pre_redesign"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Install:
    """One venv holding qualify, and where things are.

    Attributes:
        venv: the venv directory.
        python: its interpreter.
        site: its ``site-packages``.
        elsewhere: a working directory outside the repository.
        source: the copy of the source tree it was built from.
        seconds: how long each step took (``copy``, ``build``, ``venv``, ``install``).
        wheel: the wheel file (``None`` for an editable install).
    """

    venv: Path
    python: Path
    site: Path
    elsewhere: Path
    source: Path
    seconds: dict[str, float]
    wheel: Path | None

    @property
    def qualify(self) -> Path:
        """The ``qualify`` console script."""
        return self.venv / "bin" / "qualify"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without ``PYTHONPATH`` / ``PYTHONHOME``."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONNOUSERSITE"] = "1"
        env.update(extra)
        return env

    def run(self, argv: Sequence[str | Path], *, timeout: float = 120,
            **extra: str) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` from :attr:`elsewhere`; the finished process (output captured)."""
        return subprocess.run([str(a) for a in argv], cwd=self.elsewhere, env=self.env(**extra),
                              capture_output=True, text=True, timeout=timeout, check=False)

    def python_json(self, code: str) -> Any:
        """Run ``code`` in the venv's Python; the JSON its last stdout line holds."""
        proc = self.run([self.python, "-c", code])
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.splitlines()[-1])


def _timed(seconds: dict[str, float], step: str, argv: Sequence[str | Path],
           cwd: Path | None = None) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    seconds[step] = round(time.perf_counter() - t0, 2)
    assert proc.returncode == 0, f"{step}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def copy_source_tree(dest: Path) -> None:
    """Copy the files git tracks or would track (not ignored) to ``dest``."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the source tree cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the work tree is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def make_venv(base: Path, seconds: dict[str, float]) -> tuple[Path, Path, Path]:
    """A bare venv under ``base``: ``(venv, python, site-packages)``."""
    venv = base / "venv"
    _timed(seconds, "venv", [sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    return venv, python, site


def see_dependencies(site: Path) -> None:
    """Let the venv import this environment's packages, but not its editable qualify.

    The harness SDK (``qualify-harness``, a dependency of qualify) is installed editable
    from ``sdk/`` here as in CI: an editable finder's ``.pth`` is not run from a path that a
    ``.pth`` adds, so its directory is added itself.
    """
    import qualify_harness

    sdk = Path(qualify_harness.__file__).resolve().parent.parent
    paths = dict.fromkeys([*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")),
                           str(sdk)])
    (site / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in paths))


def pip_install(python: Path, seconds: dict[str, float], *args: str | Path) -> None:
    """``pip install`` into the venv of ``python`` (pip runs from this environment).

    Called before :func:`see_dependencies`: pip must not see (and uninstall) the editable
    qualify of this environment.
    """
    _timed(seconds, "install", [sys.executable, "-m", "pip", "--python", python, "install",
                                "--no-deps", "--no-index", "--no-build-isolation",
                                "--disable-pip-version-check", *args])


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Install:
    """The wheel built from a copy of this tree, installed into a fresh venv."""
    base = tmp_path_factory.mktemp("wheel")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    source = base / "src"
    copy_source_tree(source)
    seconds["copy"] = round(time.perf_counter() - t0, 2)
    dist = base / "dist"
    _timed(seconds, "build", [sys.executable, "-m", "pip", "wheel", "--no-deps",
                              "--no-build-isolation", "--disable-pip-version-check", "-q",
                              "-w", dist, source, source / "sdk"])
    (wheel,) = dist.glob("qualify-*.whl")
    (sdk_wheel,) = dist.glob("qualify_harness-*.whl")
    venv, python, site = make_venv(base, seconds)
    pip_install(python, seconds, wheel, sdk_wheel)
    see_dependencies(site)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    print(f"wheel install steps (s): {seconds}")
    return Install(venv=venv, python=python, site=site, elsewhere=elsewhere, source=source,
                   seconds=seconds, wheel=wheel)


def under(path: str | Path, parent: Path) -> bool:
    """Whether ``path`` (resolved) lies in ``parent``."""
    return Path(path).resolve().is_relative_to(parent.resolve())


RESOURCES = """
import json, harnesses, qualify
from qualify import resources as r
from qualify.contract import default_contract_path
from qualify.evidence.sign import default_keys_dir
print(json.dumps({
    "qualify": qualify.__file__, "harnesses": harnesses.__file__,
    "is_checkout": r.is_checkout(), "checkout_root": r.checkout_root() and str(r.checkout_root()),
    "repo_root": str(r.repo_root()), "data_root": str(r.data_root()),
    "contracts": str(r.contracts_dir()), "sbatch": str(r.sbatch_dir()),
    "harnesses_dir": str(r.harnesses_dir()), "default_contract": str(default_contract_path()),
    "keys": str(default_keys_dir()),
    "schemas": sorted(p.name for p in (r.contracts_dir() / "schema").iterdir()),
    "schema_loads": r.load_schema("contract")["type"],
    "sbatch_scripts": sorted(p.name for p in r.sbatch_dir().iterdir()),
}))
"""


# --------------------------------------------------------------------------- the wheel


def test_build_is_quick(installed: Install) -> None:
    assert installed.seconds["build"] < 60, installed.seconds


def test_wheel_carries_every_module_and_data_file_from_its_one_place(installed: Install
                                                                     ) -> None:
    assert installed.wheel is not None
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    src = installed.source
    want = {p.relative_to(src).as_posix()
            for pkg in ("qualify", "harnesses") for p in (src / pkg).rglob("*.py")}
    want |= {p.relative_to(src).as_posix() for p in (src / "harnesses").glob("*/README.md")}
    want.add("qualify/py.typed")
    data = {"contracts": ["*.toml", "schema/*.schema.json", "gates/*.toml", "keys/*.pub",
                          "keys/README.md"],
            "sbatch": ["*.sbatch"]}
    for folder, globs in data.items():
        for g in globs:
            want |= {f"qualify/_data/{p.relative_to(src).as_posix()}"
                     for p in (src / folder).glob(g)}
    assert want - names == set()
    zf = zipfile.ZipFile(installed.wheel)
    for name in sorted(n for n in names if n.startswith("qualify/_data/")):
        assert zf.read(name) == (src / name.removeprefix("qualify/_data/")).read_bytes(), name
    assert "qualify/_data/contracts/tiny-qwen3.toml" in names
    assert "qualify/_data/contracts/schema/contract.schema.json" in names
    assert "harnesses/torch_tp/README.md" in names
    assert not any(n.startswith(("tests/", "contracts/", "sbatch/", "scripts/")) for n in names)
    assert not [n for n in names if b"PRIVATE KEY" in zf.read(n)]
    assert not (ROOT / "qualify" / "_data").exists(), "qualify/_data/ exists only in a wheel"


def test_validate_finds_the_embedded_default_contract(installed: Install) -> None:
    proc = installed.run([installed.qualify, "validate"])
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    path = installed.site / "qualify" / "_data" / "contracts" / "tiny-qwen3.toml"
    assert first.startswith(f"{path}: valid contract 'tiny-qwen3', digest "), proc.stdout
    assert "  cell torch_tp-fp32-actor-tp1" in proc.stdout.splitlines()


def test_resources_lie_in_the_install(installed: Install) -> None:
    doc = installed.python_json(RESOURCES)
    site = installed.site
    for key in ("qualify", "harnesses", "repo_root", "data_root", "contracts", "sbatch",
                "harnesses_dir", "default_contract", "keys"):
        assert under(doc[key], site), (key, doc[key])
        assert not under(doc[key], ROOT), (key, doc[key])
        assert Path(doc[key]).exists(), (key, doc[key])
    assert doc["is_checkout"] is False
    assert doc["checkout_root"] is None
    assert Path(doc["data_root"]) == site / "qualify" / "_data"
    assert Path(doc["harnesses_dir"]) == site / "harnesses"
    assert doc["schemas"] == sorted(p.name for p in (ROOT / "contracts" / "schema").iterdir())
    assert doc["schema_loads"] == "object"
    assert doc["sbatch_scripts"] == sorted(p.name for p in (ROOT / "sbatch").glob("*.sbatch"))


def test_harness_imports_from_the_install(installed: Install) -> None:
    doc = installed.python_json(
        "import json, harnesses.torch_tp.harness as h; print(json.dumps(h.__file__))")
    assert Path(doc) == installed.site / "harnesses" / "torch_tp" / "harness.py"


def test_a_launched_child_imports_the_installed_harness(installed: Install) -> None:
    """The torchrun ranks get :func:`~qualify.candidate.launch.launch_env`'s environment.

    The child finds the module (``find_spec``) without importing torch a second time in
    this test module (seconds on 2 cores); :func:`test_harness_imports_from_the_install`
    imports it."""
    code = """
import json, subprocess, sys
from qualify.candidate.launch import launch_env
env = launch_env({})
out = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                      "print(u.find_spec('harnesses.torch_tp.harness').origin)"],
                     env=env, capture_output=True, text=True, check=True)
print(json.dumps({"pythonpath": env["PYTHONPATH"], "harness": out.stdout.strip()}))
"""
    doc = installed.python_json(code)
    assert Path(doc["harness"]) == installed.site / "harnesses" / "torch_tp" / "harness.py"
    assert not under(doc["pythonpath"].split(os.pathsep)[0], ROOT)


def test_pre_redesign_evidence_is_judged_from_the_install_as_from_the_checkout(
        installed: Install, tmp_path: Path) -> None:
    """The installed verify reads the fixture's signature, manifest and schemas (steps 1-6 ok)
    and refuses its run at step 7, as the checkout does (tests/test_pre_redesign.py): the
    fixture's reference seals hand-made bounds that the bound rule does not give."""
    world = tmp_path / "pre_redesign"
    shutil.copytree(FIXTURE, world)
    proc = installed.run([installed.qualify, "verify",
                          world / "evidence" / "gate-tiny" / "run-1-good",
                          "--keys", world / "keys", "--contracts-dir", world / "contracts"])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    for step in range(1, 7):
        assert f"[ok  ] {step}." in proc.stdout, proc.stdout
    assert "[FAIL] 7." in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_slurm_finds_its_job_scripts_in_the_install(installed: Install) -> None:
    doc = installed.python_json(
        "import json; from qualify.pipeline import slurm; print(json.dumps(str(slurm.SBATCH_DIR)))")
    assert Path(doc) == installed.site / "qualify" / "_data" / "sbatch"


@pytest.mark.slow
def test_one_real_cell_runs_from_the_install(installed: Install) -> None:
    """``qualify run`` of one torch_tp cell (the HF-sampled, torch_tp-only contract of
    :mod:`tiny_contracts`): reference stage, one torchrun launch of the installed harness,
    compare, sign. Over a minute on 2 cores (reference about 40 s, launch about 20 s)."""
    from tiny_contracts import torch_tp_only

    contract = torch_tp_only(installed.elsewhere / "contracts")
    cell = "torch_tp-fp32-actor-tp1"
    home = installed.elsewhere / "home"
    proc = installed.run([installed.qualify, "run", contract, "--cells", cell, "--quiet",
                          "--references", "refs", "--evidence", "ev"], timeout=900,
                         XDG_CONFIG_HOME=str(home))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr[-4000:]
    (report,) = (installed.elsewhere / "ev").glob("*/*/report.json")
    doc = json.loads(report.read_text(encoding="utf-8"))
    verdicts = {c["cell"]: c["verdict"] for c in doc["cells"]}
    assert verdicts[cell] == "PASS", proc.stdout + proc.stderr[-4000:]


# --------------------------------------------------------------------------- editable


def test_editable_install_reads_the_tree(installed: Install, tmp_path: Path) -> None:
    """``pip install -e`` of the same tree: the files are read where they are."""
    seconds: dict[str, float] = {}
    dist = tmp_path / "dist"
    # the bare venv has no setuptools: build the editable wheel (PEP 660) here
    _timed(seconds, "build", [sys.executable, "-c",
                              "import sys; from setuptools import build_meta as b; "
                              "print(b.build_editable(sys.argv[1]))", dist],
           cwd=installed.source)
    (wheel,) = dist.glob("qualify-*.whl")
    venv, python, site = make_venv(tmp_path, seconds)
    pip_install(python, seconds, wheel)
    see_dependencies(site)
    editable = dataclasses.replace(installed, venv=venv, python=python, site=site, wheel=None,
                                   seconds=seconds)
    doc = editable.python_json(RESOURCES)
    src = installed.source.resolve()
    assert doc["is_checkout"] is True
    assert Path(doc["checkout_root"]) == src
    assert Path(doc["data_root"]) == src
    assert Path(doc["contracts"]) == src / "contracts"
    assert Path(doc["sbatch"]) == src / "sbatch"
    assert Path(doc["harnesses"]) == src / "harnesses" / "__init__.py"
    proc = editable.run([editable.qualify, "validate"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{src / 'contracts' / 'tiny-qwen3.toml'}: valid contract")


def test_this_checkout_reads_the_repository() -> None:
    from qualify import resources

    assert resources.is_checkout()
    assert resources.checkout_root() == ROOT
    assert resources.data_root() == ROOT
    assert resources.contracts_dir() == ROOT / "contracts"
    assert resources.sbatch_dir() == ROOT / "sbatch"
    assert resources.harnesses_dir() == ROOT / "harnesses"
