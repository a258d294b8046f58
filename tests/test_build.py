"""What the built library says about itself (dcp_ops._C): the CPU ISA and CUDA archs it was built for, which a
wheel carries to the hosts it is installed on."""
import re

import dcp_ops


def test_the_library_records_its_cpu_isa_and_cuda_archs():
    assert dcp_ops._C.cpu_isa in ("default", "avx2", "avx512", "avx512bf16", "amx")
    archs = dcp_ops._C.cuda_archs
    if dcp_ops._C.with_cuda:
        entries = archs.replace(" ", ";").split(";")
        assert entries and all(re.fullmatch(r"\d+\.\d+a?(\+PTX)?", e) for e in entries), archs
    else:
        assert archs == ""
