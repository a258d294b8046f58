"""dcp_ops: Decode Context Parallelism attention primitives.

The KV cache is sharded by sequence across the ranks of a DCP group; each rank attends every query head over its
own tokens and the partial results are merged exactly by their log-sum-exp. See README.md and docs/design.md.
"""
import torch

from . import _C  # noqa: F401  (loads the native library: registers torch.ops.dcp_ops, picks the CPU kernels' ISA level)

from . import reference  # noqa: E402,F401
from .distributed import GQAShard, MLAShard, Workspace, dcp_attention, exchange_bytes, gather_heads, merge_across  # noqa: E402
from .layout import (  # noqa: E402
    Placement,
    local_causal_lens,
    local_index,
    local_seq_lens,
    owner_rank,
    shard_kv,
    slot_mapping,
    unshard_kv,
)
from .reshard import gather_kv, reshard_kv, transfer_runs  # noqa: E402
from .ops import (  # noqa: E402
    correct_partial,
    gqa_decode_partial,
    merge_exchange,
    merge_partials,
    mla_decode_partial,
    pack_exchange,
    write_kv,
)

__all__ = [
    "gqa_decode_partial", "mla_decode_partial", "merge_partials", "correct_partial", "pack_exchange",
    "merge_exchange", "write_kv", "Placement", "owner_rank", "local_index", "local_seq_lens", "local_causal_lens",
    "slot_mapping", "shard_kv", "unshard_kv", "transfer_runs", "reshard_kv", "gather_kv",
    "reference", "dcp_attention", "GQAShard", "MLAShard", "Workspace", "exchange_bytes", "gather_heads", "merge_across",
]
__version__ = "0.2.0"
