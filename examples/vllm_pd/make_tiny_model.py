"""Build a tiny random-weight Llama and its tokenizer locally, so real vLLM can run here without a model hub.

Why: nothing can be downloaded on these machines, yet P/D tests need a model vLLM accepts. Weights are random but
fixed by --seed (same seed => byte-identical safetensors), so greedy outputs are reproducible; a second copy built
with another seed gives a decisive transfer check (if decode used prefill's KV, its tokens follow prefill's weights).
The tokenizer is a byte-level BPE trained on the short English text below, so any input string encodes.

Run: .venv/bin/python examples/vllm_pd/make_tiny_model.py OUT_DIR [--seed 0] [--layers 2] [--hidden 128] ...
Needs transformers and tokenizers (installed by scripts/setup-vllm.sh).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"

# Training text for the tokenizer: plain English, written for this script.
CORPUS = """\
The river runs past the old mill and under the stone bridge before it reaches the sea. In spring the water is
high and fast, and the children of the village watch it from the bank, counting the branches that float by.
In summer it slows down, the fish rest in the shade of the willows, and the farmers open the gates to water
their fields.

A computer keeps its working data in memory and its long-term data on disk. When a program asks for a value,
the processor first looks in its caches, which are small but very fast, then in main memory, and only then on
the disk. Moving data between machines is slower still, so a good system tries to send each byte only once and
to overlap the transfer with useful work.

Every morning the baker lights the oven before the sun rises. She mixes flour, water, salt and yeast, lets the
dough rest, shapes the loaves and bakes them until the crust is brown and crisp. By seven o'clock the shop smells
of fresh bread, and the first customers are waiting at the door with their baskets.

Language models read text as a sequence of tokens. For each token they compute keys and values in every layer,
and they keep these in a cache so that the next token does not have to recompute the whole prompt. When one
server reads the prompt and another writes the answer, the cache must travel from the first to the second.

The weather on the hills changes quickly. A clear blue sky can turn grey in an hour, the wind rises, and rain
sweeps across the fields. Walkers who know the hills carry a warm coat, a map and some food, and they turn back
early when the clouds come down over the tops.

Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text too, along with questions like "What time is it?"
and answers like "It is half past four." A small vocabulary still covers them, because any word can be spelled
out from single bytes when no longer piece fits.
"""


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on CORPUS; deterministic, and it adds BOS in front of every sequence like Llama."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = [p.replace("\n", " ") for p in CORPUS.split("\n\n")]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD, model_max_length=1 << 20
    )


def build(
    out_dir: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 4096,
    sliding_window: int | None = None,
) -> LlamaConfig:
    """Write config, bf16 safetensors weights and tokenizer to out_dir; returns the config.

    `sliding_window`: even layers attend only to that many recent tokens (``layer_types``
    alternating sliding / full, as Gemma and gpt-oss do), so vLLM runs two KV cache groups.
    """
    tokenizer = train_tokenizer(vocab)
    hybrid: dict[str, Any] = {}
    if sliding_window is not None:
        kinds = ("sliding_attention", "full_attention")
        hybrid = {"sliding_window": sliding_window, "layer_types": [kinds[i % 2] for i in range(layers)]}
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # must match the tokenizer exactly, whatever size training reached
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",  # transformers 5 name of the former torch_dtype; vLLM's dtype="auto" reads it
        **hybrid,
    )
    _save(LlamaForCausalLM, config, tokenizer, out_dir, seed)
    return config


def _save(model_class: Any, config: Any, tokenizer: PreTrainedTokenizerFast, out_dir: Path, seed: int) -> None:
    """Random bf16 weights (fixed by `seed`), safetensors and tokenizer into `out_dir`."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def build_qwen3_next(out_dir: Path, *, seed: int = 0, layers: int = 4, hidden: int = 128, vocab: int = 512) -> Any:
    """A tiny Qwen3-Next: gated-delta-net (linear attention) layers alternating with full attention, MoE MLPs.

    vLLM then keeps a Mamba-like state group beside the attention group. Its CPU kernels want bf16
    and a head dim of 64; its loader wants MoE layers, so the MLPs are 4 tiny experts.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tokenizer = train_tokenizer(vocab)
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip
    _save(Qwen3NextForCausalLM, config, tokenizer, out_dir, seed)
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="weights seed; same seed => identical weights")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    parser.add_argument("--vocab", type=int, default=512, help="upper bound for the BPE vocabulary")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--sliding-window", type=int, default=None, help="alternate sliding-window layers")
    parser.add_argument(
        "--arch",
        choices=("llama", "qwen3_next"),
        default="llama",
        help="qwen3_next: linear-attention (state) layers alternating with full attention",
    )
    args = parser.parse_args(argv)
    if args.arch == "qwen3_next":
        build_qwen3_next(args.out_dir, seed=args.seed, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        print(f"wrote {args.out_dir}: qwen3_next, {args.layers} layers, hidden {args.hidden}, seed {args.seed}")
        return
    config = build(
        args.out_dir,
        seed=args.seed,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_positions=args.max_positions,
        sliding_window=args.sliding_window,
    )
    print(
        f"wrote {args.out_dir}: llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads x {config.head_dim}, "
        f"vocab {config.vocab_size}, seed {args.seed}"
    )


if __name__ == "__main__":
    main()
