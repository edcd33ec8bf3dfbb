"""Prefill/decode disaggregation on real vLLM with the nixl_async connector, end to end, on CPU.

Builds a tiny model locally (no hub), starts a prefill and a decode vLLM server with
`NixlAsyncConnector`, a one-instance reference server and the P/D proxy, sends a few prompts
through the proxy and prints decode's answers next to the reference's.

Run (after ``bash scripts/setup.sh && bash scripts/setup-vllm.sh``)::

    .venv/bin/python examples/vllm_pd/run.py [--connector nixl_async|vllm] [--keep-logs]

The model and the servers' logs go to a temporary folder, removed at the end of a run that went well unless
``--keep-logs``.

The two servers differ from a vLLM NixlConnector set-up only in ``--kv-transfer-config``::

    {"kv_connector": "NixlAsyncConnector", "kv_connector_module_path": "nixl_async_vllm.connector",
     "kv_role": "kv_producer"}    # "kv_consumer" on the decode server
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, running

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "The baker lights the oven",
    "A computer keeps its working data in memory and its long-term data on disk. When a program asks for a value",
    "In summer the river slows down, the fish rest in the shade of the willows, and the farmers",
    "Language models read text as a sequence of tokens. For each token they compute keys and values in every layer",
]


async def ask(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> tuple[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        answer = await reply.json()
        if reply.status != 200:
            raise RuntimeError(f"{url}: {answer}")
    return answer["choices"][0]["text"], time.perf_counter() - started


async def send_prompts(proxy_url: str, single_url: str, model: str) -> bool:
    same = True
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for prompt in PROMPTS:
            pd_text, pd_s = await ask(session, proxy_url, model, prompt)
            ref_text, _ = await ask(session, single_url, model, prompt)
            same &= pd_text == ref_text
            print(f"prompt : {prompt[:70]!r}")
            print(f"  P/D  : {pd_text!r}  ({pd_s * 1e3:.0f} ms)")
            print(f"  1 inst: {ref_text!r}  {'(same)' if pd_text == ref_text else '(DIFFERENT)'}")
    return same


class WorkDir:
    """A folder for the model and the servers' logs: removed at the end of a run that went well, unless kept;
    one that failed (an exception, or `failed` set) keeps it, and says where."""

    def __init__(self, keep: bool) -> None:
        self.keep, self.failed = keep, False
        self.path = Path(tempfile.mkdtemp(prefix="vllm-pd-"))

    def __enter__(self) -> WorkDir:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if self.keep or self.failed or kind is not None:
            print(f"logs: {self.path}")
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connector", choices=["nixl_async", "vllm"], default="nixl_async")
    parser.add_argument("--keep-logs", action="store_true", help="keep the model and server logs, and say where")
    args = parser.parse_args()
    with WorkDir(args.keep_logs) as work:
        code = run(work.path, args.connector)
        work.failed = code != 0
        return code


def run(work: Path, connector: str) -> int:
    model = work / "tiny-llama"
    print(f"building a tiny model in {model} ...")
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
    prefill = VllmServer(str(model), 8100, 5600, kv_transfer_config(connector, "kv_producer"), cpu=0,
                         log_path=work / "prefill.log")  # fmt: skip
    decode = VllmServer(str(model), 8200, 5700, kv_transfer_config(connector, "kv_consumer"), cpu=1,
                        log_path=work / "decode.log")  # fmt: skip
    single = VllmServer(str(model), 8300, 5800, None, cpu=0, log_path=work / "single.log")
    print("starting prefill, decode and a reference instance (about 30-60 s) ...")
    with running(prefill, decode, single):
        proxy = ProxyProcess(8000, prefill.url, decode.url).start()
        try:
            same = asyncio.run(send_prompts(proxy.url, single.url, str(model)))
        finally:
            proxy.stop()
    print("decode's tokens equal the single instance's on every prompt" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
