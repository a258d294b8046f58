"""The main job (python -m dcp_ops demo): a small run on CPU ranks agrees with unsharded attention; bad options fail
with a message. The same run on GPU ranks over NCCL is in tests/test_cuda.py."""
import re

import pytest
import torch

from dcp_ops import demo


def test_demo_runs_on_cpu_ranks_and_checks_itself(capsys):
    assert demo.main(["--world-size", "2", "--context", "300", "--batch", "2", "--steps", "1", "--threads", "1",
                      "--interleave", "2"]) == 0
    text = capsys.readouterr().out
    assert "DCP decode on 2 CPU ranks (gloo)" in text and "all modes agree with unsharded attention" in text
    rows = [line for line in text.splitlines() if line.startswith(("MLA", "GQA"))]
    assert len(rows) == 15  # five layers (MTP and fp8 included) x three modes
    assert sum("MTP 2 tok" in row for row in rows) == 3
    fp8 = [row for row in rows if " fp8 " in row]
    assert len(fp8) == 3
    unit = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
    for row in fp8:  # KV per rank: 1 byte a value, against a bf16 TP cache (2 bytes, every token): about 2 x 2 ranks
        kv_rank, kv_tp = (float(n) * unit[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB|GiB)", row)[:2])
        assert 3.9 < kv_tp / kv_rank < 4.1, row
    for row in rows:
        err = re.search(r" (\d\.\d\de[-+]\d+) ", row)  # the max |err| column
        assert err is not None and float(err.group(1)) <= 2e-5, row


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU: the error path does not apply")
def test_demo_on_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.parametrize("world", [0, 3])
def test_demo_rejects_a_world_size_that_does_not_divide_the_heads(capsys, world):
    with pytest.raises(SystemExit):
        demo.main(["--world-size", str(world)])
    assert f"--world-size must divide the MLA layer's 128 heads among the ranks, got {world}" in capsys.readouterr().err


def test_demo_runs_under_torchrun():
    """Launched the way multi-node jobs are (torchrun, env://), each process is one rank of the launcher's group."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:  # a free port (torchrun's --master-port=0 waits forever here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), "-m", "dcp_ops", "demo", "--context", "200",
                          "--batch", "2", "--steps", "1", "--threads", "1"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count("DCP decode on 2 CPU ranks (gloo)") == 1  # rank 0 prints the table, once
    assert "all modes agree with unsharded attention" in res.stdout
