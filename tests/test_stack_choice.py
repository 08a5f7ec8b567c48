"""`specd up --drafter auto`'s measured choice between the split stack and heads-only (specd_app/stack_choice.py)."""

from __future__ import annotations

from types import SimpleNamespace

from specd_app import stack_choice


def test_both_stacks_are_measured_interleaved_and_the_faster_is_chosen(monkeypatch):
    calls = []
    speed = {"a:1": 20.0, "b:2": 25.0}  # tokens a second of each gateway
    clock = [0.0]  # a clock that only requests move: sleeps of a few ms swapped order on a loaded 2-core CI machine
    monkeypatch.setattr(stack_choice, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def generate(address: str, prompt: str, tokens: int) -> int:
        calls.append((address, prompt))
        clock[0] += tokens / speed[address]
        return tokens

    rates = stack_choice.measure_stacks({"split": "a:1", "heads": "b:2"}, generate, prompts=("p", "q"), tokens=4, passes=2)
    assert calls == [("a:1", "p"), ("b:2", "p"), ("a:1", "q"), ("b:2", "q"),  # A B
                     ("b:2", "p"), ("a:1", "p"), ("b:2", "q"), ("a:1", "q")]  # then B A
    assert len(rates["heads"]) == len(rates["split"]) == 2
    assert all(heads > split > 0 for heads, split in zip(rates["heads"], rates["split"]))
    assert stack_choice.choose(rates) == "heads"
    assert stack_choice.choose({"split": [25.0, 25.0], "heads": [25.0, 25.0]}) == "heads"  # a tie: no draft service to pay for
    assert stack_choice.choose({"split": [25.5, 25.2], "heads": [25.0, 25.0]}) == "split"  # faster in every pass
    assert stack_choice.choose({"split": [27.0, 24.5], "heads": [25.0, 25.0]}) == "heads"  # faster overall, not in every pass
    calls.clear()
    assert stack_choice.measure_stacks({"split": "a:1", "heads": "b:2"}, generate, prompts=("p",), tokens=4,
                                       stopped=lambda: len(calls) >= 1) == {}  # stopped after the first request
    assert len(calls) == 1


def test_the_choice_is_cached_for_exactly_its_key(tmp_path):
    key = {"machine": {"cpu": "x", "cores": 2}, "target": "t"}
    assert stack_choice.cached_choice(key, str(tmp_path)) is None
    record = stack_choice.save_choice(key, {"split": [19.0, 20.0], "heads": [21.5, 21.0]}, str(tmp_path))
    assert record["choice"] == "heads"
    cached = stack_choice.cached_choice(key, str(tmp_path))
    assert cached["tokens_per_s"] == {"split": 19.5, "heads": 21.25}
    assert cached["tokens_per_s_by_pass"] == {"split": [19.0, 20.0], "heads": [21.5, 21.0]}
    assert stack_choice.cached_choice({**key, "target": "other"}, str(tmp_path)) is None
    stack_choice.choice_path(key, str(tmp_path)).write_text("{not json")
    assert stack_choice.cached_choice(key, str(tmp_path)) is None


def test_the_split_gateway_asks_for_the_cache_only_where_the_draft_has_a_device_of_its_own():
    from specd_app.stack import draft_has_own_device, service_commands, split_gateway_flags

    assert draft_has_own_device({"verify": "cuda:0", "draft": "cuda:1"})
    assert not draft_has_own_device({"verify": "cuda:0", "draft": "cuda:0"})  # one GPU: they take turns on it
    assert draft_has_own_device({"verify": "cuda:0", "draft": "cpu"})
    assert not draft_has_own_device({"verify": "cpu", "draft": "cpu"}) and not draft_has_own_device(None)
    assert split_gateway_flags({"verify": "cpu", "draft": "cpu"}) == ("--speculated-outcomes", "0")
    ports = {"gateway": 1, "draft": 2, "verify": 3}
    two_gpus = service_commands("127.0.0.1", ports, "t", "feature", "h", 0, 3, {"verify": "cuda:0", "draft": "cuda:1"})
    one_cpu = service_commands("127.0.0.1", ports, "t", "feature", "h", 0, 3, {"verify": "cpu", "draft": "cpu"})
    assert "--speculated-outcomes" not in two_gpus["gateway"]
    assert one_cpu["gateway"][-2:] == ["--speculated-outcomes", "0"]
