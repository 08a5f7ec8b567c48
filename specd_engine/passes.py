"""The pass engines: what runs one pass over the feeds of distinct sessions.

CausalLM (lm.py) makes the feeds and hands each session its rows back; an engine runs the model
over every feed's tokens in order (`run`) and returns one PassOutput, and says how it scores prompt
rows (`prompt_kernel`: their dense product or None; `positional_prompts`: whether a prompt row's bits
depend on its position alone). Three engines, one chosen when the model is loaded:

  RaggedPasses        the lean forward (lean_forward.py), every feed in one pass, attention in place
                      in each session's own cache: the CPU default for Llama-shaped models
  flat_pass.FlatPasses  the lean forward over a KV store allocated up front, fixed shapes, replayed
                      as CUDA graphs on a GPU (`--forward flat`)
  TransformersPasses  transformers' own forward, a feed at a time: other architectures, and
                      `--forward transformers`

Every engine runs on the model thread (CausalLM calls it there) and inside the pass runtime's
`pass_of` (tuning.py: one pass at a time, its threads and weight layout, the pass counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from specd_engine import lean_forward
from specd_engine.sessions import Feed
from specd_engine.tuning import PassRuntime


@dataclass
class PassOutput:
    """One pass over feeds' tokens in order: every row's final hidden state [T, H] (after the final
    norm), the captured layers' outputs [T, L, H] where kept (else None), and the logits of the rows
    `logit_rows` names [W, V] (None when none is wanted)."""

    hidden: torch.Tensor
    layers: Optional[torch.Tensor]
    logits: Optional[torch.Tensor]


def logit_rows(feeds: Sequence[Feed]) -> list[int]:
    """The rows of a pass over the feeds' tokens in order whose logits are wanted: each feed's last
    `logits`, and the last row of a prefill chunk that scores it. A prefill chunk wants none otherwise:
    scoring its n × V logits would cost the LM head's weights n times over."""
    wanted, at = [], 0
    for feed in feeds:
        at += len(feed.tokens)
        wanted += range(at - feed.logit_rows, at)
    return wanted


def keeps_hidden(feeds: Sequence[Feed]) -> bool:
    """Whether a pass keeps its rows' hidden states and captured layers: a session keeps features, or a
    prefill keeps its scored row (KVSession.take_prefill_chunk)."""
    return any(feed.session.keep_features or feed.scores_last for feed in feeds)


class RaggedPasses:
    """Every feed's tokens in one lean pass (lean_forward.forward_ragged): the weights stream once for
    all rows, attention runs per session over its own cache, in place. With int4 products (`padded`)
    every row is one query over its keys padded to whole blocks, so a position scores alike in any
    pass; a prompt's rows attend in whole tiles (`tiles`) and take the dense prompt products where
    the layers keep them (`prompt_kernel`, quantized.choose_prompt_kernel)."""

    def __init__(self, lean: lean_forward.LeanLlama, device: torch.device, runtime: PassRuntime, int4: bool):
        self.lean, self.device, self.runtime = lean, device, runtime
        self.padded = self.tiles = int4
        self.prompt_kernel: Optional[str] = None

    def run(self, feeds: Sequence[Feed], starts: Sequence[int], captured: Sequence[int]) -> PassOutput:
        segments, ids, positions, at = [], [], [], 0
        for feed, cached in zip(feeds, starts):
            ids += feed.tokens
            positions += feed.positions if feed.positions is not None else range(cached, cached + len(feed.tokens))
            mask = None if feed.mask is None else feed.mask.to(self.device)
            if feed.tokens:  # a round whose row 0 the prefill scored may feed nothing
                segments.append(lean_forward.Segment(feed.session.cache, at, len(feed.tokens), mask, self.padded,
                                                     feed.prompt_rows if self.tiles else 0))
            at += len(feed.tokens)
        wanted = logit_rows(feeds)
        with self.runtime.pass_of(at, trial=len(feeds) == 1):  # serving trials time lone passes
            hidden, layers = self.lean.forward_ragged(torch.tensor(ids, dtype=torch.long, device=self.device),
                                                      torch.tensor(positions, dtype=torch.long, device=self.device), segments,
                                                      keeps_hidden(feeds), captured, prompt_rows(feeds, self.prompt_kernel))  # [T, H], [T, L, H] or None
            logits = self.lean.lm_head(hidden[wanted]).float() if wanted else None  # [W, V]
        return PassOutput(hidden, layers, logits)

    @property
    def positional_prompts(self) -> bool:
        """A prompt row's bits depend on its position alone, however the prompt was chunked and whatever
        shared its passes (CausalLM.prescores): int4's per-row products and tiles cut by position."""
        return self.tiles


def prompt_rows(feeds: Sequence[Feed], kernel: Optional[str]) -> Optional[lean_forward.PromptRows]:
    """The rows of a pass over the feeds' tokens that are prompt positions, where prompt rows take dense
    products (`kernel`, quantized.PROMPT_KERNELS); None where none does. A row is one by its position
    alone (Feed.prompt_rows), so it is scored alike in a chunk of any size and beside any rows."""
    return None if kernel is None else prompt_positions(feeds)


def prompt_positions(feeds: Sequence[Feed]) -> Optional[lean_forward.PromptRows]:
    """The rows of a pass over the feeds' tokens that are prompt positions (Feed.prompt_rows); None where none is."""
    prompt, at = [], 0
    for feed in feeds:
        prompt += range(at, at + feed.prompt_rows)
        at += len(feed.tokens)
    if not prompt:
        return None
    other = sorted(set(range(at)) - set(prompt))
    return lean_forward.PromptRows(lean_forward.row_index(prompt), lean_forward.row_index(other) if other else None)


class TransformersPasses:
    """transformers' forward, one pass a feed: what serves the architectures the lean forward does not.
    Forward hooks keep the final hidden state and the captured layers' outputs of a pass that asks."""

    prompt_kernel: Optional[str] = None  # prompt rows take no dense product here
    positional_prompts = False  # float GEMMs round a prompt row by the chunk's row count

    def __init__(self, model: torch.nn.Module, device: torch.device, runtime: PassRuntime):
        self.model, self.device, self.runtime = model, device, runtime
        self._keep = False
        self._hidden: Optional[torch.Tensor] = None  # [1, n, H] of the last pass, when kept
        self._layers: dict[int, torch.Tensor] = {}  # captured layer → its output [1, n, H], when kept
        self._hooked: set[int] = set()
        model.base_model.register_forward_hook(self._take_final)

    def run(self, feeds: Sequence[Feed], starts: Sequence[int], captured: Sequence[int]) -> PassOutput:
        self._hook(captured)
        self._keep = keeps_hidden(feeds)
        hidden, layers, logits = [], [], []
        for feed, start in zip(feeds, starts):
            custom = {} if feed.positions is None else {
                "position_ids": torch.tensor([feed.positions], dtype=torch.long, device=self.device),  # [1, n]
                "attention_mask": feed.mask[None, None].to(self.device),  # [1, 1, n, cached + n]
            }
            with self.runtime.pass_of(len(feed.tokens)):
                output = self.model(input_ids=torch.tensor([feed.tokens], dtype=torch.long, device=self.device),
                                    past_key_values=feed.session.cache, use_cache=True, logits_to_keep=max(feed.logits, 1),
                                    **custom)  # logits [1, kept, V]
            if feed.logits:
                logits.append(output.logits[0].float())
            if self._keep:
                hidden.append(self._hidden[0])  # [n, H]
                layers.append(torch.stack([self._layers[layer][0] for layer in captured], dim=1) if captured else None)  # [n, L, H]
        self._hidden, self._layers = None, {}  # no pass holds another's activations
        return PassOutput(torch.cat(hidden) if hidden else None, torch.cat(layers) if hidden and captured else None,
                          torch.cat(logits) if logits else None)

    def _hook(self, captured: Sequence[int]) -> None:
        """Forward hooks on the captured decoder layers not hooked yet (their outputs [1, n, H])."""
        decoder = self.model.base_model.layers
        for layer in set(captured) - self._hooked:
            decoder[layer - 1].register_forward_hook(lambda module, args, output, layer=layer: self._take_layer(layer, output))
            self._hooked.add(layer)

    def _take_layer(self, layer: int, output: Any) -> None:
        if self._keep:
            self._layers[layer] = output[0] if isinstance(output, tuple) else output

    def _take_final(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The base model's first output is the final hidden state (after the final norm), what feature
        drafters and Medusa heads read. Why a hook and not `output_hidden_states=True`: in transformers 5
        the first such call installs capture hooks on every decoder layer for good, and every later
        pass pays for them (~1 ms a pass on a 2-core AMD EPYC, features asked for or not)."""
        self._hidden = output[0] if self._keep else None
