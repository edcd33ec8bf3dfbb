"""P/D on real vLLM with hybrid models: the adapter against vLLM's NixlConnector and one instance.

The `vllm` scenario's method on a Llama alternating sliding-window (64 tokens) and full
attention layers, and on a Qwen3-Next (gated-delta-net state layers alternating with full
attention), both with vLLM's hybrid allocator on.
"""

from __future__ import annotations

from .common import Result
from .vllm import STATE, WINDOW, run_models


def run(quick: bool = False) -> Result:
    return run_models([WINDOW] if quick else [WINDOW, STATE], "vllm_hybrid")
