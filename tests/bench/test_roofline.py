"""bench/roofline.py: the floor model by hand, and the tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench import roofline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SMOL = roofline.SHAPES["smollm2-135m"]


def test_smollm2_layer_shapes_hold_its_135m_parameters():
    layers = SMOL["num_hidden_layers"] * sum(n * k for n, k in roofline.layer_shapes(SMOL))
    embed = SMOL["vocab_size"] * SMOL["hidden_size"]
    norms = (2 * SMOL["num_hidden_layers"] + 1) * SMOL["hidden_size"]
    assert layers + embed + norms == 134_515_008  # SmolLM2-135M's parameter count (tied embedding)


def test_floor_is_bytes_over_bandwidth_when_memory_bound_and_flops_over_peak_when_compute_bound():
    args = dict(prompt_tokens=3200, output_tokens=1958, requests=32, slots=8)
    slow_memory = roofline.he32_floor(SMOL, read_gb_s=1.0, gflop_s=1e6, **args)
    assert slow_memory["decode_step_bound"] == "memory"
    assert slow_memory["decode_steps"] == pytest.approx((1958 - 32) / 8, abs=0.051)  # rounded to 0.1
    weights = 4 * (SMOL["num_hidden_layers"] * sum(n * k for n, k in roofline.layer_shapes(SMOL))
                   + SMOL["vocab_size"] * SMOL["hidden_size"])
    # the step reads at least the weights: at 1 GB/s, 1 ms per MB
    assert slow_memory["decode_step_ms"] > weights / 1e6
    slow_compute = roofline.he32_floor(SMOL, read_gb_s=1e6, gflop_s=1.0, **args)
    assert slow_compute["decode_step_bound"] == "compute"
    # 8 rows x 2 FLOPs per weight at least, at 1 GFLOP/s
    assert slow_compute["decode_step_ms"] > 8 * 2 * weights / 4 / 1e6
    # prefill is compute: twice the peak, half the time
    twice = roofline.he32_floor(SMOL, read_gb_s=1e6, gflop_s=2.0, **args)
    assert twice["prefill_s"] == pytest.approx(slow_compute["prefill_s"] / 2, rel=1e-3)
    for f in (slow_memory, slow_compute, twice):
        assert f["total_s"] == pytest.approx(f["prefill_s"] + f["decode_s"], abs=0.02)


def test_tiny_run_writes_every_kind_and_a_floor(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "bench.roofline", "--tiny", "--threads", "1",
                           "--rows", "1,3", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "roofline_tiny.json").read_text())
    from worker.models.llama.linear import cpu_linear_candidates

    fp32_kinds = set(cpu_linear_candidates(torch.float32))
    assert fp32_kinds <= set(payload["kinds"])
    for name, kind in payload["kinds"].items():
        assert set(kind["ms"]) >= {"1", "3"} and all(ms > 0 for ms in kind["ms"].values()), name
        assert ("512" in kind["ms"]) == (name in fp32_kinds), name
    assert payload["read_gb_s"] > 0
    assert payload["fp32_gemm_gflop_s"] == max(payload["kinds"][k]["gflop_s_512"] for k in fp32_kinds)
    assert payload["he32_floor"]["total_s"] > 0 and "floor" in done.stdout.lower()
    assert "int8 multiply-add peak" in done.stdout and ("skipped" in payload["int8_peak"]
                                                        or payload["int8_peak"]["gmac_s"] > 0)


def _tiny_gguf(path, tied: bool) -> None:
    """A header-only-interesting GGUF: a 16 x 32 fp32 embedding, one 64 x 32 fp16 weight, and (untied) a
    16 x 32 fp16 output head."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), dtype=np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((16, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_every_weight_but_the_embedding_and_the_head_whole(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, tied)
    params = 64 * 32 + 16 * 32  # the fp16 weight and the head (the embedding itself when tied)
    assert roofline.step_weight_bytes(path, "fp32") == 4 * params
    assert roofline.step_weight_bytes(path, "bf16") == 2 * params
    assert roofline.step_weight_bytes(path, "int4") == params // 2
    # as stored: fp16 weight, and the head fp32 when it is the embedding, else fp16
    assert roofline.step_weight_bytes(path, "gguf") == 2 * 64 * 32 + (4 if tied else 2) * 16 * 32
    with pytest.raises(ValueError, match="fp8"):
        roofline.step_weight_bytes(path, "fp8")
    # one multiply-add per element of each matrix a step multiplies: the weight and the head
    assert roofline.step_macs(path) == params
    floors = roofline.model_floors([str(path)], ["gguf", "bf16"], 10.0, rows=4, int8_gmac_s=1.0)[str(path)]
    assert floors["gguf"]["compute_floor_ms"] == pytest.approx(round(4 * params / 1e9 * 1000, 2))
    assert floors["gguf"]["rows"] == 4 and "compute_floor_ms" not in floors["bf16"]


def test_the_compute_floor_is_multiply_adds_over_the_peak():
    assert roofline.compute_floor_ms(1_500_000_000, 8, 300.0) == pytest.approx(40.0)
    for bad in ((1, 8, 0.0), (1, 0, 1.0)):
        with pytest.raises(ValueError):
            roofline.compute_floor_ms(*bad)


def test_the_int8_peak_is_measured_where_the_cpu_and_a_compiler_allow():
    import shutil

    one = roofline.int8_peak(1, seconds=0.02, passes=1)
    from worker.models.llama.extension import cpu_has

    vnni = all(cpu_has(f) for f in ("avx512f", "avx512bw", "avx512_vnni"))
    if not (cpu_has("avx2") or vnni) or shutil.which("cc") is None:
        assert set(one) == {"skipped"}
        return
    assert one["threads"] == 1 and one["gmac_s"] == one["per_thread_gmac_s"] > 0
    assert ("VNNI" in one["instruction"]) == vnni
    two = roofline.int8_peak(2, seconds=0.02, passes=1)
    # every thread's rate counted: at least the slowest thread's twice
    assert two["threads"] == 2 and two["gmac_s"] >= 2 * two["per_thread_gmac_s"] > 0


def test_the_decode_floor_is_bytes_over_bandwidth():
    assert roofline.decode_floor_ms(2_000_000_000, 10.0) == pytest.approx(200.0)
    with pytest.raises(ValueError):
        roofline.decode_floor_ms(1, 0.0)


def test_stream_bandwidth_measures_read_and_copy():
    out = roofline.stream_bandwidth(mib=8, passes=1)
    assert out["tensor_mib"] == 8 and out["read_gb_s"] > 0 and out["copy_gb_s"] > 0
