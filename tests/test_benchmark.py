"""`lab/benchmark.py all --json F` writes every key, and the parts it ran measured each one (or said
exactly why not). The whole --quick run takes ~4 minutes on 2 loaded cores: this runs its two short
parts (transfers and upload growth) at --tiny's size, --quick's paths on fewer bytes and intervals;
the stall and pod parts are left to the benchmark. No figure is judged here: the machine is shared;
the figures are the benchmark's, not the test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench_report import KEYS
from benchmark import PART_KEYS
from podlab import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="the pod runner needs root")]


def test_all_writes_every_key_and_measures_the_parts_it_ran(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "benchmark.py"), "all", "--tiny", "--json", str(out),
                             "--only", "transfer", "--only", "growth"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(KEYS) <= set(figures) and {"machine", "started_at"} <= set(figures)
    ran = PART_KEYS["transfer"] + PART_KEYS["growth"]
    unmeasured = {key: figures[key]["how"] for key in ran if figures[key]["value"] is None}
    assert not unmeasured, unmeasured
    for key in ran:
        entry = figures[key]
        if entry["floor"] is not None:
            assert entry["ratio"] == pytest.approx(entry["value"] / entry["floor"], rel=0.01), key
    assert all("not run" in figures[key]["how"] for key in set(KEYS) - set(ran))


def test_the_fsdp_part_measures_every_key_in_its_cpu_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "lab" / "benchmark.py"), "all", "--quick", "--json", str(out),
                             "--only", "fsdp"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    unmeasured = {key: figures[key]["how"] for key in PART_KEYS["fsdp"] if figures[key]["value"] is None}
    assert not unmeasured, unmeasured
    ddp, fsdp = (figures["fsdp_state_bytes_per_rank"]["detail"][mode] for mode in ("ddp", "fsdp"))
    assert [r["weights"] for r in fsdp] == [sum(r["weights"] for r in fsdp) // 2] * 2, "each rank holds half"
    assert sum(r["weights"] for r in fsdp) == ddp[0]["weights"], "the same model"
    nodes = figures["fsdp_restore_bytes_per_node"]["detail"]
    assert sum(nodes["node_bytes"]) < nodes["whole_bytes"] * 1.1, "the shared files are small"
