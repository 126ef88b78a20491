"""The README's claims that a machine without a GPU can check: its first two commands are the
install-and-demo and the test command CI runs, every generator command it shows runs, its
presets table says what `python -m generator --presets` says, and every link in it and in docs/
leads to a file."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = (REPO_ROOT / "README.md").read_text()
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def generator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "generator", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_first_commands_install_and_test():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert first_block[0].startswith("pip install -v . && python -m fmha.demo")
    assert first_block[1].startswith("python -m pytest -q tests")
    # CI runs the README's test command (with the python3 of its machine).
    assert "python3 -m pytest -q tests" in (REPO_ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("command", sorted(set(
    re.findall(r"python -m generator ([^`\n]*)", README))))
def test_a_generator_command_of_the_readme_runs(command):
    done = generator(*command.split("#")[0].split())
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_presets_table_says_what_the_generator_says():
    done = generator("--presets")
    assert done.returncode == 0, done.stderr[-2000:]
    counted = {m.group(1): tuple(map(int, m.group(2, 3, 4))) for m in re.finditer(
        r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s", done.stdout, re.M)}
    tabled = {m.group(1): tuple(map(int, m.group(2, 3, 4))) for m in re.finditer(
        r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \|", README, re.M)}
    assert tabled and tabled == counted


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_link_leads_to_a_file(page):
    text = page.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    missing = [t for t in targets if not re.match(r"[a-z]+:|#", t)
               and not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO_ROOT)} links to missing files: {missing}"
