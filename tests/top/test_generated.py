"""The committed generated/ directory is exactly what `fagen build --default-set` writes."""

from pathlib import Path

from fagen.cli import main

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "generated"
HAND_WRITTEN = {"README.md"}


def test_generated_matches_a_fresh_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "generated"
    assert main(["build", "--default-set", "--arch", "sm_80,sm_90", "--out", str(out)]) == 0
    committed = {p.name for p in GENERATED.iterdir() if p.is_file()} - HAND_WRITTEN
    fresh = {p.name for p in out.iterdir() if p.is_file()}
    assert committed == fresh, "generated/ holds different files; rerun the command in generated/README.md"
    for name in sorted(fresh):
        assert (GENERATED / name).read_bytes() == (out / name).read_bytes(), (
            f"generated/{name} differs from a fresh build; rerun the command in generated/README.md")
