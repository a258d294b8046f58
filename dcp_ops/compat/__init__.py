"""Drop-in adapters for engines that already have a DCP code path (see dcp_ops.compat.vllm)."""
