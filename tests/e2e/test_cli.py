"""`epdserve generate` on the default model: JSON output and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_for_a_prompts_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOne, two, three,\n")
    proc = run("generate", "--prompts-file", str(prompts), "--max-tokens", "8", "--json", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"text", "token_ids", "finish_reason", "num_prompt_tokens"}
        assert len(row["token_ids"]) == 8 and row["finish_reason"] == "length" and row["num_prompt_tokens"] > 0
    single = json.loads(run("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--json",
                            "--ignore-eos").stdout)
    assert single["token_ids"] == rows[0]["token_ids"]  # batching does not change greedy output


def test_chat_generation_answers():
    proc = run("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24",
               "--dtype", "float32")
    assert proc.returncode == 0 and "Paris" in proc.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--prompt", ""], "prompt must not be empty"),
        (["--prompt", "word " * 300, "--max-model-len", "128"], "max_model_len"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_input_is_one_line_error(args, fragment):
    proc = run("generate", *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr


def test_corrupt_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    proc = run("generate", "--prompt", "hi", "--model", str(bad))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "corrupt.gguf" in lines[0]


def test_serve_with_a_bad_device_fails_before_starting_workers():
    import torch

    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    proc = run("serve", "--port", "0", "--colocated-workers", "1", "--device", device, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "device" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", [["--colocated-workers", "1"], ["--role-switching", "manual"]])
def test_decode_no_prefix_caching_without_fixed_decode_workers_is_one_line_error(layout):
    proc = run("serve", "--port", "0", "--decode-no-prefix-caching", *layout, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--decode-no-prefix-caching" in lines[0] and "Traceback" not in proc.stderr
