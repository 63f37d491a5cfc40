"""scripts/gpu_check.py (make gpu-check) without a GPU: one line, exit 0, nothing written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script().main(["--out", str(tmp_path / "r" / "report.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA GPU" in out[0]
    assert not (tmp_path / "r").exists()


def test_the_peak_bandwidth_formula(monkeypatch):
    """H100 SXM: 2619 MHz HBM3 clock on a 5120-bit bus, double data rate = 3.35 TB/s."""
    class Props:
        name, major, minor, total_memory = "H100", 9, 0, 80 * 2**30
        memory_clock_rate, memory_bus_width = 2_619_000, 5120

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert abs(_script().gpu_summary()["peak_hbm_bytes_per_s"] / 1e12 - 3.352) < 0.001
