"""A tiny Hugging Face tokenizer directory for unit tests, built here without a model hub.

Byte-level BPE trained with ``tokenizers`` on the fixture repositories and a few standard-library
files, with the ChatML special tokens and the chat template of
``scripts/sglang_cpu/make_tiny_model.py`` (the one ``make e2e``'s model carries), written as
``tokenizer.json`` + ``tokenizer_config.json``. About a second on one core.
"""

import importlib.util
import json
import os
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_REPOS = ROOT / "tests" / "fixtures" / "repos"


def _tiny_model_script():
    path = ROOT / "scripts" / "sglang_cpu" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("_make_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tiny_tokenizer(out_dir, vocab_size: int = 1024) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    script = _tiny_model_script()
    corpus = [
        p.read_text(errors="replace") for p in sorted(FIXTURE_REPOS.rglob("*")) if p.is_file()
    ]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus += [
        (stdlib / f).read_text(errors="replace")
        for f in ("textwrap.py", "json/encoder.py")
        if (stdlib / f).exists()
    ]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=script.SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": script.CHAT_TEMPLATE,
            },
            f,
        )
    return str(out_dir)


def fixture_pool(path) -> str:
    """The two fixture repository tasks as a JSONL pool, with their minimal patch as the
    reference patch (what the family's demonstrations are built from)."""
    from gagar_jax.envs.repo import RepoTask

    with open(path, "w") as f:
        for name in ("slugger", "statkit"):
            task = RepoTask.from_dir(FIXTURE_REPOS / name)
            d = task.to_dict()
            d["reference_patch"] = (FIXTURE_REPOS / name / "patches" / "minimal.diff").read_text()
            f.write(json.dumps(d) + "\n")
    return str(path)
