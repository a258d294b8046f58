"""python -m dcp_ops demo [...]: the distributed DCP demo (dcp_ops/demo.py).
python -m dcp_ops generate [...]: Hugging Face Llama and DeepSeek-V3 decoding with DCP (examples/hf_generate.py, in a
checkout; it needs `transformers`)."""
import os
import sys

USAGE = ("usage: python -m dcp_ops demo [--world-size N] [...] | python -m dcp_ops generate [--world N] [...]; "
         "see --help")


def _generate(argv):
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if not os.path.isfile(os.path.join(examples, "hf_generate.py")):
        sys.exit("python -m dcp_ops generate runs examples/hf_generate.py from a checkout of the repository; "
                 f"{examples} has none")
    sys.path.insert(0, examples)
    import hf_generate
    return hf_generate.main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "generate"):
        sys.exit(USAGE)
    if sys.argv[1] == "demo":
        from . import demo
        sys.exit(demo.main(sys.argv[2:]))
    sys.exit(_generate(sys.argv[2:]))
