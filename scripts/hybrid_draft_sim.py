"""Experiment: n-gram lookup first, the trained draft when lookup finds nothing (greedy, held-out).

usage: scripts/hybrid_draft_sim.py DRAFT_DIR WORK_DIR  (WORK_DIR of `specd train-draft`; writes WORK_DIR/hybrid.json)
Exact for greedy rounds, like draft_eval.simulate_matches: a model round accepts the run of
teacher-forced matches; an n-gram round accepts the matching prefix of prompt_lookup's proposal.
"""
import json, logging, sys, torch
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, format='%(message)s')
from pathlib import Path
from collections import defaultdict
from specd_common.models import load_causal_lm
from draft_service.ngram import prompt_lookup
from draft_service.distill_data import load_records
from draft_service.draft_eval import teacher_forced_matches
draft = load_causal_lm(sys.argv[1], dtype='float32')
recs = load_records(Path(sys.argv[2]) / 'data', 'gen-eval')
matches = [teacher_forced_matches(draft.model, r) for r in recs]
out = {}
for k in (2, 3, 4):
    tot = defaultdict(lambda: [0, 0, 0, 0])  # tokens, passes, drafted, accepted
    for r, m in zip(recs, matches):
        toks = r['tokens'].tolist(); s = r['start']; ans = toks[s:]; p = 0
        while p < len(ans):
            budget = min(k, len(ans) - p - 1)
            ng = prompt_lookup(toks[: s + p], budget) if budget > 0 else []
            if ng:
                a = 0
                while a < len(ng) and ng[a] == ans[p + a]: a += 1
                drafted = len(ng)
            else:
                a = 0
                while a < budget and m[p + a]: a += 1
                drafted = budget
            for key in ('all', r['category']):
                t = tot[key]; t[1] += 1; t[2] += drafted; t[3] += a
            p += a + 1
        for key in ('all', r['category']): tot[key][0] += len(ans)
    out[f'k={k}'] = {key: {'tokens_per_pass': round(t[0] / t[1], 3), 'acceptance': round(t[3] / max(1, t[2]), 3)} for key, t in sorted(tot.items())}
    logging.info('k=%d: %s', k, out[f'k={k}']['all'])
json.dump(out, open(Path(sys.argv[2]) / 'hybrid.json', 'w'), indent=1)
