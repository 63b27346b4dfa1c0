"""The sampler's KV cache builds on transformers internals: the range it was tested with
is one constant, the same as pyproject.toml's pin, and importing the sampler with a
transformers outside it fails with a message that says how to fix it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from llamarl.app.sampling import kv_cache

ROOT = Path(__file__).resolve().parents[1]


def test_tested_range_is_the_pyproject_pin():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    assert pin.specifier == SpecifierSet(kv_cache.TESTED_TRANSFORMERS)


@pytest.mark.parametrize("version", ["5.17.0", "5.25.0", "5.25.3", "5.25.0.dev0",
                                     transformers.__version__])
def test_versions_in_the_tested_range_pass(version):
    kv_cache.check_transformers(version)


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "5.26.0.dev0", "4.57.1", "6.0.0"])
def test_versions_outside_the_tested_range_are_refused(version):
    with pytest.raises(ImportError) as err:
        kv_cache.check_transformers(version)
    message = str(err.value)
    assert f"transformers {version} is installed" in message
    assert f"pip install 'transformers{kv_cache.TESTED_TRANSFORMERS}'" in message


def test_importing_the_sampler_checks_the_installed_version():
    """The check runs when the package is imported, on the installed version string."""
    code = ("import transformers; transformers.__version__ = '5.26.0'\n"
            "try:\n    import llamarl.app.sampling\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "transformers 5.26.0 is installed" in out.stdout, out.stdout + out.stderr
