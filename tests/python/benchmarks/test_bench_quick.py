"""`python -m benchmarks.bench --quick`, `python -m benchmarks.ragged --quick` and
`python -m benchmarks.options --quick` run end to end
and write their results (smoke tests of every code path of the benchmarks; no timing assertions);
the tables of docs/benchmarks/README.md are what the benchmark prints from the saved runs; the
block-product probe is a library of its own, outside the product's op namespace."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import causal_attention  # noqa: F401  (the ops: block_shape)

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_bench_quick_writes_results(tmp_path):
    # A tiny memory budget makes the materializing implementations skip the larger quick case,
    # so the "skipped (memory)" path runs too.
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(tmp_path),
         "--mem-budget-gib", "0.001"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("results.csv", "results.json", "gflops.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "gflops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((tmp_path / "results.json").read_text())
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    impls = report["implementations"]
    assert set(impls) == {"ours", "sdpa", "sdpa_math", "naive"}
    for impl in impls:
        assert any(r["impl"] == impl and r["status"] == "ok" for r in rows), impl
    assert {r["section"] for r in rows} == {"short", "decode"}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    assert any(r["status"] == "skipped (memory)" for r in rows)
    assert all(r["status"] == "skipped (memory)" or float(r["time_ms"]) > 0 for r in rows)
    assert len(rows) == len(report["results"])

    assert set(report["limit_gflops"]) == {"float32", "bfloat16"}
    assert all(value > 0 for value in report["limit_gflops"].values())
    assert report["copy_gbps"] > 0
    assert report["environment"]["cpu_model"]
    assert set(report["scaling"]) == {"ours", "sdpa"}
    assert [m["impl"] for m in report["memory"]] == ["ours"]
    assert report["memory"][0]["ratio"] > 0, report["memory"]
    assert set(report["accuracy"]["max_abs_error"]) == {"ours", "sdpa"}
    assert report["summary"]
    assert "summary" in result.stdout


@pytest.mark.parametrize("saved", ["full_grid.json", "grid_bfloat16.json"])
def test_documented_grid_tables_are_the_saved_runs(saved):
    """docs/benchmarks/README.md's grid tables are what `python -m benchmarks.bench --table-from
    docs/benchmarks/<saved>` prints: the figures there come from the saved runs, not from hand."""
    path = REPO_ROOT / "docs" / "benchmarks" / saved
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--table-from", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    # One line per grid cell timed for both ours and SDPA, plus the header.
    cells = {
        (r["dtype"], r["mode"], r["B"], r["H"], r["D"], r["Lq"])
        for r in json.loads(path.read_text())["results"]
        if r["section"] == "grid" and r["status"] == "ok" and r["impl"] == "ours"
    }
    assert len(cells) > 0 and len(lines) == 1 + len(cells)
    document = (REPO_ROOT / "docs" / "benchmarks" / "README.md").read_text()
    assert f"python -m benchmarks.bench --table-from docs/benchmarks/{saved}" in document
    for line in lines:
        assert line in document, line


def test_call_overhead_times_every_call_against_sdpa():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.call_overhead", "--rounds", "1", "--min-run-time",
         "0.01"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("(")]
    assert len(rows) == 10  # 2 shapes x 5 calls
    for shape, call, median_us, vs_sdpa in rows:
        assert float(median_us) > 0
        if "sdpa" in call:
            assert float(vs_sdpa) == 1.0


def test_documented_grid_comparison_is_the_saved_runs():
    """The comparison docs/benchmarks/README.md quotes is what --compare-with prints for the two
    saved Zen 5 runs, and every cell's ratio of ratios is the cells' own."""
    now, base = (REPO_ROOT / "docs" / "benchmarks" / name
                 for name in ("grid_zen5_options.json", "grid_zen5.json"))
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--table-from", str(now), "--compare-with",
         str(base)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    document = (REPO_ROOT / "docs" / "benchmarks" / "README.md").read_text()
    assert lines[-1].startswith("now / base over 32 cells") and lines[-1] in document
    for line in lines[1:-1]:
        base_ratio, now_ratio, change = (float(field) for field in line.split("|")[1:])
        assert abs(now_ratio / base_ratio - change) <= 0.01, line


def quick_report(module: str, tmp_path):
    """What ``python -m benchmarks.<module> --quick --out ...`` wrote, after it exited 0."""
    out = tmp_path / f"{module}.json"
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "module, sections",
    [
        ("ragged", ("mask", "leftpad", "packed", "attn_mask", "documents", "bias")),
        ("options", ("window", "modifiers")),
    ],
)
def test_bench_sections_quick_writes_every_section(tmp_path, module, sections):
    """python -m benchmarks.ragged --quick and python -m benchmarks.options --quick time every
    section, dtype and pass and write them."""
    rows = quick_report(module, tmp_path)["rows"]
    assert {(r["section"], r["dtype"], r["pass"]) for r in rows} == {
        (section, dtype, pass_name)
        for section in sections
        for dtype in ("float32", "bfloat16")
        for pass_name in ("fwd", "f+b")
    }
    for row in rows:
        seconds = [value for key, value in row.items() if key.endswith("_s")]
        assert seconds and all(value > 0 for value in seconds), row


def test_the_block_product_probe_is_its_own_library():
    """The probe loads from its own library under causal_attention_bench; the product's
    namespace holds no benchmark op."""
    from benchmarks.limits import block_gemm_gflops

    probe = block_gemm_gflops()
    assert probe is torch.ops.causal_attention_bench.block_gemm_gflops
    assert probe(torch.float32, 64, 64, 64, 4) > 0
    assert probe(torch.bfloat16, 64, 64, 64, 4) > 0
    with pytest.raises(ValueError, match="must be positive"):
        probe(torch.float32, 0, 64, 64, 4)
    assert not hasattr(torch.ops.causal_attention, "_block_gemm_gflops")
    assert not hasattr(torch.ops.causal_attention, "block_gemm_gflops")


@pytest.mark.parametrize("prefetch_next", [False, True])
def test_the_page_read_probe_sums_the_listed_pages_in_any_order(prefetch_next):
    """read_pages sums every element of the pages the table lists (a page listed twice, twice),
    split among the threads, and refuses tables that leave the pool with a ValueError."""
    from benchmarks.limits import probe

    read = probe("read_pages")
    cache = torch.randn(40, 16, 2, 8)
    table = torch.tensor([[3, 39, 0, 7], [7, 12, 25, 1]], dtype=torch.int32)
    expected = cache[table.flatten().long()].double().sum().item()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)  # float32 sums of 2048 elements
            assert read(cache, table, prefetch_next) == pytest.approx(expected, abs=1e-4)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match=r"must lie in \[0, 40\), got -1 to 38"):
        read(cache, table - 1, prefetch_next)
    with pytest.raises(TypeError, match="block_table int32"):
        read(cache, table.long(), prefetch_next)
    assert not hasattr(torch.ops.causal_attention, "read_pages")


@pytest.mark.parametrize("order", [{}, {"heads": 2, "page_rows": 16}], ids=["pages", "decode"])
@pytest.mark.parametrize("multiply_adds", [0, 4, 32])
def test_the_overlap_probe_reads_every_listed_word_once_in_either_order(order, multiply_adds):
    """read_pages_computing reads each word of the listed pages once, whole pages or in the
    decode's order (blocks of 4 pages, head by head, the next block requested), with
    multiply_adds multiply-adds on it by factors that pair up to 2: the sum of the pages (times
    multiply_adds where there are any); a layout that does not divide the pages is refused."""
    from benchmarks.limits import probe

    compute = probe("read_pages_computing")
    cache = torch.randn(40, 16, 2, 8)
    table = torch.tensor([3, 39, 0, 7, 7, 12, 25, 1, 30], dtype=torch.int32)
    expected = cache[table.long()].double().sum().item() * max(1, multiply_adds)
    assert compute(cache, table, multiply_adds, **order) == pytest.approx(
        expected, rel=1e-3, abs=1e-2 * max(1, multiply_adds))
    with pytest.raises(ValueError, match="must divide a page's 256 words, got 3 and 16"):
        compute(cache, table, multiply_adds, heads=3, page_rows=16)
    with pytest.raises(ValueError, match="must be 0, 4, 8, 16 or 32, got 5"):
        compute(cache, table, 5, **order)


def test_breakdown_quick_reports_both_views(tmp_path):
    """`python -m benchmarks.breakdown --quick`: the products' time at their probe rate against
    the call's, what they allow against SDPA and our float32 (each bound the times it divides),
    and (where perf is installed) the sampling profile's categories; perf missing is said, not
    hidden."""
    out_file = tmp_path / "breakdown.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.breakdown", "--quick", "--out", str(out_file)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "block products of two inputs: bfloat16 " in out
    assert "block products at their probe rate:" in out
    assert "% best" in out
    for product in ("S = Q K^T", "O += P V", "dV += P^T dO", "dK += dS^T Q", "dQ += dS K"):
        assert product in out, product
    if "no sampling profile" not in out:
        for category in ("block products (oneDNN JIT)", "softmax pass", "packing and conversion"):
            assert category in out, category
    assert "against SDPA on the same inputs" in out and "against our float32" in out
    report = json.loads(out_file.read_text())
    # The shape it prices is the one the kernels take (the quick call: bfloat16, D 64, L 256).
    rows, keys = torch.ops.causal_attention.block_shape(torch.bfloat16, 64, 64, 256)
    assert (report["block_shape"]["query_rows"], report["block_shape"]["keys"]) == (rows, keys)
    assert f"blocks of {rows} query rows by {keys} keys" in out
    assert f"{rows}x{keys}x64" in out  # S = Q K^T, in chains of 64
    ms, floor = report["ms"], report["floor_ms"]
    # The floor takes each product at its operands' best rate, never slower than the kernels'
    # shapes' (products_ms).
    assert 0 < floor <= report["products_ms"] * (1 + 1e-9)
    assert report["sdpa_over_floor"] == pytest.approx(ms["sdpa"] / floor)
    assert report["float32_over_floor"] == pytest.approx(ms["float32"] / floor)
    assert report["sdpa_over_rounded_floor"] == pytest.approx(
        ms["sdpa"] / report["rounded_floor_ms"])
    assert report["float32_floor_over_floor"] == pytest.approx(report["float32_floor_ms"] / floor)
    # Split P and dS: the products that take them with twice the reduction, so above the rounded
    # floor and below twice it (the products of two inputs, S and dP, count once); and the
    # kernels' own operands where bfloat16 multiplies natively (operands.h), else float32's.
    rounded, split = report["rounded_floor_ms"], report["split_floor_ms"]
    assert rounded < split < 2 * rounded
    assert report["sdpa_over_split_floor"] == pytest.approx(ms["sdpa"] / split)
    if torch.ops.causal_attention.block_products(torch.bfloat16) == "native":
        assert floor == pytest.approx(split) and "dQ += dS K (pairs)" in out
    else:
        assert "(pairs)" not in out


def test_context_parallel_benchmark_quick_writes_every_section(tmp_path):
    """python -m benchmarks.context_parallel --quick runs every section on real processes and
    writes them; the bytes it measures at the socket are the formula's, within the handshake.
    About 30 s on 2 cores (the suite's longest): its four sections start ten sets of freshly
    spawned processes, each importing torch, at sizes already the smallest that run every path;
    it is the only test of the benchmark's own process handling."""
    report = quick_report("context_parallel", tmp_path)
    # At the quick sizes a call adds about a page to the resident set, within the kernel's
    # counting: the figures are there, their size is not the point.
    for method in ("ring", "ulysses"):
        assert len(report["memory"][method]["per_rank_mib"]) == 2, method
        assert 1.0 <= report["bytes"][method]["ratio_measured_to_formula"] < 1.05, method
    for layout in ("zigzag", "contiguous"):
        assert len(report["balance"][layout]["cpu_s_per_rank"]) == 2, layout


def test_paged_benchmark_quick_writes_every_section(tmp_path):
    """python -m benchmarks.paged --quick times every path (paged on shuffled pages and on pages
    in order, contiguous, gathered SDPA, the bare reads of the pages, the mixed batch's three
    ways, a draft-verifying step with and without its tree mask, MLA's decode from a latent read
    once and from two caches with the bound the chip puts on their ratio, the decode and a
    prefill chunk from float32, bfloat16 and 8-bit caches beside bare reads of their pages and
    beside the same decode on pages that stay in cache, the pages read with arithmetic on them
    beside that arithmetic in cache) and measures a call's memory on a float32 and an int8 cache;
    the paged output is the contiguous op's."""
    report = quick_report("paged", tmp_path)
    (decode,) = report["decode"]
    assert decode["max_abs_error"] < 1e-5
    assert {"paged_ms", "pages_in_order_ms", "contiguous_ms", "flash_layout_ms",
            "gather_sdpa_ms", "read_pages_ms", "read_in_order_pages_ms"} <= decode.keys()
    assert {"one_call_ms", "per_request_ms", "decodes_then_chunks_ms"} <= report["mixed"].keys()
    assert {"no_mask_ms", "chain_ms", "tree_ms", "tree_over_no_mask"} <= report["verify"].keys()
    (latent,) = report["latent"]
    assert {"shared_ms", "two_caches_ms", "two_caches_over_shared"} <= latent.keys()
    assert latent["latent_read_ms"] > 0 and latent["values_read_ms"] > 0
    for suffix in ("", "_all_bfloat16"):  # 1 + values read / max(floor, latent read)
        floor = latent[f"arithmetic_floor{suffix}_ms"]
        assert floor > 0
        assert latent[f"two_caches_over_shared_bound{suffix}"] == pytest.approx(
            1 + latent["values_read_ms"] / max(floor, latent["latent_read_ms"]))
    assert [m["cache_dtype"] for m in report["memory"]] == ["float32", "int8"]
    for memory in report["memory"]:
        assert {"peak_added_mib", "added_over_cache"} <= memory.keys()
    precisions = report["precisions"]
    assert {row["cache"] for row in precisions["decode"]} == {
        "float32", "bfloat16", "e4m3_token", "e4m3_tensor", "e5m2_token", "int8_token"}
    for row in precisions["decode"] + precisions["prefill"]:
        assert row.get("decode_ms", row.get("prefill_ms")) > 0, row
        assert row["bfloat16_over_this"] > 0, row
    assert all(row["bare_read_ms"] > 0 and row["in_cache_ms"] > 0 for row in precisions["decode"])
    for row in precisions["decode"]:
        assert row["prefetched_read_ms"] > 0, row
        assert row["prefetched_read_over_decode"] == pytest.approx(
            row["prefetched_read_ms"] / row["decode_ms"]), row
    overlap = report["overlap"]
    assert [(row["order"], row["multiply_adds_per_vector"]) for row in overlap] == [
        (order, m) for order in ("pages", "decode") for m in (0, 4, 8, 16, 32)]
    (bare_read,) = [row["read_computing_ms"] for row in overlap
                    if row["order"] == "pages" and row["multiply_adds_per_vector"] == 0]
    for row in overlap:  # hidden: the share of the shorter of read and arithmetic that vanished
        assert row["read_ms"] > 0 and row["in_cache_ms"] > 0, row
        assert row["hidden"] == pytest.approx(
            (row["read_ms"] + row["in_cache_ms"] - row["read_computing_ms"])
            / min(row["read_ms"], row["in_cache_ms"])), row
        assert row["over_bare_read"] == pytest.approx(row["read_computing_ms"] / bare_read), row


def test_serving_benchmark_quick_tokens_match_generate_and_pages_come_back(tmp_path):
    """python -m benchmarks.serving --quick serves its queue both ways: continuous batching's
    greedy tokens are each request's GPT.generate alone, the padded baseline's are the same
    (padding changes no request's tokens), the pool's pages in use stay inside it and all come
    back once every request is done; from fp8 and int8 caches of the same bytes, more requests
    run at once and most tokens are the float32 cache's."""
    report = quick_report("serving", tmp_path)
    checks = report["checks"]
    assert checks["checked_against_generate"] == report["queue"]["requests"] > 0
    assert checks["equal_generate_each"] == [True] * checks["checked_against_generate"]
    assert checks["equal_generate"] == checks["checked_against_generate"]
    assert checks["padded_equal_ours"] == checks["requests"] == report["queue"]["requests"]
    ours, padded = report["ours"], report["padded"]
    assert ours["tokens_per_s"] > 0 and padded["tokens_per_s"] > 0
    assert 0 < ours["peak_pages_in_use"] <= ours["pool_pages"]
    assert ours["pages_in_use_after"] == 0
    assert 0 <= ours["page_pairs_in_order"] <= 1
    assert padded["computed_tokens"] >= padded["needed_tokens"] == ours["computed_tokens"]
    # The 8-bit caches in the float32 pool's bytes hold more tokens and so run more requests.
    assert set(report["eight_bit"]) == {"float8_e4m3fn", "int8"}
    for name, row in report["eight_bit"].items():
        assert row["pool_mib"] <= ours["pool_mib"], name
        assert row["tokens_held_over_model_dtype"] > 1 and row["max_batch"] > ours["max_batch"]
        assert row["pages_in_use_after"] == 0 and row["tokens_per_s"] > 0, name
        assert 0 < row["equal_tokens_share"] <= 1, name


def test_quantized_accuracy_quick_reports_each_cache_and_the_model(tmp_path):
    """python -m benchmarks.quantized_accuracy --quick: for each 8-bit dtype and scale layout the
    quantization's error is far above the kernel's own in float32, and the small GPT's logits
    from 8-bit caches stay near the bfloat16 cache's."""
    report = quick_report("quantized_accuracy", tmp_path)
    assert len(report["op"]) == 6
    for row in report["op"]:
        assert row["kernel_error_float32"] < 1e-5 < row["quantization_error_max"], row
        assert row["kernel_error_bfloat16"] < 0.05 * row["output_rms"] + 1e-2, row
    model = report["model"]
    for name in ("float8_e4m3fn_tensor", "float8_e4m3fn_token", "float8_e5m2_tensor",
                 "int8_token"):
        assert model[name]["logits_max_difference"] < 0.1 * model[name]["logits_range"], name
        assert model[name]["same_greedy_token_share"] > 0.5, name
