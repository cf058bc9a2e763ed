"""The LLM simulated user: strict validation, named rejections, one re-ask, rule-based fallback.

The chat model is :class:`ScriptedUserPolicy` (a deterministic policy that plays given answers or
reads the prompt), standing in for a server only where the answer itself is the thing tested.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import feedback_toy
from gagar_jax.data.feedback import FeedbackRecord, derive_spans
from gagar_jax.envs.family import FamilySettings
from gagar_jax.envs.llm_user import (
    MAX_ITEMS,
    LLMUser,
    ScriptedUserPolicy,
    load_prompt,
    parse_answer,
)
from gagar_jax.envs.simulated_user import _line_token_ranges, feedback_record, user_feedback
from gagar_jax.envs.toy_family import ToyFamily
from gagar_jax.feedback.run import FeedbackConfigError, FeedbackRunConfig

POOL = ToyFamily(FamilySettings(seed=0, difficulty=1, num_train=4, num_eval=0, max_prompt_len=48))
TOK = POOL.tokenizer
TASK = POOL.train_task(0)
# Two edit lines: a no-op edit of line 2, then the reference fix; then EOS.
PATCH = f"2 : {TASK.lines[1]}\n{TASK.reference_patch}"
RESPONSE = TOK.encode(PATCH) + [TOK.eos_id]
LINES = _line_token_ranges(RESPONSE, TOK)
RULE = user_feedback(TASK, RESPONSE, tokenizer=TOK)


def _ans(*items) -> str:
    return json.dumps({"feedback": list(items)})


def _item(**kw):
    return {"polarity": "negative", "text": "not needed", **kw}


def _check_items(items):
    """Every item is a well-formed, in-response, non-overlapping token span."""
    end = LINES[-1][1]
    spans = sorted(tuple(it["token_range"]) for it in items)
    for a, b in spans:
        assert 0 <= a < b <= end
    for (_, b0), (a1, _) in zip(spans, spans[1:]):
        assert b0 <= a1
    prompt = POOL.prompt_tokens(TASK)
    rec = FeedbackRecord.from_dict(
        {
            "record_id": "r",
            "segments": [
                {"role": "prompt", "text": TASK.prompt, "tokens": list(prompt)},
                {"role": "model", "text": PATCH, "tokens": RESPONSE},
            ],
            "feedback": [
                {
                    **it,
                    "token_range": [
                        len(prompt) + it["token_range"][0],
                        len(prompt) + it["token_range"][1],
                    ],
                }
                for it in items
            ],
        }
    )
    derive_spans(rec, TOK)  # raises FeedbackError on anything invalid


def test_prompt_is_versioned_and_shows_the_evidence():
    assert "$lines" in load_prompt("llm_user") and load_prompt("llm_user_system")
    with pytest.raises(FileNotFoundError, match="v999"):
        load_prompt("llm_user", "v999")
    policy = ScriptedUserPolicy()
    LLMUser(policy)(TASK, RESPONSE, tokenizer=TOK)
    user = policy.conversations[0][1]["content"]
    assert f"[2] {TASK.reference_patch}" in user and TASK.reference_patch in user
    assert "PASS" in user and "from 1 to 2" in user


def test_valid_line_answer_gives_the_models_feedback():
    user = LLMUser(ScriptedUserPolicy())  # praises the reference fix, criticises the rest
    items = user(TASK, RESPONSE, tokenizer=TOK)
    assert [(it["polarity"], it["token_range"]) for it in items] == [
        ("negative", list(LINES[0])),
        ("positive", list(LINES[1])),
    ]
    assert user.metrics["accepted"] == 1 and user.metrics["fallback"] == 0
    _check_items(items)


def test_char_range_maps_to_the_tokens_it_touches():
    # "2 : return a\n1 : a = ..." chars [4, 10) are "return"; [0, 1) is "2".
    ans = _ans(
        _item(char_range=[4, 10], text="why touch the return"),
        _item(char_range=[0, 1], polarity="neutral", text="line 2"),
        _item(line=2, polarity="positive", text="the fix"),
    )
    user = LLMUser(ScriptedUserPolicy([ans]))
    items = user(TASK, RESPONSE, tokenizer=TOK)
    assert user.metrics["accepted"] == 1
    assert [it["token_range"] for it in items] == [[2, 3], [0, 1], list(LINES[1])]
    assert TOK.decode(RESPONSE[2:3]) == "return"
    _check_items(items)


BIG = 10**300
MALFORMED = {
    "no_json": "I think the patch is fine!",
    "huge_int_digits": '{"feedback": [{"line": 1' + "9" * 5000 + ', "polarity": "negative", '
    '"text": "x"}]}',
    "deep_nesting": '{"feedback": ' + "[" * 3000 + "]" * 3000 + "}",
    "deep_nesting_objects": '{"feedback": [' + '{"a": ' * 2000 + "1" + "}" * 2000 + "]}",
    "too_long": _ans(_item(line=1, text="x" * 30_000)),
    "no_json_bare_list": "[1, 2, 3]",
    "bad_items_dict": json.dumps({"feedback": {"line": 1}}),
    "bad_items_missing": json.dumps({"comments": []}),
    "bad_item_list": _ans([1, "negative", "x"]),
    "too_many_items": _ans(*[_item(line=1)] * (MAX_ITEMS + 1)),
    "unknown_field_token_range": _ans(_item(line=1, token_range=[0, 10_000])),
    "bad_ref_both": _ans(_item(line=1, char_range=[0, 3])),
    "bad_ref_neither": _ans(_item()),
    "bad_type_str_line": _ans(_item(line="1")),
    "bad_type_bool_line": _ans(_item(line=True)),
    "bad_type_float_line": _ans(_item(line=1.0)),
    "bad_type_nan_line": '{"feedback": [{"line": NaN, "polarity": "negative", "text": "x"}]}',
    "bad_type_char_range": _ans(_item(char_range=[0, "5"])),
    "bad_type_char_range_3": _ans(_item(char_range=[0, 1, 2])),
    "out_of_range_line_0": _ans(_item(line=0)),
    "out_of_range_line_3": _ans(_item(line=3)),
    "out_of_range_line_neg": _ans(_item(line=-1)),
    "out_of_range_line_huge": _ans(_item(line=BIG)),
    "out_of_range_chars_neg": _ans(_item(char_range=[-1, 3])),
    "out_of_range_chars_huge": _ans(_item(char_range=[0, BIG])),
    "out_of_range_chars_reversed": _ans(_item(char_range=[5, 2])),
    "empty_range": _ans(_item(char_range=[3, 3])),
    "no_tokens_space": _ans(_item(char_range=[1, 2])),  # the space between "2" and ":"
    "overlap_same_line": _ans(_item(line=1), _item(line=1, polarity="positive")),
    "overlap_line_and_chars": _ans(_item(char_range=[4, 10]), _item(line=1)),
    "bad_polarity": _ans(_item(line=1, polarity="very negative")),
    "bad_polarity_int": _ans(_item(line=1, polarity=-1)),
    "bad_text_type": _ans(_item(line=1, text=5)),
    "bad_text_empty": _ans(_item(line=1, text="   ")),
}


REASONS = (
    "no_json",
    "too_long",
    "bad_items",
    "bad_item",
    "too_many_items",
    "unknown_field",
    "bad_ref",
    "bad_type",
    "out_of_range",
    "empty_range",
    "no_tokens",
    "overlap",
    "bad_polarity",
    "bad_text",
)
NAMED = {"huge_int_digits": "no_json", "deep_nesting": "no_json", "deep_nesting_objects": "no_json"}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_answer_is_rejected_by_name_then_falls_back(case):
    policy = ScriptedUserPolicy([MALFORMED[case]])
    user = LLMUser(policy)
    items = user(TASK, RESPONSE, tokenizer=TOK)
    reason = NAMED.get(case) or next(r for r in REASONS if case.startswith(r))
    assert policy.calls == 2  # asked, re-asked once
    assert user.metrics[f"rejected_{reason}"] == 2, dict(user.metrics)
    assert user.metrics["rejected"] == 2 and user.metrics["fallback"] == 1
    assert user.metrics["accepted"] == 0
    assert items == RULE  # the rule-based user answered
    # the re-ask tells the model why
    assert policy.conversations[1][-1]["content"].startswith(f"Rejected: {reason}")


def test_reask_once_accepts_a_corrected_answer():
    good = _ans(_item(line=2, polarity="positive", text="that is the fix"))
    policy = ScriptedUserPolicy([_ans(_item(line=1), _item(line=1)), good])
    user = LLMUser(policy)
    items = user(TASK, RESPONSE, tokenizer=TOK)
    assert items == [
        {"text": "that is the fix", "polarity": "positive", "token_range": list(LINES[1])}
    ]
    assert policy.calls == 2 and user.metrics["rejected_overlap"] == 1
    assert user.metrics["accepted"] == 1 and user.metrics["fallback"] == 0
    assert len(policy.conversations[1]) == 4
    assert policy.conversations[1][2]["role"] == "assistant"


def test_dead_server_and_broken_responses_fall_back_and_are_counted():
    user = LLMUser(ScriptedUserPolicy(raise_error=True))
    assert user(TASK, RESPONSE, tokenizer=TOK) == RULE
    assert user.metrics["rejected_client_error"] == 1 and user.metrics["fallback"] == 1
    assert user.metrics["calls"] == 1  # a dead server is not re-asked

    class Broken:
        def __init__(self):
            self.replies = iter([{}, {"choices": [{"message": {"content": None}}]}])

        def chat_completions(self, messages, **kw):
            return next(self.replies)

    user = LLMUser(Broken())
    assert user(TASK, RESPONSE, tokenizer=TOK) == RULE
    assert user.metrics["rejected_no_response"] == 1 and user.metrics["rejected_no_json"] == 1
    assert user.metrics["fallback"] == 1
    # max_attempts=1: no re-ask
    policy = ScriptedUserPolicy(["nope"])
    user = LLMUser(policy, max_attempts=1)
    user(TASK, RESPONSE, tokenizer=TOK)
    assert policy.calls == 1 and user.metrics["fallback"] == 1
    with pytest.raises(ValueError, match="max_attempts"):
        LLMUser(policy, max_attempts=0)


def test_parse_answer_takes_the_first_object_in_fences():
    assert parse_answer('ok:\n```json\n{"feedback": []}\n```') == {"feedback": []}
    assert parse_answer('x {bad} then {"feedback": [1]}') == {"feedback": [1]}


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["positive", "neutral", "negative"]),
)
_json = st.recursive(
    _json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=12,
)
_raw_item = st.fixed_dictionaries(
    {},
    optional={
        "line": st.one_of(st.integers(-3, 5), _json),
        "char_range": st.one_of(st.lists(st.integers(-5, 40), min_size=2, max_size=2), _json),
        "polarity": st.one_of(st.sampled_from(["positive", "neutral", "negative"]), _json),
        "text": st.one_of(st.text(min_size=1, max_size=20), _json),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_raw_item, _json), max_size=5), st.booleans())
def test_no_model_output_gives_an_invalid_span_or_a_crash(raw_items, wrap):
    answer = json.dumps({"feedback": raw_items} if wrap else raw_items)
    user = LLMUser(ScriptedUserPolicy([answer]))
    items = user(TASK, RESPONSE, tokenizer=TOK)
    assert user.metrics["accepted"] + user.metrics["fallback"] == 1
    _check_items(items)


def test_feedback_record_takes_the_llm_user_and_the_config_selects_it():
    prompt = POOL.prompt_tokens(TASK)
    user = LLMUser(ScriptedUserPolicy())
    rec = feedback_record(TASK, prompt, RESPONSE, record_id="r", tokenizer=TOK, user=user)
    assert [it["text"] for it in rec["feedback"]] == [
        "this step is not the fix",
        "good, that is the fix",
    ]
    derive_spans(FeedbackRecord.from_dict(rec), TOK)

    default = FeedbackRunConfig.from_config_dict({})
    assert default.feedback.user == "rule" and default.feedback.make_user() is None
    llm = FeedbackRunConfig.from_config_dict(
        {"feedback": {"user": "llm", "sglang_url": "http://127.0.0.1:1"}}
    )
    assert llm.base_fingerprint() != default.base_fingerprint()
    scripted = ScriptedUserPolicy()
    made = llm.feedback.make_user(scripted)
    assert isinstance(made, LLMUser) and made.client is scripted and made.max_attempts == 2
    with pytest.raises(FeedbackConfigError, match="feedback.sglang_url"):
        FeedbackRunConfig.from_config_dict({"feedback": {"user": "llm"}})
    with pytest.raises(FeedbackConfigError, match="feedback.user"):
        FeedbackRunConfig.from_config_dict({"feedback": {"user": "oracle"}})
    with pytest.raises(FeedbackConfigError, match="unknown keys"):
        FeedbackRunConfig.from_config_dict({"feedback": {"url": "x"}})


def test_prepare_base_builds_llm_user_feedback_data(tmp_path):
    """The feedback data generation with ``feedback.user = "llm"``: every record from the model
    or the rule-based fallback, the counters in the base stats."""
    from gagar_jax.data.feedback import read_jsonl
    from gagar_jax.feedback.run import prepare_base

    c = feedback_toy.get_config("span_kto,smoke").to_dict()
    c["feedback"].update(user="llm", sglang_url="http://127.0.0.1:1")
    cfg = FeedbackRunConfig.from_config_dict(c)
    # every other answer is garbage: the re-ask is accepted
    policy = ScriptedUserPolicy(["garbage", ScriptedUserPolicy.line_critic] * 1000)
    base = prepare_base(cfg, str(tmp_path / "base"), log=lambda *_: None, user_client=policy)
    stats = base["stats"]
    assert stats["feedback_user"] == "llm"
    m = stats["llm_user"]
    n = stats["records"]
    assert m["records"] == n == cfg.task.num_train * cfg.base.samples_per_task
    assert m.get("accepted", 0) + m.get("fallback", 0) + m.get("no_lines", 0) == n
    assert m.get("rejected_no_json", 0) >= 1 and m.get("accepted", 0) >= 1
    records = read_jsonl(base["jsonl"])
    texts = {it.text for r in records for it in r.feedback}
    assert texts & {"this step is not the fix", "good, that is the fix"}
    for r in records:
        derive_spans(r, TOK)
