"""The README's Python examples run as written (on CPU here, through the emulator)."""

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
EXAMPLES = [block for block in re.findall(r"```python\n(.*?)```", README, re.S) if "flash_attn_func(" in block]


def test_readme_has_the_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, capsys):
    exec(compile(code, "README.md", "exec"), {})
