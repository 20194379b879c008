#!/usr/bin/env python3
"""Prove tinytp's GPU path in one run of under six minutes, on a bare GPU machine with a python3 of
its own (a CUDA build of torch, transformers, pytest): nothing is installed.

    python3 .ci/gpu.py               # on a GPU: the steps below, the 8B's shapes
    python3 .ci/gpu.py --device cpu  # the same steps on CPU with tiny models (CI runs this)

The steps, each a process of its own within a time limit (docs/gpu.md says how to read them):
  pre-flight     one rank joins a process group as tinytp's workers do (nccl on CUDA, gloo
                 on CPU) and all-reduces; if it fails, the steps that start workers do not run
  tests          test_tinytp.py's CUDA tests
  sdpa           tinytp's choice of attention backends first; with it, model.py's own attention
                 call sites (its attention layer at the 8B's shapes: prefill, decodes with and
                 without a mask, the fixed-shape step, a chunk beside decodes), each named, with
                 the backend it ran, the layouts SDPA returned and its agreement with the unfused
                 kernel; then which backend runs each of tinytp's calls alone (tinytp's choice,
                 each backend alone, PyTorch's own last): ok or failed, and its time
  decode step    tinytp on Llama-3.1-8B's shapes (dummy weights, tp=1, batch 8): one decode step
                 under torch.profiler in the worker (kernels, their sum, the GPU's idle gaps)
                 beside the step's own time; peak GPU memory; the 8B's matmuls alone, back to
                 back (the achievable floor) beside the read-rate floor
  tinytp         bench.py on the 8B's shapes (llama-3.1-8b-instruct.json, bfloat16, tp=1,
                 batch 8, input 128, output 256)
  mission: ...   the mission's command in spirit: checkpoints.py writes a random checkpoint
                 of the 8B's exact shapes at 4 layers; tinytp.py's CLI runs it; its greedy
                 tokens at tp=1 and at tp=2 (both ranks on the one GPU, over gloo) are checked
                 against transformers in bfloat16, teacher-forced
  cuda graphs    LLM(cuda_graphs=True) on the mission's checkpoint: every step's logits
                 against the same fixed-shape step run eagerly (the same kernels at the same
                 shapes: equal tokens, logits equal or within GRAPH_ULPS bfloat16 ulps), and
                 the decode step timed as graphs, at the fixed shape eagerly, and on the
                 default path (on CPU, which has no graphs, the fixed-shape step runs eagerly
                 both ways)
  transformers   bench.py --backend hf on the 8B's shapes, with tinytp's attention backends;
                 the one step that may be cut for time without failing the run
Then the report, and the budget table: each step's limit beside its seconds. With $OUT set, two
files: gpu.json, the summary, written first and again as each step starts (a run cut short still
brings back what it found), and steps.log, every step's output in turn. A step that fails or runs
out of time is reported and the others still run; one out of time is stopped as Ctrl-C stops
tinytp, so that it leaves nothing in /dev/shm. The exit status says whether all passed; on CPU
(CI) also whether every step spent at most half its GPU limit on its CPU-side work.
On one GPU, nccl at tp=2, its speed and a second GPU stay unproven, and the report says so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tinytp  # noqa: E402 (from ROOT, for the probes)
from worker import Worker, choose_cuda_attention_backends  # noqa: E402

# The device (docs/gpu.md, "The budget"): one command may run 600 s, and a session has 15 device-
# minutes in all, a fresh machine's start (1 to 2 minutes) and its idle waits included. A first run
# and one rerun must fit, the rerun sent while the machine is warm (it waits 30 s), the machine
# given back after it: each run's command is given RUN_SECONDS.
COMMAND_LIMIT, DEVICE_SECONDS, MACHINE_START, WARM = 600, 15 * 60, 120, 30
RUN_SECONDS = 363
assert RUN_SECONDS <= COMMAND_LIMIT
assert MACHINE_START + RUN_SECONDS + WARM + RUN_SECONDS <= DEVICE_SECONDS
# The run from the start of main to its report: python's start and torch's import come first.
BUDGET_SECONDS = RUN_SECONDS - 30
# Each step's limit, in seconds: at least twice its CPU-side work (imports, test collection, model
# building), measured by the CPU run (check_budget), with room for the GPU's own. They add up to the
# budget less what the run does outside them (its checks before the first step, the report, one
# step's grace to stop), so that no step is cut for time a slower one used up.
STEP_LIMITS = {
    "pre-flight": 15,
    "tests": 50,
    "sdpa": 20,
    "decode step": 28,
    "tinytp": 35,
    "mission: write": 15,
    "mission: cli": 26,
    "mission: tokens": 42,
    "mission: transformers": 24,
    "cuda graphs": 34,
    "transformers": 24,
}
OUTSIDE_THE_STEPS = 20
assert sum(STEP_LIMITS.values()) <= BUDGET_SECONDS - OUTSIDE_THE_STEPS
# On CPU the run is the GPU run's host side alone (tiny models, eager as on a GPU: EAGER): a step
# that spends more than this share of its GPU limit on it leaves too little for the GPU's work.
CPU_SIDE_SHARE = 0.5
MAY_BE_CUT = {"transformers"}  # out of time there: reported, but the run still passes
# On CPU (CI) the steps run on cores that other programs may be using: the budget and every limit
# this many times longer, to end a hung step; the budget check (CPU_SIDE_SHARE) is the measure.
CPU_SCALE = 4
# A step out of time is stopped as Ctrl-C stops tinytp (SIGINT to its process group), whose driver
# then stops its workers and frees its shared memory; STOP_GRACE seconds later by SIGTERM, then by
# SIGKILL (see stop_step).
STOP_GRACE = 5
# The steps that start tinytp's workers, which join a process group as the pre-flight does.
JOIN_A_PROCESS_GROUP = {
    "tests",
    "decode step",
    "tinytp",
    "mission: cli",
    "mission: tokens",
    "cuda graphs",
}

# What each device runs: the model to benchmark, and bench.py's shape and dtype settings.
with open(os.path.join(ROOT, "llama-3.1-8b-instruct.json")) as f:
    LLAMA_31_8B = json.load(f)
TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
}
SETTINGS = {
    "cuda": {
        "model": ("Llama-3.1-8B-Instruct", LLAMA_31_8B),
        "dtype": "bfloat16",
        "batch": 8,
        "input": 128,
        "output": 256,
        "warmup": 1,
        "iterations": 3,
    },
    "cpu": {
        "model": ("tiny Llama", TINY),
        "dtype": "float32",
        "batch": 2,
        "input": 16,
        "output": 8,
        "warmup": 1,
        "iterations": 2,
    },
}
# transformers' eager decode is slower: fewer rounds fit
HF_ITERATIONS = {"warmup": 1, "iterations": 1}
# The mission's checkpoint: the 8B's shapes at 4 layers (checkpoints.py); on CPU also narrower.
MISSION_CHECKPOINT = {
    "cuda": ["--layers", "4"],
    "cpu": ["--layers", "2", "--hidden-size", "128", "--intermediate-size", "256"],
}
# On a GPU tinytp never compiles its steps (Worker.load_model); on one CPU rank it would, seconds
# that a GPU run never spends. The CPU run runs eagerly, as a GPU's host does: its time is then the
# GPU run's CPU-side work (the budget check, below).
EAGER = {"cuda": {}, "cpu": {"enforce_eager": True}}
EAGER_FLAGS = {"cuda": [], "cpu": ["--enforce-eager"]}  # the same, for bench.py and tinytp.py
MISSION_PROMPT, MISSION_TOKENS = "What is the capital of France?", 32
MISSION_DIR = "llama-3.1-8b-shapes"  # in the run's working directory
PROBE_RESULT = "probe result: "  # the line with which a probe hands its JSON back
PROBE_FAILED = "probe failed: "  # or says why it failed, in one line
DEVICE_FILES = 8  # the files the device brings back from $OUT, at most
UNPROVEN = (
    "Unproven on one GPU: nccl at tp=2 (the tp=2 runs here put both ranks on the one GPU, over "
    "gloo, for function only), its speed, and a second GPU."
)


def versions(device: str) -> dict:
    import transformers

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch cuda": torch.version.cuda,
    }
    if device == "cuda":
        found.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
            nccl=str(torch.cuda.nccl.version()),
        )
        try:
            found["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split("\n")[0]
        except (OSError, subprocess.TimeoutExpired):
            found["driver"] = None
    else:
        found.update(
            cpu=platform.processor() or platform.machine(), cores=len(os.sched_getaffinity(0))
        )
    return found


def synchronizer(device: str):
    return torch.cuda.synchronize if device == "cuda" else lambda: None


def best_seconds(run, device: str, repeats: int = 5) -> float:
    """The best of `repeats` timed calls of run(), after one to warm up."""
    synchronize = synchronizer(device)
    best = math.inf
    for _ in range(repeats + 1):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(device: str) -> float:
    """Bytes per second that a sum over a large tensor reads: the ceiling for a decode step,
    which only reads its weights. (A copy would count each byte twice over: it also writes.)"""
    size = (2 << 30) if device == "cuda" else (256 << 20)
    data = torch.ones(size // 4, dtype=torch.float32, device=device)
    seconds = best_seconds(data.sum, device)
    del data
    if device == "cuda":
        torch.cuda.empty_cache()  # the benchmarks that follow are other processes: give it back
    return size / seconds


# --------------------------------------------------------------------------------------
# The probes: each runs as `.ci/gpu.py --probe NAME --device D ARGS`, a process of its own, and
# prints its result as one JSON line. tinytp's workers import this file as spawn does, so the
# functions that run in them (through collective_rpc) are found there too.
# --------------------------------------------------------------------------------------


def sdpa_calls(config: dict, settings: dict, device: str) -> dict:
    """The calls model.py's attention makes, at the model's shapes: a batch's prefill from
    position 0 (causal, each KV head repeated for its query heads), and a decode step at the
    longest context (the query heads of each KV head as one longer query, keys and values read
    from the cache as a strided view), with a boolean mask for rows of different lengths (as
    every fixed-shape step has) and without one for rows of one length."""
    dtype = getattr(torch, settings["dtype"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, group = config["hidden_size"] // heads, heads // kv_heads
    batch, prompt, context = (
        settings["batch"],
        settings["input"],
        settings["input"] + settings["output"],
    )

    def random(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    positions = torch.arange(context - batch, context, device=device)  # rows of different lengths
    # [batch, 1, 1 token, context]
    mask = torch.arange(context, device=device) <= positions[:, None, None, None]
    # [batch, kv_heads, context, head_dim]
    cache = random(batch, context, kv_heads, head_dim).transpose(1, 2)
    return {
        "prefill": (
            (
                random(batch, heads, prompt, head_dim),
                random(batch, heads, prompt, head_dim),
                random(batch, heads, prompt, head_dim),
            ),
            {"attn_mask": None, "is_causal": True},
        ),
        "decode": (
            (random(batch, kv_heads, group, head_dim), cache, cache.clone()),
            {"attn_mask": mask, "is_causal": False},
        ),
        "decode, one length": (
            (random(batch, kv_heads, group, head_dim), cache, cache.clone()),
            {"attn_mask": None, "is_causal": False},
        ),
    }


def call_sites(config: dict, settings: dict, device: str, dtype: str) -> dict:
    """model.py's own attention calls: its attention layer (LlamaAttention.forward: the SDPA calls
    and what it does with their outputs) at the model's shapes, built by Worker.load_model (one
    layer, dummy weights, tp=1), fed by Worker.prepare_inputs for each kind of step, with random
    keys and values in the cache. Each site: its inputs, and a way to run the layer on them."""
    from checkpoints import config_from_dict
    from model import kv_cache_shape
    from worker import CachedRequest, SamplingParams

    batch, prompt = settings["batch"], settings["input"]
    context = prompt + settings["output"]
    rank = Worker(0, 1)
    rank.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    rank.dtype = getattr(torch, dtype)
    one_layer = config_from_dict({**config, "num_hidden_layers": 1})
    # dummy: no directory; eager: the layer is called here as it is, uncompiled, as on a GPU
    rank.load_model(one_layer, None, context, load_format="dummy", enforce_eager=True)
    # Worker.init_kv_cache's blocks, random (its zeros would make every output zero), without its
    # question to a process group (this process joins none); request i in the blocks after block 0
    block_size = 16
    per_request = -(-context // block_size)
    generator = torch.Generator(rank.device).manual_seed(0)
    shape = kv_cache_shape(rank.config, 1, batch * per_request + 1, block_size)
    rank.kv_caches = [torch.randn(shape, generator=generator, dtype=rank.dtype, device=rank.device)]
    rank.block_size = block_size
    layer, hidden = rank.model.layers[0].self_attn, config["hidden_size"]

    def rows(*requests):  # (tokens cached, tokens this step) of requests 0, 1, ...
        return [
            (
                CachedRequest(
                    [0] * (cached + n),
                    cached,
                    list(range(1 + i * per_request, 1 + (i + 1) * per_request)),
                    SamplingParams(),
                    None,
                ),
                n,
            )
            for i, (cached, n) in enumerate(requests)
        ]

    different = [(prompt + i, 1) for i in range(batch)]  # decodes of different lengths
    longest = max(cached for cached, _ in different)
    sites = {
        "prefill, causal": (rows(*[(0, prompt)] * batch), None),
        "decode, rows of one length": (rows(*[(context - 1, 1)] * batch), None),
        "decode, rows of different lengths, masked": (rows(*different), None),
        # as Worker.cuda_graph_step: every request a row, a power of two of positions
        "fixed-shape decode step (CUDA graphs' shape), masked": (
            rows(*different),
            min(context, max(16, 1 << longest.bit_length())),
        ),
        "a prompt's later chunk beside decodes, masked": (
            rows(*different[:-1], (prompt // 2, prompt - prompt // 2)),
            None,
        ),
    }

    def runner(scheduled, context_len):
        inputs = rank.prepare_inputs(scheduled, context_len)
        x = torch.randn(
            len(inputs.input_ids), hidden, generator=generator, device=rank.device, dtype=rank.dtype
        )
        cos, sin = rank.model.rope_table[:, inputs.positions]
        return lambda: layer(x, cos, sin, rank.kv_caches[0], inputs)

    return {site: runner(*args) for site, args in sites.items()}


def attention_operators(profile) -> list[str]:
    return sorted(
        {
            e.name
            for e in profile.events()
            if e.name.startswith("aten::_") and ("attention" in e.name or "attn" in e.name)
        }
    )


def probe_call_sites(config: dict, settings: dict, device: str, dtype: str) -> dict:
    """Each of model.py's attention call sites (call_sites) run through its attention layer with
    the backends chosen now, then on the unfused (math) kernel alone: ok or failed (PyTorch's
    reason), the operators it ran, the layouts of SDPA's outputs (which the layer must flatten
    whatever they are: docs/gpu.md), and the largest difference from the unfused run, over the
    largest output, within a tolerance (rounding: 1e-3 in float32, 0.1 in half precision; heads
    out of order differ by about 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa, found = torch.nn.functional.scaled_dot_product_attention, {}
    tolerance = 1e-3 if dtype == "float32" else 0.1
    for site, run in call_sites(config, settings, device, dtype).items():
        layouts = collections.Counter()

        def recording(*args, **kwargs):
            out = sdpa(*args, **kwargs)
            layouts["contiguous" if out.is_contiguous() else "other layouts"] += 1
            return out

        try:
            with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording):
                with (
                    torch.inference_mode(),
                    torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU]
                    ) as profile,
                ):
                    out = run().float()
            with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
                unfused = run().float()
        except RuntimeError as e:
            found[f"{site}, {dtype}"] = {"ok": False, "why": [str(e).split("\n")[0]]}
            continue
        difference = ((out - unfused).abs().max() / unfused.abs().max()).item()
        found[f"{site}, {dtype}"] = {
            "ok": True,
            "operators": attention_operators(profile),
            "outputs": dict(layouts),
            "largest_difference": difference,
            "tolerance": tolerance,
            "agrees": difference <= tolerance,
        }
    if device == "cuda":
        torch.cuda.empty_cache()
    return found


def probe_sdpa(device: str, config: dict, settings: dict) -> dict:
    """tinytp's choice of backends first (choose_cuda_attention_backends, as its workers choose on
    CUDA), before any other: a backend that faults (cuDNN's, say) must not leave the process
    broken for it. With it, model.py's own call sites (probe_call_sites: through the attention
    layer, in the run's dtype and in float32); then each of tinytp's calls alone (sdpa_calls) with
    tinytp's choice, with each backend alone (sdpa_kernel chooses it, whatever was chosen
    before), cuDNN's last, and last with PyTorch's own choice (every backend enabled, in its own
    order): the operator each runs, matched to the backend alone that runs it, and its time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    choose_cuda_attention_backends()  # for the rest of this process
    sites = {}
    for dtype in dict.fromkeys([settings["dtype"], "float32"]):
        sites.update(probe_call_sites(config, settings, device, dtype))
    backends = ["MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]
    calls = sdpa_calls(config, settings, device)
    runs = {call: {} for call in calls}
    for way in ["tinytp", *backends, "pytorch"]:
        for call, (args, kwargs) in calls.items():
            every = [getattr(SDPBackend, b) for b in backends]
            choice = (
                sdpa_kernel(getattr(SDPBackend, way))
                if way in backends
                else sdpa_kernel(every)
                if way == "pytorch"
                else contextlib.nullcontext()
            )
            with choice, warnings.catch_warnings(record=True) as reasons:
                warnings.simplefilter("always")
                try:
                    with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU]
                    ) as profile:
                        sdpa(*args, **kwargs)
                    seconds = best_seconds(lambda: sdpa(*args, **kwargs), device)
                except RuntimeError as e:
                    why = [str(w.message).split("\n")[0] for w in reasons] or [
                        str(e).split("\n")[0]
                    ]
                    runs[call][way] = {"ok": False, "why": why[:2]}
                    continue
            runs[call][way] = {
                "ok": True,
                "ms": seconds * 1e3,
                "operators": attention_operators(profile),
            }
    kernels = {}
    for call, ran in runs.items():
        kernels[call] = {"alone": {backend: ran[backend] for backend in backends}}
        for choice in ("pytorch", "tinytp"):
            same = [
                b
                for b in backends
                if ran[b]["ok"] and ran[b]["operators"] == ran[choice].get("operators")
            ]
            kernels[call][choice] = {**ran[choice], "backend": same[0] if same else None}
    for site in sites.values():  # the backends whose operators a site ran
        site["backends"] = [
            b
            for b in backends
            if site["ok"]
            and any(
                ran[b]["ok"] and set(ran[b]["operators"]) <= set(site["operators"])
                for ran in runs.values()
            )
        ]
    return {"call sites": sites, "kernels": kernels}


def profile_next_decode_step(worker) -> None:  # run in the worker, through collective_rpc
    """Run the worker's next decode step under torch.profiler, once: an instance attribute
    shadows the method for the worker loop, and goes again after that step."""
    run_step = worker.execute_model

    def profiled(scheduler_output):
        if scheduler_output.new_requests:  # a prefill: not the step to profile
            return run_step(scheduler_output)
        del worker.execute_model
        activities = [torch.profiler.ProfilerActivity.CPU]
        if worker.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            output = run_step(scheduler_output)  # it ends with .tolist(): the GPU has finished
        worker.step_profile = device_activity(profile.events(), worker.device.type)
        return output

    worker.execute_model = profiled


def device_activity(events, device_type: str) -> dict:
    """What the device did in a profiled step: its kernels (and copies), their summed time, and
    how much of the span from the first to the last it sat idle. On a CPU the operators that
    call no other operator stand in for kernels."""
    if device_type == "cuda":
        spans = [e.time_range for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        spans = [e.time_range for e in events if e.name.startswith("aten::") and not e.cpu_children]
    spans = sorted((s.start, s.end) for s in spans)  # microseconds
    first = spans[0][0] if spans else 0.0  # none: the profiler saw no device activity (0 kernels)
    busy, gaps, reached = 0.0, [], first
    for start, end in spans:
        if start > reached:
            gaps.append(start - reached)
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return {
        "kernels": len(spans),
        "kernel_ms": sum(end - start for start, end in spans) / 1e3,
        "busy_ms": busy / 1e3,
        "span_ms": (reached - first) / 1e3,
        "idle_ms": sum(gaps) / 1e3,
        "idle_gaps": len(gaps),
        "largest_gap_ms": max(gaps, default=0.0) / 1e3,
    }


def step_profile(worker) -> dict:  # run in the worker, through collective_rpc
    return worker.step_profile


def peak_gpu_memory(worker) -> int | None:  # run in the workers, through collective_rpc
    return torch.cuda.max_memory_allocated(worker.device) if worker.device.type == "cuda" else None


def matmul_floor(config: dict, settings: dict, device: str, bandwidth: float) -> dict:
    """A decode step's matmuls alone, back to back, at its batch: every layer's fused q/k/v,
    o, gate/up and down projections, then the LM head, as F.linear runs them in tinytp. One
    layer's weights serve every layer: each matrix is far larger than the GPU's L2 cache, so
    every pass reads it from memory again."""
    dtype, batch = getattr(torch, settings["dtype"]), settings["batch"]
    hidden, inter, heads = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"],
    )
    head_dim = hidden // heads
    q_and_kv = (heads + 2 * config["num_key_value_heads"]) * head_dim
    layer = [
        torch.randn(shape, dtype=dtype, device=device)
        for shape in [
            (q_and_kv, hidden),
            (hidden, heads * head_dim),
            (2 * inter, hidden),
            (hidden, inter),
        ]
    ]
    head = torch.randn(config["vocab_size"], hidden, dtype=dtype, device=device)
    inputs = {
        size: torch.randn(batch, size, dtype=dtype, device=device)
        for size in {hidden, heads * head_dim, inter}
    }

    def matmuls():
        for _ in range(config["num_hidden_layers"]):
            for weight in layer:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        torch.nn.functional.linear(inputs[hidden], head)

    weight_bytes = config["num_hidden_layers"] * sum(w.nbytes for w in layer) + head.nbytes
    seconds = best_seconds(matmuls, device)
    return {
        "matmul_ms": seconds * 1e3,
        "weight_bytes": weight_bytes,
        "read_rate_floor_ms": weight_bytes / bandwidth * 1e3,
        "matmul_read_gbps": weight_bytes / seconds / 1e9,
    }


def time_decode_steps(worker) -> None:  # run in the workers, through collective_rpc
    """From now on time each decode step in the worker, from its message to its sampled tokens,
    until decode_step_seconds collects the times: an instance attribute shadows the method for
    the worker loop (timed here, not in the driver, whose steps may overlap the workers')."""
    run_step, worker.decode_seconds = worker.execute_model, []

    def timed(scheduler_output):
        start = time.perf_counter()
        output = run_step(scheduler_output)  # it ends with .tolist(): the GPU has finished
        if not scheduler_output.new_requests:  # a prefill: not a decode step
            worker.decode_seconds.append(time.perf_counter() - start)
        return output

    worker.execute_model = timed


def decode_step_seconds(worker) -> list[float]:  # run in the workers, through collective_rpc
    del worker.execute_model
    return worker.decode_seconds


def generate_timed(llm, prompts: list, params) -> tuple[list, list[float]]:
    """generate()'s outputs, and the time of each of its decode steps in rank 0's worker."""
    llm.collective_rpc(time_decode_steps)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, llm.collective_rpc(decode_step_seconds)[0]


def probe_decode_step(device: str, config: dict, settings: dict, bandwidth: float) -> dict:
    """tinytp at tp=1 on the benchmark's model (dummy weights): the decode steps' own time in
    the worker, one of them profiled, and peak memory; then the matmul floor, in this process."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="tinytp-ci-gpu-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f)
        prompts = np.random.default_rng(0).integers(
            config["vocab_size"], size=(settings["batch"], settings["input"])
        )
        with tinytp.LLM(
            model_dir,
            1,
            device,
            settings["dtype"],
            max_num_seqs=settings["batch"],
            max_model_len=settings["input"] + settings["output"],
            load_format="dummy",
            **EAGER[device],
        ) as llm:
            params = tinytp.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            # warm-up: the first steps pay for setup
            llm.generate(prompts.tolist(), params, use_tqdm=False)
            _, worker_seconds = generate_timed(llm, prompts.tolist(), params)
            llm.collective_rpc(profile_next_decode_step)
            llm.generate(
                prompts.tolist(),
                tinytp.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                use_tqdm=False,
            )
            profile = llm.collective_rpc(step_profile)[0]
            peak = llm.collective_rpc(peak_gpu_memory)
    return {
        "step_ms": float(np.median(worker_seconds)) * 1e3,
        "profiled_step": profile,
        "peak_memory_per_rank": peak,
        **matmul_floor(config, settings, device, bandwidth),
    }


class EveryRankOnGPU0(tinytp.Executor):
    """tinytp's Executor, with init_device told "cuda:0" instead of "cuda": every rank on the
    one GPU, and so over gloo, since nccl refuses two ranks on one GPU (as in the tests)."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "init_device":
            args = ("cuda:0", *args[1:])
        return super().collective_rpc(method, timeout, args, kwargs)


def placement(worker) -> str:  # run in the workers, through collective_rpc
    return f"{worker.device}, {torch.distributed.get_backend()}, {str(worker.dtype).split('.')[1]}"


def probe_mission_tokens(device: str, model_dir: str, results_path: str) -> dict:
    """tinytp on the mission's checkpoint as the CLI runs it (the prompt through the chat
    template, greedy, the checkpoint's dtype), at tp=1 and tp=2; tokens written for the
    transformers step to check."""
    found = {}
    for tp in (1, 2):
        one_gpu = device == "cuda" and torch.cuda.device_count() < tp
        with (
            mock.patch.object(torch.cuda, "device_count", return_value=tp)
            if one_gpu
            else contextlib.nullcontext()
        ):
            llm = tinytp.LLM(
                model_dir,
                tp,
                device,
                distributed_executor_backend=EveryRankOnGPU0 if one_gpu else "mp",
                **EAGER[device],
            )
        with llm:
            chat = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": MISSION_PROMPT}],
                tokenize=False,
                add_generation_prompt=True,
            )
            prompt = llm.tokenizer(chat, add_special_tokens=False).input_ids
            output = llm.generate(
                [prompt],
                tinytp.SamplingParams(temperature=0, max_tokens=MISSION_TOKENS),
                use_tqdm=False,
            )[0].outputs[0]
            found[f"tp={tp}"] = {
                "ranks": llm.collective_rpc(placement),
                "prompt_ids": prompt,
                "token_ids": output.token_ids,
                "text": output.text,
                "peak_memory_per_rank": llm.collective_rpc(peak_gpu_memory),
            }
    with open(results_path, "w") as f:
        json.dump(found, f)
    return found


def probe_mission_transformers(device: str, model_dir: str, results_path: str) -> dict:
    """Each run's greedy tokens, teacher-forced through transformers: every token's float32
    logit within twice transformers' own bfloat16 error (its largest difference from its
    float32 logits, on the same tokens) of the best, as the CUDA bfloat16 test judges."""
    from transformers import LlamaForCausalLM

    with open(results_path) as f:
        runs = json.load(f)
    bfloat16 = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    # The checkpoint is bfloat16: widening a copy on the device is loading it in float32, faster.
    models = {torch.bfloat16: bfloat16, torch.float32: copy.deepcopy(bfloat16).float()}
    found = {}
    for name, run in runs.items():
        prompt, generated = run["prompt_ids"], run["token_ids"]
        with torch.no_grad():
            logits = {
                dtype: model(torch.tensor([prompt + generated], device=device)).logits[0].float()
                for dtype, model in models.items()
            }
        # the rows that chose each generated token
        reference = logits[torch.float32][len(prompt) - 1 : -1]
        tolerance = 2 * (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item()
        gaps = (
            reference.max(dim=-1).values
            - reference[torch.arange(len(generated)), torch.tensor(generated)]
        )
        found[name] = {
            "tokens": len(generated),
            "tolerance": tolerance,
            "largest_gap": gaps.max().item(),
            "passed": bool(gaps.max().item() <= tolerance),
            "equal_to_float32_argmax": int(
                (reference.argmax(-1).cpu() == torch.tensor(generated)).sum()
            ),
        }
    if not all(run["passed"] for run in found.values()):
        raise SystemExit(f"tokens beyond transformers' tolerance: {json.dumps(found)}")
    return found


def record_steps(worker) -> None:  # run in the workers, through collective_rpc
    """From now on keep each step's logits as the sampler gets them (the scheduled rows, on the
    host, whichever path computed them) and the positions its attention reads if it is a
    fixed-shape step (None if not), until recorded_steps collects them: instance attributes
    shadow the two methods for the worker loop."""
    sample, prepare_inputs = worker.sample, worker.prepare_inputs
    worker.recorded = {"logits": [], "attended": []}

    def recording_sample(logits, scheduled):
        worker.recorded["logits"].append(logits.float().cpu())
        return sample(logits, scheduled)

    def recording_prepare_inputs(scheduled, context_len=None):  # once a step, a replayed one too
        worker.recorded["attended"].append(context_len)
        return prepare_inputs(scheduled, context_len)

    worker.sample, worker.prepare_inputs = recording_sample, recording_prepare_inputs


def recorded_steps(worker) -> dict:  # run in the workers, through collective_rpc
    del worker.sample, worker.prepare_inputs
    return worker.recorded


def captured_lengths(worker) -> list[int]:  # run in the workers, through collective_rpc
    return sorted(worker.graphs)


def without_graphs(worker) -> None:  # run in the workers, through collective_rpc
    """The fixed-shape decode step from now on eagerly: its graphs' kernels, at their shapes."""
    worker.capture_graphs = False


def timed_then_recorded(llm, prompts: list, params, record: bool = True) -> dict:
    """generate three times: to warm up (and capture the graphs), then timed in the worker,
    then recording every step (kept out of the timed run: the copies to the host are no part
    of a step)."""
    llm.generate(prompts, params, use_tqdm=False)
    _, seconds = generate_timed(llm, prompts, params)
    run = {
        "step_ms": statistics.median(seconds) * 1e3,
        "captured_lengths": llm.collective_rpc(captured_lengths)[0],
    }
    if record:
        llm.collective_rpc(record_steps)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        run.update(
            llm.collective_rpc(recorded_steps)[0], tokens=[o.outputs[0].token_ids for o in outputs]
        )
    return run


# Graphs against the same step run eagerly: equal tokens, and logits equal or within this many
# bfloat16 ulps of the largest logit. The same kernels at the same shapes give the same bits,
# unless cuBLAS picks another algorithm (another order of sums) for the capture stream: that
# rounds a logit by an ulp or two. A stale input (a mask, a position, a token, a slot) moves more.
GRAPH_ULPS = 4


def bfloat16_ulp(x: float) -> float:
    """The gap between bfloat16 numbers at |x| (8 significant bits): 2 ** (exponent - 7)."""
    return math.ldexp(torch.finfo(torch.bfloat16).eps, math.frexp(abs(x))[1] - 1)


def compare_steps(tested: dict, reference: dict) -> dict:
    """Two recorded runs of the same prompts, step by step: they agree when their tokens are equal
    and their logits equal, or within GRAPH_ULPS bfloat16 ulps of the largest logit (rounding); a
    stale input (a mask, position or token) differs by more, and long before the tokens part."""
    if tested["attended"] != reference["attended"]:
        raise ValueError(
            f"the runs' steps differ in shape: {tested['attended']} against {reference['attended']}"
        )
    pairs = list(zip(tested["logits"], reference["logits"], strict=True))
    differing = [step for step, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    attended = collections.Counter(
        "prefill" if length is None else str(length) for length in tested["attended"]
    )
    difference = max((a - b).abs().max().item() for a, b in pairs)
    largest = max(b.abs().max().item() for _, b in pairs)
    ulps = difference / bfloat16_ulp(largest)
    tokens_equal = tested["tokens"] == reference["tokens"]
    return {
        "agrees": tokens_equal and ulps <= GRAPH_ULPS,
        "logits_equal": not differing,
        "steps_compared": dict(attended),
        "steps_differing": len(differing),
        "first_differing_step": differing[0] if differing else None,
        "largest_logit_difference": difference,
        "largest_logit": largest,
        "bfloat16_ulps": ulps,
        "tokens_equal": tokens_equal,
    }


# Prompts and greedy tokens: decode contexts of 101 to 140 positions, so that the fixed-shape step
# attends over 128, then 256 (on CPU, where one step is slower, 13 to 20: over 16, then 32).
GRAPH_RUN = {
    "cuda": {"prompt_length": 100, "tokens": 40},
    "cpu": {"prompt_length": 12, "tokens": 8},
}


def probe_cuda_graphs(
    device: str, model_dir: str, batch: int, prompt_length: int, tokens: int
) -> dict:
    """LLM(cuda_graphs=True) on the mission's checkpoint at tp=1, in one engine (init_kv_cache
    again switches the way: one load fits the step's time), on random prompts, greedy: every
    step of the graphs against the same fixed-shape step run eagerly, and the decode step's time
    in the worker as graphs, at the fixed shape eagerly, and on the default eager path. On CPU,
    which has no graphs, the fixed-shape step runs eagerly both ways."""
    import numpy as np

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = np.random.default_rng(0).integers(vocab_size, size=(batch, prompt_length)).tolist()
    params = tinytp.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = {}
    with tinytp.LLM(
        model_dir,
        1,
        device,
        max_num_seqs=batch,
        max_model_len=256,
        cuda_graphs=device == "cuda",
        **EAGER[device],
    ) as llm:
        for way in ("cuda graphs", "fixed shape, eager", "eager"):
            # a fresh cache (the prefix cache forgotten with it), and no graphs yet
            kv = llm.scheduler.kv_cache_manager
            llm.collective_rpc(
                "init_kv_cache", args=(kv.num_blocks, kv.block_size, batch, way != "eager")
            )
            assert llm.reset_prefix_cache()
            if way == "fixed shape, eager":
                llm.collective_rpc(without_graphs)
            runs[way] = timed_then_recorded(llm, prompts, params, record=way != "eager")
    graphs = runs["cuda graphs"]
    return {
        **compare_steps(graphs, runs["fixed shape, eager"]),
        "captured_lengths": graphs["captured_lengths"],
        "step_ms": {way: run["step_ms"] for way, run in runs.items()},
        "tokens": tokens,
    }


def probe_pre_flight(device: str) -> dict:
    """One rank joins a process group as tinytp's workers do (Worker.init_device: nccl on CUDA,
    gloo on CPU, through a loopback TCP store) and all-reduces a tensor: where nccl has never
    run, its failure costs seconds here, not every step that starts workers."""
    store = tinytp.loopback_store()
    rank = Worker(0, 1)
    rank.init_device(device, "float32", store.port, 1)
    try:
        ones = torch.ones(4, device=rank.device)
        torch.distributed.all_reduce(ones)
        if ones.tolist() != [1.0] * 4:  # .tolist() waits for the device
            raise SystemExit(f"a 1-rank all-reduce of ones gave {ones.tolist()}")
        return {"backend": torch.distributed.get_backend(), "device": str(rank.device)}
    finally:
        rank.close()


PROBES = {
    "pre-flight": probe_pre_flight,
    "sdpa": probe_sdpa,
    "decode step": probe_decode_step,
    "mission: tokens": probe_mission_tokens,
    "mission: transformers": probe_mission_transformers,
    "cuda graphs": probe_cuda_graphs,
}


# --------------------------------------------------------------------------------------
# The run: the steps in order, then the report
# --------------------------------------------------------------------------------------


def group_pids(group: int) -> list[int]:
    """The processes in a process group (from Linux's /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # after the name, "(...)": state, ppid, pgrp, ...
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group:
            found.append(int(entry))
    return found


def shm_blocks_of(pids: set[int]) -> list[str]:
    """The shared-memory blocks that these processes made and did not unlink: tinytp names each
    after its maker."""
    return sorted(
        name
        for name in os.listdir("/dev/shm")
        if any(name.startswith(f"tinytp_{pid}_") for pid in pids)
    )


def stop_step(process: subprocess.Popen) -> tuple[str, str, str]:
    """End a step that ran out of time, as politely as it lets us, each signal to its process group:
    SIGINT, as Ctrl-C (tinytp's driver stops its workers and unlinks its shared memory; the workers
    ignore it); STOP_GRACE seconds later SIGTERM, which ends Python processes without their exit
    hooks but not multiprocessing's resource tracker (it ignores both signals), which then unlinks
    the blocks and semaphores the dead driver made; then SIGKILL. Its stdout, its stderr, and the
    signal that ended it."""
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group has ended already
            os.killpg(process.pid, stop)
        try:
            stdout, stderr = process.communicate(
                timeout=None if stop == signal.SIGKILL else STOP_GRACE
            )
            return stdout, stderr, stop.name
        except subprocess.TimeoutExpired:
            continue


def cpu_seconds_of_children() -> float:
    """The CPU time of this process's ended children, theirs included: a step's process, its
    workers. A step's CPU-side work is its CPU time rather than its wall time, which other
    programs on the machine's cores (CI's, a developer's) stretch far more."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def one_line(error: BaseException) -> str:
    """An error as one line of the report: its type and its message's lines (nccl's run to several:
    what failed, then "Last error:" and why)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' / '.join(lines)}"[:500]


class Steps:
    """Runs each step as a subprocess in the repository root, within its own limit and what is
    left of the budget, and keeps its seconds and its output. Under $OUT, when set: the report so
    far (gpu.json) as each step starts, and each step's output after the others' (steps.log)."""

    def __init__(self, out: str | None, device: str, started: float, report: dict | None = None):
        self.out, self.report = out, report if report is not None else {}
        self.scale = 1 if device == "cuda" else CPU_SCALE
        self.deadline = started + BUDGET_SECONDS * self.scale
        self.seconds: dict[str, tuple[float, float]] = {}  # each step's wall and CPU seconds
        # why the steps in JOIN_A_PROCESS_GROUP are not run, if they are not
        self.not_run: str | None = None

    def save(self) -> None:
        """The report so far, as $OUT/gpu.json: the summary, first of the files."""
        if self.out:
            with open(os.path.join(self.out, "gpu.json"), "w") as f:
                json.dump(self.report, f, indent=2)

    def run(self, name: str, command: list[str], env: dict | None = None) -> tuple[str, str]:
        """("passed", or what went wrong; its stdout), its stderr kept in the log."""
        print(f"\n=== {name}: {' '.join(command)}", flush=True)
        self.save()
        # Its own limit, or what is left of the budget after the time to stop it
        limit = min(
            STEP_LIMITS[name] * self.scale, self.deadline - time.monotonic() - 2 * STOP_GRACE
        )
        skipped = self.not_run if name in JOIN_A_PROCESS_GROUP else None
        if skipped or limit < 5:
            outcome = f"not run: {skipped or 'out of budget'}"
            print(outcome, flush=True)
            return outcome, ""
        start, used = time.monotonic(), cpu_seconds_of_children()
        # A session (and process group) of its own, so that a step out of time is stopped with its
        # workers: they would hold its output pipes open, and a stuck one would hang us.
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        # of shared-memory blocks: tinytp's driver, which is the step's own process
        makers = {process.pid}
        try:
            stdout, stderr = process.communicate(timeout=limit)
            outcome = "passed" if process.returncode == 0 else f"exit status {process.returncode}"
        except subprocess.TimeoutExpired:
            makers.update(group_pids(process.pid))
            stdout, stderr, stopped_by = stop_step(process)
            outcome = f"ran out of time (stopped by {stopped_by})"
        left = shm_blocks_of(makers)
        if left:
            outcome += f"; it left {len(left)} blocks in /dev/shm ({', '.join(left)})"
        print(
            "\n".join(line for line in stdout.splitlines() if not line.startswith(PROBE_RESULT)),
            flush=True,
        )
        # tqdm's progress bars fill stderr: shown only when something went wrong
        if outcome != "passed":
            print(stderr[-3000:], end="", flush=True)
        self.seconds[name] = (time.monotonic() - start, cpu_seconds_of_children() - used)
        print(
            f"{name}: {outcome} after {self.seconds[name][0]:.0f} s of its {limit:.0f} "
            f"({self.seconds[name][1]:.0f} s of CPU time)",
            flush=True,
        )
        if self.out:  # one log for every step: the device brings back DEVICE_FILES files at most
            with open(os.path.join(self.out, "steps.log"), "a") as f:
                f.write(f"=== {name}: {outcome}\n$ {' '.join(command)}\n{stdout}\n")
                f.write(f"--- stderr ---\n{stderr[-100_000:]}\n")  # tqdm's bars: the end
        return outcome, stdout

    def probe(self, name: str, device: str, env: dict | None = None, **kwargs) -> dict:
        outcome, stdout = self.run(
            name,
            [
                sys.executable,
                os.path.abspath(__file__),
                "--device",
                device,
                "--probe",
                name,
                json.dumps(kwargs),
            ],
            env,
        )
        if outcome != "passed":
            why = [line for line in stdout.splitlines() if line.startswith(PROBE_FAILED)]
            return {"error": f"{outcome}: {why[0][len(PROBE_FAILED) :]}" if why else outcome}
        return json.loads(
            next(line for line in stdout.splitlines() if line.startswith(PROBE_RESULT))[
                len(PROBE_RESULT) :
            ]
        )


def run_tests(steps: Steps) -> dict:
    start = time.monotonic()
    outcome, stdout = steps.run(
        "tests",
        [
            sys.executable,
            "-m",
            "pytest",
            "test_tinytp.py",
            "-k",
            "test_cuda_",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
    )
    summary = next(
        (
            line.strip("= ")
            for line in reversed(stdout.splitlines())
            if re.search(r"\d+ (passed|failed|skipped|error)", line)
        ),
        "",
    )
    found = {"summary": summary, "seconds": time.monotonic() - start}
    return found if outcome == "passed" else {**found, "error": outcome}


# transformers' benchmark runs in a process that first chooses tinytp's attention backends, as
# tinytp's workers do: both runs' attention takes the same kernels (on CUDA; on CPU it changes
# nothing).
BENCH_WITH_TINYTPS_ATTENTION = [
    "-c",
    "import sys, bench, worker; worker.choose_cuda_attention_backends(); sys.exit(bench.main())",
]


def run_bench(
    steps: Steps, name: str, backend: str, config: dict, device: str, settings: dict, workdir: str
) -> dict:
    config_path = os.path.join(workdir, f"{name.replace(' ', '-')}.json")
    results_path = config_path.replace(".json", "-results.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    program = ["bench.py"] if backend == "tinytp" else BENCH_WITH_TINYTPS_ATTENTION
    outcome, _ = steps.run(
        name,
        [
            sys.executable,
            *program,
            "--config",
            config_path,
            "--backend",
            backend,
            "--device",
            device,
            "--tp",
            "1",
            "--dtype",
            settings["dtype"],
            "--batch-size",
            str(settings["batch"]),
            "--input-len",
            str(settings["input"]),
            "--output-len",
            str(settings["output"]),
            "--num-iters-warmup",
            str(settings["warmup"]),
            "--num-iters",
            str(settings["iterations"]),
            "--output-json",
            results_path,
            *(EAGER_FLAGS[device] if backend == "tinytp" else []),
        ],
    )
    if outcome != "passed":
        return {"error": outcome}
    with open(results_path) as f:
        return json.load(f)


def run_mission(steps: Steps, device: str, workdir: str) -> dict:
    """The mission's command in spirit, on a checkpoint written here."""
    model_dir, results_path = (
        os.path.join(workdir, MISSION_DIR),
        os.path.join(workdir, "mission.json"),
    )
    outcome, _ = steps.run(
        "mission: write",
        [
            sys.executable,
            "checkpoints.py",
            "llama-3.1-8b-shapes",
            model_dir,
            *MISSION_CHECKPOINT[device],
        ],
    )
    if outcome != "passed":
        return {"error": f"writing the checkpoint: {outcome}"}
    outcome, stdout = steps.run(
        "mission: cli",
        [
            sys.executable,
            "tinytp.py",
            "--device",
            device,
            "--model",
            model_dir,
            "--prompt",
            MISSION_PROMPT,
            "--max-tokens",
            str(MISSION_TOKENS),
            "--temperature",
            "0",
            *EAGER_FLAGS[device],
        ],
    )
    cli = (
        {"text": stdout.split("\nOutput: ", 1)[1].removesuffix("\n")}
        if outcome == "passed" and "\nOutput: " in stdout
        else {"error": outcome}
    )
    tokens = steps.probe("mission: tokens", device, model_dir=model_dir, results_path=results_path)
    checked = (
        steps.probe("mission: transformers", device, model_dir=model_dir, results_path=results_path)
        if "error" not in tokens
        else {"error": "no tokens to check"}
    )
    if "error" not in cli and "error" not in tokens:
        cli["same_text_as_tp=1"] = cli["text"] == tokens["tp=1"]["text"]
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return {
        "checkpoint": {
            key: config[key]
            for key in (
                "num_hidden_layers",
                "hidden_size",
                "vocab_size",
                "num_attention_heads",
                "num_key_value_heads",
                "rope_scaling",
            )
        },
        "cli": cli,
        "tokens": tokens,
        "transformers": checked,
    }


def passed(report: dict) -> bool:
    mission, sdpa, graphs = report["mission"], report["sdpa"], report["cuda_graphs"]
    failures = [
        *("error" in report[step] for step in ("pre_flight", "tests", "decode_step")),
        "error" in sdpa,
        *(not call["tinytp"]["ok"] for call in sdpa.get("kernels", {}).values()),
        *(not site["ok"] or not site["agrees"] for site in sdpa.get("call sites", {}).values()),
        *("error" in run for name, run in report["runs"].items() if name not in MAY_BE_CUT),
        *(
            "error" in part
            for part in (
                mission,
                mission.get("cli", {}),
                mission.get("tokens", {}),
                mission.get("transformers", {}),
                graphs,
            )
        ),
        mission.get("cli", {}).get("same_text_as_tp=1") is False,
        graphs.get("agrees") is False,
    ]
    return not any(failures)


def check_budget(seconds: dict[str, tuple[float, float]], device: str) -> dict:
    """Each step's GPU limit beside its wall and CPU seconds, and the CPU's share of the limit. On
    CPU a run is all host work, eager as on a GPU, with tiny models: the GPU run's CPU-side work
    (imports, test collection, processes, model building). A step that spends more than
    CPU_SIDE_SHARE of its limit on it leaves too little for the GPU's own, and is named: on CPU
    the run then fails."""
    steps = {
        name: {
            "limit": STEP_LIMITS[name],
            "seconds": wall,
            "cpu_seconds": cpu,
            "share": cpu / STEP_LIMITS[name],
        }
        for name, (wall, cpu) in seconds.items()
    }
    over = [name for name, row in steps.items() if row["share"] > CPU_SIDE_SHARE]
    return {"steps": steps, "over": over if device == "cpu" else []}


def describe_budget(budget: dict) -> list[str]:
    lines = [f"{'step':24}{'limit (s)':>10}{'seconds':>9}{'CPU-side s':>12}{'share':>7}"]
    for name, row in budget["steps"].items():
        over = f"  over {CPU_SIDE_SHARE:.0%} of its limit" if name in budget["over"] else ""
        lines.append(
            f"{name:24}{row['limit']:>10}{row['seconds']:>9.1f}{row['cpu_seconds']:>12.1f}"
            f"{row['share']:>7.0%}{over}"
        )
    return lines


def gib(per_rank: list[int | None]) -> str:
    if None in per_rank:
        return "none (not on a GPU)"
    return ", ".join(f"rank {rank} {size / 2**30:.2f} GiB" for rank, size in enumerate(per_rank))


def describe(report: dict, model_name: str) -> str:
    """The report: what each step found, in a few lines each."""
    bandwidth = report["read_bandwidth_gbps"] * 1e9
    pre_flight = report["pre_flight"]
    joined = pre_flight.get("error") or f"a 1-rank all-reduce over {pre_flight['backend']}"
    lines = [
        f"memory read rate (a sum over a large tensor): {bandwidth / 1e9:,.0f} GB/s",
        f"pre-flight: {joined}",
        "",
    ]

    def ran(choice: dict) -> str:
        return (
            f"{choice['backend'] or 'no one backend'} ({choice['ms']:.3f} ms)"
            if choice["ok"]
            else "nothing (failed)"
        )

    for site, found in report["sdpa"].get("call sites", {}).items():
        lines.append(
            f"sdpa at model.py's call site {site}: "
            + (
                f"{' and '.join(found['backends']) or 'no one backend'}, SDPA's outputs "
                + ", ".join(f"{count} {layout}" for layout, count in found["outputs"].items())
                + f"; within {found['largest_difference']:.2g} of the unfused kernel (tolerance "
                f"{found['tolerance']:g}): {'agrees' if found['agrees'] else 'DIFFERS'}"
                if found["ok"]
                else f"FAILED ({'; '.join(found['why'])})"
            )
        )
    for call, found in report["sdpa"].get("kernels", {}).items():
        alone = ", ".join(
            f"{backend.lower()} " + (f"{run['ms']:.3f} ms" if run["ok"] else "failed")
            for backend, run in found["alone"].items()
        )
        lines.append(
            f"sdpa {call}: tinytp's choice runs {ran(found['tinytp'])}, PyTorch's own "
            f"{ran(found['pytorch'])}; each alone: {alone}"
        )
    if "error" in report["sdpa"]:
        lines.append(f"sdpa: {report['sdpa']['error']}")
    step = report["decode_step"]
    if "error" not in step:
        gpu, batch = step["profiled_step"], report["settings"]["batch"]
        lines += [
            f"decode step ({model_name}, batch {batch}): {step['step_ms']:.2f} ms in the worker; "
            f"profiled: {gpu['kernels']} kernels, {gpu['kernel_ms']:.2f} ms of kernel time, "
            f"device busy {gpu['busy_ms']:.2f} of {gpu['span_ms']:.2f} ms, idle "
            f"{gpu['idle_ms']:.2f} ms in {gpu['idle_gaps']} gaps (largest "
            f"{gpu['largest_gap_ms']:.3f} ms)",
            f"floors: the step's matmuls alone, back to back: {step['matmul_ms']:.2f} ms "
            f"({step['matmul_read_gbps']:,.0f} GB/s); its {step['weight_bytes'] / 1e9:.2f} GB of "
            f"weights at the read rate: {step['read_rate_floor_ms']:.2f} ms",
            f"peak GPU memory per rank: {gib(step['peak_memory_per_rank'])}",
        ]
    else:
        lines.append(f"decode step: {step['error']}")
    lines += [
        "",
        f"{'':38}{'avg latency':>12}{'prefill':>11}{'decode step':>13}{'roofline':>10}"
        f"{'latency / hf':>14}",
    ]
    for name, run in report["runs"].items():
        label = f"{'tinytp' if name == 'tinytp' else 'transformers'}, {model_name}"
        if "error" in run:
            lines.append(f"{label:38}  {run['error']}")
            continue
        figures = report["figures"][name]
        ratio = (
            f"{figures['latency_over_hf']:14.2f}" if "latency_over_hf" in figures else f"{'-':>14}"
        )
        lines.append(
            f"{label:38}{run['avg_latency']:10.3f} s{run['prefill_seconds'] * 1e3:8.1f} ms"
            f"{run['decode_step_seconds'] * 1e3:10.2f} ms"
            f"{figures['roofline_of_read_bandwidth']:10.0%}{ratio}"
        )
    lines += [
        "roofline: the weights a decode step reads (the input embedding left out) over the read "
        "rate",
        "transformers runs with tinytp's attention backends (cuDNN's off on CUDA)",
    ]
    mission = report["mission"]
    lines.append("")
    if "error" in mission:
        lines.append(f"mission: {mission['error']}")
    else:
        lines.append(f"mission checkpoint: {json.dumps(mission['checkpoint'])}")
        cli = mission["cli"]
        same = cli.get("same_text_as_tp=1")
        lines.append(
            f"mission cli: {cli.get('error') or 'ran'}"
            + ("" if same is None else f"; its text the same as tp=1's through the API: {same}")
        )
        checked = mission["transformers"]
        for name, run in mission["tokens"].items() if "error" not in mission["tokens"] else []:
            verdict = checked.get(name)
            lines.append(
                f"mission {name} ({'; '.join(run['ranks'])}): {len(run['token_ids'])} greedy "
                "tokens; "
                + (
                    f"largest gap to transformers' best {verdict['largest_gap']:.4f} "
                    f"within {verdict['tolerance']:.4f}"
                    f", {verdict['equal_to_float32_argmax']} equal to its float32 argmax"
                    if verdict
                    else f"transformers: {checked.get('error')}"
                )
                + f"; peak GPU memory per rank: {gib(run['peak_memory_per_rank'])}"
            )
        if "error" in mission["tokens"]:
            lines.append(f"mission tokens: {mission['tokens']['error']}")
    lines += [
        "",
        *describe_graphs(report["cuda_graphs"], report["settings"]["batch"]),
        "",
        *describe_budget(report["budget"]),
        "",
        UNPROVEN,
    ]
    return "\n".join(lines)


def describe_graphs(graphs: dict, batch: int) -> list[str]:
    if "error" in graphs:
        return [f"cuda graphs: {graphs['error']}"]
    ms = graphs["step_ms"]
    steps = ", ".join(f"{count} at {length}" for length, count in graphs["steps_compared"].items())
    differ = (
        f"{graphs['steps_differing']} steps differ from step {graphs['first_differing_step']}, by "
        f"{graphs['largest_logit_difference']:.3g} at most: {graphs['bfloat16_ulps']:.1f} bfloat16 "
        f"ulps of the largest logit, {graphs['largest_logit']:.3g} ({GRAPH_ULPS} allowed); tokens "
        f"{'equal' if graphs['tokens_equal'] else 'NOT equal'}"
    )
    verdict = (
        "equal, bit for bit, at every step"
        if graphs["logits_equal"] and graphs["tokens_equal"]
        else f"equal within rounding: {differ}"
        if graphs["agrees"]
        else f"NOT equal: {differ}"
    )
    graphed = "as graphs" if graphs["captured_lengths"] else "at the fixed shape (uncaptured)"
    return [
        f"cuda graphs (the mission's checkpoint, tp=1, batch {batch}, {graphs['tokens']} greedy "
        f"tokens; captured for lengths {graphs['captured_lengths']}):",
        f"  decode step {ms['cuda graphs']:.2f} ms {graphed}, {ms['fixed shape, eager']:.2f} ms "
        f"at the fixed shape eagerly, {ms['eager']:.2f} ms on the default eager path "
        f"({ms['eager'] / ms['cuda graphs']:.2f}x)",
        f"  logits against the fixed-shape step run eagerly, steps by positions attended "
        f"({steps}): {verdict}",
    ]


def figures(runs: dict, bandwidth: float) -> dict:
    """Per benchmark run: the roofline fraction and the ratios to transformers."""
    found = {}
    hf = runs["transformers"]
    for name, run in runs.items():
        if "error" in run:
            continue
        step = run["decode_step_seconds"]
        found[name] = {
            "roofline_of_read_bandwidth": run["weight_bytes_per_decode_step"] / step / bandwidth
        }
        if "error" not in hf:
            found[name].update(
                latency_over_hf=run["avg_latency"] / hf["avg_latency"],
                decode_step_over_hf=step / hf["decode_step_seconds"],
            )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog=".ci/gpu.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the same steps with tiny models, to test this script without a GPU",
    )
    # one step, as a process of its own
    parser.add_argument("--probe", choices=PROBES, help=argparse.SUPPRESS)
    parser.add_argument("probe_args", nargs="?", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            ".ci/gpu.py: error: torch sees no CUDA GPU here; use --device cpu to run the steps "
            "on CPU",
            file=sys.stderr,
        )
        return 2
    if args.probe:
        try:
            found = PROBES[args.probe](args.device, **json.loads(args.probe_args))
        except (Exception, SystemExit) as e:  # the report names it; the traceback goes to the log
            print(PROBE_FAILED + one_line(e), flush=True)
            raise
        print(PROBE_RESULT + json.dumps(found))
        return 0
    out = os.environ.get("OUT") or None
    if out:
        os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    settings = SETTINGS[args.device]
    model_name, config = settings["model"]
    report = {
        "device": args.device,
        "versions": versions(args.device),
        "settings": {**settings, "model": model_name},
    }
    print("\n".join(f"{key}: {value}" for key, value in report["versions"].items()), flush=True)
    bandwidth = read_bandwidth(args.device)
    report["read_bandwidth_gbps"] = bandwidth / 1e9
    print(
        f"memory read bandwidth (a sum over a large tensor): {bandwidth / 1e9:,.0f} GB/s",
        flush=True,
    )

    steps = Steps(out, args.device, started, report)
    report["pre_flight"] = steps.probe(
        "pre-flight", args.device, env={**os.environ, "NCCL_DEBUG": "WARN"}
    )
    if "error" in report["pre_flight"]:
        backend = "nccl" if args.device == "cuda" else "gloo"
        steps.not_run = f"the {backend} pre-flight failed"
        print(
            f"{steps.not_run} ({report['pre_flight']['error']}): the steps that start tinytp's "
            "workers will not run",
            flush=True,
        )
    report["tests"] = run_tests(steps)
    report["sdpa"] = steps.probe("sdpa", args.device, config=config, settings=settings)
    report["decode_step"] = steps.probe(
        "decode step", args.device, config=config, settings=settings, bandwidth=bandwidth
    )
    with tempfile.TemporaryDirectory(prefix="tinytp-ci-gpu-") as workdir:
        report["runs"] = {
            "tinytp": run_bench(steps, "tinytp", "tinytp", config, args.device, settings, workdir)
        }
        report["mission"] = run_mission(steps, args.device, workdir)
        report["cuda_graphs"] = (
            steps.probe(
                "cuda graphs",
                args.device,
                batch=settings["batch"],
                model_dir=os.path.join(workdir, MISSION_DIR),
                **GRAPH_RUN[args.device],
            )
            if "error" not in report["mission"]
            else {"error": "no mission checkpoint"}
        )
        report["runs"]["transformers"] = run_bench(
            steps, "transformers", "hf", config, args.device, {**settings, **HF_ITERATIONS}, workdir
        )
    report["figures"] = figures(report["runs"], bandwidth)
    report["budget"] = check_budget(steps.seconds, args.device)
    report["table"] = describe(report, model_name)
    report["seconds"] = time.monotonic() - started
    over, files = report["budget"]["over"], len(os.listdir(out)) if out else 0
    ok = passed(report) and not over and files <= DEVICE_FILES
    summary = (
        f"tests: {report['tests']['summary'] or 'no summary'}; "
        f"{'all steps passed' if ok else 'NOT all steps passed'}, in {report['seconds']:.0f} s"
        + (f"; over half their limits on CPU: {', '.join(over)}" if over else "")
        + (
            f"; {files} files under $OUT, of which {DEVICE_FILES} come back"
            if files > DEVICE_FILES
            else ""
        )
    )
    # the summary first, in the file too
    steps.report = {"passed": ok, "summary": summary, "table": report["table"], **report}
    steps.save()
    print(f"\n{report['table']}\n\n{summary}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
