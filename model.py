"""Llama built from tensor-parallel layers, and shard-on-load weight loading: every rank
builds the same `LlamaForCausalLM`, but each parallel layer allocates only its own part. (Reading
and checking a checkpoint, before any of this runs, is checkpoints.py's.)"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# The tensor-parallel group ------------------------------------------------------------
class TPGroup:
    """This rank's place in the tensor-parallel group (`rank` of `size`), and the two collectives
    the parallel layers call (self.group.all_reduce(y), say): over torch.distributed (gloo on CPU,
    nccl on CUDA), or on one CPU machine over shared memory (subclass worker.SharedMemoryGroup)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        # torch.distributed's group of the ranks of this pipeline stage (Worker.init_device's)
        self.process_group: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        dist.all_reduce(tensor, group=self.process_group)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along the last dim in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)


# Parallel layers (Megatron-style) -----------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across ranks: no communication. The rank's
    weight may stack tensors (q, k, v; gate, up) for one matmul; `shards` lists the rows of each."""

    def __init__(self, in_features: int, shards: list[Shard]):
        super().__init__()
        self.weight = new_parameter(sum(s.size for s in shards), in_features, shards=shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split across ranks. Its input arrives split (a
    column-parallel layer's output): each rank computes a partial sum of y; one all-reduce adds."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, name: str):
        super().__init__()
        self.group = group
        shard = split(name, in_features, group, dim=1)
        self.weight = new_parameter(out_features, shard.size, shards=[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.group.size > 1:
            self.group.all_reduce(y)
        return y


def vocab_rows_per_rank(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and LM head per rank: the vocabulary padded to a multiple of tp."""
    return math.ceil(vocab_size / tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (the vocabulary) across ranks, padded with zero rows so each
    rank holds as many. A rank looks up its own ids, zeros for the rest: an all-reduce sums them."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, name: str):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.rows_per_rank = vocab_rows_per_rank(vocab_size, group.size)
        self.vocab_start = group.rank * self.rows_per_rank
        rows_in_checkpoint = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        shards = (
            [Shard(name, 0, self.vocab_start, rows_in_checkpoint)] if rows_in_checkpoint else []
        )
        self.weight = new_parameter(self.rows_per_rank, hidden_size, shards=shards)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight) * mine.unsqueeze(-1)
        self.group.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding. Each rank computes its
    slice's logits; an all-gather (not a gather to rank 0) gives every rank all logits, as each
    samples (design discussion: "the logits_processor has an AllGather instead of a Gather")."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.group.size > 1:
            logits = self.group.all_gather(logits)
        return logits[..., : self.vocab_size]  # drop the padding rows' logits


# Which slice of which checkpoint tensor a parameter holds -----------------------------
@dataclass(frozen=True)
class Shard:
    """Tensor `name`'s [start, start + size) along `dim`, held at [offset, offset + size)."""

    name: str
    dim: int
    start: int
    size: int
    offset: int = 0


def split(name: str, full_size: int, group: TPGroup, dim: int = 0) -> Shard:
    """Rank r's r-th equal part of a dimension (the common case)."""
    part = full_size // group.size
    return Shard(name, dim, group.rank * part, part)


def new_parameter(*shape: int, shards: list[Shard]) -> nn.Parameter:
    """A parameter that knows its checkpoint slices; zeros, not empty: padded vocab rows stay 0."""
    param = nn.Parameter(torch.zeros(*shape), requires_grad=False)
    offsets = itertools.accumulate([0, *(shard.size for shard in shards)])  # shards back to back
    param.shards = [replace(shard, offset=offset) for shard, offset in zip(shards, offsets)]
    return param


# Llama --------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The parts of a Hugging Face Llama `config.json` that inference needs (parsed and checked by
    checkpoints.read_config, in the driver; the workers get it whole)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, {"rope_type": "linear", "factor": 4.0}, Llama 3.1's "llama3"
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype, e.g. "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)
    unread_keys: list[str] = field(default_factory=list)  # keys transformers' Llama ignores too


@dataclass
class ModelInputs:
    """One step's tokens, packed (Worker.prepare_inputs): first one token of each of B requests (a
    decode), then each prompt chunk's tokens, N in all. The layers see them as the rows of one [N,
    hidden] matrix, and only attention asks which request a row is in: the B one-token rows in one
    call, each chunk in a call of its own. The KV cache is paged (vLLM's PagedAttention): a
    request's keys and values live in blocks of block_size positions, where its block table says."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] the position of each token in its sequence
    # where each token's keys and values go: vLLM's slot_mapping (block x block_size + offset)
    slot_mapping: tuple[torch.Tensor, torch.Tensor]  # the cache's indices: [N] blocks, [N] offsets
    # [B, L] the slot of each of the B one-token rows' first L positions (the longest context)
    context_slots: torch.Tensor  # block tables padded with block 0 (null), to a graph's B, L
    attn_mask: torch.Tensor | None  # [B, 1, 1, L] True where a row may see a cached key; None: all
    # each chunk: the slots of its positions up to its last, its first position, tokens, and a mask:
    # [tokens, first position + tokens] of the keys each token sees (None from position 0: causal)
    chunks: list[tuple[torch.Tensor, int, int, torch.Tensor | None]]
    # the rows whose logits are computed: first those sampled (each decode's, each prompt's last)
    logits_indices: torch.Tensor  # then those that score a prompt's next token (prompt_logprobs)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), times a learned weight, in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float, name: str):
        super().__init__()
        self.weight = new_parameter(hidden_size, shards=[Shard(name, 0, 0, hidden_size)])
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is transformers' x * rsqrt(mean(x^2) + eps), the same bits, in one call; cast
        # back to x's dtype before the weight, as transformers does.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE's per-pair rotation speeds, with Llama 3.1's long-context rescaling if set."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    if config.rope_scaling is None:
        return inv_freq
    if config.rope_scaling["rope_type"] == "linear":  # positions / `factor`: all slowed alike
        return inv_freq / config.rope_scaling["factor"]
    # llama3: slow rotations (long wavelengths) slowed by `factor`, fast ones kept, between blended
    s = config.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


class LlamaAttention(nn.Module):
    """Self-attention with this rank's heads: q/k/v column-parallel, o_proj row-parallel. Rank r's
    query heads start at head r * nh / tp, and each KV head serves nh / n_kv query heads, so its
    first KV head is r * n_kv // tp: a block of n_kv / tp of them, or, when tp > n_kv, the one KV
    head that tp / n_kv ranks share, each keeping a copy (weights and KV cache), as vLLM does."""

    def __init__(self, config: ModelConfig, group: TPGroup, prefix: str):
        super().__init__()
        hd = config.head_dim
        self.num_heads = config.num_heads // group.size
        self.num_kv_heads = max(1, config.num_kv_heads // group.size)
        first_kv_head = group.rank * config.num_kv_heads // group.size
        q_rows, kv_rows = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                Shard(f"{prefix}.q_proj.weight", 0, group.rank * q_rows, q_rows),
                Shard(f"{prefix}.k_proj.weight", 0, first_kv_head * hd, kv_rows),
                Shard(f"{prefix}.v_proj.weight", 0, first_kv_head * hd, kv_rows),
            ],
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * hd, config.hidden_size, group, f"{prefix}.o_proj.weight"
        )
        self.head_dim = hd

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        return self.o_proj(self.attend(*self.qkv_rope(x, cos, sin), kv_cache, inputs))

    def qkv_rope(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, ...]:
        """The rank's query, key and value heads of x, RoPE on the first two."""
        # [N, q, k and v heads, the two halves of a head]
        qkv = self.qkv_proj(x).view(len(x), -1, 2, self.head_dim // 2)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        # RoPE on the query and key heads at once: x cos + rotate_half(x) sin, where
        # rotate_half(x) = (-x2, x1) is flip(x) = (x2, x1) with its sign in sin's first half.
        qk = qk * cos + qk.flip(2) * sin
        return *qk.split([self.num_heads, self.num_kv_heads], dim=1), v

    def attend(self, q, k, v, kv_cache: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """Each row's query over its request's keys and values, this step's too: o_proj's input."""
        # This step's keys and values into the cache, and the B one-token rows' attention
        outputs = [attend_decodes(q, k, v, kv_cache, inputs)]  # (no rows where none decodes)
        q_per_kv, hd = self.num_heads // self.num_kv_heads, self.head_dim
        row = len(inputs.context_slots)
        for context_slots, start, length, mask in inputs.chunks:
            # Each query head gets a copy of its KV head: SDPA's own GQA (enable_gqa) has, on CUDA,
            # only half-precision kernels, and a float32 prefill would fall to the unfused one.
            # Causal from position 0 needs no mask (an 8k-token prompt: the upper half skipped).
            keys, values = (
                kv_cache.view(2, -1, self.num_kv_heads, hd)  # as attend_decodes reads its slots
                .index_select(1, context_slots)
                .transpose(1, 2)
                .repeat_interleave(q_per_kv, dim=1)[:, None]
            )
            query = q[row : row + length].reshape(length, self.num_heads, hd).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None
            )
            outputs.append(out[0].transpose(0, 1).reshape(length, -1))
            row += length
        return torch.cat(outputs)


def attend_decodes(q, k, v, kv_cache: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """All N rows' keys and values into their slots (block, offset); then one call for the first B
    rows (one token each), up to the longest context, over their requests' slots in table order
    (index_select: far faster on CPU than indexing). Grouped-query attention as plain attention: the
    query heads sharing a KV head go in as one longer query (a view). A mask hides a row's later
    positions and what an earlier request left in its last block (or a short table's null block)."""
    B, kv_heads, hd = len(inputs.context_slots), k.shape[1], k.shape[2] * k.shape[3]
    # Indexing the cache itself, not a view of it: compiled (Worker.load_model), the write stays a
    # write of N slots in place; into a view, torch.compile would copy the whole cache a step.
    blocks, offsets = inputs.slot_mapping
    kv_cache[:, blocks, offsets] = torch.cat((k, v)).view(2, -1, kv_heads, hd)
    if not B:
        return q.new_empty(0, q[0].numel())
    slots = kv_cache.view(2, -1, kv_heads, hd)  # [2, num_blocks x block_size, kv_heads, hd]
    gathered = slots.index_select(1, inputs.context_slots.view(-1))
    keys, values = gathered.view(2, B, -1, kv_heads, hd).transpose(2, 3)
    query = q[:B].reshape(B, kv_heads, -1, hd)
    # reshape, not view: CUDA's memory-efficient kernel gives [B, M, H, K] transposed (docs/gpu.md)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=inputs.attn_mask)
    return out.reshape(B, -1)


class LlamaMLP(nn.Module):
    """SwiGLU: gate and up fused in one column-parallel matmul, down row-parallel."""

    def __init__(self, config: ModelConfig, group: TPGroup, prefix: str):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                split(f"{prefix}.gate_proj.weight", size, group),
                split(f"{prefix}.up_proj.weight", size, group),
            ],
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, group, f"{prefix}.down_proj.weight"
        )
        self.size = size // group.size  # this rank's gate (and up) features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate_up[:, : self.size]) * gate_up[:, self.size :])


class LlamaDecoderLayer(nn.Module):
    """Two all-reduces per layer: one after attention's o_proj, one after the MLP's down_proj."""

    def __init__(self, config: ModelConfig, group: TPGroup, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, f"{prefix}.input_layernorm.weight"
        )
        self.self_attn = LlamaAttention(config, group, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, f"{prefix}.post_attention_layernorm.weight"
        )
        self.mlp = LlamaMLP(config, group, f"{prefix}.mlp")

    def forward(self, x, cos, sin, kv_cache, inputs: ModelInputs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


def stage_layers(num_layers: int, stage: int, pp: int) -> range:
    """The layers of pipeline stage `stage` of `pp`, split as vLLM's get_pp_indices splits them:
    equal parts, and the remainder one each to the stages just before the last (which holds the
    norm and the LM head too): 4 layers in 3 stages are [0], [1, 2], [3]."""
    base, extra = divmod(num_layers, pp)
    sizes = [base + (pp - 1 - extra <= s < pp - 1) for s in range(pp)]
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


class LlamaForCausalLM(nn.Module):
    """Token ids in, full-vocabulary logits of each sequence's last token out, on every rank. Under
    pipeline parallelism (pp stages) a rank holds its stage's layers only: the first stage embeds,
    the last one norms and holds the LM head; the others take and give hidden states."""

    def __init__(
        self, config: ModelConfig, group: TPGroup, max_model_len: int, stage: int = 0, pp: int = 1
    ):
        super().__init__()
        embedding, last = "model.embed_tokens.weight", stage == pp - 1
        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(V, H, group, embedding) if stage == 0 else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, group, f"model.layers.{i}")
            for i in stage_layers(config.num_layers, stage, pp)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps, "model.norm.weight") if last else None
        # Llama 3.2 ties the LM head to the embedding table: one tensor where one stage holds both
        head = embedding if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = ParallelLMHead(V, H, group, head) if last else None
        if config.tie_word_embeddings and self.embed_tokens and self.lm_head:
            self.lm_head.weight = self.embed_tokens.weight
        # cos and sin of every position, computed once in float32 as transformers does, then
        # kept in the model's dtype (transformers casts them each step), and sin's first half
        # negated for RoPE (see LlamaAttention): [2, positions, 1 (every head), 2 halves, hd / 2].
        freqs = torch.outer(torch.arange(max_model_len).float(), rope_inverse_frequencies(config))
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.stack((torch.stack((cos, cos), 1), torch.stack((-sin, sin), 1)))[:, :, None]
        self.register_buffer("rope_table", table.to(torch.get_default_dtype()), persistent=False)

    def forward(
        self, inputs: ModelInputs, kv_caches: list[torch.Tensor], x: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits; on a stage before the last, its hidden states: [N, hidden]. x: the hidden
        states from the stage before (None on the first stage, which embeds the tokens)."""
        x = self.embed_tokens(inputs.input_ids) if x is None else x  # [N, hidden]
        cos, sin = self.rope_table[:, inputs.positions]  # each [N, 1, 2, hd / 2]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, inputs)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x[inputs.logits_indices]))  # only rows whose logits are used


# Loading: each rank reads only its own slices of the safetensors files ----------------
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights, uniform in +-1e-3 as vLLM's (load_format "dummy"): real shapes and speed."""
    torch.manual_seed(seed)
    for param in model.parameters():
        param.data.uniform_(-1e-3, 1e-3)


def load_checkpoint(model: nn.Module, files: dict, show_progress: bool) -> None:
    """Copy into each parameter the slices its `shards` name, from `files` (each tensor's open
    safetensors file: checkpoints.open_checkpoint): `get_slice` reads only those bytes, so a rank
    never holds a whole weight it does not need. (check_checkpoint has checked the shapes.)"""
    from tqdm import tqdm  # a dependency of transformers and huggingface_hub

    head = model.lm_head and model.lm_head.weight
    # tied, yet a head of its own: see checkpoints.check_checkpoint
    if head is not None and head.shards[0].name != "lm_head.weight" and "lm_head.weight" in files:
        model.lm_head.weight = nn.Parameter(torch.zeros_like(head), requires_grad=False)
        model.lm_head.weight.shards = [
            replace(shard, name="lm_head.weight") for shard in head.shards
        ]
    shards = [(param, shard) for param in model.parameters() for shard in param.shards]
    # if slow
    bar = tqdm(shards, desc="loading weights", unit="tensor", disable=not show_progress, delay=1)
    for param, shard in bar:
        tensor_slice = files[shard.name].get_slice(shard.name)
        index = [slice(None)] * len(tensor_slice.get_shape())
        index[shard.dim] = slice(shard.start, shard.start + shard.size)
        param.data.narrow(shard.dim, shard.offset, shard.size).copy_(tensor_slice[tuple(index)])


# What a rank holds, from the config alone ---------------------------------------------
def meta_model(config: ModelConfig, group: TPGroup, stage: int = 0, pp: int = 1) -> nn.Module:
    """A rank's model on the "meta" device: its parameters' shapes, and no memory."""
    with torch.device("meta"):
        return LlamaForCausalLM(config, group, 1, stage, pp)


def weight_bytes(config: ModelConfig, group: TPGroup, dtype: str, stage=0, pp=1) -> int:
    """Bytes of the weights that `group`'s rank holds (a tied table once; padded vocab rows too)."""
    params = meta_model(config, group, stage, pp).parameters()
    return sum(p.numel() for p in params) * getattr(torch, dtype).itemsize


def kv_cache_shape(
    config: ModelConfig, tp: int, num_blocks: int, block_size: int
) -> tuple[int, ...]:
    """One layer's KV cache on a rank, paged: keys and values, num_blocks blocks of block_size
    positions, the rank's KV heads (one at least: replicated where tp exceeds them), each head_dim
    wide. Worker.init_kv_cache allocates it; LLM checks it fits."""
    return 2, num_blocks, block_size, max(1, config.num_kv_heads // tp), config.head_dim


# Not PyTorch's public API, in one place -------------------------------------------------
def cpu_has_native_bfloat16() -> bool:
    """Does oneDNN run bfloat16 natively on this CPU (AVX-512 BF16, AMX)? Nothing public says."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()
