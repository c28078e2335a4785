"""A checkpoint's config and tokenizer as transformers reads them, kept in tapllm's cache so that later
starts need not import transformers: they must give what transformers gives, in every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from family_configs import family_configs
from tapllm.engine.cached_tokenizer import CachedTokenizer, read_tokenizer
from tapllm.utils.hf_config import HFConfig, read_hf_config

# Every attribute tapllm's models, loader and config read from a transformers config.
READ_BY_TAPLLM = (
    "activation_function", "attention_bias", "attn_logit_softcapping", "eos_token_id", "final_logit_softcapping",
    "head_dim", "hidden_act", "hidden_activation", "hidden_size", "intermediate_size", "layer_norm_eps",
    "layer_norm_epsilon", "layer_types", "max_position_embeddings", "mlp_bias", "model_type", "n_inner", "n_positions",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "query_pre_attn_scalar", "rms_norm_eps",
    "rope_parameters", "rope_theta", "rotary_pct", "scale_attn_by_inverse_layer_idx", "scale_attn_weights",
    "sliding_window", "tie_word_embeddings", "use_bidirectional_attention", "use_parallel_residual", "vocab_size",
)
MISSING = object()


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TAPLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family", sorted(family_configs()))
def test_a_cached_config_reads_as_transformers_reads_it(family, tmp_path, cache):
    from transformers import AutoConfig

    folder = tmp_path / family
    family_configs()[family].save_pretrained(folder)
    first = read_hf_config(folder)
    again = read_hf_config(folder)
    assert again._transformers is None  # read back from the cache, not from transformers
    real = AutoConfig.from_pretrained(str(folder))
    for name in (*READ_BY_TAPLLM, *real.to_dict()):
        if name in ("id2label", "label2id", "transformers_version", "_name_or_path"):
            continue  # bookkeeping of transformers (JSON turns id2label's keys into strings)
        assert getattr(again, name, MISSING) == getattr(real, name, MISSING), name
        assert getattr(first, name, MISSING) == getattr(again, name, MISSING), name
    rebuilt = again.to_transformers()  # what a transformers function (scaled rotary frequencies) is given
    assert type(rebuilt) is type(real) and rebuilt.to_dict() == real.to_dict()


def test_an_edited_config_is_read_again(tmp_path, cache):
    folder = tmp_path / "llama"
    family_configs()["llama"].save_pretrained(folder)
    assert read_hf_config(folder).rms_norm_eps == 1e-6
    raw = json.loads((folder / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(folder).rms_norm_eps == 1e-5


def test_a_config_snapshot_is_read_only_and_names_what_it_lacks(tmp_path, cache):
    folder = tmp_path / "gpt2"
    family_configs()["gpt2"].save_pretrained(folder)
    config = read_hf_config(folder)
    assert isinstance(config, HFConfig) and config.hidden_size == config.n_embd == 64  # GPT-2's aliases
    with pytest.raises(AttributeError, match="no_such_field"):
        config.no_such_field
    with pytest.raises(AttributeError):
        config.hidden_size = 3


TEXTS = ["The three primary colors are", "", " leading and trailing spaces  ", "naïve café — 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines\r\n", "a" * 300]


def test_a_cached_tokenizer_encodes_and_decodes_as_transformers_does(default_model_folder, cache):
    from transformers import AutoTokenizer

    first = read_tokenizer(default_model_folder)
    tok = read_tokenizer(default_model_folder)
    assert isinstance(tok, CachedTokenizer) and tok._hf is None and first._hf is not None
    hf = AutoTokenizer.from_pretrained(str(default_model_folder))
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == ids, (text, special)
            assert tok(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        ids = hf.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            assert tok.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert tok(TEXTS[:3], add_special_tokens=False)["input_ids"] == hf(TEXTS[:3], add_special_tokens=False)["input_ids"]
    assert tok.decode([[1, 2, 3], [4, 5]]) == hf.decode([[1, 2, 3], [4, 5]])
    assert tok.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    pieces = hf.convert_ids_to_tokens(hf.encode(TEXTS[3]))
    assert tok.convert_tokens_to_string(pieces) == hf.convert_tokens_to_string(pieces)
    assert tok.get_vocab() == hf.get_vocab() and len(tok) == len(hf)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "all_special_tokens", "chat_template"):
        assert getattr(tok, name) == getattr(hf, name), name
    assert tok._hf is None  # none of that needed transformers


def test_chat_templates_go_to_transformers_with_the_engines_template(default_model_folder, cache):
    tok = read_tokenizer(default_model_folder)
    read_tokenizer(default_model_folder)
    tok = read_tokenizer(default_model_folder)
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok._hf is None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[hi]" and tok.hf.chat_template == tok.chat_template


def test_a_tokenizer_that_cleans_up_spaces_stays_transformers_own(tmp_path, cache):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    hf.save_pretrained(tmp_path / "wordlevel")
    tok = read_tokenizer(tmp_path / "wordlevel")
    assert not isinstance(tok, CachedTokenizer)  # its decode cleans up spaces: transformers keeps it
    assert tok.decode(tok.encode("hello , world", add_special_tokens=False)) == "hello, world"
    assert not (cache / "tokenizers").exists() or not any((cache / "tokenizers").iterdir())


def test_the_snapshot_keeps_the_pipeline_transformers_resolved(tmp_path, cache):
    """A tokenizer_config.json that turns BOS on makes transformers rebuild the post-processor of
    tokenizer.json: the snapshot must hold the rebuilt one, not the file's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "bos"
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            add_bos_token=True, add_eos_token=True).save_pretrained(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    want = hf.encode("hello world")
    assert want[0] == 0 and want[-1] == 1  # transformers adds both
    read_tokenizer(folder)
    tok = read_tokenizer(folder)
    assert isinstance(tok, CachedTokenizer) and tok._hf is None
    assert tok.encode("hello world") == want and tok.encode("hello world", add_special_tokens=False) == [3, 4]


def test_snapshots_travel_to_other_processes(default_model_folder, tmp_path, cache):
    """The engine core sends its ModelConfig (with the config) to the API servers: both pickle."""
    import pickle

    folder = tmp_path / "gpt2"
    family_configs()["gpt2"].save_pretrained(folder)
    config = pickle.loads(pickle.dumps(read_hf_config(folder)))
    assert config.hidden_size == 64 and config.to_dict() == read_hf_config(folder).to_dict()
    read_tokenizer(default_model_folder)
    tok = read_tokenizer(default_model_folder)
    tok.chat_template = "{{ messages[0]['content'] }}"
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode(TEXTS[3]) == tok.encode(TEXTS[3]) and copy.chat_template == tok.chat_template


def test_threads_that_first_need_transformers_together_all_get_it(default_model_folder, tmp_path):
    """A server renders chat templates on many threads at once; the first ones import transformers."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from tapllm.engine.cached_tokenizer import read_tokenizer\n"
        f"tok = read_tokenizer(Path({str(default_model_folder)!r}))\n"
        "if 'transformers' in sys.modules:\n"
        "    sys.exit(0)  # the first read made the snapshot with transformers; the next process checks\n"
        "got, errors, start = [], [], threading.Barrier(8)\n"
        "def use():\n"
        "    start.wait()\n"
        "    try:\n"
        "        got.append(tok.hf)\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=use) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "assert not errors, errors\n"
        "assert len(got) == 8 and all(g is got[0] for g in got)\n"
    )
    env = {**os.environ, "TAPLLM_CACHE": str(tmp_path / "cache")}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
