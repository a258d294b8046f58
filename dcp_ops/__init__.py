"""dcp_ops: Decode Context Parallelism attention primitives.

The KV cache is sharded by sequence across the ranks of a DCP group; each rank attends every query head over its
own tokens and the partial results are merged exactly by their log-sum-exp. See README.md and docs/design.md.
"""
import torch

from . import _C  # noqa: F401  (loads the native library: registers torch.ops.dcp_ops)

_ISA_NEEDS = {"amx": ("AVX512",), "avx512bf16": ("AVX512",), "avx512": ("AVX512",), "avx2": ("AVX2", "AVX512")}


def _isa_missing(isa: str) -> str:
    """What this CPU (and OS) lacks of the instruction set dcp_ops was built for; empty when nothing."""
    if isa not in _ISA_NEEDS:
        return ""
    if torch.backends.cpu.get_cpu_capability() not in _ISA_NEEDS[isa]:
        return f"this CPU reports {torch.backends.cpu.get_cpu_capability()}"
    if isa in ("avx512bf16", "amx") and not torch.cpu._is_avx512_bf16_supported():
        return "this CPU lacks AVX512_BF16"
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        return "this CPU lacks AMX"
    if isa == "amx" and not torch.cpu._init_amx():  # Linux grants the AMX tile state per process, on request
        return "Linux refused this process the AMX tile state"
    return ""


_missing = _isa_missing(_C.cpu_isa)
if _missing:
    raise ImportError(f"dcp_ops was built for the {_C.cpu_isa} CPU instruction set but {_missing}; "
                      "rebuild with DCP_OPS_CPU_ISA=default (or the CPU's ISA)")

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
    "slot_mapping", "shard_kv", "unshard_kv",
    "reference", "dcp_attention", "GQAShard", "MLAShard", "Workspace", "exchange_bytes", "gather_heads", "merge_across",
]
__version__ = "0.1.0"
