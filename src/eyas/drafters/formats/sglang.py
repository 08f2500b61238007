"""SGLang's format: served by `sglang.launch_server --speculative-algorithm`."""

from __future__ import annotations

from eyas.drafters.formats.base import Format, Served


class Sglang(Format):
    name, engine = "sglang", "SGLang"

    def serve_line(
        self, target: str, path: str, served: Served, config: dict, tokens: int, render: list[str]
    ) -> list[str]:
        return [
            "python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            target,
            "--speculative-algorithm",
            served.method,
            "--speculative-draft-model-path",
            path,
            *served.flags(config, tokens),
            *render,
        ]


SGLANG = Sglang()
