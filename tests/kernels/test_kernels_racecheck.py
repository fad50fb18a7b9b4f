"""fagen's own kernels run clean under racecheck: no shared-memory hazard, no cp.async
destination touched before its wait, no two blocks storing one element.

CI runs every variant of the committed default set (generated/) forward and backward,
and the other kernel families (FA-1, key padding, dropout, deterministic dQ, deep and
single-stage pipelines) once each; the slow tier runs the whole emulated kernel matrix
under racecheck (`python -m pytest -q -m slow tests/kernels/test_kernels_racecheck.py`).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fagen.kernels.build import default_specs
from fagen.spec import Spec
from kernel_cases import Shape, poisoned_empty, run_and_check

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAMILIES = [Spec(64, version=1, mask="causal", key_padding=True, dropout=True),
            Spec(128, mask="causal", key_padding=True, dropout=True, deterministic=True),
            Spec(64, version=1, deterministic=True, num_stages=3, block_m=64, block_n=32),
            Spec(32, mask="causal", num_stages=1, block_m=64, block_n=32, bwd_stages=1),
            Spec(256, dtype="bf16", mask="causal"),
            # V's own head dim; past 256, warp pairs sharing rows (and the dQ kernel's); 99 KB tiles.
            Spec(192, head_dim_v=128, mask="causal", dropout=True),
            Spec(320, mask="causal", key_padding=True, deterministic=True),
            Spec(512, head_dim_v=256, block_m=32, block_n=16, num_warps=4, num_stages=1, bwd_block_n=16)]


def test_mla_decoding_is_race_free():
    """One cache whose first 512 columns are V (Spec.v_from_k): the append, the attention over
    two K-only stages in two splits, the combine."""
    from kvcache_cases import check_mla

    check_mla(page=64, num_splits=2)


@pytest.fixture(autouse=True)
def racecheck(monkeypatch):
    from fagen.kernels import attention_kernels

    monkeypatch.setattr(attention_kernels, "_empty", poisoned_empty)
    monkeypatch.setenv("FAGEN_EMULATE_RACECHECK", "1")


@pytest.mark.parametrize("spec", default_specs(), ids=lambda s: s.name)
def test_shipped_variants_are_race_free(spec):
    run_and_check(spec, Shape(2, 150, 200, heads=2, kv_heads=1))


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.name)
def test_the_other_kernel_families_are_race_free(spec):
    run_and_check(spec, Shape(2, 130, 97, heads=2, kv_heads=2))


@pytest.mark.slow
def test_the_kernel_matrix_is_race_free():
    env = {**os.environ, "FAGEN_EMULATE_RACECHECK": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(HERE / "test_kernels_emulated.py")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=3600)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0 and " passed" in tail, tail


# Variants skip tiles their mask empties (no barrier at the end of a skipped step): a global
# prefix beside a local band leaves empty tiles in the middle of every row's key range.
BAND = {"mask_mod": lambda b, h, q_idx, kv_idx: (kv_idx < 4) | ((q_idx - kv_idx < 20) & (kv_idx <= q_idx)),
        "softcap": 3.0, "sinks": None}
VARIANT_FAMILIES = [Spec(64, block_m=64, block_n=32, num_stages=2, dropout=True),
                    Spec(64, version=1, block_m=64, block_n=32, num_stages=2),
                    Spec(64, deterministic=True, bwd_stages=2)]


@pytest.mark.parametrize("schedule", ["forward", "warp-serial"])
@pytest.mark.parametrize("spec", VARIANT_FAMILIES, ids=lambda s: s.name)
def test_variants_that_skip_empty_tiles_are_race_free(spec, schedule, monkeypatch):
    from variant_cases import run_variant_case

    monkeypatch.setenv("FAGEN_EMULATE_SCHEDULE", schedule)
    variant = {k: v for k, v in BAND.items() if v is not None}
    run_variant_case(spec, Shape(1, 200, 230, heads=2, kv_heads=1), variant)
    run_variant_case(spec.replace(mask="causal"), Shape(1, 180, 120, heads=2, kv_heads=2), {"window_size": (30, 0)})
