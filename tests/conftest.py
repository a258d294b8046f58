import datetime
import math
import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def paged_cache(lens, block_size, entry, dtype, gen, extra_blocks=2):
    """A paged cache [num_blocks, block_size, *entry] holding len random tokens per request, NaN everywhere else.

    Blocks are handed out in a random order; unused block-table entries hold an id far outside the cache, so a
    kernel that reads past a sequence's last block fails loudly. Returns (cache, block_table int32).
    """
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need + [0]) + 1
    cache = torch.full((num_blocks, block_size, *entry), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for b, (n, k) in enumerate(zip(lens, need)):
        table[b, :k] = order[used:used + k].int()
        used += k
        pos = torch.arange(n)
        cache[table[b, pos // block_size].long(), pos % block_size] = torch.randn(
            n, *entry, generator=gen).to(dtype)
    return cache, table


def randn(*shape, dtype=torch.float32, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def sharp_mla_case(lens, seed):
    """mla_decode_partial's arguments for DeepSeek's 16 heads of 512 + 64 in fp32, w_uk [16, 128, 512] absorbed, at 3x
    its softmax scale: sharp attention (as large query and key channels give) in which every score sums 576 products."""
    gen = torch.Generator().manual_seed(seed)
    kv, table = paged_cache(lens, 64, (576,), torch.float32, gen)
    w_uk = randn(16, 128, 512, gen=gen, scale=128 ** -0.5)
    q_nope, q_pe = randn(len(lens), 16, 128, gen=gen), randn(len(lens), 16, 64, gen=gen)
    return q_nope, q_pe, kv, table, torch.tensor(lens, dtype=torch.int32), 3 * 192 ** -0.5, w_uk, None


def init_gloo(rank, world, init_file):
    """A spawned test rank joins a gloo group. Workers end with a barrier and destroy_process_group, not in a
    `finally`: a rank that fails exits at once, so spawn reports its error (its peers' collectives then fail on the
    closed connections); the one-minute timeout is the backstop (gloo's default is 30 minutes)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))


def spawn_ranks(worker, world, *args):
    """Runs worker(rank, world, init_file, *args) in `world` spawned processes that share a fresh file:// store (the
    worker joins with init_gloo); a rank's failure fails the caller with its traceback."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, os.path.join(d, "store"), *args), nprocs=world)


@pytest.fixture(scope="session")
def simt_ops():
    """torch.ops.dcp_ops_simt: the CUDA kernel sources built with the host compiler against csrc/simt/simt.h."""
    from torch.utils.cpp_extension import load

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = os.path.join(root, "build", "simt")
    os.makedirs(build, exist_ok=True)
    load(name="dcp_ops_simt", sources=[os.path.join(root, "tests", "simt", "simt_ops.cpp"),
                                       os.path.join(root, "csrc", "validate.cpp")],
         extra_include_paths=[os.path.join(root, "csrc"), os.path.join(root, "tests", "simt")],
         extra_cflags=["-O1", "-DDCP_SIMT", "-mf16c"], build_directory=build, is_python_module=False, verbose=False)
    return torch.ops.dcp_ops_simt


def pytest_collection_modifyitems(items):
    """Every test that runs the CUDA sources (it takes the simt_ops fixture) carries the simt marker, so that
    `pytest -m simt` selects them all."""
    for item in items:
        if "simt_ops" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.simt)
