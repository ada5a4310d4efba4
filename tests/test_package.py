"""The package's shape: pure-Python parts import without the compiled extension, the
extension is a real module import, and the public names re-exported from canonical_ops
are the frontend's and the ops core's own objects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIGHT_IMPORTS = (
    "layouts",
    "canonical_ops",
    "canonical_ops.checks",
    "canonical_ops.engine",
    "canonical_ops.engine.pages",
    "canonical_ops.engine.region",
    "canonical_ops.units",
    "canonical_ops.engine.cache",
    "canonical_ops.vllm",
)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", LIGHT_IMPORTS)
def test_pure_python_parts_import_without_the_extension(module):
    code = (
        f"import sys, {module}\n"
        "loaded = [m for m in sys.modules if m == 'canonical_ops._C']\n"
        "assert not loaded, f'importing {module!r} loaded the extension'\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr


def test_the_file_store_needs_no_redis_client(tmp_path):
    """redis-py is loaded by the Redis tier only: without it the file store and StageCache
    work, and the Redis tier is one clear ImportError (the demo: one usage line, exit 2)."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'redis':\n"
        "            raise ModuleNotFoundError('No module named redis')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    result = _python(
        blocker
        + "from canonical_ops.engine import StageCache\n"
        + "from canonical_ops.units import FileStore\n"
        + "import sys; sys.path.insert(0, 'tests')\n"
        + "from helpers.store import small_namespace\n"
        + f"with FileStore({str(tmp_path)!r}, small_namespace(2), fsync=False) as files:\n"
        + "    assert files.lookup([b'k'], 0, 2) == 0\n"
        + "assert 'redis' not in sys.modules\n"
        + "try:\n"
        + "    from canonical_ops.units import RedisStore\n"
        + "except ImportError:\n"
        + "    pass\n"
        + "else:\n"
        + "    raise AssertionError('RedisStore imported without redis')\n"
        + "from canonical_ops.demo import main\n"
        + "sys.exit(main(['--preset', 'tiny', '--store', 'redis://127.0.0.1:1/0']))\n"
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "needs the redis package (pip install redis)" in result.stderr


def test_first_op_use_loads_the_extension_as_a_module():
    result = _python(
        "import sys, canonical_ops\n"
        "canonical_ops.make_plan\n"
        "ext = sys.modules['canonical_ops._C']\n"
        "assert ext.__file__.endswith(tuple(__import__('importlib.machinery').machinery"
        ".EXTENSION_SUFFIXES)), ext.__file__\n"
        "import torch; assert torch.ops.canonical.canonical_store is not None\n"
    )
    assert result.returncode == 0, result.stderr


def test_reexports_are_the_defining_modules_objects():
    import canonical_ops
    import canonical_ops.engine as engine
    from canonical_ops import ops, plan
    from canonical_ops.engine import pages, region, worker

    for name in canonical_ops.__all__:
        value = getattr(canonical_ops, name)
        homes = [m for m in (ops, plan, pages, region, worker) if hasattr(m, name)]
        if homes:
            assert value is getattr(homes[0], name), name
    for name in engine.__all__:
        assert getattr(engine, name) is getattr(canonical_ops, name), name
    # every public name of the engine is public at the top too, and every listed name resolves
    assert set(engine.__all__) <= set(canonical_ops.__all__)
    assert set(dir(canonical_ops)) >= set(canonical_ops.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        canonical_ops.nope  # noqa: B018


def test_round3_import_paths_still_work_and_name_their_replacement():
    """README names of round 3 (canonical_ops.frontend...) resolve to the moved modules."""
    code = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
try:
    import canonical_ops.frontend.store.files
except DeprecationWarning as w:
    print("warned:", w)
warnings.simplefilter("ignore", DeprecationWarning)
import canonical_ops.frontend.store.encoding as old_unit, canonical_ops.units.unit as unit
from canonical_ops.frontend.tiers import StageCache
from canonical_ops.engine.cache import StageCache as new
from canonical_ops.frontend import PageManager
import canonical_ops.frontend.demo as old_demo, canonical_ops.demo as demo
print(old_unit is unit, StageCache is new, PageManager.__module__, old_demo is demo)
print(unit.__spec__.name)
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0]
        == "warned: canonical_ops.frontend.store moved to canonical_ops.units; import it from there"
    )
    assert lines[1] == "True True canonical_ops.engine.pages True"
    assert lines[2] == "canonical_ops.units.unit"


@pytest.mark.parametrize("name", ["RegionClosedError", "PageInfo"])
def test_removed_public_names_say_what_replaces_them(name):
    import canonical_ops
    import canonical_ops.engine

    for package in (canonical_ops, canonical_ops.engine):
        with pytest.raises(AttributeError, match=f"{name} was removed: .+"):
            getattr(package, name)
