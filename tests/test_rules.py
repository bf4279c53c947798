"""autotune.engine.rules: validity rules as data, and the errors a bad rules file gives."""

from __future__ import annotations

import pytest

from autotune.errors import ConfigError
from autotune.engine.rules import load_rules, violations

FACTS = {"head_dim": 8, "ctx": 4096, "max_context": 2048, "compute_capability": "7.0"}


def write(tmp_path, text):
    path = tmp_path / "rules.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_rule_applies_when_its_options_match_unless_its_facts_hold(tmp_path):
    rules = load_rules(
        write(
            tmp_path,
            """
[[rule]]
name = "block"
when = { cache_type = ["q8_0"] }
unless = { head_dim_multiple_of = 32 }
reason = "cache_type {cache_type}: head size {head_dim}"
source = "test"

[[rule]]
name = "ampere"
when = { dtype = ["bf16"] }
unless = { min_compute_capability = "8.0" }
reason = "bf16 needs sm_80, this card is {compute_capability}"
source = "test"

[[rule]]
name = "ctx"
when = {}
unless = { ctx_within_model = true }
reason = "ctx {ctx} > {max_context}"
source = "test"
""",
        )
    )
    assert violations(rules, {"cache_type": "f16", "ctx": 1024}, {**FACTS, "ctx": 1024}) == []
    assert violations(rules, {"cache_type": "q8_0", "ctx": 1024}, {**FACTS, "ctx": 1024}) == [
        "cache_type q8_0: head size 8"
    ]
    assert violations(rules, {"cache_type": "q8_0", "ctx": 1024}, {**FACTS, "ctx": 1024, "head_dim": 64}) == []
    assert violations(rules, {"dtype": "bf16", "ctx": 1024}, {**FACTS, "ctx": 1024}) == [
        "bf16 needs sm_80, this card is 7.0"
    ]
    assert violations(rules, {"dtype": "bf16", "ctx": 1024}, {**FACTS, "ctx": 1024, "compute_capability": None}) == []
    assert violations(rules, {"ctx": 4096}, FACTS) == ["ctx 4096 > 2048"]


def test_every_problem_of_a_rules_file_is_named_at_once(tmp_path):
    path = write(
        tmp_path,
        """
[[rule]]
name = "a"
when = { cache_type = "q8_0" }
reason = "r"
source = "s"
colour = "red"

[[rule]]
name = "b"
unless = { moon_phase = "full" }
reason = ""
source = "s"
""",
    )
    with pytest.raises(ConfigError) as info:
        load_rules(path)
    text = str(info.value)
    assert "[[rule]] 0 ('a'): unknown field(s) ['colour']" in text
    assert "[[rule]] 0 ('a'): when must map option names to non-empty lists" in text
    assert "[[rule]] 1 ('b'): unless ['moon_phase']: not a known fact (known: head_dim_multiple_of" in text
    assert "[[rule]] 1 ('b'): reason must be a non-empty string" in text
    assert str(path) in text


def test_llama_servers_rules_file_loads():
    from pathlib import Path

    import autotune_plugins.llama_server as plugin

    rules = load_rules(Path(plugin.__file__).with_name("rules.toml"))
    assert {r.name for r in rules} >= {
        "quantized V cache needs flash attention",
        "the cache block must divide the head size",
    }
    assert all(r.source for r in rules)


def test_at_most_bounds_an_option_by_a_number_an_option_or_a_fact(tmp_path):
    rules = load_rules(
        write(
            tmp_path,
            """
[[rule]]
name = "layers"
when = { moe = [true] }
unless = { at_most = [["experts_off", "n_layers"], ["ubatch", "batch"], ["slots", 4]] }
reason = "too many: {experts_off} of {n_layers}, ub {ubatch}, b {batch}"
source = "test"
""",
        )
    )
    facts = {**FACTS, "moe": True, "n_layers": 4, "batch": 2048}
    assert violations(rules, {}, facts) == []  # absent options are within any bound
    assert violations(rules, {"experts_off": 4, "ubatch": 2048, "slots": 4}, facts) == []
    assert violations(rules, {"experts_off": 5, "ubatch": 512}, facts) == ["too many: 5 of 4, ub 512, b 2048"]
    assert len(violations(rules, {"ubatch": 512, "batch": 256}, facts)) == 1  # the option beats the fact
    assert violations(rules, {"slots": 5}, facts) == ["too many: unset of 4, ub unset, b 2048"]
    assert violations(rules, {"experts_off": "all"}, facts) == []  # not a number: no bound applies
    assert violations(rules, {"experts_off": 9}, {**facts, "moe": False}) == []  # `when` reads the facts too
    with pytest.raises(ConfigError, match=r"unless at_most must be a list of \[option, bound\] pairs"):
        load_rules(
            write(
                tmp_path,
                """
[[rule]]
name = "bad"
when = {}
unless = { at_most = ["ubatch", "batch"] }
reason = "r"
source = "s"
""",
            )
        )
