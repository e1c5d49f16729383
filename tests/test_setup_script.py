"""``scripts/setup.sh`` on an unlucky machine, run as a user runs it.

Each test runs a copy of the script and of ``pyproject.toml`` in a clone of its own under
``tmp_path`` (its path has a space in it), never this checkout's ``.venv``. Hermetic: pip
has no index and no configuration (``PIP_NO_INDEX``, ``PIP_CONFIG_FILE=/dev/null``), so
any install fails at once; the tests look at what the script decided before that, what it
left behind and what it said. The script runs in a child process with a timeout
(``subprocess.run`` kills and reaps it on timeout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable))
TOOLS = ("bash", "cat", "cut", "dirname", "sha256sum")


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    root = tmp_path / "a clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", root / "scripts")
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def setup_sh(
    root: Path, *, path: Path | None = None, interruptible: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the clone's ``scripts/setup.sh`` with pip cut off from any index.

    ``interruptible``: SIGINT at its default in the script (the test runner may have it
    ignored, and a child inherits that), and the script in a process group of its own, as
    a terminal runs a command, so that a SIGINT to its group reaches only it."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "P2PKV_"))
    }
    base.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", P2PKV_VLLM="0")
    if path is not None:
        base["PATH"] = str(path)
    base.update(env)
    argv = [shutil.which("bash") or "/bin/bash", str(root / "scripts" / "setup.sh")]
    if interruptible:
        default_sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        default_sigint += "os.execv(sys.argv[1], sys.argv[1:])"
        argv = [sys.executable, "-c", default_sigint, *argv]
    return subprocess.run(
        argv,
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root.parent,
        start_new_session=interruptible,
    )


def bin_with(tmp_path: Path, pythons: dict[str, str | Path]) -> Path:
    """A PATH directory holding the script's tools and the given pythons: a str is the
    version a FAKE python reports (and nothing else), a Path the real interpreter."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        (directory / tool).symlink_to(found)
    for name, python in pythons.items():
        if isinstance(python, Path):
            (directory / name).symlink_to(python)
        else:
            fake = directory / name
            fake.write_text(f"#!/bin/sh\necho {python}\n")
            fake.chmod(0o755)
    return directory


def make_venv(root: Path) -> Path:
    """A complete venv at ``root/.venv``, stamped as set up for this pyproject.toml."""
    venv = root / ".venv"
    subprocess.run([str(BASE_PYTHON), "-m", "venv", str(venv)], check=True, timeout=300)
    stamp = subprocess.run(
        ["sha256sum", str(root / "pyproject.toml")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()[0]
    (venv / ".p2pkv-setup").write_text(stamp + "\n")
    return venv


def fake_dist(site: Path, name: str, requires: list[str]) -> None:
    """A FAKE installed distribution: only its metadata, naming its requirements."""
    info = site / f"{name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 0.1.0"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def site_packages(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    return site


def test_a_venv_left_half_built_by_an_interrupted_run_is_rebuilt(clone: Path) -> None:
    """An interrupt during ``python -m venv`` leaves ``.venv/bin/python`` and nothing else
    (no pip, no activate). Every later run trusted it and failed at once with
    ``.venv/bin/activate: No such file or directory``, for good."""
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "python").symlink_to(BASE_PYTHON)
    done = setup_sh(clone, PYTHON=str(BASE_PYTHON))
    assert (clone / ".venv" / "bin" / "activate").is_file(), done.stderr
    pip = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-m", "pip", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pip.returncode == 0, pip.stderr
    assert "rebuilding .venv" in done.stderr
    assert done.returncode != 0  # no index: the install itself fails, and says so


def test_no_python_new_enough_is_named_and_leaves_no_venv(tmp_path: Path, clone: Path) -> None:
    """``python3`` older than 3.11 and no other: the script made a 3.10 ``.venv`` (here the
    FAKE made none and the script failed on ``activate``), which every later run kept even
    with ``PYTHON`` naming a newer one. It now says what it needs and what it found."""
    done = setup_sh(clone, path=bin_with(tmp_path, {"python3": "3.10.13"}))
    assert done.returncode != 0
    assert "Python >= 3.11" in done.stderr and "python3 is 3.10.13" in done.stderr
    assert not (clone / ".venv").exists()


def test_an_older_python3_is_passed_over_for_a_newer_python3_x(tmp_path: Path, clone: Path) -> None:
    minor = f"python3.{sys.version_info.minor}"
    path = bin_with(tmp_path, {"python3": "3.10.13", minor: BASE_PYTHON})
    done = setup_sh(clone, path=path)
    cfg = (clone / ".venv" / "pyvenv.cfg").read_text()
    assert f"version = 3.{sys.version_info.minor}." in cfg, done.stderr
    assert done.returncode != 0  # no index


def test_a_python_named_by_python_that_is_too_old_is_refused(tmp_path: Path, clone: Path) -> None:
    fake = bin_with(tmp_path, {"old-python": "3.9.18"}) / "old-python"
    done = setup_sh(clone, PYTHON=str(fake))
    assert done.returncode != 0
    assert "Python >= 3.11" in done.stderr and "3.9.18" in done.stderr
    assert not (clone / ".venv").exists()


def test_a_package_gone_from_a_stamped_venv_is_installed_again(clone: Path) -> None:
    """The stamp says only that an install once finished. A package removed since (``pip
    uninstall msgspec``) was never put back: the script exited 0 and ``demo.sh`` failed on
    ``ModuleNotFoundError: No module named 'msgspec'``. Here p2pkv is a FAKE distribution
    (metadata only) whose ``msgspec`` is missing; the script must try to install again
    (and fail: no index) and say what was missing."""
    venv = make_venv(clone)
    fake_dist(site_packages(venv), "p2pkv", ["msgspec>=0.19", 'pytest>=9; extra == "test"'])
    done = setup_sh(clone)
    assert done.returncode != 0, done.stderr
    assert "msgspec" in done.stderr and "pytest" in done.stderr


def test_a_stamped_venv_without_p2pkv_is_set_up_again(clone: Path) -> None:
    make_venv(clone)
    done = setup_sh(clone)
    assert done.returncode != 0, done.stderr
    assert "lacks p2pkv" in done.stderr


def test_a_pythonpath_of_the_caller_does_not_count_as_installed(
    tmp_path: Path, clone: Path
) -> None:
    """A ``PYTHONPATH`` naming another environment's site-packages made pip take what it
    held as installed: the first run left ``.venv`` with almost nothing in it, stamped,
    and the demo ran on the other environment's packages. Here msgspec is a FAKE
    distribution on the ``PYTHONPATH`` only: the script must see it missing."""
    venv = make_venv(clone)
    fake_dist(site_packages(venv), "p2pkv", ["msgspec>=0.19"])
    elsewhere = tmp_path / "elsewhere"
    fake_dist(elsewhere, "msgspec", [])
    done = setup_sh(clone, PYTHONPATH=str(elsewhere))
    assert done.returncode != 0, done.stderr
    assert "lacks msgspec" in done.stderr


def test_ctrl_c_during_the_torch_install_stops_the_script(clone: Path) -> None:
    """pip exits 1 on Ctrl-C, not by the signal, so bash went on: the interrupted torch
    install was taken for "no such build" and the fallback index tried, then the rest of
    the install ran to its end. Here a FAKE ``.pth`` file in the venv sends SIGINT to the
    script's whole process group (as a terminal's Ctrl-C does) when pip starts the torch
    install, and that python exits 1. The script must stop there, with 130."""
    venv = make_venv(clone)
    (venv / ".p2pkv-setup").unlink()
    (site_packages(venv) / "zz_fake_ctrl_c.pth").write_text(
        "import os, signal, sys; 'torch==2.13.0+cpu' in sys.argv and os.killpg(0, signal.SIGINT)\n"
    )
    done = setup_sh(clone, interruptible=True)
    assert done.returncode == 130, done.stderr
    assert "No matching distribution found for torch==2.13.0" not in done.stderr
    assert "interrupted" in done.stderr


def test_no_torch_anywhere_says_which_indexes_were_asked(clone: Path) -> None:
    """With no index reachable pip's last words were "No matching distribution found for
    torch==2.13.0" (the first try's messages hidden), as if that build did not exist."""
    make_venv(clone)
    done = setup_sh(clone, P2PKV_TORCH_INDEX="http://127.0.0.1:9/cpu")
    assert done.returncode != 0
    assert "http://127.0.0.1:9/cpu" in done.stderr and "reachable" in done.stderr
