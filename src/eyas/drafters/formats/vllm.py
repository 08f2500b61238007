"""vLLM's format: speculators-style exports, served by `vllm serve --speculative-config`."""

from __future__ import annotations

import json

from eyas.drafters.formats.base import Format, Served


class Vllm(Format):
    name, engine = "vllm", "vLLM"

    def speculative_config(self, served: Served, path: str, tokens: int) -> dict:
        """vLLM's `speculative_config` for an export at `path`, `tokens` drafted a round."""
        return {"method": served.method, "model": path, "num_speculative_tokens": tokens}

    def serve_line(
        self, target: str, path: str, served: Served, config: dict, tokens: int, render: list[str]
    ) -> list[str]:
        spec = json.dumps(self.speculative_config(served, path, tokens), separators=(",", ":"))
        return ["vllm", "serve", target, "--speculative-config", spec, *render]


VLLM = Vllm()
