"""A request of the demo's trace as it is sent to the demo's Serve deployment.

It carries what each router reads: the prompt's token ids (distkv's router keys them as the
engine does), the prompt as text (Ray's PrefixCacheAffinityRouter matches text prefixes: one
character per token, so a text prefix is a token prefix), and `kv_transfer_params`, where
distkv's router puts the Directory's answer for the replica it chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the first code point of the tokens' characters: past the surrogates, room for any vocabulary
_TOKEN_CHARS = 0x10000


@dataclass
class DemoRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def prompt(self) -> str:
        return "".join(chr(_TOKEN_CHARS + t) for t in self.prompt_token_ids)
