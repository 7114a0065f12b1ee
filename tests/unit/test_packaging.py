"""A non-editable install (a built wheel in a fresh virtual environment) ships recipes and configs."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_wheel_install_ships_recipes_and_configs(tmp_path):
    wheel_dir = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode != 0 and "No matching distribution found for hatchling" in build.stderr:
        pytest.skip("the package registry is unreachable: cannot fetch the build backend")
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("minippo-*.whl")

    # A fresh venv that installs minippo itself from the wheel, not from this checkout, and sees the
    # dependencies (torch, omegaconf, ...) of the interpreter running pytest. Not through
    # system_site_packages: that exposes the *base* interpreter's site-packages, which lacks them
    # when pytest runs inside a venv. Instead a .pth file in the new venv lists the running
    # interpreter's site directories (its own, a parent venv's, the base's, the user site: every
    # site-packages/dist-packages entry of sys.path). At start-up ``site`` appends those lines to
    # sys.path AFTER the new venv's site-packages, so the wheel's minippo is found first; and as
    # plain paths (not site.addsitedir) their own .pth files do not run, so an editable install of
    # this checkout (a .pth line or import hook pointing at the source tree) stays invisible.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site_dirs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    assert site_dirs, f"no site-packages directory on sys.path: {sys.path}"
    env_site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(env_site) / "_running_interpreter_sites.pth").write_text("\n".join(site_dirs) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def cli(*args):
        return subprocess.run(
            [str(env_dir / "bin" / "minippo"), *args],
            cwd=work,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    where = subprocess.run(
        [str(python), "-c", "import minippo; print(minippo.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where  # really the wheel, not the checkout

    ls = cli("ls")
    assert ls.returncode == 0, ls.stderr
    assert "async_ppo" in ls.stdout and "tiny_cpu" in ls.stdout
    for name, src in [("tiny_cpu", "configs/tiny_cpu.yaml"), ("async_ppo", "recipes/async_ppo.py")]:
        res = cli("cp", name, str(work))
        assert res.returncode == 0, res.stderr
        assert (work / Path(src).name).read_text() == (ROOT / src).read_text()
