"""A small language model that speaks the agentic grader's protocol, distilled from a CPU grader.

The agentic grader (``grading.agentic``) can only be measured on a model that answers its prompts
with verdicts. Without a model hub, this module makes one in the project:

* ``ProtocolTeacher``: a chat client that answers the agentic grader's own prompts (the ones it
  sends for each vote, anonymised and shuffled per vote) with a CPU grader's verdict (the
  heuristic grader's, by default) rendered in the grader's answer format with the vote's
  aliases (``render_verdict``). The agentic grader parses and validates each answer like any
  model's, so every demonstration is a verdict the grader accepted.
* ``record_episodes``: runs the agentic grader over groups with that teacher behind a
  ``distill.RecordingClient`` and a ``distill.TeacherLog``; returns ``(messages, answer)`` per
  vote (several votes per group: different shuffles of the same group).
* ``train_tokenizer`` / ``StudentTokenizer``: a byte-level BPE trained on the recorded prompts
  and answers with the ChatML special tokens and the chat template of the tiny test model
  (``scripts/sglang_cpu/make_tiny_model.py``), written in the Hugging Face layout SGLang loads;
  ``chat_text`` renders that template (no tools) exactly as the server does.
* ``student_config``, ``train_student``: a small Qwen2-shaped decoder fine-tuned through
  ``gagar_jax.update.sft.run_sft`` on the demonstrations (loss on the answer tokens only).
* ``export_student``: Hugging Face safetensors (``models.hf.save_hf_safetensors``) plus the
  tokenizer files and the end-of-turn id, a directory ``rollout.sglang_server.SGLangServer``
  serves.

The prompts are the compact version (``agentic.COMPACT_PROMPT_VERSIONS``): the default prompts
with their tool schemas run to thousands of tokens per call, beyond what a model trained on two
CPU cores in minutes can read. ``scripts/train_agentic_student.py`` runs the whole recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gagar_jax.grading import schema
from gagar_jax.grading.agentic import AgenticGrader, AnonymisedView
from gagar_jax.grading.distill import RecordingClient, TeacherLog
from gagar_jax.grading.schema import DIMENSIONS, GroupWorkspace, Verdict

STUDENT_PROMPT_VERSION = "c1"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, EOS = "<|endoftext|>", "<|im_end|>"
# transformers' Qwen2Tokenizer pre-split (see train_tokenizer).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The tiny test model's ChatML template (scripts/sglang_cpu/make_tiny_model.py), tools included.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------------------
# The teacher
# ------------------------------------------------------------------------------------------------


def _score(x: float) -> float:
    return round(float(x), 1)


def render_verdict(verdict: Verdict, view: AnonymisedView) -> str:
    """``verdict`` (real candidate ids) as the answer a model gives to ``view``'s prompt.

    Compact JSON, one item per judged candidate in alias order (``C1``, ``C2``, ...): the
    candidate's alias, tier, rank and cheat as given, the five scores rounded to one decimal,
    ``cheat_reason`` (its headline) only for a cheat, and the evidence the rules need, nothing
    more: one item per score below 0.5 and for a cheat, or one for the lowest score of a tier 2
    or 3 candidate without either. Evidence names the first file of the candidate's patch
    (``kind: patch`` without a line), or, for a patch that changes no file, quotes the first
    line of its test output (``kind: execution``).
    """
    items = []
    for j in sorted(verdict.judgements, key=lambda j: int(view.alias_of[j.candidate_id][1:])):
        alias = view.alias_of[j.candidate_id]
        c = view.workspace.candidate(j.candidate_id)
        scores = {d: _score(j.scores[d]) for d in DIMENSIONS}
        claims = [d for d in DIMENSIONS if scores[d] < schema.NEGATIVE_SCORE]
        claims += ["cheat"] if j.cheat else []
        if not claims and j.tier >= 2:
            claims = [min(DIMENSIONS, key=lambda d: (scores[d], DIMENSIONS.index(d)))]
        paths = c.parsed_patch.paths
        evidence = []
        for claim in claims:
            if paths:
                evidence.append(
                    {"claim": claim, "kind": "patch", "candidate": alias, "file": paths[0]}
                )
            else:
                line = next(
                    (ln.strip() for ln in c.test_log.splitlines() if len(ln.strip()) >= 3), ""
                )
                evidence.append(
                    {"claim": claim, "kind": "execution", "candidate": alias, "quote": line[:60]}
                )
        item: dict[str, Any] = {
            "candidate": alias,
            "tier": j.tier,
            "rank": j.rank,
            "scores": scores,
            "cheat": bool(j.cheat),
        }
        if j.cheat:  # the reason's headline (before any colon): its quotes are long
            item["cheat_reason"] = (j.cheat_reason or "").split(":")[0].strip()[:60] or "cheat"
        item["evidence"] = evidence
        items.append(item)
    return json.dumps({"verdicts": items}, separators=(",", ":"))


class ProtocolTeacher:
    """A chat client answering an ``AgenticGrader``'s prompts with ``teacher``'s verdicts.

    ``index(grader, workspaces)`` must be called first: it builds the prompt of every vote of
    every group (``AgenticGrader.episode_messages``), so that a call is matched to its group
    and aliases by its exact task message. The teacher grades each group once (cached).
    """

    def __init__(self, teacher: Any):
        self.teacher = teacher
        self._by_prompt: dict[str, tuple[GroupWorkspace, AnonymisedView]] = {}
        self._verdicts: dict[str, Verdict] = {}

    def index(self, grader: AgenticGrader, workspaces: Iterable[GroupWorkspace]) -> None:
        for ws in workspaces:
            for vote in range(grader.votes):
                messages, view = grader.episode_messages(ws, vote)
                self._by_prompt[messages[1]["content"]] = (ws, view)

    def chat_completions(
        self, messages, *, tools=None, max_tokens=1024, temperature=0.0, response_format=None
    ):
        key = messages[1]["content"] if len(messages) > 1 else ""
        if key not in self._by_prompt:
            raise KeyError("ProtocolTeacher: prompt of a group not indexed (call index first)")
        ws, view = self._by_prompt[key]
        if ws.group_id not in self._verdicts:
            out = self.teacher.grade(ws)
            self._verdicts[ws.group_id] = schema.validate(out, ws)
        content = render_verdict(self._verdicts[ws.group_id], view)
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}


@dataclasses.dataclass(frozen=True)
class Episode:
    """One model call of a recorded grading: the messages the grader sent and the answer."""

    group_id: str
    messages: tuple[dict, ...]  # what the grader sent (system, task)
    answer: str  # the teacher's answer, accepted by the grader


def record_episodes(
    teacher: Any,
    workspaces: Sequence[GroupWorkspace],
    *,
    votes: int,
    log_path: str | os.PathLike,
    seed: int = 0,
    prompt_version: str = STUDENT_PROMPT_VERSION,
) -> list[Episode]:
    """Runs the agentic grader (``votes`` votes, one call each) over ``workspaces`` with
    ``teacher`` answering, behind a ``TeacherLog`` writing ``log_path`` (appended: workspace,
    merged verdict and trajectory per group); returns every logged call as an ``Episode``."""
    client = ProtocolTeacher(teacher)
    grader = AgenticGrader(
        RecordingClient(client),
        prompt_version=prompt_version,
        votes=votes,
        vote_temperature=0.0,
        max_steps=1,
        seed=seed,
    )
    client.index(grader, workspaces)
    logged = TeacherLog(grader, log_path)
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    for ws in workspaces:
        logged.grade(ws)
    return read_episodes(log_path, offset=start)


def read_episodes(log_path: str | os.PathLike, *, offset: int = 0) -> list[Episode]:
    """The model calls a ``TeacherLog`` file recorded (from byte ``offset``) as episodes."""
    episodes = []
    with open(log_path, encoding="utf-8") as f:
        f.seek(offset)
        for line in f:
            rec = json.loads(line)
            gid = rec["workspace"]["group_id"]
            for call in rec["trajectory"]:
                answer = call["response"]["choices"][0]["message"]["content"]
                episodes.append(Episode(gid, tuple(call["messages"]), answer))
    return episodes


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def chat_text(messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
    """``CHAT_TEMPLATE`` rendered without tools (what the server tokenizes for a chat call)."""
    text = "".join(
        f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages
    )
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int) -> str:
    """A byte-level BPE on ``texts`` with ``SPECIAL`` tokens, saved as ``tokenizer.json`` +
    ``tokenizer_config.json`` (chat template, end of turn ``<|im_end|>``) in ``out_dir``."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None))
    # The normaliser and pre-split a Qwen2 tokenizer applies: SGLang loads the directory with
    # transformers' Qwen2Tokenizer (the model type decides), which imposes them whatever the
    # file says, so training with any other split would tokenize differently at serving time.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "bos_token": None,
                "unk_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 8192,
            },
            f,
            indent=1,
        )
    return os.fspath(out_dir)


class StudentTokenizer:
    """The tokenizer of ``train_tokenizer``'s directory (``tokenizers``; no ``transformers``)."""

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer

        self.directory = os.fspath(directory)
        self.tok = Tokenizer.from_file(os.path.join(self.directory, "tokenizer.json"))
        self.pad_id = self.tok.token_to_id(PAD)
        self.eos_id = self.tok.token_to_id(EOS)
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def demonstrations(
    episodes: Sequence[Episode], tok: StudentTokenizer, *, max_len: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """``(prompt ids, answer ids + end of turn)`` per episode of at most ``max_len`` tokens, and
    how many longer episodes were left out."""
    demos, dropped = [], 0
    for e in episodes:
        prompt = tok.encode(chat_text(e.messages))
        answer = tok.encode(e.answer) + [tok.eos_id]
        if len(prompt) + len(answer) > max_len:
            dropped += 1
            continue
        demos.append((prompt, answer))
    return demos, dropped


# ------------------------------------------------------------------------------------------------
# Model, training, export
# ------------------------------------------------------------------------------------------------


def student_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 8192,
):
    """A small Qwen2-shaped decoder (q/k/v biases, untied embeddings)."""
    from gagar_jax.models import TransformerConfig

    return TransformerConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        rope_theta=10000.0,
        qkv_bias=True,
        max_position_embeddings=max_position_embeddings,
    )


def train_student(
    demos: Sequence[tuple[list[int], list[int]]],
    config,
    *,
    steps: int,
    seq_len: int,
    pad_id: int,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    log_fn: Callable[[int, dict], None] | None = None,
    log_every: int = 10,
    model=None,
):
    """``model`` (default: a fresh ``config`` model) fine-tuned in place on ``demos`` with
    ``update.sft.run_sft``; returns ``(model, history)``."""
    from gagar_jax.models import create_model
    from gagar_jax.update.sft import run_sft

    model = create_model(config, seed) if model is None else model
    history = []
    if steps > 0:
        history = run_sft(
            model,
            demos,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            warmup_steps=min(20, steps),
            seq_len=seq_len,
            pad_id=pad_id,
            seed=seed,
            log_fn=log_fn,
            log_every=log_every,
        )
    return model, history


def export_student(model, config, tokenizer_dir: str | os.PathLike, out_dir: str) -> str:
    """Safetensors + ``config.json`` (with the end-of-turn and padding ids) + the tokenizer
    files in ``out_dir``: a Hugging Face directory SGLang serves."""
    from gagar_jax.models import save_hf_safetensors

    save_hf_safetensors(model, config, out_dir)
    tok = StudentTokenizer(tokenizer_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return out_dir
