"""Planted self-test cases (tests/selftest/): tables of fagen.selftest_cases.cases.Case whose runs pass,
return a wrong result, hang, or kill their process, so that the watchdog, the verdicts and the
gate are tested without a GPU and without building a kernel. The child process loads a table by
`--cases selftest_planted:NAME`, with tests/support on its PYTHONPATH (`CHILD_ENV`).

A run that passes appends its template to the file FAGEN_TEST_SELFTEST_RUNS names (when set), so
a test can count how many times the self-test ran.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from fagen.reference import attention_forward, attention_same_dtype
from fagen.selftest_cases.cases import Case
from fagen.selftest_cases.rule import Checks

SUPPORT = Path(__file__).resolve().parent
CHILD_ENV = (("PYTHONPATH", os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])),)
RUNS_ENV = "FAGEN_TEST_SELFTEST_RUNS"
PAUSE_ENV = "FAGEN_TEST_SELFTEST_PAUSE"   # seconds a passing run sleeps first (to overlap two processes)


def passes(device) -> list:
    time.sleep(float(os.environ.get(PAUSE_ENV, "0")))
    runs = os.environ.get(RUNS_ENV)
    if runs:
        with open(runs, "a") as f:
            f.write(f"{os.getpid()}\n")
    return []


def wrong_result(device) -> list:
    """Plain attention in fp16 by torch, its output moved by 0.5: held to the rule, it fails."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 1, 16, generator=generator) for _ in range(3))
    oracle, _ = attention_forward(q, k, v)
    same = attention_same_dtype(q.half(), k.half(), v.half(), torch.zeros(1, 16, 1, 16).half())[0]
    checks = Checks()
    checks.output("O", same.float() + 0.5, oracle, same)
    return checks.problems


def hangs(device) -> list:
    while True:
        time.sleep(1.0)


def dies(device) -> list:
    os._exit(3)


def raises(device) -> list:
    raise RuntimeError("planted: the kernel raised")


def table(**runs) -> dict:
    """{template: Case}; keyword names spell templates with '__' for '.' (sm90__d64). They run no
    kernel, so the child's check that a case ran its family's kernels is off for them."""
    return {name.replace("__", "."): Case(name.replace("__", "."), run, runs_kernels=False) for name, run in runs.items()}


# What a training call at d = 64 uses, on either family: sm90's forward and backward, sm80's; and
# a decoding step at d = 64 on sm90.
PASSING = table(sm80__d64=passes, sm90__d64=passes, sm90__backward=passes, sm90__decode=passes)
SM90_WRONG = table(sm80__d64=passes, sm90__d64=wrong_result)
# sm90's backward alone wrong: a training call at d = 64 keeps sm90's forward and runs sm80's backward;
# with sm90's forward wrong too, the whole call runs on sm80.
SM90_BACKWARD_WRONG = table(sm80__d64=passes, sm90__d64=passes, sm90__backward=wrong_result)
SM90_BOTH_WRONG = table(sm80__d64=passes, sm90__d64=wrong_result, sm90__backward=wrong_result)
SM80_WRONG = table(sm80__d64=wrong_result, sm90__d64=passes)
# The watchdog: a hang and a death among passing cases (run in this order: d64 first).
HANG = table(sm90__d64=hangs, sm90__d128=passes)
DEATH = table(sm90__d64=dies, sm90__d128=passes)
ERROR = table(sm90__d64=raises, sm90__d128=passes)
SLOW = table(sm90__d64=hangs, sm90__d128=hangs)
# Every way a case can end, in one run of three children (a hang and a death each end one).
MIXED = table(sm90__d64=hangs, sm90__d128=dies, sm90__d192=raises, sm90__d256=wrong_result, sm90__d320=passes)
