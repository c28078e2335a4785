"""The ``tapllm`` command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import random_prompts


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=300)


def test_generate_jsonl_batch_and_single_prompt(tiny_models, tmp_path):
    from tapllm import LLM, SamplingParams

    model = str(tiny_models["qwen2"])
    ids = random_prompts([6, 13], seed=11)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text(
        "\n".join(json.dumps(x) for x in [{"prompt": "Hello there"}, {"prompt_token_ids": ids[0]},
                                          {"text": "A second text"}, {"prompt_token_ids": ids[1]}]) + "\n"
    )
    out = tmp_path / "out.jsonl"
    proc = _run("generate", "--model", model, "--input", str(inp), "--output", str(out),
                "--max-tokens", "5", "--dtype", "float32", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "generating" in proc.stderr  # the progress bar
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    llm = LLM(model, dtype="float32")
    ref = llm.generate(["Hello there", ids[0], "A second text", ids[1]],
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in ref]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in ref]

    single = _run("generate", "Hello there", "--model", model, "--max-tokens", "5", "--dtype", "float32",
                  "--ignore-eos", "--quiet")
    assert single.returncode == 0, single.stderr
    assert single.stdout == ref[0].outputs[0].text + "\n"


def test_cli_errors_are_clear(tiny_models, tmp_path):
    model = str(tiny_models["qwen2"])
    proc = _run("generate", "hi", "--model", model, "--max-tokens", "0", "--quiet")
    assert proc.returncode == 2 and "max_tokens must be an integer >= 1" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    proc = _run("generate", "--model", model, "--input", str(bad), "--quiet")
    assert proc.returncode == 2 and "bad.jsonl:2" in proc.stderr and "prompt" in proc.stderr
    proc = _run("generate", "hi", "--model", str(tmp_path / "missing"), "--quiet")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_one_jsonl_reader_for_generate_and_collect(tmp_path):
    import pytest

    from tapllm.collect.prompt_records import Item, read_jsonl, to_prompt
    from tapllm.collect.sources import read_items

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'\xef\xbb\xbf{"prompt": "p", "text": "t"}\n\n{"messages": null, "prompt": "only"}\n'
                    b'{"prompt_token_ids": [1, 2], "text": "t"}\n{"messages": [{"role": "user", "content": "m"}]}\n')
    items = read_jsonl(inp)
    assert items == [Item("text", "t"), Item("text", "only"), Item("ids", [1, 2]),
                     Item("messages", [{"role": "user", "content": "m"}])]
    assert read_items(inp) == items  # collect reads JSONL with the same function
    chat = lambda msgs: "chat:" + msgs[-1]["content"]  # noqa: E731
    assert [to_prompt(it, chat) for it in items] == ["t", "only", [1, 2], "chat:m"]
    assert [to_prompt(it, chat, chat=True) for it in items] == ["chat:t", "chat:only", [1, 2], "chat:m"]
    for body, message in [(b'{"text": "ok"}\n{"text": "bad \xff"}\n', ":2: not valid UTF-8 (byte 0xff at byte 15"),
                          (b'{"text": "ok"}\n{"text": \n', ":2: not valid JSON"),
                          (b'{"text": "ok"}\n[1]\n', ":2: each record must be an object"),
                          (b'{"nothing": 1}\n', ":1: needs a 'text', 'prompt'"),
                          (b'\n\n', "holds no records")]:
        inp.write_bytes(body)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            read_jsonl(inp)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl")
