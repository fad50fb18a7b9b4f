"""The README's map names every package and top-level module of fagen, and every template
folder, so that a newcomer finds any of them by name (docs/design.md points to it)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _map_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Where things are")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_map_names_every_package_and_module():
    block = _map_block()
    package = ROOT / "fagen"
    names = [f"fagen/{p.name}" for p in package.glob("*.py")]
    names += [f"fagen/{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
    names += [f"templates/{p.name}/" for p in (ROOT / "templates").iterdir() if p.is_dir()]
    missing = sorted(n for n in names if n not in block)
    assert not missing, f"README.md's map does not name {missing}"


def test_the_map_comes_right_after_the_two_commands():
    text = (ROOT / "README.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings.index("## Where things are") == headings.index("## Two commands for a fresh machine") + 1
