"""The documentation's Python examples run as written (on CPU here, through the emulator), and do
what their comments claim.

Every ```python block of README.md and of each docs/*.md page runs, in a fresh namespace, with
the environment restored afterwards; its test id is the page and the block's number on that
page, counting from 1 ("docs/usage.md#2"). A block whose first line is `# not run: <reason>`
(one that needs a GPU, or several torch.distributed processes) is skipped, with that reason
shown: an opt-out the reader sees too. Each `print(...)  # value` line must print exactly that
line. The README's first example's dropout replays exactly (its gradients are the float64
oracle's with the very mask the forward drew). The docs' relative links, and their #anchors,
resolve; the `fagen build` synopsis in docs/usage.md lists every option the parser has.
"""

import os
import re
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from fagen.ops import dense
from fagen.reference import attention_backward, attention_forward, attention_same_dtype, dropout_keep_mask

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
PAGES = ["README.md", *DOCS]
# Every file of the documentation whose links must resolve: the pages and the package READMEs.
LINKED = PAGES + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "fagen").glob("*/README.md"))

FENCE = re.compile(r"^(?P<indent>[ \t]*)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)
NOT_RUN = re.compile(r"#\s*not run:\s*(?P<reason>\S.*?)\s*")
PRINTED = re.compile(r"^print\(.*\)\s+#\s*(?P<claim>\S.*?)\s*$", re.M)
GRAD_FACTOR, ABS_FLOOR = 3.0, 1e-5   # FlashAttention-2's rule (tests/support/kernel_cases.py)


def python_blocks(page: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, the code) for each ```python block of `page`."""
    text = (ROOT / page).read_text()
    return [(text[:m.start("code")].count("\n"), textwrap.dedent(m.group("code"))) for m in FENCE.finditer(text)]


BLOCKS = {(page, number): block for page in PAGES for number, block in enumerate(python_blocks(page), 1)}
README_FIRST = BLOCKS[("README.md", 1)][1]


def _example(page: str, number: int):
    _, code = BLOCKS[(page, number)]
    opt_out = NOT_RUN.fullmatch(code.splitlines()[0]) if code.strip() else None
    marks = [pytest.mark.skip(reason=f"{page}#{number} not run: {opt_out.group('reason')}")] if opt_out else []
    return pytest.param(page, number, id=f"{page}#{number}", marks=marks)


def run_example(page: str, number: int) -> dict:
    """Run block `number` of `page`; tracebacks name the page and its line numbers."""
    line, code = BLOCKS[(page, number)]
    namespace: dict = {"__name__": f"example_{number}"}
    with mock.patch.dict(os.environ):   # an example may set FAGEN_* variables for itself
        exec(compile("\n" * line + code, str(ROOT / page), "exec"), namespace)
    return namespace


def test_the_pages_have_their_examples():
    assert DOCS, "docs/ holds no page"
    assert PRINTED.search(README_FIRST) and "dropout replays exactly" in README_FIRST
    runnable = [key for key, (_, code) in BLOCKS.items() if not NOT_RUN.fullmatch(code.splitlines()[0])]
    assert len(runnable) >= 10


@pytest.mark.parametrize("page, number", [_example(page, number) for page, number in BLOCKS])
def test_example_runs_and_prints_what_it_says(page, number, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))   # `from generated.NAME import ...` runs from the repository root
    run_example(page, number)
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    for claim in PRINTED.finditer(BLOCKS[(page, number)][1]):
        assert claim["claim"] in printed, f"{page}#{number} says this prints {claim['claim']!r}; it printed {printed}"


def test_the_first_example_replays_its_dropout_mask_exactly():
    p = float(re.search(r"dropout_p=([0-9.]+)", README_FIRST).group(1))
    drawn = []
    real_state = dense.philox_state

    def recording(dropout_p, device):
        state = real_state(dropout_p, device)
        drawn.append(state)
        return state

    with mock.patch.object(dense, "philox_state", recording):
        ns = run_example("README.md", 1)
    (state,) = drawn
    seed, offset = (int(x) for x in state.tolist())
    q, k, v, out = (ns[name].detach().cpu() for name in ("q", "k", "v", "out"))
    batch, seqlen_q, heads, _ = q.shape
    keep = dropout_keep_mask(seed, offset, batch, heads, seqlen_q, k.shape[1], p)
    flags = dict(causal=True, dropout_p=p, keep_mask=keep)
    dout = torch.ones_like(out)            # out.sum().backward()
    ref_out, _ = attention_forward(q, k, v, **flags)
    refs = attention_backward(q, k, v, ref_out, dout, **flags)
    pt_grads = attention_same_dtype(q, k, v, dout, **flags)[1:]
    for name, ref, pt in zip("qkv", refs, pt_grads):
        got = ns[name].grad.cpu()
        err, err_pt = (got.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
        assert err <= GRAD_FACTOR * err_pt + ABS_FLOOR, (
            f"d{name}: error {err:.3g} against the oracle with the forward's own mask exceeds "
            f"{GRAD_FACTOR}x PyTorch's {err_pt:.3g}: the backward did not replay the forward's dropout")


# -- links -----------------------------------------------------------------------------------------

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)   # no headings in code
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_anchors_follow_githubs_rule():
    assert anchor("Packed sequences: `fagen.flash_attn_varlen_func`") == "packed-sequences-fagenflash_attn_varlen_func"
    assert anchor("PyTorch's SDPA signature") == "pytorchs-sdpa-signature"


@pytest.mark.parametrize("page", LINKED)
def test_relative_links_and_their_anchors_resolve(page):
    source = ROOT / page
    text = re.sub(r"^```.*?^```", "", source.read_text(), flags=re.S | re.M)
    broken = []
    for m in LINK.finditer(text):
        target = m.group("target")
        if re.match(r"[a-z]+:", target):   # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page}: broken links {broken}"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    missing = [page for page in DOCS if f"]({page})" not in readme and f"]({page}#" not in readme]
    assert not missing, f"README.md does not link {missing}"


# -- the command-line synopsis -----------------------------------------------------------------------

def _synopsis(command: str) -> str:
    """The `fagen COMMAND` lines of docs/usage.md's "Command line" block, with their continuations."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    block = re.search(r"## Command line\n+```\n(.*?)```", usage, re.S).group(1)
    entries = re.findall(rf"^fagen {command} .*(?:\n[ \t]+.*)*", block, re.M)
    assert entries, f"no `fagen {command}` in docs/usage.md's synopsis"
    return "\n".join(entries)


def test_the_build_synopsis_lists_every_flag_of_build_help():
    """Every option `fagen build --help` lists (from the parser itself, so a new one must be added)."""
    import argparse

    from fagen.cli import make_parser

    parser = make_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    synopsis = _synopsis("build")
    missing = [action.option_strings[0] for action in subcommands.choices["build"]._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction)
               and not any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", synopsis)
                           for flag in action.option_strings)]
    assert not missing, f"docs/usage.md's `fagen build` synopsis lacks {missing}"
