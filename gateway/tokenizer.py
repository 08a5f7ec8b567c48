"""The gateway's tokenizer, built from what the verify service reports (no model, no torch).

Chat templates are rendered with a sandboxed Jinja environment, as transformers does, so prompts
tokenize to the same ids the target's own `apply_chat_template` would give.
"""

from __future__ import annotations

from typing import Sequence

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from specd.v1 import common_pb2
from specd_common.errors import FailedPrecondition, InvalidArgument


class GatewayTokenizer:
    """Encode prompts (raw or through the chat template) and decode generated ids."""

    def __init__(self, info: common_pb2.GetModelInfoResponse):
        if not info.tokenizer_json:
            raise FailedPrecondition(f"model {info.model_name!r} reported no tokenizer; the gateway needs one")
        self._tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self._bos_token, self._eos_token = info.bos_token, info.eos_token
        self._template = None
        if info.chat_template:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = _raise_template_error
            self._template = environment.from_string(info.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template applied to messages, ending with the assistant's turn opening."""
        if self._template is None:
            raise InvalidArgument("this model has no chat template; send a text prompt with raw=true or token ids")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        # The rendered template already holds the special tokens as text: add none.
        return self._tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def encode_raw(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_prompt(self, text: str, raw: bool) -> list[int]:
        """A text prompt: one user message through the chat template, unless raw or the model has none."""
        if raw or self._template is None:
            return self.encode_raw(text)
        return self.encode_chat([{"role": "user", "content": text}])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _raise_template_error(message: str) -> None:
    raise InvalidArgument(f"chat template refused the messages: {message}")
