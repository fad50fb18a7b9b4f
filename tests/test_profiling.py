"""`fagen profile`: the counters of a variant's kernels beside the FlashAttention IO model."""

import json

import pytest

from fagen.cli import main
from fagen.profiling import profile
from fagen.spec import Spec


@pytest.mark.parametrize("spec", [Spec(64, mask="causal", block_m=64, block_n=32), Spec(32, key_padding=True)],
                         ids=lambda s: s.name)
def test_the_fa2_forward_moves_exactly_the_io_models_bytes(spec):
    """Q once, K and V once per visited tile, O and L once: the paper's tiled algorithm's
    traffic (fagen.reference.fa2_forward) is what the kernel reads and writes."""
    result = profile(spec, seqlen_q=150, seqlen_k=97, batch=2, heads=4, kv_heads=2)
    (forward,) = result.passes
    assert forward.read_bytes == forward.model_read_bytes > 0
    assert forward.write_bytes == forward.model_write_bytes > 0


def test_profile_prints_a_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "counters.json"
    assert main(["profile", "fa2_d32_causal_fp16", "--seqlen", "70", "--heads", "2", "--backward",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fa2_d32_causal_fp16_fwd" in out and "fa2_d32_causal_fp16_bwd" in out and "model" in out
    data = json.loads(path.read_text())
    assert set(data["passes"]) == {"forward", "backward"}
    for kernel in ("fa2_d32_causal_fp16_fwd", "fa2_d32_causal_fp16_bwd", "fa2_d32_causal_fp16_bwd_dq_convert"):
        info = data["kernels"][kernel]
        for key in ("hbm_read_bytes", "hbm_write_bytes", "bank_conflicts", "sectors_per_request", "mma",
                    "barriers"):
            assert key in info, (kernel, key)
    assert data["kernels"]["fa2_d32_causal_fp16_fwd"]["mma"] > 0
    assert data["kernels"]["fa2_d32_causal_fp16_fwd"]["counters"]["ldmatrix_conflicts"] == 0   # padded rows
    assert "not timed on a GPU" in data["note"]


@pytest.mark.parametrize("argv, message", [
    (["profile", "--seqlen", "64"], "name a variant"),
    (["profile", "fa2_d64_fp16", "--d", "64", "--seqlen", "64"], "names the whole variant"),
    (["profile", "--d", "64", "--seqlen", "64", "--heads", "3", "--kv-heads", "2"], "multiple of kv_heads"),
    (["profile", "--d", "64", "--seqlen", "0"], "seqlen_q must be a positive int"),
])
def test_profile_refuses_bad_options(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
