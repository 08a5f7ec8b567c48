"""Sampling parameters, validated once at every entry point (torch-free: the gateway uses them too)."""

from __future__ import annotations

from dataclasses import dataclass

from specd_common.errors import require

MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: ±100 bans or forces a token whatever the logits
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit; a bias is applied to every row of every pass
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the likeliest tokens reported at each position


def check_top_logprobs(top_logprobs: int) -> None:
    """INVALID_ARGUMENT unless top_logprobs is in [0, MAX_TOP_LOGPROBS] (the gateway's and the verify's field)."""
    require(0 <= top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")


@dataclass(frozen=True)
class Warp:
    """Temperature / top-k / top-p after validation. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, params) -> "Warp":
        """Validate a specd.v1.SamplingParams (INVALID_ARGUMENT saying what to fix); unset top_p means off."""
        temperature, top_k, top_p = float(params.temperature), int(params.top_k), float(params.top_p)
        require(
            0.0 <= temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE}] (0 = greedy), got {temperature}",
        )
        require(top_k >= 0, f"top_k must be >= 0 (0 = off), got {top_k}")
        require(0.0 <= top_p <= 1.0, f"top_p must be in (0, 1] (0 or 1 = off), got {top_p}")
        bias = dict(params.logit_bias)
        require(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
        for token, value in bias.items():
            require(token >= 0, f"logit_bias token ids must be >= 0, got {token}")
            require(-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,  # also false for NaN
                    f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        return cls(temperature=temperature, top_k=top_k, top_p=top_p if top_p > 0 else 1.0,
                   logit_bias=tuple(sorted((int(token), float(value)) for token, value in bias.items() if value)))

    @property
    def biased_tokens(self) -> list[int]:
        """The token ids logit_bias names (a service checks them against its vocabulary)."""
        return [token for token, _ in self.logit_bias]

    def to_proto(self, message_type):
        """Fill a specd.v1.SamplingParams (passed in to keep this module free of generated imports)."""
        return message_type(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                            logit_bias=dict(self.logit_bias))
