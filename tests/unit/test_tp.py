"""Tensor parallelism: real rank processes joined by torch.distributed (gloo on this CPU).

Greedy output at TP 2 (and 4) must equal TP 1 in float32, on Gemma-3 (one KV head, replicated
on every rank) and on a tiny Llama checkpoint written here with four KV heads (split two per
rank at TP 2, one per rank at TP 4). Ranks outlive neither their engine nor a killed parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.engine.tp import local_kv_heads, rank_cores
from epdserve.errors import ConfigError
from epdserve.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_kv_heads_split_or_replicate():
    assert [local_kv_heads(4, tp) for tp in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert local_kv_heads(1, 2) == 1
    with pytest.raises(ConfigError, match="do not split"):
        local_kv_heads(2, 3)
    with pytest.raises(ConfigError, match="do not split"):
        local_kv_heads(6, 4)


def test_rank_cores_split_the_workers_cores():
    assert [rank_cores([4, 5, 6, 7], r, 2) for r in (0, 1)] == [[4, 5], [6, 7]]
    assert [rank_cores([0, 1], r, 4) for r in range(4)] == [[0], [1], [0], [1]]  # shared when short


def generate(model: str, tp: int, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs, and the follower pids (gone once the engine's group is closed)."""
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", tensor_parallel_size=tp, kv_cache_memory_gib=0.05,
                                  max_model_len=1024, max_num_batched_tokens=256))
    try:
        outputs = [c[0].token_ids for c in engine.generate(prompts, GREEDY)]
        assert engine.kv_cache.is_all_free()
        tp_group = engine.loaded.tp
        pids = [p.pid for p in tp_group.followers] if tp_group is not None else []
        if tp_group is not None:
            assert engine.runner.kv_caches[0].shape[3] == local_kv_heads(engine.loaded.spec.num_kv_heads, tp)
            tp_group.close()
        return outputs, pids
    finally:
        if engine.loaded.tp is not None:
            engine.loaded.tp.close()


def assert_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"tensor-parallel rank {pid} outlived its engine")


def test_tiny_llama_tp2_and_tp4_match_tp1(tiny_llama):
    prompts = [[5 + (7 * i) % 900 for i in range(n)] for n in (3, 40, 300)]  # 300: chunks of 256
    expected, _ = generate(str(tiny_llama), 1, prompts)
    for tp in (2, 4):
        outputs, pids = generate(str(tiny_llama), tp, prompts)
        assert len(pids) == tp - 1
        assert outputs == expected, f"TP {tp}"
        assert_gone(pids)


def test_gemma3_tp2_matches_tp1(gemma3_gguf):
    prompts = [[2, *[100 + (13 * i) % 5000 for i in range(n)]] for n in (5, 600)]  # 600: past the 512 window
    expected, _ = generate(str(gemma3_gguf), 1, prompts)
    outputs, pids = generate(str(gemma3_gguf), 2, prompts)
    assert outputs == expected
    assert_gone(pids)


def test_heads_that_do_not_split_fail_cleanly(tiny_llama):
    with pytest.raises(ConfigError, match="tensor-parallel") as info:
        LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", tensor_parallel_size=3,
                             kv_cache_memory_gib=0.05, max_model_len=256))
    assert "rank 1" in str(info.value) and "rank 2" in str(info.value)


def test_ranks_exit_when_the_engine_process_is_killed(tiny_llama, tmp_path):
    """SIGKILL to the process holding rank 0: its followers notice the closed pipe and exit."""
    pid_file = tmp_path / "followers"
    script = textwrap.dedent(f"""
        import pathlib, time
        from epdserve.config import EngineArgs
        from epdserve.engine.engine import LLMEngine
        if __name__ == "__main__":
            engine = LLMEngine(EngineArgs(model={str(tiny_llama)!r}, dtype="float32", tensor_parallel_size=2,
                                          kv_cache_memory_gib=0.05, max_model_len=256))
            pids = " ".join(str(p.pid) for p in engine.loaded.tp.followers)
            pathlib.Path({str(pid_file)!r}).write_text(pids)
            time.sleep(120)
    """)
    path = tmp_path / "hold_tp.py"
    path.write_text(script)
    process = subprocess.Popen([sys.executable, str(path)])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    assert_gone(pids)
