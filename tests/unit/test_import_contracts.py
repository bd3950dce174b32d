"""The allowed import directions (`[tool.importlinter]` in pyproject.toml) hold, and can fail.

`lint-imports` (PyPI `import-linter`) reads the contracts from pyproject.toml. The second test runs the
same contracts over a small tree of packages that break each one, so a contract that could never
fail (a misspelt module, a wrong type) fails this test instead of passing silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"


def _contract_names() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c["name"] for c in config["contracts"]]


def _lint(cwd: Path, config: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), COLUMNS="400")
    return subprocess.run([LINT, "--config", str(config), "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_code_keeps_every_import_contract():
    result = _lint(REPO, REPO / "pyproject.toml", REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    names = _contract_names()
    assert len(names) >= 5
    assert f"Contracts: {len(names)} kept, 0 broken." in result.stdout


def test_each_contract_fails_on_a_forbidden_import(tmp_path: Path):
    modules = {
        "domain/__init__.py": "",
        "domain/events.py": "import psycopg\nfrom tapeline import settings\n",  # contract 1, and 2 (upward)
        "processors/__init__.py": "",
        "processors/worker.py": "from projections import fold\n",  # contract 2 (siblings are independent)
        "processors/intake.py": "from confluent_kafka import Consumer\n",  # contract 7
        "regions/failover.py": "import cli.wiring\n",  # contract 2 (upward)
        "cli/wiring.py": "",
        "cli/helpers.py": "import confluent_kafka\n",  # contract 6 (only the adapter imports the Kafka client)
        # the adapter's own imports of the client, which contract 6 ignores (an ignore that matches nothing fails)
        "tapeline/kafka.py": "import confluent_kafka\n", "tapeline/kafka_scan.py": "import confluent_kafka\n",
        "tapeline/kafka_topics.py": "import confluent_kafka\n",
        "projections/__init__.py": "",
        "projections/fold.py": "",
        "projections/api.py": "",
        "producers/__init__.py": "",
        "tapeline/__init__.py": "",
        "tapeline/settings.py": "import processors.worker\n",  # contract 2 (upward)
        "tapeline/logs.py": "import schemas.register\n",  # contract 3
        "tapeline/ports.py": "import tapeline.kafka\n",  # contract 4
        "projections/projector.py": "import confluent_kafka\n",  # contract 5
        "schemas/__init__.py": "", "schemas/register.py": "",
    }
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:  # every module a contract names must exist, or lint-imports stops
        layers = [name.strip() for layer in contract.get("layers", []) for name in layer.replace(":", "|").split("|")]
        internal = [m for m in contract.get("forbidden_modules", []) if m.split(".")[0] in config["root_packages"]]
        for module in contract.get("source_modules", []) + contract.get("modules", []) + layers + internal:
            path = module.replace(".", "/") + ("/__init__.py" if "." not in module else ".py")
            modules.setdefault(path, "")
    for name, text in modules.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    result = _lint(tmp_path, tmp_path / "pyproject.toml", tmp_path)
    names = _contract_names()
    assert result.returncode != 0
    assert f"Contracts: 0 kept, {len(names)} broken." in result.stdout, result.stdout[-4000:]
