"""What users install: every subpackage reaches the wheel, and the TRL/transformers range is pinned.

The full proof (build the wheel, install it non-editable in a fresh venv, import and run the
quickstart from outside the checkout) is `.ci/check_wheel.sh`, run by `.ci/run`; these checks are
the fast part of it.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]


def _setup_module():
    spec = importlib.util.spec_from_file_location("jetrl_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    import setuptools

    original, setuptools.setup = setuptools.setup, lambda **kw: None  # read the package list, build nothing
    try:
        spec.loader.exec_module(module)
    finally:
        setuptools.setup = original
    return module


def test_every_source_folder_is_a_discovered_package():
    setup = _setup_module()
    packages = set(setup.discover_packages())
    for name, folder in setup.PACKAGE_DIR.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.parent.relative_to(ROOT / folder)
            package = ".".join([name, *rel.parts]) if rel.parts else name
            assert (path.parent / "__init__.py").exists(), f"{path.parent} has modules but no __init__.py"
            assert package in packages, f"{package} ({path}) would be missing from the wheel"


def test_ci_installs_the_wheel_non_editable():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/check_wheel.sh" in ci
    check = (ROOT / ".ci" / "check_wheel.sh").read_text()
    assert "python3 -m venv" in check and "pip wheel" in check and "quickstart.py\" --fast" in check


def test_trl_and_transformers_have_a_tested_upper_bound():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in ("trl", "transformers"):
        (spec,) = [d[len(name) :] for d in deps if re.match(rf"{name}[<>=!~ ]", d)]
        specifier = SpecifierSet(spec)
        assert any(s.operator == "<" for s in specifier), f"{name} needs an upper bound: {spec}"
        assert version(name) in specifier, f"installed {name} {version(name)} is outside the tested {spec}"
