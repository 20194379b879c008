"""One decode step's all-reduces of Llama-3.1-8B (65 of them: 2 per layer for 32 layers and
1 after the embedding, each [batch, 4096] in bfloat16) between 2 processes on this machine,
two ways: gloo over TCP on the loopback interface, the best case of a network (no wire, no
switch), and tinytp's SharedMemoryGroup. docs/performance.md, "Past one machine".

    python docs/allreduce_over_tcp.py
"""

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import TPGroup  # noqa: E402
from worker import SharedMemoryGroup, collective_block_bytes, new_shared_memory  # noqa: E402

WORLD_SIZE, HIDDEN, ALL_REDUCES_PER_STEP, STEPS = 2, 4096, 2 * 32 + 1, 20


def time_steps(group: TPGroup, batch: int) -> float:
    """The median time of one step's all-reduces, in seconds."""
    tensor = torch.ones(batch, HIDDEN, dtype=torch.bfloat16)
    times = []
    for step in range(STEPS + 3):  # 3 to warm up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ALL_REDUCES_PER_STEP):
            group.all_reduce(tensor)
            tensor.fill_(1)  # keep the values small
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def rank_main(rank: int, port: int, block_name: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    shared = SharedMemoryGroup(rank, WORLD_SIZE, block_name)
    for batch in (1, 8):
        over_tcp = time_steps(TPGroup(rank, WORLD_SIZE), batch)
        in_memory = time_steps(shared, batch)
        if rank == 0:
            print(
                f"batch {batch}: {ALL_REDUCES_PER_STEP} all-reduces of {batch * HIDDEN * 2:,} "
                "bytes: gloo over "
                f"TCP loopback {over_tcp * 1e3:.2f} ms a step, shared memory "
                f"{in_memory * 1e3:.2f} ms"
            )
    shared.close(unlink=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    block = new_shared_memory(collective_block_bytes(WORLD_SIZE))
    try:
        mp.spawn(rank_main, args=(store.port, block.name), nprocs=WORLD_SIZE)
    finally:
        block.close()
        block.unlink()
