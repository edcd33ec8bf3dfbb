"""The vLLM scenarios serve every set-up the same prompts (pure logic)."""

from nixl_async_benchmarks.vllm import nth_run, paired_prompts


def test_the_nth_run_of_each_setup_gets_the_same_prompts():
    """Before session 38 each prompt's tag named its set-up, and `make_prompt` picks words by the tag's length:
    the adapter's prompts came out ~5 tokens longer than NixlConnector's, past vLLM's 128-token CPU block, so
    every adapter request moved two KV blocks to NixlConnector's one (found by an audit of the benchmarks)."""
    order = ["nixl_async", "vllm", "vllm", "nixl_async", "nixl_async", "vllm"]
    runs = [nth_run(order, index) for index in range(len(order))]
    assert runs == [0, 0, 1, 1, 2, 2]
    by_setup: dict[str, list[dict[int, list[str]]]] = {}
    for setup, run in zip(order, runs, strict=True):
        by_setup.setdefault(setup, []).append(paired_prompts(run, 100, 100))
    assert by_setup["nixl_async"] == by_setup["vllm"]
    every = [p for prompts in by_setup["vllm"] for batch in prompts.values() for p in batch]
    assert len(set(every)) == len(every)  # unique: no prefix cache hit within or across runs
    assert len({len(p) for p in every}) == 1 and len({len(p.split()) for p in every}) == 1  # one length for all
