"""`tandem init-model`: a tiny GGUF written here by the `gguf` package is converted into a plain HF
directory, which loads without the GGUF, stops at its end-of-turn token, and passes the checks
(a greedy chat reply; a chat template that extends a conversation token-exactly). No network."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the `models` extra (gguf) is not installed")

from services.demo.gguf_model import (  # noqa: E402
    MARKER,
    ModelCheckFailed,
    convert_gguf,
    init_model,
    template_extends_exactly,
)
from services.demo.model_source import ModelUnavailable  # noqa: E402
from services.launcher.cli import main as tandem  # noqa: E402

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a `gpt2` GGUF tokenizer lists)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama with a byte-level vocabulary plus ChatML's tokens, its matrices in Q8_0."""
    tokens = SPECIALS + _byte_chars() + ["Ġt", "he"]
    merges = ["Ġ t", "h e"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-chat")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    kv = HIDDEN // HEADS * KV_HEADS
    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
                                 ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", FFN, HIDDEN),
                                 ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    source = write_tiny_gguf(root / "tiny.gguf")
    out = root / "hf"
    assert tandem_exit(["init-model", str(source), str(out)]) == 0
    return source, out


def tandem_exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        tandem(argv)
    return int(exc.value.code or 0)


def test_tiny_gguf_converts_to_a_plain_hf_directory_that_loads_and_stops_at_end_of_turn(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = converted
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == LAYERS
    assert not list(out.parent.glob(".hf.tmp-*")), "the temporary directory is left behind"
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == im_end
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("the", add_special_tokens=False)) == ["t", "he"]
    # the Q8_0 weights came through dequantized: the embedding matches the GGUF's to Q8_0's precision
    reader = gguf.GGUFReader(str(source))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(emb.data, emb.tensor_type)
    got = model.get_input_embeddings().weight.detach().numpy()
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-6)
    report = json.loads((out / MARKER).read_text())
    assert report["template_exact"] is True and report["check_reply"] and report["dtype"] == "float32"
    assert report["end_of_turn"] == "<|im_end|>" and report["parameters"] == model.num_parameters()


def test_a_second_run_is_skipped_and_a_foreign_directory_is_not_overwritten(converted, tmp_path, capsys):
    source, out = converted
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert tandem_exit(["init-model", str(source), str(out)]) == 0
    assert "already at" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "readme.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert_gguf(source, foreign)
    assert (foreign / "readme.txt").read_text() == "mine"


def test_bfloat16_and_force_replace_the_directory_atomically(converted, tmp_path):
    from safetensors import safe_open

    source, _ = converted
    out = tmp_path / "bf16"
    first = convert_gguf(source, out, dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    again = convert_gguf(source, out, dtype="float32", force=True)
    assert not again.skipped and first.sha256 == again.sha256
    assert json.loads((out / MARKER).read_text())["dtype"] == "float32"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary or old directories remain"


def test_a_template_that_rewrites_earlier_turns_fails_the_exactness_check(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted[1]))
    assert template_extends_exactly(tokenizer)
    # keeps only the last user message: a conversation is not a prefix of its continuation
    tokenizer.chat_template = ("{{ '<|im_start|>user\n' + messages[-1]['content'] + '<|im_end|>\n' }}"
                               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    assert not template_extends_exactly(tokenizer)


def test_bad_sources_fail_clearly(tmp_path, capsys):
    with pytest.raises(ModelUnavailable, match="unknown model 'llama9'"):
        init_model("llama9", tmp_path / "x")
    with pytest.raises(ValueError, match="output directory"):
        init_model(str(tmp_path / "m.gguf"))
    assert tandem_exit(["init-model", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 1
    assert "no GGUF file" in capsys.readouterr().err
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with pytest.raises((ValueError, ModelCheckFailed, OSError)):
        convert_gguf(broken, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
