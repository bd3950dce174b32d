"""The README's first two commands are what CI and new users run: keep them true."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_commands_are_make_targets_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    first, second = blocks[0].strip(), blocks[1].strip()
    assert (first, second) == ("make demo", "make test")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
