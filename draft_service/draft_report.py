"""A trained draft's README: recipe, data, training curve and held-out numbers as markdown tables.

Written next to the weights by `specd train-draft`, so every draft folder says how it was made and
how well it drafts, in the same words as the issue's targets (acceptance, tokens per target pass,
cost relative to the target).
"""

from __future__ import annotations


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def speculation_table(report: dict, name: str) -> list[str]:
    """One line per k: tokens per pass, acceptance and acceptance per draft position."""
    lines = [f"**{name}**", "", _row(["k", "tokens / target pass", "acceptance", "per position"]), _row(["---"] * 4)]
    for k, entry in report.items():
        overall = entry["all"]
        lines.append(_row([k.removeprefix("k="), overall["tokens_per_pass"], overall["acceptance"], overall["per_position"]]))
    return lines + [""]


def kind_table(draft: dict, ngram: dict, k: str) -> list[str]:
    """Per task kind at one k: the trained draft against the n-gram drafter."""
    lines = [_row(["kind", "draft tokens/pass", "draft acceptance", "draft per position", "n-gram tokens/pass", "answer tokens"]), _row(["---"] * 6)]
    for kind, entry in draft[k]["by_kind"].items():
        other = ngram[k]["by_kind"].get(kind, {})
        lines.append(_row([kind, entry["tokens_per_pass"], entry["acceptance"], entry["per_position"], other.get("tokens_per_pass", "-"), entry["tokens"]]))
    return lines + [""]


def render_readme(name: str, recipe: dict, training: dict, report: dict) -> str:
    """The whole README for a draft folder."""
    lines = [f"# {name}", "", "A draft model distilled by `specd train-draft` from the target's own greedy answers.", ""]
    lines += ["## Recipe", "", "```json", _compact(recipe), "```", ""]
    history = training.get("history", [])
    lines += ["## Training", "", f"{training.get('step')} steps in {training.get('train_seconds', 0) / 60:.1f} min.", ""]
    if history:
        lines += [_row(["step", "epoch", "loss", "train agreement"]), _row(["---"] * 4)]
        shown = history[:: max(1, len(history) // 12)]
        shown += history[-1:] if shown[-1] is not history[-1] else []
        lines += [_row([h["step"], h["epoch"], h["loss"], h["agreement"]]) for h in shown]
        lines.append("")
    if report:
        lines += ["## Held-out evaluation (greedy, simulated against the target's own answers)", ""]
        lines += [f"{report['held_out_answers']} held-out answers; teacher-forced position-1 agreement "
                  f"{report['teacher_forced_agreement']}.", ""]
        lines += speculation_table(report["draft"], "trained draft") + speculation_table(report["ngram"], "n-gram drafter (same answers)")
        best = max(report["draft"], key=lambda k: report["draft"][k]["all"]["tokens_per_pass"])
        lines += [f"### Per task kind ({best})", ""] + kind_table(report["draft"], report["ngram"], best)
        cost = report["cost"]
        lines += ["## Cost", "", f"One cached 1-position forward, {cost['threads']} thread(s), same process: draft "
                  f"{cost['draft_forward_ms']} ms, target {cost['target_forward_ms']} ms (ratio {cost['ratio']}).", ""]
    return "\n".join(lines)


def _compact(value: dict) -> str:
    import json

    return json.dumps(value, indent=1)
