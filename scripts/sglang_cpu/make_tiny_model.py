"""Builds a tiny random Qwen2 (or Llama) model with a locally trained BPE tokenizer, in HF layout.

Runs in the SGLang venv (needs torch, transformers, tokenizers); no model hub is touched. The
tokenizer is a byte-level BPE trained with `tokenizers` on Python standard-library source files
(present on every machine with this Python), with ChatML special tokens and a chat template that
lists tools.

    .venv-sglang/bin/python scripts/sglang_cpu/make_tiny_model.py --out /tmp/tiny --seed 0
    .venv-sglang/bin/python scripts/sglang_cpu/make_tiny_model.py --out /tmp/t2 --like /tmp/tiny
"""

import argparse
import json
import shutil
import sysconfig
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS_FILES = [
    "textwrap.py",
    "string.py",
    "json/decoder.py",
    "json/encoder.py",
    "difflib.py",
    "argparse.py",
    "shlex.py",
    "fnmatch.py",
    "unittest/case.py",
    "dataclasses.py",
]


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [
        (stdlib / f).read_text(errors="replace") for f in CORPUS_FILES if (stdlib / f).exists()
    ]
    if not corpus:
        raise SystemExit(f"no corpus files found under {stdlib}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL[1:2],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    return fast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument(
        "--like", help="copy config + tokenizer from this directory; new random weights"
    )
    args = ap.parse_args()

    import torch
    import transformers

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.like:
        like = Path(args.like)
        config = transformers.AutoConfig.from_pretrained(like)
        for f in like.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, out / f.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(like)
    else:
        tokenizer = train_tokenizer(args.vocab_size)
        common = dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            initializer_range=args.init_std,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            bos_token_id=None,
            torch_dtype="float32",
        )
        if args.arch == "qwen2":
            config = transformers.Qwen2Config(**common)
        else:
            config = transformers.LlamaConfig(**common, head_dim=16)
        tokenizer.save_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    print(
        json.dumps(
            {
                "out": str(out),
                "vocab_size": config.vocab_size,
                "eos_token_id": config.eos_token_id,
                "seed": args.seed,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main()
