"""The benchmarks of causal_attention against torch's scaled_dot_product_attention on the CPU.

    python -m benchmarks.bench --quick     # the grid benchmark (bench.py), seconds-long smoke run
    python -m benchmarks.ragged --quick    # key masks and packed sequences (ragged.py)

By job: cli (the command lines), cases (the implementations, the sizes, the planned cases),
timing (torch.utils.benchmark), limits (the machine: CPU, block-product limit, copy bandwidth),
memory (the peak memory of one call, shared with tests/python/test_memory.py), accuracy
(bfloat16 errors against float64), report (tables, the summary against targets.json, files).
The results and the machine they were measured on are in docs/benchmarks/README.md.
"""
