"""The README's Python examples run as written (on CPU here, through the emulator), and do
what their comments claim: each `print(...)  # value` prints that value, and the first
example's dropout replays exactly (its gradients are the float64 oracle's with the very
mask the forward drew)."""

import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from fagen.ops import dense
from fagen.reference import attention_backward, attention_forward, attention_same_dtype, dropout_keep_mask

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
EXAMPLES = [block for block in re.findall(r"```python\n(.*?)```", README, re.S)
            if any(call in block for call in ("flash_attn_func(", "fagen.sdpa(", 'attn_implementation="fagen"'))]
PRINTED = re.compile(r"^print\(.*\)\s+#\s*(\S+)\s*$", re.M)
GRAD_FACTOR, ABS_FLOOR = 3.0, 1e-5   # FlashAttention-2's rule (tests/kernel_cases.py)


def test_readme_has_the_examples():
    assert len(EXAMPLES) >= 2
    assert PRINTED.search(EXAMPLES[0]) and "dropout replays exactly" in EXAMPLES[0]


def run_example(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs_and_prints_what_it_says(code, capsys):
    run_example(code)
    printed = capsys.readouterr().out.split()
    for expected in PRINTED.findall(code):
        assert expected in printed, f"the README says this prints {expected!r}; it printed {printed}"


def test_the_first_example_replays_its_dropout_mask_exactly():
    code = EXAMPLES[0]
    p = float(re.search(r"dropout_p=([0-9.]+)", code).group(1))
    drawn = []
    real_state = dense.philox_state

    def recording(dropout_p, device):
        state = real_state(dropout_p, device)
        drawn.append(state)
        return state

    with mock.patch.object(dense, "philox_state", recording):
        ns = run_example(code)
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


def _synopsis(command: str) -> str:
    """The README's `fagen COMMAND` lines in its "Command line" block, with their continuations."""
    block = re.search(r"## Command line\n+```\n(.*?)```", README, re.S).group(1)
    entries = re.findall(rf"^fagen {command} .*(?:\n[ \t]+.*)*", block, re.M)
    assert entries, f"no `fagen {command}` in the README's synopsis"
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
    assert not missing, f"the README's `fagen build` synopsis lacks {missing}"
