"""Structured outputs in the engine (tiny random checkpoints: a random model follows no
instruction, so valid output is the constraint's doing). Greedy constrained outputs equal
transformers' greedy decoding with xgrammar's mask applied step by step, in every scheduling
mode; sampled, seeded and n > 1 outputs validate against an independent checker (jsonschema,
``re``); the same requests unconstrained are invalid; bad constraints are ValueErrors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_helpers import sample_prompts

from nano_engine import LLM, SamplingParams, StructuredOutputsParams
from nano_models.testing import load_reference

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "admin": {"type": "boolean"},
        "role": {"enum": ["reader", "writer", "owner"]},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "admin", "role", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["yes", "no", 'say "maybe"']
EBNF = """
root ::= item ("," item){0,2} "."
item ::= [a-c]{1,3} "=" [0-9]{1,2}
"""
EBNF_AS_REGEX = r"[a-c]{1,3}=[0-9]{1,2}(,[a-c]{1,3}=[0-9]{1,2}){0,2}\."
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}
MODES = {
    "default": {"kvcache_block_size": 4},
    "chunked-prefill": {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 52, "max_model_len": 200},
    "sync-scheduling": {"kvcache_block_size": 4, "async_scheduling": False},
}
MAX_TOKENS = 160


def valid(kind: str, text: str) -> bool:
    """Whether ``text`` meets the constraint ``kind`` (checked without xgrammar)."""
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
    except (ValueError, jsonschema.ValidationError):
        return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(EBNF_AS_REGEX, text) is not None


def hf_constrained_greedy(model, grammar, prompt, eos, max_tokens):
    """Greedy decoding with transformers, the grammar's bitmask unpacked and applied to each
    step's logits in float64 (a matcher of its own, no engine code)."""
    matcher = xgr.GrammarMatcher(grammar)
    vocab = model.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            matcher.fill_next_token_bitmask(bitmask)
            bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.flatten()[:vocab].bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert matcher.accept_token(token)
            out.append(token)
            ids.append(token)
            if token in eos or matcher.is_terminated():
                break
    return out


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("qwen3")


@pytest.fixture(scope="module")
def expected(path):
    """Per prompt: the constraint's kind (None: unconstrained) and transformers' tokens."""
    with LLM(path, enforce_eager=True) as llm:  # (its compiler: the engine's tokenizer info)
        eos = llm.engine.eos_token_ids
        grammars = {
            k: llm.engine.request_factory.grammars.compile(so) for k, so in CONSTRAINTS.items()
        }
    model = load_reference(path)
    kinds = [*CONSTRAINTS, None, "json", None]
    prompts = sample_prompts()
    tokens = []
    for kind, prompt in zip(kinds, prompts):
        if kind is None:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
                )
            tokens.append(out[0, len(prompt) :].tolist())
        else:
            tokens.append(hf_constrained_greedy(model, grammars[kind], prompt, eos, MAX_TOKENS))
    return kinds, prompts, tokens


@pytest.mark.parametrize("mode", sorted(MODES))
def test_constrained_greedy_matches_transformers_with_the_mask(path, expected, mode):
    """Constrained and unconstrained requests in one batch: each row gets its own mask (or
    none), in every scheduling mode, preemption included."""
    kinds, prompts, tokens = expected
    params = [
        SamplingParams(temperature=0, max_tokens=24)
        if kind is None
        else SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind]
        )
        for kind in kinds
    ]
    with LLM(path, **MODES[mode]) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if mode == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.grammars.live == 0
    for kind, out, want in zip(kinds, outputs, tokens):
        o = out.outputs[0]
        assert o.token_ids == want, kind
        if kind is not None and o.finish_reason == "stop":
            assert valid(kind, o.text), (kind, o.text)
    finished = [o.outputs[0].finish_reason for o, k in zip(outputs, kinds) if k]
    assert finished.count("stop") >= 4, finished  # (the grammars end, mostly)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_sampled_seeded_and_n_outputs_meet_the_constraint(path, kind):
    prompts = sample_prompts()[:4]
    so = CONSTRAINTS[kind]
    if kind == "json":  # (at temperature 1 a random model spends its tokens on whitespace)
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    with LLM(path, kvcache_block_size=4, num_kvcache_blocks=60, max_model_len=200) as llm:
        free = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=3)
        loose = llm.generate(prompts, free, use_tqdm=False)
        runs = [
            llm.generate(prompts, free.replace(structured_outputs=so, seed=seed), use_tqdm=False)
            for seed in (None, 7)
        ]
        alone = llm.generate(
            prompts[:1], free.replace(structured_outputs=so, seed=7), use_tqdm=False
        )
    texts = [c for out in runs[0] + runs[1] for c in out.outputs]
    assert len(texts) == 24
    for c in texts:
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert valid(kind, c.text), (kind, c.text)
    assert sum(c.finish_reason == "stop" for c in texts) >= 8  # (not vacuous)
    # the same requests unconstrained: invalid, so the constraint is what makes them valid
    assert not any(valid(kind, c.text) for out in loose for c in out.outputs)
    # a seeded constrained request draws the same tokens alone as in a batch
    assert [c.token_ids for c in alone[0].outputs] == [c.token_ids for c in runs[1][0].outputs]


def test_the_grammar_end_finishes_with_stop(path):
    """With ignore_eos too; a stop string still stops; max_tokens cuts with length."""
    so = StructuredOutputsParams(choice=["abc", "abd"])
    with LLM(path) as llm:
        ends = llm.generate(
            ["x", "y"],
            [
                SamplingParams(temperature=0, max_tokens=50, structured_outputs=so),
                SamplingParams(
                    temperature=0, max_tokens=50, structured_outputs=so, ignore_eos=True
                ),
            ],
            use_tqdm=False,
        )
        cut = llm.generate(
            ["x"], SamplingParams(max_tokens=1, structured_outputs=so), use_tqdm=False
        )[0].outputs[0]
        stopped = llm.generate(
            ["x"],
            SamplingParams(temperature=0, max_tokens=50, structured_outputs=so, stop=["b"]),
            use_tqdm=False,
        )[0].outputs[0]
    for out in ends:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("abc", "abd")
    assert cut.finish_reason == "length" and len(cut.token_ids) == 1
    assert stopped.finish_reason == "stop" and stopped.text == "a" and stopped.stop_reason == "b"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "a", "choice": ["b"]}, "exactly one of .* got regex, choice"),
        ({}, "exactly one of .* got none"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": [1]}, "json must be a JSON schema"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"grammar": ""}, "grammar must be a non-empty string"),
        ({"json": False, "regex": "a"}, "exactly one of .* got json, regex"),
    ],
)
def test_malformed_constraints_are_refused(constraint, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**constraint)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "frobnicate"}}, r"cannot compile the json: Unsupported type"),
        ({"json": {"$ref": "#/$defs/missing"}}, r"cannot compile the json: .*missing"),
        ({"regex": "(?<=a)b"}, r"cannot compile the regex: .*Lookbehind"),
        ({"grammar": "root ::= undefined_rule"}, r"cannot compile the grammar: .*not defined"),
    ],
)
def test_constraints_xgrammar_cannot_compile_are_value_errors(path, constraint, message):
    with LLM(path) as llm:
        so = StructuredOutputsParams(**constraint)
        with pytest.raises(ValueError, match=message):
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert llm.engine.num_requests == 0
        ok = SamplingParams(max_tokens=8, structured_outputs=CONSTRAINTS["regex"])
        assert llm.generate(["x"], ok, use_tqdm=False)[0].finished


def test_equal_schemas_share_one_compiled_grammar(path):
    with LLM(path) as llm:
        grammars = llm.engine.request_factory.grammars
        a = grammars.compile(StructuredOutputsParams(json={"type": "integer", "minimum": 1}))
        b = grammars.compile(StructuredOutputsParams(json='{"minimum": 1, "type": "integer"}'))
        assert a is b or a.serialize_json() == b.serialize_json()


def test_bad_words_never_appear_and_out_of_vocabulary_ids_are_refused(path):
    """A word greedy decoding writes unconstrained never appears once banned (as a token
    sequence: its last token is banned where the output ends with the rest)."""
    with LLM(path) as llm:
        tokenizer = llm.engine.tokenizer
        free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        ids = free[0].outputs[0].token_ids
        word = next(  # (one whose token greedy decoding wrote)
            w
            for t in ids
            if (w := tokenizer.decode([t]).strip()).isalpha()
            and t in (*tokenizer.encode(w), *tokenizer.encode(" " + w))
        )
        banned = SamplingParams(temperature=0, max_tokens=40, bad_words=[word])
        out = llm.generate(["Hello"], banned, use_tqdm=False)[0].outputs[0]
        for text in (word, " " + word):
            seq = tuple(tokenizer.encode(text, add_special_tokens=False))
            got = out.token_ids
            assert all(tuple(got[i : i + len(seq)]) != seq for i in range(len(got) - len(seq) + 1))
        assert out.token_ids != ids
        vocab = llm.engine.model_config.vocab_size
        for field in ("allowed_token_ids", "logit_bias"):
            value = [vocab] if field == "allowed_token_ids" else {vocab: 1.0}
            with pytest.raises(ValueError, match=f"{field} .* outside the vocabulary"):
                llm.generate(["x"], SamplingParams(**{field: value}), use_tqdm=False)


def test_the_output_follows_the_schemas_order_and_the_string_patch_applies(path):
    """Properties come in the schema's order (not sorted); the patch of xgrammar's JSON string
    characters finds what it replaces (it would silently do nothing if xgrammar's printed
    grammar changed)."""
    from nano_engine.structured import _STRING_CHARS

    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    with LLM(path) as llm:
        text = llm.generate(["x"], SamplingParams(max_tokens=40, structured_outputs=so))
    assert list(json.loads(text[0].outputs[0].text)) == ["zeta", "alpha"]
    printed = str(xgr.Grammar.from_json_schema('{"type": "string", "maxLength": 3}'))
    assert all(theirs in printed for theirs in _STRING_CHARS), printed


def test_a_steps_grammar_work_takes_tokens_then_fills_without_the_ended():
    """TokenMasks' background work on a vocabulary of single letters: each matcher takes its
    token (refused, taken, or a stop token that ends its grammar), then the bitmask of the
    next rows fills, leaving out the matcher that ended."""
    from nano_engine.structured import ACCEPTED, ENDED, REJECTED, TokenMasks

    vocab = ["a", "b", "c", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[3])
    grammar = xgr.GrammarCompiler(info).compile_grammar('root ::= "a" "b"?')
    done, going, wrong = (xgr.GrammarMatcher(grammar) for _ in range(3))
    assert done.accept_token(0)  # "a": the grammar may end here
    masks = TokenMasks(torch.device("cpu"), len(vocab), [3])
    try:
        work = masks.start([done, going, wrong], [3, 0, 2], [done, going, wrong], [4, 1, 2])
        assert work.statuses_of_tokens() == [ENDED, ACCEPTED, REJECTED]
        bitmask, rows = work.masks()
        assert rows == [1, 2]  # (row 4's grammar ended: no bitmask)
        allowed = [{t for t in range(len(vocab)) if row >> t & 1} for row in bitmask[:, 0].tolist()]
        assert allowed == [{1, 3}, {0}]  # after "a": "b" or the end; nothing taken: "a"
        assert done.is_terminated() and not going.is_terminated()
        assert masks.start([], [], [going], [0]).masks()[1] == [0]
        # an ended matcher asked for anyway (the engine never does): its row is left out
        assert masks.start([], [], [done, wrong], [0, 1]).masks()[1] == [1]
        assert masks.start([going], [3], [going], [0]).masks() is None  # (it ended)
    finally:
        masks.close()


# Run under Triton's interpreter (set before triton is imported: a process of its own), with
# the sampler's fused pass on the CPU, where it is otherwise CUDA's only.
_DEFERRED = """
import json, sys
from nano_engine import LLM, SamplingParams, StructuredOutputsParams

path, constraints = sys.argv[1], json.loads(sys.argv[2])
params = [
    SamplingParams(temperature=1.0, seed=7, max_tokens=40, n=2,
                   structured_outputs=StructuredOutputsParams(**constraints["json"])),
    SamplingParams(temperature=1.0, seed=8, max_tokens=40,
                   structured_outputs=StructuredOutputsParams(**constraints["regex"])),
    SamplingParams(temperature=0.0, max_tokens=40,
                   structured_outputs=StructuredOutputsParams(**constraints["choice"])),
    SamplingParams(temperature=1.0, seed=9, max_tokens=30),  # (unconstrained, in the batch)
]
prompts = ["a b c", "hello", "x", "y z"]
result = {}
for mode in ("async", "sync"):
    with LLM(path, kvcache_block_size=4, async_scheduling=mode == "async") as llm:
        engine = llm.engine
        engine.sampler.fused = True
        draw, deferred = engine._draw_deferred, []

        def spy(step, clock):
            deferred.append(len(step.pending.slots))
            draw(step, clock)

        engine._draw_deferred = spy
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[mode] = {
            "tokens": [[c.token_ids for c in o.outputs] for o in outs],
            "texts": [[c.text for c in o.outputs] for o in outs],
            "reasons": [[c.finish_reason for c in o.outputs] for o in outs],
            "deferred": len(deferred),
        }
print(json.dumps(result))
"""


def test_draws_put_off_to_the_next_launch_equal_the_synchronous_loop(path, tmp_path):
    """With async scheduling a constrained step that takes the fused pass draws its tokens at
    the next step's launch (``LLMEngine._deferrable``): seeded, greedy and unconstrained rows
    beside them draw what the synchronous loop draws, and the outputs meet the constraints
    (a choice that ends while the others go on leaves steps with no bitmask at all)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    constraints = {
        "json": {"json": SCHEMA, "disable_any_whitespace": True},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
    }
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = tmp_path / "deferred.py"
    script.write_text(_DEFERRED)
    run = subprocess.run(
        [sys.executable, str(script), path, json.dumps(constraints)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    deferred, synchronous = result["async"], result["sync"]
    assert deferred["deferred"] > 10 and synchronous["deferred"] == 0
    assert deferred["tokens"] == synchronous["tokens"]
    assert deferred["reasons"] == synchronous["reasons"]
    for kind, texts, reasons in zip(
        ("json", "regex", "choice"), deferred["texts"], deferred["reasons"]
    ):
        for text, reason in zip(texts, reasons):
            assert reason == "length" or valid(kind, text), (kind, text)
    assert deferred["reasons"][2] == ["stop"] and deferred["texts"][2][0] in CHOICES
