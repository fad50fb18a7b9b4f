"""The wheel ships the templates: install it into a fresh venv and build from elsewhere."""

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_builds_from_another_directory(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
                   cwd=REPO, check=True, capture_output=True)
    (wheel,) = dist.glob("fagen-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # The wheel goes in whole; its dependencies (torch, NVRTC, ...) are borrowed
    # from the test's environment through a .pth line rather than re-downloaded.
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                    str(site), str(wheel)], check=True)
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    # NVRTC's shared library is found by site-packages search, which does not
    # look through .pth lines: point the loader at the borrowed copy.
    nvrtc_lib = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cuda_nvrtc" / "lib"
    env = {**os.environ, "FAGEN_CACHE_DIR": str(tmp_path / "cache"),
           "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(nvrtc_lib),
                                                            os.environ.get("LD_LIBRARY_PATH")]))}
    probe = subprocess.run([python, "-c", "import fagen, fagen.kernels.render as c; print(fagen.__file__); "
                            "print(c.template_dir())"], cwd=work, env=env, capture_output=True, text=True,
                           check=True)
    fagen_file, template_dir = probe.stdout.split()
    assert fagen_file.startswith(str(site)) and template_dir.startswith(str(site))
    fagen_bin = env_dir / "bin" / "fagen"
    if not fagen_bin.exists():  # pip --target does not write console scripts
        fagen_bin = None
    cmd = [str(fagen_bin)] if fagen_bin else [str(python), "-m", "fagen.cli"]
    result = subprocess.run(cmd + ["build", "--d", "64", "--causal", "--arch", "sm_80", "--out", "gen"],
                            cwd=work, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (work / "gen" / "fa2_d64_causal_fp16.cu").is_file()
    assert (work / "gen" / "fa2_d64_causal_fp16.json").is_file()
