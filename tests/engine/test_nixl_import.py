"""Importing the engine loads the NIXL wheel `import nixl` would choose, without importing torch."""

import subprocess
import sys


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()  # fmt: skip


def test_the_engine_loads_nixls_own_wheel_without_importing_torch():
    # With a CPU-only torch, `import nixl` imports torch to look for a CUDA version (seconds in every
    # process: each test peer, each CLI call) and then takes its first wheel; we take it directly.
    ours = _python("import sys, nixl_async._agent as a; print(a._bindings.__name__, 'torch' in sys.modules)")
    nixls = _python("import nixl; print(nixl._bindings.__name__)")
    wheel, torch_imported = ours.split()
    assert wheel == nixls
    assert torch_imported == "False"
    # and once torch (or nixl) is imported, as in a vLLM worker, nixl's own choice is taken as it is
    assert _python("import torch, nixl_async._agent as a, nixl; print(a._bindings is nixl._bindings)") == "True"
