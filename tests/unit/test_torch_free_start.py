"""The coordinator's torch-free loaders give what transformers' torch-importing ones give (issue 16.5).

``services.common.tokens.load_tokenizer`` against ``AutoTokenizer`` and ``context_length`` against
``AutoConfig``, on the demo's tiny model and on copies of it whose ``tokenizer_config.json`` names the
other classes the project's models use (Qwen3's ``Qwen2Tokenizer``); the coordinator's TensorBoard
writer against torch's ``SummaryWriter``, both read back by TensorBoard's own ``EventAccumulator``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from services.common.tokens import context_length, load_tokenizer
from services.coordinator.tb_writer import SummaryWriter
from services.envs.render import ChatRenderer

TEXTS = ["hello", "5|", " a  b\n", "<|end|>x<|pad|>", "héllo wörld ✓", ""]
CHATS = [[{"role": "user", "content": "play 5"}],
         [{"role": "system", "content": "You are X."}, {"role": "user", "content": "board"},
          {"role": "assistant", "content": "5|"}, {"role": "user", "content": "again"}]]


def _variant(model: Path, dest: Path, tokenizer_class: str) -> str:
    out = Path(shutil.copytree(model, dest, ignore=shutil.ignore_patterns("*.safetensors")))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg | {"tokenizer_class": tokenizer_class}))
    return str(out)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("tokenizers")
    return [str(tiny_model_dir)] + [_variant(tiny_model_dir, root / c, c)
                                    for c in ("PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast")]


def test_load_tokenizer_is_what_auto_tokenizer_loads(model_dirs: list[str]):
    for path in model_dirs:
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto), path
        for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "chat_template", "all_special_ids",
                     "model_max_length", "padding_side"):
            assert getattr(ours, attr) == getattr(auto, attr), (path, attr)
        assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
        assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
               {i: str(t) for i, t in auto.added_tokens_decoder.items()}
        for text in TEXTS:
            ids = auto.encode(text, add_special_tokens=False)
            assert ours.encode(text, add_special_tokens=False) == ids
            assert ours(text)["input_ids"] == auto(text)["input_ids"]
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
        for chat in CHATS:
            for prompt in (True, False):
                assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                       auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        mine, theirs = ChatRenderer(ours, "sys"), ChatRenderer(auto, "sys")
        assert mine.user_turn("board") == theirs.user_turn("board")


def test_context_length_is_what_auto_config_reads(tiny_model_dir: Path, tmp_path: Path):
    assert context_length(str(tiny_model_dir)) == AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    bare = Path(shutil.copytree(tiny_model_dir, tmp_path / "bare", ignore=shutil.ignore_patterns("*.safetensors")))
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["max_position_embeddings"]  # not written: AutoConfig's class default, as before
    (bare / "config.json").write_text(json.dumps(cfg))
    assert context_length(str(bare)) == AutoConfig.from_pretrained(bare).max_position_embeddings


def test_tensorboard_writer_writes_what_torch_writes(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    read = []
    for name, cls in (("torch", TorchWriter), ("ours", SummaryWriter)):
        writer = cls(log_dir=str(tmp_path / name), flush_secs=10)
        for step, value in enumerate([0.5, -1.25, 3.0]):
            writer.add_scalar("A/train/loss", value, global_step=step)
        writer.add_scalar("B/eval/score", 1, global_step=7)
        writer.add_text("transcripts/train", "**X** plays 5|\n\nwörld", global_step=2)
        writer.flush()
        writer.close()
        acc = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        read.append(({t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]},
                     {t: [(e.step, e.tensor_proto.SerializeToString()) for e in acc.Tensors(t)]
                      for t in tags["tensors"]},
                     acc.SummaryMetadata("transcripts/train/text_summary").SerializeToString()))
    assert read[0] == read[1]
    assert read[1][0]["A/train/loss"] == [(0, 0.5), (1, -1.25), (2, 3.0)]
