"""`fagen profile`: the counters of a variant's kernels beside the FlashAttention IO model."""

import json
import re

import pytest
import torch

from fagen.cli import main
from fagen.profiling import default_variant_values, profile
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
    (["profile", "--seqlen", "64"], "name a spec"),
    (["profile", "fa2_d64_fp16", "--d", "64", "--seqlen", "64"], "names the whole spec"),
    (["profile", "--d", "64", "--seqlen", "64", "--heads", "3", "--kv-heads", "2"], "multiple of kv_heads"),
    (["profile", "--d", "64", "--seqlen", "0"], "seqlen_q must be a positive int"),
])
def test_profile_refuses_bad_options(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# -- variants: the kernels get their run-time values ------------------------------------------

SMALL_TILES = {"block_m": 32, "block_n": 16, "num_warps": 2}   # several blocks at a small seqlen


@pytest.mark.parametrize("feature", ["softcap", "alibi", "sinks"])
def test_variants_whose_values_change_no_count_match_the_io_model(feature):
    """Softcap, ALiBi and sinks change values, never which blocks are visited: with their values
    passed to the kernels, a causal forward still moves exactly the model's bytes, and the
    per-head arrays the model has no array for are listed apart."""
    spec = Spec(16, mask="causal", **SMALL_TILES, **{feature: True})
    values = default_variant_values(spec, heads=2)
    (forward,) = profile(spec, seqlen_q=64, heads=2, **values).passes
    assert forward.read_bytes == forward.model_read_bytes > 0
    assert forward.write_bytes == forward.model_write_bytes > 0
    per_head = {"softcap": set(), "alibi": {"alibi_slopes"}, "sinks": {"sinks"}}[feature]
    assert set(forward.left_out_bytes) == per_head and all(forward.left_out_bytes.values())


def test_a_window_skips_the_blocks_outside_it_as_the_io_model_does():
    """The kernel reads K and V only for the blocks the window reaches (counted with the reference's
    own block test), and the forward moves exactly the windowed model's bytes."""
    from fagen.reference.problem import make_problem

    spec = Spec(16, window=True, **SMALL_TILES)
    seqlen, window = 64, (8, 0)
    forward, backward = profile(spec, seqlen_q=seqlen, window_size=window, backward=True).passes
    inputs = [torch.zeros(1, seqlen, 1, 16)] * 3
    problem = make_problem(*inputs, window_size=window)
    visited = sum(not problem.block_is_masked(0, range(r, min(r + spec.block_m, seqlen)),
                                              range(c, min(c + spec.block_n, seqlen)))
                  for r in range(0, seqlen, spec.block_m) for c in range(0, seqlen, spec.block_n))
    assert visited < (seqlen // spec.block_m) * (seqlen // spec.block_n)   # the window skips some
    (launch,) = forward.launches
    assert launch.tensors["k"]["read_bytes"] == visited * spec.block_n * 16 * 2
    assert forward.read_bytes == forward.model_read_bytes
    assert forward.write_bytes == forward.model_write_bytes
    assert backward.model_read_bytes > 0


@pytest.mark.parametrize("spec, values, message", [
    (Spec(16, softcap=True), {}, "fa2_d16_softcap_fp16 has softcap: give its run-time value softcap > 0"),
    (Spec(16), {"softcap": 30.0}, "softcap is given, but fa2_d16_fp16 has no softcap"),
    (Spec(16, window=True), {"window_size": (-1, -1)}, "has window: give its run-time value window_size"),
    (Spec(16, alibi=True), {"alibi_slopes": torch.ones(3)}, "alibi_slopes must have shape"),
])
def test_profile_refuses_values_that_do_not_fit_the_spec(spec, values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        profile(spec, seqlen_q=16, heads=2, **values)


@pytest.mark.parametrize("flags", [["--d", "16", "--window", "8", "0"], ["--d", "16", "--softcap"],
                                   ["--d", "16", "--alibi", "--heads", "2"], ["--d", "16", "--sinks"],
                                   ["fa2_d16_window_fp16", "--window", "-1", "4"]])
def test_profile_runs_every_variant_flag(flags, capsys):
    assert main(["profile", *flags, "--seqlen", "16", "--backward"]) == 0
    assert "fa2_d16_" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--d", "16", "--window"], "has a sliding window, and fagen profile runs it: give its sizes, --window"),
    (["--d", "16", "--window", "-1", "-1"], "--window -1 -1 is no window (-1 is unbounded on both sides)"),
    (["--d", "16", "--causal", "--window", "-1", "3"], "--window -1 3 is no window (-1 leaves the left"),
    (["fa2_d16_fp16", "--window", "4", "0"], "--window gives a sliding window's sizes, but fa2_d16_fp16 has no"),
    (["fa2_d16_window_fp16", "--window", "4"], "--window takes two ints >= -1 (left right) or none, got 4"),
])
def test_profile_refuses_window_sizes_it_cannot_run(argv, message, capsys):
    assert main(["profile", *argv, "--seqlen", "16"]) == 2
    assert message in capsys.readouterr().err
