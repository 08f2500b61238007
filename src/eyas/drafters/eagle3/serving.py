"""How an EAGLE-3 drafter is served in each format, without torch (the command line reads
it for `--serve-with`): vLLM runs eyas's network (three norms, any head); SGLang's EAGLE-3
model has none of the norms and applies a draft window."""

from __future__ import annotations

from eyas.drafters.formats import SGLANG, VLLM, Served

# SGLang's EAGLE-3 network has none of these norms.
SGLANG_LACKS = ("norm_before_fc", "norm_before_residual", "norm_output")
WINDOW = "eyas_attention_window"  # an SGLang export's window, served by the flag its line names


def _chain(export_config: dict, tokens: int) -> list[str]:
    # A chain: one candidate per step (top-k 1), K steps, K + 1 tokens verified a round.
    window = export_config.get(WINDOW)
    return [
        "--speculative-num-steps",
        str(tokens),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(tokens + 1),
        *(["--speculative-draft-window-size", str(window)] if window else []),
    ]


def _no_window(c) -> str | None:
    if not c.attention_window:
        return None
    return (
        f"--attention-window {c.attention_window}: vLLM applies no window to an EAGLE-3 drafter "
        "(its speculative config has none), so the drafter served would attend to more than it "
        "was trained on. Serve it with SGLang (--serve-with sglang to train, --format sglang to "
        "export: its --speculative-draft-window-size serves the window), or train without it"
    )


def _no_norms(c) -> str | None:
    on = [n for n in SGLANG_LACKS if getattr(c, n, False)]
    if not on:
        return None
    return (
        f"the drafter was trained with {', '.join(on)}, which SGLang's EAGLE-3 model does not "
        "have: it would run another network than the one trained. Export --format vllm, or "
        "train with --serve-with sglang (the same as --no-"
        + " --no-".join(n.replace("_", "-") for n in on)
        + ")"
    )


SERVING = {
    VLLM: Served("eagle3", refuses=_no_window, defaults={"head_init": "target-frozen"}),
    SGLANG: Served(
        "EAGLE3",
        flags=_chain,
        refuses=_no_norms,
        trains=dict.fromkeys(SGLANG_LACKS, False),
        defaults={"head_init": "random"},
    ),
}
